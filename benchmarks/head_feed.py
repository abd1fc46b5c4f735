"""What keeping the draft head current costs a round: plain decoding against plain rounds that feed the head.

    python -m benchmarks.head_feed [--prompts 6] [--max-new-tokens 96] [--repeats 2]

The embedded engine (its default precision) decodes each hand-written open prompt twice per repeat, greedy: in plain
mode (the no-draft arm alone: the target reports no hidden states, the head runs nothing) and with the draft head as
the only arm at gamma 0 (every round is still a one-token plain step, but the target hands its hidden states to the
head, which runs its first pass over them, as in every round of a bandit stream). Both give the same tokens; the
difference per round is the price of an always-current head. Writes JSON under benchmarks/results/ and prints a
table. Numbers, not assertions.
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
    args = ap.parse_args(argv)
    engine = Engine.from_preset("embedded")
    engine.generate("Hello", 8)  # warm up
    rows = []
    for p in load_prompt_set("open")[:args.prompts]:
        for _ in range(args.repeats):
            plain_ms, plain_tps, plain_ids = per_round(engine, p["prompt"], args.max_new_tokens, mode="plain")
            fed_ms, fed_tps, fed_ids = per_round(engine, p["prompt"], args.max_new_tokens, gamma=0, drafters=["draft_head"])
            rows.append({"prompt": p["kind"], "plain_ms_per_round": plain_ms, "fed_ms_per_round": fed_ms,
                         "plain_tok_per_s": plain_tps, "fed_tok_per_s": fed_tps, "same_tokens": plain_ids == fed_ids})
    env = environment()
    env.update(precision=engine.precision)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"head_feed_{'cuda' if env['cuda'] else 'cpu'}_{engine.precision}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": "python -m benchmarks.head_feed " + " ".join(sys.argv[1:] if argv is None else argv), "env": env,
         "rows": rows}, indent=2))
    print(f"{env['cuda'] or env['machine']}, precision {engine.precision}\n")
    print("| prompt | plain ms/round | head fed ms/round | extra ms | plain tok/s | fed tok/s | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['plain_ms_per_round']:.2f} | {r['fed_ms_per_round']:.2f} | "
              f"{r['fed_ms_per_round'] - r['plain_ms_per_round']:+.2f} | {r['plain_tok_per_s']:.1f} | {r['fed_tok_per_s']:.1f} | "
              f"{r['same_tokens']} |")
    extra = [r["fed_ms_per_round"] - r["plain_ms_per_round"] for r in rows]
    print(f"\nmedian extra {median(extra):.2f} ms a round, median plain round {median(r['plain_ms_per_round'] for r in rows):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
