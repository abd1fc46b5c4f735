"""A few-step CPU run of the draft head's training recipe on a tiny random target (with the embedded model's
tokenizer and chat template): the corpus, the draft vocabulary, the loss going down, checkpoints and export."""
import json
import random
from dataclasses import replace

import pytest
import torch

from flashspec_core import Engine
from flashspec_core.draft_head import load_head
from flashspec_core.head_data import CACHES, Corpus, Gen, chat_prefix, coverage, draft_vocabulary, load_sources
from flashspec_core.train_head import (SoftCrossEntropy, TrainConfig, answer_rows, batches, compile_loss, corpus_for,
                                       earlier_corpora, export, load_checkpoint, load_corpus, make_corpus, merge,
                                       has_moments, lr_at, new_head, optimizer, pad, pass_loss, save_checkpoint,
                                       save_corpus, set_lr, soft_targets, step_loss, train, train_step, valid)

CFG = TrainConfig(topic_asks_per_domain=1, materials=8, bank_prompts=40, self_prompts=4, follow_ups=4, max_new_tokens=10,
                  gen_batch=64, round_answers=32, draft_vocab=256, ttt_steps=3, batch_tokens=512, max_len=256,
                  data_minutes=5, train_minutes=0.02, eval_every_s=1000, eval_sequences=4)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from flashspec_core.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaky next-token laws, so the draft vocabulary holds most of their mass
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


