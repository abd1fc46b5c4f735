"""Where a stream's start goes: the prompt's prefill, the drafters' start, the captured round's begin.

    python -m benchmarks.start_profile [--prompts 12] [--tree auto] [--dtype bfloat16]

The engine as `benchmarks.run` builds it (embedded model, warm-up), then for each hand-written open prompt a plain
stream and a draft-head stream (the tree's, `--tree`) of a few tokens, cold, with the target's prompt prefilled as
one padded graph (`StaticCausalLM.prefill_graphs`, the default on a GPU) and again as one eager forward. Each part of
the start is timed with a device sync before and after it (so the parts add up to a little more than the start
alone), the start itself without them. Writes JSON under benchmarks/results/ and prints a table of medians.
Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from statistics import median

import torch

from benchmarks.run import RESULTS, environment, load_prompt_set, parse_tree
from flashspec_core import Engine


class Parts:
    """Wall time of named methods while `on`, each between two syncs."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False  # inside a start, recording
        self.record = False  # whether the next starts record

    def wrap(self, obj, attr: str, name: str) -> None:
        f = getattr(obj, attr)

        def timed(*args, **kwargs):
            if not self.on:
                return f(*args, **kwargs)
            self.sync()
            t0 = time.perf_counter()
            out = f(*args, **kwargs)
            self.sync()
            self.seconds[name] += time.perf_counter() - t0
            return out

        setattr(obj, attr, timed)


def instrument(engine: Engine) -> Parts:
    """The parts of `DeviceRound.start`, timed while a start runs (the rounds after it are not)."""
    parts, r = Parts(engine.target.device), engine.round
    start = r.start

    def timed_start(*args, **kwargs):
        parts.on = parts.record
        try:
            return start(*args, **kwargs)
        finally:
            parts.on = False

    r.start = timed_start
    parts.wrap(r, "feed", "feed")
    parts.wrap(r, "_capture", "capture check")
    parts.wrap(r.target, "forward", "target prefill")
    for name, d in r.drafters.items():
        parts.wrap(d, "start", f"{name} start")
    if r._built is not None:
        parts.wrap(r._built, "begin", "captured begin")
        parts.wrap(r._built, "prompt", "head prompt graphs")
    return parts


def one_start(engine: Engine, parts: Parts, prompt: str, kwargs: dict) -> dict:
    """The start of one cold stream: its prefill_s alone (parts off), then its parts (a second stream, synced
    around each)."""
    engine.reset_session()
    alone = engine.generate(prompt, max_new_tokens=4, seed=0, **kwargs).stats["prefill_s"]
    engine.reset_session()
    parts.seconds.clear()
    parts.record = True
    try:
        engine.generate(prompt, max_new_tokens=4, seed=0, **kwargs)
    finally:
        parts.record = False
    return {"start_ms": 1e3 * alone, **{k: 1e3 * v for k, v in parts.seconds.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="the first N hand-written open prompts")
    ap.add_argument("--tree", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    tree = parse_tree(args.tree)
    engine = Engine.from_preset("embedded", dtype=args.dtype, captured="auto")
    warm = engine.warm_up(512, trees=[tree] if tree else ())
    parts = instrument(engine)
    configs = {"plain": dict(mode="plain"), "head": dict(drafters=["draft_head"], tree=tree)}
    lm, graphs = engine.target, getattr(engine.target, "prefill_graphs", 0)
    rows = []
    for p in load_prompt_set("open")[:args.prompts]:
        n = len(engine.encode(p["prompt"]))
        for prefill in ("graph", "eager"):
            lm.prefill_graphs = graphs if prefill == "graph" else 0
            for name, kw in configs.items():
                one_start(engine, parts, p["prompt"], kw)  # anything this prompt captures, outside the timed runs
                rows.append({"prompt": p["kind"], "tokens": n, "prefill": prefill, "config": name,
                             **one_start(engine, parts, p["prompt"], kw)})
    lm.prefill_graphs = graphs
    keys = sorted({k for r in rows for k in r} - {"prompt", "tokens", "prefill", "config"})
    print(f"warm-up {warm:.1f} s; medians over {args.prompts} prompts (ms)")
    print(f"{'prefill':>12} {'config':>6} " + " ".join(f"{k:>15}" for k in keys))
    for prefill in ("graph", "eager"):
        for name in configs:
            sel = [r for r in rows if r["prefill"] == prefill and r["config"] == name]
            print(f"{prefill:>12} {name:>6} " + " ".join(f"{median(r.get(k, 0.0) for r in sel):15.2f}" for k in keys))
    out = RESULTS / f"start_profile_{engine.target.device.type}_{engine.precision}{args.tag}.json"
    out.write_text(json.dumps({"environment": environment(), "warm_up_s": warm, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
