"""Where a captured round's GPU time goes: the kernels of plain, chain and tree rounds, in microseconds a round.

    python -m benchmarks.round_profile [--prompt 1] [--max-new-tokens 96] [--rows 40] [--dtype float32]
                                       [--temperature 1]

On a GPU (rounds replay CUDA graphs), one hand-written open prompt is decoded once per config as
`benchmarks.tree_round` decodes it (plain, a chain of 6, trees of 10 and 32 nodes), then again under the torch
profiler; each kernel's device time and launches are divided by the rounds. The sum over kernels is a round's GPU
work (a graph adds no launch gaps of the host's); comparing the configs' tables says what a tree round adds to a
chain round. Writes JSON under benchmarks/results/ and prints the tables. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.run import RESULTS, environment, load_prompt_set
from benchmarks.tree_round import decode, name_of
from flashspec_core import Engine, SamplingConfig
from flashspec_core.tree_round import TreeSize

CONFIGS = (0, 6, TreeSize(6, 2, 10), TreeSize(6, 4, 32))


def kernels(prof, rounds: int) -> list[dict]:
    """The profile's device-side events (kernels, copies) per round, costliest first."""
    rows = [{"name": e.key, "us_a_round": e.self_device_time_total / rounds, "launches_a_round": e.count / rounds}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_a_round"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=1, help="index in the hand-written open prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rows", type=int, default=40, help="kernels printed per config")
    ap.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA; float32 profiles its rounds")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled rounds (trees in their static shape)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("round_profile needs a GPU: its rounds are CUDA graphs", file=sys.stderr)
        return 2
    engine = Engine.from_preset("embedded", dtype=args.dtype, precision="auto", captured="auto")
    engine.warm_up(1024)
    ids = engine.encode(load_prompt_set("open")[args.prompt]["prompt"])
    sampling, out = SamplingConfig(temperature=args.temperature), {}
    for config in CONFIGS:
        decode(engine, ids, config, sampling, 0, args.max_new_tokens)  # its graphs, before the profiled run
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run = decode(engine, ids, config, sampling, 0, args.max_new_tokens)
        rows = kernels(prof, run["forwards"])
        out[name_of(config)] = {"rounds": run["forwards"], "round_ms": run["round_ms"],
                                "tokens_per_forward": run["tokens_per_forward"],
                                "kernel_us_a_round": sum(r["us_a_round"] for r in rows),
                                "launches_a_round": sum(r["launches_a_round"] for r in rows), "kernels": rows}
        o = out[name_of(config)]
        print(f"\n== {name_of(config)}: {o['round_ms']:.2f} ms a round (profiled), {o['kernel_us_a_round']:.0f} us of "
              f"kernels in {o['launches_a_round']:.0f} launches a round, {o['rounds']} rounds")
        for r in rows[:args.rows]:
            print(f"  {r['us_a_round']:7.1f} us {r['launches_a_round']:6.1f}x  {r['name'][:100]}")
    env = environment()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "round_profile_cuda" + (f"_{args.tag}" if args.tag else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": "python -m benchmarks.round_profile " + " ".join(sys.argv[1:] if argv is None else argv),
         "env": env, "configs": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
