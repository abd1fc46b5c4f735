"""How a trained draft head's held-out loss moves over the first steps of a run that starts from it, per recipe.

Every head run since the broad corpus started from the shipped head (`train_head --init`) at the recipe's peak
learning rate, and each first lost held-out loss (0.02-0.06 in its first 45-90 s on an H200). This replays such a
start at small scale: the shipped head, a corpus it never saw (the target's answers to the prompt bank's templates,
made here by the engine, half greedy, half at temperature 1; one answer in 8 held out), the target's features and
laws computed once, then each recipe over the batches in one shuffled order, held-out loss every --eval steps.
A recipe is PEAK_LR/WARMUP_STEPS/FILL: FILL steps at lr 0 first (AdamW's moments from the data, no weight moves;
they take the order's first FILL batches, so that recipe's training steps start FILL batches later), then the
warm-up and a cosine over --steps down to 10% (`train_head.lr_at`).

    python -m benchmarks.warm_restart [--minutes 8] [--batch-tokens 1024] [--passes 2] [--steps 60] [--eval 15]
        [--recipes 3e-4/60/0 3e-4/1/40 1e-4/60/0 3e-5/60/0] [--tag TAG]

Writes benchmarks/results/warm_restart_{device}[_tag].json and prints a table. Numbers, not assertions.
"""
import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.run import RESULTS, environment
from flashspec_core import Engine
from flashspec_core import prompt_bank as bank
from flashspec_core import train_head as th
from flashspec_core.draft_head import load_head
from flashspec_core.head_data import Corpus
from flashspec_core.models import load_model
from flashspec_core.sampling import SamplingConfig

HEAD = Path("assets/draft_head")


HELD_EVERY = 8  # one answer in 8 is held out


def answers(minutes: float, max_new_tokens: int, seed: int) -> Corpus:
    """The 4-bit engine's answers to template prompts over the bank's domains until `minutes` pass, and at least
    HELD_EVERY of them, so that one is held out however slow the machine runs."""
    rng = random.Random(seed)
    prompts = bank.make_prompts(100000, list(bank.DOMAINS), {}, rng)
    engine, seqs, starts, greedy, t0 = Engine.from_preset("embedded"), [], [], [], time.monotonic()
    for i, p in enumerate(prompts):
        if time.monotonic() - t0 > minutes * 60 and len(seqs) >= HELD_EVERY:
            break
        ids = engine.encode(p.text)
        sampling = None if i % 2 == 0 else SamplingConfig(temperature=1.0)
        out = engine.generate(p.text, max_new_tokens, sampling, mode="plain", seed=seed + i).token_ids
        seqs.append(ids + out)
        starts.append(len(ids))
        greedy.append(sampling is None)
    return Corpus(seqs, starts, [i % HELD_EVERY == HELD_EVERY - 1 for i in range(len(seqs))], greedy)


@torch.no_grad()
def target_batches(model, head, corpus: Corpus, cfg: th.TrainConfig, heldout: bool) -> list[tuple]:
    """Each batch's ids, lengths, answer starts, the target's features and its laws on the draft vocabulary."""
    out = []
    for idx in th.batches(corpus, corpus.split(heldout), cfg, None if heldout else random.Random(cfg.seed)):
        ids, lengths, starts = th.pad(corpus, idx, cfg.max_len, "cpu")
        features, probs, _ = th.target_side(model, ids, head.cfg.aux_layers, head.draft_ids)
        out.append((ids, lengths, starts, features, probs.to(torch.bfloat16)))
    return out


def loss_of(head, batch, cfg: th.TrainConfig) -> torch.Tensor:
    target = th.soft_targets(head, batch[4].float(), keep=cfg.tv_weight > 0)
    return th.head_loss(head, batch[:3], batch[3], target, cfg)


