"""What the app costs on top of the engine: tokens per second through the app's own handler
(components.handlers.run_stream, the generator the Run button drives, every yield consumed, formatting and
figures included) against the engine alone (Engine.stream drained), same prompt, seed and settings.

    python -m benchmarks.app_overhead [--reps 5] [--max-new-tokens 128] [--example NAME]

Two configurations: the app's default (the bandit over prompt lookup, n-gram cache and no-draft; its choices
follow measured times, so two runs may take different paths) and prompt lookup alone (no bandit: both sides
decode exactly the same rounds, so the difference is the app's cost). Runs alternate engine / handler and
configuration, after one warm-up round; medians are reported. Both sides decode on the app's engine thread
(components.background), as the app does. Not included: gradio serialising and sending each update, and the
browser drawing it; gradio does that while the engine thread keeps decoding, but on a small machine it still
competes for the cores.

Writes benchmarks/results/app_overhead.json and prints a table. Target: the handler within 10% of the engine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from benchmarks.run import RESULTS, shown_path
from components import engine_cache
from components.background import on_engine_thread
from components.handlers import EXAMPLES, open_stream, run_stream
from components.prompt import example_by_name
from components.session import Session
from components.settings import parse_settings

OUT = RESULTS / "app_overhead.json"
TARGET = 0.10
CONFIGS = {"bandit (app default)": ["prompt_lookup", "ngram_cache"], "prompt_lookup only": ["prompt_lookup"]}


def picker_values(roles: list[str], max_new_tokens: int) -> dict:
    return dict(pair="embedded", target="", draft="", roles=roles, gamma_auto=False, gamma=4, temperature=0.0,
                top_p=1.0, max_new_tokens=max_new_tokens, seed=0, bandit="ucb1", backend="auto")


def engine_alone(slot, prompt: str, values: dict) -> dict:
    """The engine's stream drained, as the handler would set it up; wall time around everything."""
    settings = parse_settings(**values)
    t0 = time.perf_counter()
    with slot.lock:  # on the engine thread, like the app: see components/background.py
        events = on_engine_thread(lambda: list(open_stream(slot, prompt, settings)))
    wall = time.perf_counter() - t0
    tokens = sum(len(e.emitted) for e in events)
    return dict(tokens=tokens, wall_s=wall, tok_per_s=tokens / wall, rounds=len(events),
                engine_tok_per_s=tokens / events[-1].elapsed_s)


def through_handler(prompt: str, values: dict) -> dict:
    """The Run button's handler, every yield consumed; wall time around everything."""
    state = Session()
    t0 = time.perf_counter()
    yields = sum(1 for _ in run_stream(state, prompt, **values))
    wall = time.perf_counter() - t0
    if not state.runs:
        raise RuntimeError("the handler did not finish a run; see its status line")
    run = state.runs[-1].record
    return dict(tokens=run["new_tokens"], wall_s=wall, tok_per_s=run["new_tokens"] / wall, yields=yields,
                rounds=run["target_forwards"], engine_tok_per_s=run["tok_per_s"])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--example", default="Long repetitive answer", choices=[ex["name"] for ex in EXAMPLES])
    args = parser.parse_args(argv)
    prompt = example_by_name(EXAMPLES, args.example)["prompt"]
    load_before = os.getloadavg()
    slot = engine_cache.get_engine(parse_settings(**picker_values(["prompt_lookup"], 1)).pair, "auto")

    runs = {name: {"engine": [], "handler": []} for name in CONFIGS}
    for rep in range(args.reps + 1):  # rep 0 warms up; configurations and sides alternate, so load drifts hit all
        for name, roles in CONFIGS.items():
            values = picker_values(roles, args.max_new_tokens)
            if rep % 2:  # which side goes first alternates too
                engine, handler = engine_alone(slot, prompt, values), through_handler(prompt, values)
            else:
                handler, engine = through_handler(prompt, values), engine_alone(slot, prompt, values)
            if rep:
                runs[name]["engine"].append(engine)
                runs[name]["handler"].append(handler)
    results = {}
    for name, roles in CONFIGS.items():
        med = {side: statistics.median(r["tok_per_s"] for r in rs) for side, rs in runs[name].items()}
        ratios = [h["tok_per_s"] / e["tok_per_s"] for e, h in zip(runs[name]["engine"], runs[name]["handler"])]
        results[name] = dict(drafters=roles, runs=runs[name], median_tok_per_s=med,
                             overhead_of_medians=1 - med["handler"] / med["engine"],
                             overhead_paired=1 - statistics.median(ratios))

    report = dict(
        command=" ".join(["python -m benchmarks.app_overhead", *(sys.argv[1:] if argv is None else argv)]),
        what="tok/s = new tokens / wall seconds around one whole run (prefill included), medians over reps; "
             "overhead_paired = 1 - median over reps of handler/engine tok/s of the runs made back to back",
        example=args.example, max_new_tokens=args.max_new_tokens, reps=args.reps, target_overhead=TARGET,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__,
                     torch_threads=torch.get_num_threads(), device=str(slot.engine.target.device),
                     load_average_before=load_before, load_average_after=os.getloadavg()),
        results=results,
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1))
    print(f"{'configuration':<22}{'engine tok/s':>14}{'handler tok/s':>15}{'overhead':>10}{'paired':>8}"
          f"  (target < {TARGET:.0%})")
    for name, r in results.items():
        m = r["median_tok_per_s"]
        print(f"{name:<22}{m['engine']:>14.1f}{m['handler']:>15.1f}{r['overhead_of_medians']:>10.1%}"
              f"{r['overhead_paired']:>8.1%}")
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus; "
          f"wrote {shown_path(OUT)}")
    return report


if __name__ == "__main__":
    main()
