"""The draft head's step against the target's one-token step, on the default CPU path (the file's 4-bit weights).

    python -m benchmarks.head_step [--context 300] [--reps 200] [--repeats 5] [--intermediate 2048] [--tag T]

One draft step is what each drafted token after the first costs: the head's layer over one token at `context`
verified slots, then its logits over the restricted draft vocabulary and their argmax. It is timed for each way the
head's products can run: float weights (bfloat16), torch's int8 rows (bfloat16 activations) and the native
kernel's Q8_0 blocks with the output layer's rows in Q4_1 (float32 activations, the engine's choice beside the
4-bit target where the kernel loads),
taking turns `--repeats` times; each cell is the median of the repeats' means over `--reps` steps. The target's
one-token forward is timed the same way in the same process. `--intermediate` times the shipped head widened to
that many MLP units (what a wider head would cost before one is trained). Writes JSON under benchmarks/results/
and prints a table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from statistics import median

import torch

from benchmarks.run import RESULTS, environment
from flashspec_core import Engine, native
from flashspec_core.draft_head import DraftHead, HeadCache


def head_variants(head) -> dict:
    """name -> (head, activation dtype): copies of the shipped head with each kind of product."""
    out = {}
    for name, dtype, packing in (("bfloat16 weights", torch.bfloat16, None), ("int8 rows", torch.bfloat16, False),
                                 ("Q8_0 + Q4_1 output (native)", torch.float32, True)):
        if packing and not native.load():
            continue
        h = copy.deepcopy(head)
        h.unpack()
        h.to(dtype)
        h.embed = head.embed
        if packing is not None:
            h.pack(native=packing)
        out[name] = (h, dtype)
    return out


def widened_head(head, width: int):
    """A float copy of `head` whose MLP is `width` units wide (the new units silent, `train_head.widened`): what a
    wider head would cost a step before one is trained."""
    from dataclasses import replace

    from flashspec_core.train_head import widened
    h = copy.deepcopy(head)
    h.unpack()
    wide = DraftHead(replace(h.cfg, intermediate_size=width), h.embed)
    wide.load_state_dict(widened(h.state_dict(), wide.state_dict()))
    return wide.to(next(h.parameters()).dtype)


@torch.inference_mode()
def step_ms(head, dtype, limit: int | None, context: int, reps: int) -> float:
    cache = HeadCache(head.cfg, 1, context + 8, "cpu", dtype)
    features = torch.randn(1, context, head.cfg.feature_size, generator=torch.Generator().manual_seed(0))
    head.step(cache, torch.zeros(1, context, dtype=torch.long), head.fuse(features.to(dtype)))
    h, token = torch.randn(1, 1, head.cfg.hidden_size).to(dtype), torch.zeros(1, 1, dtype=torch.long)

    def one():
        out = head.step(cache, token, h)
        head.logits(out[:, -1], limit).float().argmax(dim=-1)
        cache.crop(context)

    for _ in range(10):
        one()
    t0 = time.perf_counter()
    for _ in range(reps):
        one()
    return (time.perf_counter() - t0) / reps * 1e3


@torch.inference_mode()
def target_ms(engine: Engine, context: int, reps: int) -> float:
    target = engine.target
    target.reset()
    target.forward(torch.ones(1, context, dtype=torch.long), logits_to_keep=1)
    ids = torch.ones(1, 1, dtype=torch.long)
    for _ in range(5):
        target.forward(ids, logits_to_keep=1)
        target.crop(context)
    t0 = time.perf_counter()
    for _ in range(reps // 4):
        target.forward(ids, logits_to_keep=1)
        target.crop(context)
    return (time.perf_counter() - t0) / (reps // 4) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--intermediate", type=int, default=0, help="time the shipped head with its MLP widened to this "
                    "many units (0: as shipped)")
    ap.add_argument("--tag", default="", help="a suffix for the result file")
    args = ap.parse_args(argv)
    engine = Engine.from_preset("embedded")
    drafter = engine.drafters["draft_head"]
    base = widened_head(drafter.head, args.intermediate) if args.intermediate else drafter.head
    variants = head_variants(base)
    times = {name: [] for name in [*variants, "target one-token forward"]}
    for _ in range(args.repeats):
        for name, (head, dtype) in variants.items():
            times[name].append(step_ms(head, dtype, drafter.limit, args.context, args.reps))
        times["target one-token forward"].append(target_ms(engine, args.context, args.reps))
    ms = {name: median(v) for name, v in times.items()}
    target = ms["target one-token forward"]
    env = environment()
    env.update(precision=engine.precision, path=engine.target.path if hasattr(engine.target, "path") else None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    width = base.cfg.intermediate_size
    tag = (f"_w{width}" if args.intermediate else "") + (f"_{args.tag}" if args.tag else "")
    (RESULTS / f"head_step_cpu_{engine.precision}{tag}.json").write_text(json.dumps(
        {"command": "python -m benchmarks.head_step " + " ".join(sys.argv[1:] if argv is None else argv), "env": env,
         "context": args.context, "draft_vocab": drafter.limit, "intermediate": width, "ms": ms, "runs_ms": times},
        indent=2))
    print(f"{env['machine']}, precision {engine.precision}, context {args.context}, draft vocabulary {drafter.limit}, "
          f"MLP {width} units\n")
    print("| step | ms (median) | / target one-token forward |")
    print("|---|---:|---:|")
    for name, value in ms.items():
        print(f"| {name} | {value:.3f} | {value / target:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