@torch.no_grad()
def heldout_loss(head, held: list[tuple], cfg: th.TrainConfig) -> float:
    weights = [int((b[1] - b[2]).clamp_min(0).sum()) for b in held]  # answer tokens a batch holds
    return sum(float(loss_of(head, b, cfg)) * w for b, w in zip(held, weights)) / sum(weights)


def run_recipe(recipe: str, model, data: dict, cfg: th.TrainConfig, steps: int, every: int) -> list[tuple]:
    """(step, held-out loss) from the shipped head through `steps` steps of the recipe PEAK/WARMUP/FILL."""
    peak, warm, fill = recipe.split("/")
    cfg = replace(cfg, lr=float(peak), warmup_steps=int(warm))
    head = load_head(HEAD, model.config, model.get_input_embeddings().weight).train()  # its output rows frozen
    opt = th.optimizer(head, cfg)
    params, train, curve = [p for g in opt.param_groups for p in g["params"]], data["train"], []
    curve.append((0, heldout_loss(head, data["held"], cfg)))
    for k in range(int(fill) + steps):
        step = k - int(fill)  # < 0: filling the moments
        for g in opt.param_groups:
            g["lr"] = 0.0 if step < 0 else th.lr_at(step, step / steps, cfg)
        th.optimizer_step(loss_of(head, train[k % len(train)], cfg), opt, params)
        if step >= 0 and (step + 1) % every == 0:
            curve.append((step + 1, heldout_loss(head, data["held"], cfg)))
    return curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=8.0, help="time for making the corpus")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--passes", type=int, default=2, help="draft passes unrolled a step (training-time test)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval", type=int, default=15, help="held-out loss every this many steps")
    ap.add_argument("--heldout-batches", type=int, default=4)
    ap.add_argument("--recipes", nargs="+", default=["3e-4/60/0", "3e-4/1/40", "1e-4/60/0", "3e-5/60/0"])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    corpus = answers(args.minutes, args.max_new_tokens, args.seed)
    cfg = replace(th.TrainConfig(), batch_tokens=args.batch_tokens, max_len=384, ttt_steps=args.passes,
                  tv_weight=2.0, seed=args.seed)  # tv_weight: the shipped head's run
    model = load_model("embedded", torch.device("cpu"), torch.float32)[0].eval()
    head = load_head(HEAD, model.config, model.get_input_embeddings().weight)
    data = {"train": target_batches(model, head, corpus, cfg, False),
            "held": target_batches(model, head, corpus, cfg, True)[:args.heldout_batches]}
    print(f"{len(corpus)} answers, {len(data['train'])} training batches of {args.batch_tokens} tokens, "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    curves = {r: run_recipe(r, model, data, cfg, args.steps, args.eval) for r in args.recipes}
    command = "python -m benchmarks.warm_restart " + " ".join(sys.argv[1:] if argv is None else argv)
    report(args, corpus, curves, command)
    return 0


def report(args, corpus: Corpus, curves: dict, command: str) -> None:
    answer_tokens = sum(len(s) - b for s, b in zip(corpus.sequences, corpus.starts))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("warm_restart_cpu" + (f"_{args.tag}" if args.tag else "") + ".json")
    path.write_text(json.dumps({"command": command, "env": environment(), "answers": len(corpus),
                                "answer_tokens": answer_tokens, "curves": curves}, indent=1))
    steps = [s for s, _ in next(iter(curves.values()))]
    print(f"\nheld-out loss by step ({len(corpus)} answers, {answer_tokens} answer tokens; {path.name})\n")
    print("| peak lr / warm-up / steps at lr 0 | " + " | ".join(str(s) for s in steps) + " | highest - start |")
    print("|---|" + "---:|" * (len(steps) + 1))
    for recipe, curve in curves.items():
        losses = [l for _, l in curve]
        print(f"| {recipe} | " + " | ".join(f"{l:.4f}" for l in losses) + f" | {max(losses) - losses[0]:+.4f} |")


if __name__ == "__main__":
    raise SystemExit(main())
