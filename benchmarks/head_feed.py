"""What keeping the draft head fed costs a round: plain decoding against plain rounds that feed the head.

    python -m benchmarks.head_feed [--prompts 6] [--max-new-tokens 96] [--repeats 2] [--catch-up 1 16]

The embedded engine (its default precision) decodes each hand-written open prompt per repeat, greedy: in plain
mode (the no-draft arm alone: the target reports no hidden states, the head runs nothing) and with the draft head as
the only arm at gamma 0 (every round is still a one-token plain step, but the target hands its hidden states to the
head, as in every round of a bandit stream), once per `--catch-up` value: the head's first pass runs once that
many verified slots wait (1: every round, the head always current). All give the same tokens; the difference per
round is the price of feeding the head. Writes JSON under benchmarks/results/ and prints a table. Numbers, not
assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
from statistics import median

from benchmarks.run import RESULTS, environment, load_prompt_set
from flashspec_core import Engine


def per_round(engine: Engine, prompt: str, max_new: int, **kwargs) -> tuple[float, float, list[int]]:
    result = engine.generate(prompt, max_new, **kwargs)
    return 1e3 * result.stats["elapsed_s"] / len(result.events), result.stats["tok_per_s"], result.token_ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--catch-up", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args(argv)
    engine = Engine.from_preset("embedded")
    engine.generate("Hello", 8)  # warm up
    head, rows = engine.drafters["draft_head"], []
    for p in load_prompt_set("open")[:args.prompts]:
        for _ in range(args.repeats):
            plain_ms, plain_tps, plain_ids = per_round(engine, p["prompt"], args.max_new_tokens, mode="plain")
            for catch_up in args.catch_up:
                head.catch_up_slots = catch_up
                fed_ms, fed_tps, fed_ids = per_round(engine, p["prompt"], args.max_new_tokens, gamma=0,
                                                     drafters=["draft_head"])
                rows.append({"prompt": p["kind"], "catch_up": catch_up, "plain_ms_per_round": plain_ms,
                             "fed_ms_per_round": fed_ms, "plain_tok_per_s": plain_tps, "fed_tok_per_s": fed_tps,
                             "same_tokens": plain_ids == fed_ids})
    env = environment()
    env.update(precision=engine.precision)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"head_feed_{'cuda' if env['cuda'] else 'cpu'}_{engine.precision}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": "python -m benchmarks.head_feed " + " ".join(sys.argv[1:] if argv is None else argv), "env": env,
         "rows": rows}, indent=2))
    print(f"{env['cuda'] or env['machine']}, precision {engine.precision}\n")
    print("| prompt | catch up | plain ms/round | head fed ms/round | extra ms | plain tok/s | fed tok/s | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['catch_up']} | {r['plain_ms_per_round']:.2f} | {r['fed_ms_per_round']:.2f} | "
              f"{r['fed_ms_per_round'] - r['plain_ms_per_round']:+.2f} | {r['plain_tok_per_s']:.1f} | {r['fed_tok_per_s']:.1f} | "
              f"{r['same_tokens']} |")
    print(f"\nmedian plain round {median(r['plain_ms_per_round'] for r in rows):.2f} ms")
    for catch_up in args.catch_up:
        extra = [r["fed_ms_per_round"] - r["plain_ms_per_round"] for r in rows if r["catch_up"] == catch_up]
        print(f"catch up {catch_up}: median extra {median(extra):.2f} ms a round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