@pytest.fixture(scope="module")
def made(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    gen = Gen(*tiny, CFG.gen_batch, CFG.gen_cache, CFG.max_new_tokens)
    return make_corpus(gen, CFG, folder, log=lambda m: None), folder


@pytest.fixture(scope="module")
def corpus(made):
    return made[0]


def test_corpus_is_prompt_then_answer_with_a_heldout_split(tiny, made, tmp_path):
    _, tokenizer = tiny
    corpus, folder = made
    before, after = chat_prefix(tokenizer)
    assert len(corpus) >= 40 and any(corpus.heldout) and not all(corpus.heldout)
    assert any(corpus.greedy) and not all(corpus.greedy) and corpus.starts
    second_turns = 0
    for seq, start in zip(corpus.sequences, corpus.starts):
        text = tokenizer.decode(seq[:start])
        assert text.startswith(before) and text.endswith(after) and 0 < len(seq) - start <= CFG.max_new_tokens
        second_turns += text.count("<|im_start|>user") == 2
    assert second_turns >= 1  # follow-ups: a first exchange, then a second user turn
    again = load_corpus(folder)  # the shards the rounds wrote, in order
    assert again.sequences == corpus.sequences and again.starts == corpus.starts and again.heldout == corpus.heldout
    held = json.loads((folder / "heldout_prompts.json").read_text())
    assert held and {"kind", "prompt"} <= set(held[0])


def test_a_later_run_draws_new_prompts_from_an_earlier_runs_sources(tiny, made, tmp_path, monkeypatch):
    """The topics and materials a run wrote are saved with its corpus; a run given them (`sources`) writes none and
    draws its own prompts from them with its seed."""
    from dataclasses import replace

    import flashspec_core.train_head as th

    corpus, folder = made
    sources = load_sources(folder / "bank_sources.json.gz")
    pairs = [pair for kind in sources["materials"].values() for pair in kind]
    assert sources["topics"] and all(isinstance(pair, tuple) for pair in pairs)
    monkeypatch.setattr(th, "bank_sources", lambda *a, **k: pytest.fail("topics and materials written again"))
    cfg = replace(CFG, seed=1, sources=str(folder / "bank_sources.json.gz"))
    again = make_corpus(Gen(*tiny, CFG.gen_batch, CFG.gen_cache, CFG.max_new_tokens), cfg, tmp_path, log=lambda m: None)
    assert len(again) >= 40 and again.sequences != corpus.sequences
    assert not (tmp_path / "bank_sources.json.gz").exists()


def test_corpus_shards_are_uint16_and_bounded(corpus, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    import flashspec_core.train_head as th

    monkeypatch.setattr(th, "SHARD_TOKENS", 300)
    paths = save_corpus(corpus, tmp_path)
    assert len(paths) > 1
    for p in paths:
        t = load_file(str(p))
        assert t["tokens"].dtype.name == "uint16" and t["tokens"].size <= max(300, t["lengths"].max())
    again = load_corpus(tmp_path)
    assert again.sequences == corpus.sequences and again.greedy == corpus.greedy
    with pytest.raises(ValueError, match="uint16"):
        save_corpus(Corpus([[70000, 1]], [1], [False], [True]), tmp_path / "big")


def test_earlier_runs_corpora_join_in_order_and_a_missing_one_stops_training(corpus, tmp_path):
    from dataclasses import replace

    half = len(corpus) // 2
    for name, part in (("a", slice(0, half)), ("b", slice(half, None))):
        save_corpus(Corpus(*(x[part] for x in (corpus.sequences, corpus.starts, corpus.heldout, corpus.greedy))),
                    tmp_path / name)
    cfg = replace(CFG, earlier=f"{tmp_path / 'a'}, {tmp_path / 'b'}")
    joined = merge(earlier_corpora(cfg, resume=False, log=lambda m: None))
    assert joined.sequences == corpus.sequences and joined.heldout == corpus.heldout and joined.greedy == corpus.greedy
    gone = replace(CFG, earlier=str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="gone"):
        earlier_corpora(gone, resume=False)
    assert earlier_corpora(replace(gone, train_minutes=0), resume=True) == []  # export only: no corpus read


def test_an_export_only_call_without_the_runs_corpus_json_says_so_instead_of_making_a_corpus(tiny, tmp_path):
    (tmp_path / "meta.json").write_text("{}")  # a checkpoint brought back without corpus.json beside it
    with pytest.raises(FileNotFoundError, match="corpus.json"):
        corpus_for(replace(CFG, train_minutes=0), *tiny, tmp_path)
    assert not list(tmp_path.glob("corpus-*"))


def test_draft_vocabulary_is_the_most_frequent_answer_tokens():
    c = Corpus([[9, 9, 5, 5, 5, 7, 3], [1, 5, 7, 2]], [2, 1], [False, False], [True, True])
    ids = draft_vocabulary(c, 3, 10, always=[2])
    assert ids.tolist() == [2, 5, 7]  # end of turn first, then by count (prompt tokens 9, 9 and 1 not counted)
    assert coverage(c, ids, heldout=False) == pytest.approx(7 / 8)  # answers 5 5 5 7 3 and 5 7 2
    assert len(merge([c, c])) == 4


@pytest.mark.parametrize("compiled,tv", [(False, 0.0), (True, 0.0), (False, 1.5), (True, 1.5)])
def test_the_fused_soft_cross_entropy_and_its_gradient_are_the_written_out_ones(compiled, tv):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(300, 16, generator=g, dtype=torch.float64)
    p_all = torch.randn(50, 300, generator=g, dtype=torch.float64).softmax(-1) * 0.9  # not renormalised (as the target)
    at = torch.randperm(50, generator=g)[:37]
    p = p_all[at]
    weights = torch.rand(37, generator=g, dtype=torch.float64)  # a non-uniform upstream gradient
    ref = -(p * (x @ W.t()).log_softmax(-1)).sum(-1) + tv * (1 - torch.minimum(p, (x @ W.t()).softmax(-1)).sum(-1))
    (gx_ref,) = torch.autograd.grad((ref * weights).sum(), x)
    compile_loss(compiled)
    try:
        got = SoftCrossEntropy.apply(x, W, p @ W, p.sum(-1), p_all, at, tv)
        (gx,) = torch.autograd.grad((got * weights).sum(), x)
    finally:
        compile_loss(False)
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-10) and torch.allclose(gx, gx_ref, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(gx, gx_ref + 1e-6)  # the comparison sees a change this small
    if tv:  # the acceptance term moves the gradient (rows of q below and above p both occur)
        (gx_ce,) = torch.autograd.grad((SoftCrossEntropy.apply(x, W, p @ W, p.sum(-1)) * weights).sum(), x)
        assert not torch.allclose(gx, gx_ce, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tv", [0.0, 1.5])
def test_the_fused_loss_compiled_under_autocast_on_cuda_is_the_written_out_one(tv):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 64, generator=g, device="cuda", requires_grad=True)
    W = torch.randn(1000, 64, generator=g, device="cuda") * 0.3
    p = torch.randn(300, 1000, generator=g, device="cuda").softmax(-1) * 0.9
    at = torch.arange(300, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        z = torch.nn.functional.linear(x, W)
        ref = -(p * z.log_softmax(-1)).sum(-1) + tv * (1 - torch.minimum(p, z.float().softmax(-1)).sum(-1))
    (gx_ref,) = torch.autograd.grad(ref.mean(), x)
    compile_loss(True)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = SoftCrossEntropy.apply(x, W, p @ W, p.sum(-1), p, at, tv)
        (gx,) = torch.autograd.grad(got.mean(), x)
    finally:
        compile_loss(False)
    assert torch.allclose(got, ref, rtol=1e-2) and float((gx - gx_ref).norm() / gx_ref.norm()) < 2e-2


def test_a_few_steps_lower_the_loss_on_a_batch(tiny, corpus):
    model, _ = tiny
    head = new_head(model, corpus, CFG, [2])
    assert not head.lm_head.weight.requires_grad and head.t2d.sum() == CFG.draft_vocab
    batch = pad(corpus, batches(corpus, corpus.split(False), CFG, random.Random(0))[0], CFG.max_len, "cpu")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    first = step_loss(head, model, batch, CFG).item()
    for _ in range(40):
        opt.zero_grad()
        step_loss(head, model, batch, CFG).backward()
        opt.step()
    assert step_loss(head, model, batch, CFG).item() < 0.92 * first  # the cross-entropy of the target's laws has a floor well above 0
    embed_before = model.get_input_embeddings().weight.clone()
    curve = train(head, model, corpus, CFG, optimizer(head, CFG), log=lambda m: None)
    assert curve and {"loss", "greedy_tokens_per_forward", "t1_tokens_per_forward", "top1_per_pass"} <= set(curve[-1])
    assert torch.equal(model.get_input_embeddings().weight, embed_before)  # the target is never trained


def test_the_weights_moving_average_is_evaluated_beside_them_and_kept_only_where_its_loss_is_lower(tiny, corpus):
    from flashspec_core.train_head import WeightAverage

    model, _ = tiny
    head = new_head(model, corpus, CFG, [2])
    params = [p for p in head.parameters() if p.requires_grad]
    average = WeightAverage(head, 0.75)
    first = [p.detach().clone() for p in params]
    average.update()  # the first update copies the weights
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    average.update()
    for a, p, f in zip([q for q in average.model.module.parameters() if q.requires_grad], params, first):
        torch.testing.assert_close(a, 0.75 * f + 0.25 * (f + 1.0))
    assert not average.keep_if_better({"loss": 1.0, "average": {"loss": 1.5}})
    assert all(torch.equal(p, f + 1.0) for p, f in zip(params, first))
    assert average.keep_if_better({"loss": 1.0, "average": {"loss": 0.5}})
    for p, a in zip(params, [q for q in average.model.module.parameters() if q.requires_grad]):
        assert torch.equal(p, a)  # the average itself
    cfg = replace(CFG, weight_average=0.9)
    curve = train(head, model, corpus, cfg, optimizer(head, cfg), log=lambda m: None)
    last = curve[-1]
    assert len(curve) >= 2 and all("average" not in point for point in curve[:-1])  # read at the end only
    assert {"loss", "t1_tokens_per_forward"} <= set(last["average"]) and "kept_average" in last
    assert last["kept_average"] == (last["average"]["loss"] < last["loss"])
    with pytest.raises(ValueError, match="weight_average"):
        replace(CFG, weight_average=1.0)


def test_the_last_evaluation_comes_when_the_budget_runs_out_at_an_epochs_end(tiny, corpus, monkeypatch):
    """One batch an epoch, a clock that moves 1 s a read and a 2.5 s budget: the first epoch evaluates at 1 s and
    ends past the budget; the run still ends on its last evaluation (with the average), not silently after it."""
    from types import SimpleNamespace

    import flashspec_core.train_head as th

    model, _ = tiny
    cfg = replace(CFG, batch_tokens=1 << 20, train_minutes=2.5 / 60, weight_average=0.9)
    assert len(batches(corpus, corpus.split(False), cfg, random.Random(0))) == 1
    head = new_head(model, corpus, cfg, [2])
    clock = iter(range(1_000_000))
    monkeypatch.setattr(th, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    curve = train(head, model, corpus, cfg, optimizer(head, cfg), log=lambda m: None)
    assert len(curve) == 2 and curve[-1]["seconds"] >= 2.5 and "average" in curve[-1] and "average" not in curve[0]
    held_out = Corpus(corpus.sequences, corpus.starts, [True] * len(corpus), corpus.greedy)  # nothing to train on
    with pytest.raises(ValueError, match="no training sequences"):
        train(head, model, held_out, cfg, optimizer(head, cfg), log=lambda m: None)


def test_the_loss_reads_the_answer_slots_each_pass_predicts(tiny, corpus):
    model, _ = tiny
    head = new_head(model, corpus, CFG, [2])
    first_batch = batches(corpus, corpus.split(False), CFG, random.Random(1))[0]
    ids, lengths, starts = pad(corpus, first_batch, CFG.max_len, "cpu")
    assert lengths.device.type == "cpu" and (starts > 1).all()  # prompts are left out of the loss
    T, K = ids.shape[1], CFG.ttt_steps
    torch.manual_seed(0)
    outs = [torch.randn(*ids.shape, head.cfg.hidden_size) for _ in range(K)]
    probs = torch.rand(*ids.shape, CFG.draft_vocab).softmax(-1) * torch.rand(*ids.shape, 1)  # masses differ by slot
    ref, weight = 0.0, 0.0  # the boolean masks, written out
    for j, h in enumerate(outs):
        mask = valid(lengths, starts, T, j)
        logp = head.logits(h[:, :T - 1 - j][mask]).log_softmax(-1)
        ref = ref + CFG.step_decay ** j * -(probs[:, 1 + j:][mask] * logp).sum(-1).mean()
        weight += CFG.step_decay ** j
    rows = answer_rows(lengths, starts, T, K, "cpu")
    got = pass_loss(head, outs, soft_targets(head, probs), rows, CFG)
    assert torch.allclose(got, ref / weight, rtol=1e-5)
    tv, cfg = 0.7, replace(CFG, tv_weight=0.7)  # plus each pass's chance of rejection at temperature 1
    for j, h in enumerate(outs):
        mask = valid(lengths, starts, T, j)
        q = head.logits(h[:, :T - 1 - j][mask]).softmax(-1)
        ref = ref + CFG.step_decay ** j * tv * (1 - torch.minimum(probs[:, 1 + j:][mask], q).sum(-1)).mean()
    got = pass_loss(head, outs, soft_targets(head, probs, keep=True), rows, cfg)
    assert torch.allclose(got, ref / weight, rtol=1e-5)
    shifted = [r[1:] for r in rows]  # one slot fewer per pass: a different loss
    assert not torch.allclose(pass_loss(head, outs, soft_targets(head, probs), shifted, CFG), ref / weight, rtol=1e-5)


def test_checkpoint_and_export_load_back_and_draft_exactly(tiny, corpus, tmp_path):
    model, tokenizer = tiny
    head = new_head(model, corpus, CFG, [2])
    meta = {"target": "tiny", "head": {**head.cfg.__dict__, "aux_layers": list(head.cfg.aux_layers)}, "steps": 0}
    save_checkpoint(head, tmp_path / "ckpt", meta)
    again, _ = load_checkpoint(tmp_path / "ckpt", model)
    for name, t in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    export(again, meta, tmp_path / "out")
    shipped = load_head(tmp_path / "out", model.config, model.get_input_embeddings().weight)
    assert shipped.cfg.draft_temperature == 1.0  # no held-out evaluation to fit it on
    engine = Engine.from_models(model, [shipped], tokenizer=tokenizer)
    plain = engine.generate("Tell me about rivers.", 12, mode="plain").token_ids
    assert engine.generate("Tell me about rivers.", 12, drafters=["draft_head"], gamma=3).token_ids == plain
    meta["heldout"] = {"t1_by_draft_temperature": {"0.7": 2.1, "0.8": 2.3, "0.9": 2.2, "1.0": float("nan")}}
    export(again, meta, tmp_path / "fitted")
    assert load_head(tmp_path / "fitted", model.config, model.get_input_embeddings().weight).cfg.draft_temperature == 0.8


def test_a_checkpoint_keeps_the_optimizers_moments_for_the_run_that_goes_on(tiny, corpus, tmp_path):
    """save_checkpoint with the optimizer writes its AdamW moments; `optimizer` over a head loaded from that folder
    takes them (same step count and moments by parameter name), a fresh one has none; --init from a checkpoint folder
    takes its weights and moments."""
    import argparse

    from flashspec_core.train_head import moments_from, start_head

    model, _ = tiny
    head = new_head(model, corpus, CFG, [2])
    opt = optimizer(head, CFG)
    assert not has_moments(opt)
    batch = pad(corpus, batches(corpus, corpus.split(False), CFG, random.Random(0))[0], CFG.max_len, "cpu")
    for _ in range(3):
        train_step(head, model, batch, CFG, opt, [p for p in head.parameters() if p.requires_grad])
    meta = {"target": "tiny", "head": {**head.cfg.__dict__, "aux_layers": list(head.cfg.aux_layers)}, "steps": 3}
    save_checkpoint(head, tmp_path / "ckpt", meta, opt)
    args = argparse.Namespace(resume=False, init=str(tmp_path / "ckpt"))
    again, _ = start_head(args, CFG, model, corpus, tmp_path / "new", [2])
    moved = optimizer(again, CFG, moments_from(args, tmp_path / "new"))
    assert has_moments(moved) and len(moved.state) == len(opt.state)
    saved = {n: opt.state[p] for n, p in head.named_parameters() if p in opt.state}
    for n, p in again.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, dict(head.named_parameters())[n]), n
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(moved.state[p][key], saved[n][key]), (n, key)
    assert moments_from(argparse.Namespace(resume=False, init=None), tmp_path) is None


def test_an_export_only_call_needs_no_moments_so_a_checkpoint_brought_back_without_some_exports(tiny, corpus, tmp_path,
                                                                                                  monkeypatch):
    """A GPU machine brings back at most 8 files a call: a checkpoint may come back with some opt shards left behind.
    `--resume --train-minutes 0` exports it all the same and leaves the moments that did come back as they were."""
    from safetensors.torch import load_file, save_file

    import flashspec_core.models
    from flashspec_core.train_head import main

    model, tokenizer = tiny
    head = new_head(model, corpus, CFG, [2])
    opt = optimizer(head, CFG)
    batch = pad(corpus, batches(corpus, corpus.split(False), CFG, random.Random(0))[0], CFG.max_len, "cpu")
    train_step(head, model, batch, CFG, opt, [p for p in head.parameters() if p.requires_grad])
    ckpt = tmp_path / "ckpt"
    meta = {"target": "tiny", "head": {**head.cfg.__dict__, "aux_layers": list(head.cfg.aux_layers)}, "steps": 1,
            "seconds": {"data": 1.0, "train": 1.0}, "curve": [], "sizes": {"answers": len(corpus)}}
    save_checkpoint(head, ckpt, meta, opt)
    (ckpt / "corpus.json").write_text('{"answers": 1}')
    shard = sorted(ckpt.glob("opt-*.safetensors"))[-1]
    part = {k: v for k, v in load_file(str(shard)).items() if not k.endswith("exp_avg_sq")}  # a shard left behind
    save_file(part, str(shard))
    monkeypatch.setattr(flashspec_core.models, "load_model", lambda *a, **k: tiny)
    assert main(["--ckpt", str(ckpt), "--resume", "--train-minutes", "0", "--out", str(tmp_path / "out")]) == 0
    shipped = load_head(tmp_path / "out", model.config, model.get_input_embeddings().weight)
    for name, t in head.state_dict().items():
        if name in shipped.state_dict() and name != "lm_head.weight":
            want = t.to(torch.bfloat16).float() if t.is_floating_point() else t  # exported in bfloat16
            assert torch.equal(shipped.state_dict()[name].to(want.dtype), want), name
    assert load_file(str(shard)).keys() == part.keys()  # the moments on disk untouched


def test_a_run_from_trained_weights_peaks_at_the_trained_lr_unless_lr_is_set():
    from flashspec_core.train_head import TRAINED_LR, parse_args

    assert parse_args([])[1].lr == TrainConfig().lr > TRAINED_LR
    assert parse_args(["--init", "assets/draft_head"])[1].lr == TRAINED_LR
    assert parse_args(["--resume"])[1].lr == TRAINED_LR
    assert parse_args(["--init", "x", "--set", "lr=3e-4"])[1].lr == 3e-4


def test_a_wider_head_from_init_starts_where_the_trained_one_is_and_trains_its_new_units(tiny, corpus, tmp_path):
    """--set head_intermediate wider than --init's head: the trained units keep their weights and moments, the new
    down columns start at zero (the same loss as the trained head, to rounding), and a step moves them."""
    import argparse
    from dataclasses import replace

    from flashspec_core.train_head import moments_from, start_head

    model, _ = tiny
    head = new_head(model, corpus, CFG, [2])
    opt = optimizer(head, CFG)
    batch = pad(corpus, batches(corpus, corpus.split(False), CFG, random.Random(0))[0], CFG.max_len, "cpu")
    for _ in range(3):
        train_step(head, model, batch, CFG, opt, [p for p in head.parameters() if p.requires_grad])
    meta = {"target": "tiny", "head": {**head.cfg.__dict__, "aux_layers": list(head.cfg.aux_layers)}, "steps": 3}
    save_checkpoint(head, tmp_path / "ckpt", meta, opt)
    wide_cfg = replace(CFG, head_intermediate=3 * head.cfg.intermediate_size)
    args = argparse.Namespace(resume=False, init=str(tmp_path / "ckpt"))
    wide, _ = start_head(args, wide_cfg, model, corpus, tmp_path / "new", [2])
    I = head.cfg.intermediate_size
    assert wide.cfg.intermediate_size == 3 * I
    down = dict(wide.named_parameters())["midlayer.mlp.down_proj.weight"]
    assert torch.equal(down[:, :I], dict(head.named_parameters())["midlayer.mlp.down_proj.weight"])
    assert not down[:, I:].any()
    with torch.no_grad():
        assert torch.allclose(step_loss(wide, model, batch, wide_cfg), step_loss(head, model, batch, CFG), rtol=1e-5)
    moved = optimizer(wide, wide_cfg, moments_from(args, tmp_path / "new"))
    assert has_moments(moved) and down not in moved.state  # a widened weight starts its moments afresh
    train_step(wide, model, batch, wide_cfg, moved, [p for p in wide.parameters() if p.requires_grad])
    assert down[:, I:].abs().sum() > 0
    export(wide, meta, tmp_path / "out")  # the engine drafts with it: its width comes from the shipped config
    shipped = load_head(tmp_path / "out", model.config, model.get_input_embeddings().weight)
    assert shipped.cfg.intermediate_size == 3 * I
    engine = Engine.from_models(model, [shipped], tokenizer=tiny[1])
    plain = engine.generate("Tell me about rivers.", 12, mode="plain").token_ids
    assert engine.generate("Tell me about rivers.", 12, drafters=["draft_head"], gamma=3).token_ids == plain


def test_a_deeper_head_from_init_starts_where_the_trained_one_is_and_trains_its_new_layer(tiny, corpus, tmp_path):
    """--set head_layers=2 from a one-layer checkpoint: the first layer keeps the trained weights, the new one starts
    as the identity (the same loss, to rounding), a step gives it weights, and the export says two layers."""
    import argparse
    from dataclasses import replace

    from flashspec_core.train_head import moments_from, start_head

    model, _ = tiny
    head = new_head(model, corpus, CFG, [2])
    opt = optimizer(head, CFG)
    batch = pad(corpus, batches(corpus, corpus.split(False), CFG, random.Random(0))[0], CFG.max_len, "cpu")
    train_step(head, model, batch, CFG, opt, [p for p in head.parameters() if p.requires_grad])
    meta = {"target": "tiny", "head": {**head.cfg.__dict__, "aux_layers": list(head.cfg.aux_layers)}, "steps": 1}
    save_checkpoint(head, tmp_path / "ckpt", meta, opt)
    deep_cfg = replace(CFG, head_layers=2, later_lr=8 * CFG.lr)
    args = argparse.Namespace(resume=False, init=str(tmp_path / "ckpt"))
    deep, _ = start_head(args, deep_cfg, model, corpus, tmp_path / "new", [2])
    assert deep.cfg.num_layers == 2
    with torch.no_grad():
        assert torch.allclose(step_loss(deep, model, batch, deep_cfg), step_loss(head, model, batch, CFG), rtol=1e-5)
    moved = optimizer(deep, deep_cfg, moments_from(args, tmp_path / "new"))
    out = dict(deep.named_parameters())["later_layers.0.self_attn.o_proj.weight"]
    assert not out.any()
    set_lr(moved, 5, 0.5, deep_cfg)  # the grown layer's group at later_lr, the trained weights at lr
    later = {id(p) for n, p in deep.named_parameters() if n.startswith("later_layers.")}
    for g in moved.param_groups:
        is_later = {id(p) for p in g["params"]} <= later
        assert g["lr"] == pytest.approx(lr_at(5, 0.5, deep_cfg) * (8 if is_later else 1))
    assert sum(len(g["params"]) for g in moved.param_groups) == sum(p.requires_grad for p in deep.parameters())
    train_step(deep, model, batch, deep_cfg, moved, [p for p in deep.parameters() if p.requires_grad])
    assert out.abs().sum() > 0
    export(deep, {**meta, "head": {**deep.cfg.__dict__, "aux_layers": list(deep.cfg.aux_layers)}}, tmp_path / "out")
    assert load_head(tmp_path / "out", model.config, model.get_input_embeddings().weight).cfg.num_layers == 2


def test_init_takes_a_shipped_heads_trainable_weights_whatever_its_vocabulary(tiny, corpus, tmp_path):
    import argparse

    from flashspec_core.train_head import start_head

    model, _ = tiny
    donor = new_head(model, corpus, CFG, [2])
    with torch.no_grad():
        donor.fc.weight.normal_()
        donor.set_draft_vocab(donor.draft_ids.flip(0))  # another order of the draft ids
    export(donor, {"target": "tiny"}, tmp_path / "donor")
    args = argparse.Namespace(resume=False, init=str(tmp_path / "donor"))
    head, meta = start_head(args, CFG, model, corpus, tmp_path, [2])
    assert torch.equal(head.fc.weight, donor.fc.weight.to(torch.bfloat16).float())  # shipped in bfloat16
    assert torch.equal(head.draft_ids, new_head(model, corpus, CFG, [2]).draft_ids)  # its own vocabulary
    assert meta["init"] == str(tmp_path / "donor") and meta["curve"] == []


def test_gen_records_each_generate_call(tiny):
    gen = Gen(*tiny, 8, "static", 6)
    gen([f"Name a river, number {i}." for i in range(10)], 6, 0.0)
    assert len(gen.calls) == 2  # ten prompts at a batch of eight: two calls at one width
    assert sum(c["new"] for c in gen.calls) == gen.tokens > 0
    assert all(c["steps"] <= 6 and c["rows"] <= c["batch"] and c["seconds"] > 0 for c in gen.calls)
    assert gen.where_time_went().startswith(f"width {gen.calls[0]['width']}: 2 calls")


@pytest.mark.parametrize("cache", CACHES)
def test_no_texts_get_no_answers_and_no_generate_call(tiny, cache):
    gen = Gen(*tiny, 4, cache, 6)
    assert gen.continue_texts([], 6, 1.0) == []  # --set self_prompts=0 asks for none
    assert gen.calls == [] and gen.tokens == 0


def test_continuous_batching_answers_as_the_batched_path_does(tiny):
    """transformers' continuous batching (a paged cache, finished rows refilled at once): greedy answers equal the
    length-batched path's token for token; sampled answers are cut at the end of turn or the cap like them."""
    from flashspec_core.head_data import end_of_turn, generate

    model, tokenizer = tiny
    before, after = chat_prefix(tokenizer)
    texts = [before + f"Tell me about rivers, number {i}." + after for i in range(6)]
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.0]
    calls = []
    cont = generate(model, tokenizer, texts, 8, temps, 4, cache="continuous", calls=calls)
    plain = generate(model, tokenizer, texts, 8, 0.0, 4, cache="dynamic")
    assert [cont[i] for i in (0, 2, 4)] == [plain[i] for i in (0, 2, 4)]
    eos = end_of_turn(model)
    for a in cont:
        assert 0 < len(a) <= 8 and all(t not in eos for t in a[:-1]) and (len(a) == 8 or a[-1] in eos)
    assert [c["rows"] for c in calls] == [3, 1, 2] and sum(c["new"] for c in calls) == sum(map(len, cont))
    with pytest.raises(ValueError, match="cache must be one of"):
        generate(model, tokenizer, texts, 8, 0.0, 4, cache="paged")


def test_slot_decoding_answers_as_the_batched_path_does(tiny):
    """Rows refilled from a ring cache (`slot_decode`), fewer rows than prompts so that rows take new prompts
    mid-run: greedy answers equal the length-batched path's token for token (prompts of several lengths, one past the
    narrowest width); sampled answers are cut at the end of turn or the cap; a prompt wider than every width gets
    none, as on the static path."""
    from flashspec_core.head_data import WIDTHS, end_of_turn, generate

    model, tokenizer = tiny
    before, after = chat_prefix(tokenizer)
    texts = [before + "Tell me about rivers" + " and lakes" * (2 * i * i) + f", number {i}." + after for i in range(7)]
    texts += [before + "word " * (WIDTHS[-1] + 5) + after]
    assert len(tokenizer(texts[4])["input_ids"]) <= WIDTHS[0] < len(tokenizer(texts[5])["input_ids"]) <= WIDTHS[1]
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.0, 0.0, 0.0]
    calls = []
    slots = generate(model, tokenizer, texts, 12, temps, 2, cache="slots", calls=calls)
    plain = generate(model, tokenizer, texts[:7], 12, 0.0, 4, cache="dynamic")
    assert [slots[i] for i in (0, 2, 4, 6)] == [plain[i] for i in (0, 2, 4, 6)]
    assert slots[7] == []
    eos = end_of_turn(model)
    for a in slots[:7]:
        assert 0 < len(a) <= 12 and all(t not in eos for t in a[:-1]) and (len(a) == 12 or a[-1] in eos)
    assert [c["rows"] for c in calls] == [5, 2] and sum(c["new"] for c in calls) == sum(map(len, slots))
    from flashspec_core.slot_decode import SlotDecoder

    enc = tokenizer(texts[4::-1], add_special_tokens=False)["input_ids"]  # longest first: a row's next prompt is
    dec = SlotDecoder(model, 2, WIDTHS[0] + 12, eos, 12)  # shorter than its last; two rows, three refills mid-run
    assert dec.answer(enc, [0.0] * 5) == plain[4::-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slot_decoding_replays_its_step_from_a_cuda_graph_with_the_same_answers():
    """On CUDA the slot decoder's step is one captured graph: a random model's greedy answers (40 prompts of 5-119
    tokens through 8 rows, so rows are refilled between replays) equal the length-batched path's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashspec_core.head_data import generate

    class Ids:  # a tokenizer stand-in: each text is already its ids
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(t) for t in texts]}

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).to("cuda").eval()
    model.generation_config.eos_token_id = 2
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(3, 512, (int(torch.randint(5, 120, (1,), generator=g)),), generator=g).tolist()
             for _ in range(40)]
    assert generate(model, Ids(), texts, 24, 0.0, 8, cache="slots") == generate(model, Ids(), texts, 24, 0.0, 8)


def test_step_profile_logs_the_ops_of_the_profiled_steps():
    from flashspec_core.train_head import StepProfile

    lines = []
    profile = StepProfile(2, lines.append)
    x = torch.randn(64, 64)
    for step in range(14):
        profile.before(step)
        x = torch.tanh(x @ x)
        profile.after(step)
        assert (step >= StepProfile.FIRST + 1) == bool(lines)  # the table comes once the profiled steps are done
    assert all(line.startswith("profile: ") for line in lines) and any("aten::mm" in line for line in lines)
    assert StepProfile(0, lines.append).prof is None


def test_a_round_of_answers_fits_the_data_budget_left():
    """The first round takes a quarter of round_answers; later ones what the measured rate answers in the time
    left (at least one, at most round_answers), so the data phase ends near its deadline, not a round past it."""
    from flashspec_core.train_head import round_size

    assert round_size(49152, 0, 0.0, 600.0) == 12288
    assert round_size(49152, 12288, 90.0, 45.0) == 6144  # 136.5 jobs/s for 45 s
    assert round_size(49152, 12288, 10.0, 600.0) == 49152
    assert round_size(49152, 12288, 90.0, 0.001) == 1


def test_sampled_temperatures_set_the_sampled_answers_temperatures(tiny, tmp_path, monkeypatch):
    """`sampled_temperatures` lists what the sampled answers are drawn at (the default keeps 0.7 and 1); a list
    without a positive temperature is refused before any data is made."""
    import flashspec_core.train_head as th

    asked = []
    answer_all = th.answer_all
    monkeypatch.setattr(th, "answer_all",
                        lambda gen, jobs, n: asked.extend(t for _, t in jobs) or answer_all(gen, jobs, n))
    cfg = replace(CFG, seed=2, sampled_fraction=1.0, sampled_temperatures="1")
    make_corpus(Gen(*tiny, CFG.gen_batch, CFG.gen_cache, CFG.max_new_tokens), cfg, tmp_path, log=lambda m: None)
    assert set(asked) == {0.0, 1.0} and asked.count(0.0) == asked.count(1.0)
    assert TrainConfig().temperatures() == (0.7, 1.0)
    assert replace(CFG, sampled_temperatures="1").temperatures() == (1.0,)
    for bad in ("", "0", "hot", "1,-0.5"):
        with pytest.raises(ValueError, match="sampled_temperatures"):
            replace(CFG, sampled_temperatures=bad)
