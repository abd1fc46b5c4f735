"""The draft head on prompts it never saw (the held-out split of its training data): tokens per target
forward and acceptance, greedy and at temperature 1, tok/s against own plain decoding, and one head step's
cost against one target step.

    python -m benchmarks.head [--prompts 12] [--max-new-tokens 96] [--gamma auto]

Every run is cold (drafter memories reset) and uses the same seed. Writes JSON under benchmarks/results/ and
prints a table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
from statistics import mean, median

from flashspec_core import Engine, SamplingConfig
from flashspec_core.engine import HEADS

from benchmarks.run import GREEDY, RESULTS, environment, run_engine

SAMPLINGS = {"greedy": GREEDY, "t1": SamplingConfig(temperature=1.0)}


def heldout_prompts(n: int) -> list[str]:
    return json.loads((HEADS["embedded"].folder / "heldout_prompts.json").read_text())[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gamma", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    engine = Engine.from_preset("embedded", device=args.device, dtype=args.dtype)
    run_engine(engine, "Hello!", 8, args.seed, drafters=["draft_head"], gamma=gamma)  # warm-up
    rows = []
    for i, prompt in enumerate(heldout_prompts(args.prompts)):
        plain = run_engine(engine, prompt, args.max_new_tokens, args.seed, mode="plain")
        row = {"prompt": i, "plain_tok_per_s": plain["tok_per_s"], "target_step_ms": plain["verify_ms"]}
        for name, sampling in SAMPLINGS.items():
            r = run_engine(engine, prompt, args.max_new_tokens, args.seed, sampling, drafters=["draft_head"], gamma=gamma)
            if name == "greedy":
                row["same_as_plain"] = r["ids"] == plain["ids"]
            row[name] = {k: v for k, v in r.items() if k != "ids"}
        rows.append(row)
        print(f"prompt {i:2d}: plain {plain['tok_per_s']:6.1f} tok/s | greedy {row['greedy']['tokens_per_forward']:.2f} "
              f"tokens/forward {row['greedy']['tok_per_s'] / plain['tok_per_s']:.2f}x | t1 "
              f"{row['t1']['tokens_per_forward']:.2f} tokens/forward", flush=True)
    summary = summarize(rows)
    env = environment()
    payload = {"command": "python -m benchmarks.head " + " ".join(sys.argv[1:] if argv is None else argv),
               "gamma": gamma, "max_new_tokens": args.max_new_tokens, "seed": args.seed, "env": env,
               "summary": summary, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"head_embedded_{'cuda' if env['cuda'] else 'cpu'}.json"
    out.write_text(json.dumps(payload, indent=2))
    print(table(summary, env))
    return 0


def summarize(rows: list[dict]) -> dict:
    """Means over prompts (tokens per forward weights every round equally within a prompt)."""
    out = {"prompts": len(rows), "same_as_plain": sum(r["same_as_plain"] for r in rows),
           "target_step_ms": median(r["target_step_ms"] for r in rows)}
    for name in SAMPLINGS:
        out[name] = {"tokens_per_forward": mean(r[name]["tokens_per_forward"] for r in rows),
                     "acceptance": mean(r[name]["acceptance"] for r in rows),
                     "speedup": mean(r[name]["tok_per_s"] / r["plain_tok_per_s"] for r in rows),
                     "head_step_ms": median(r[name]["draft_ms_per_token"] for r in rows)}
    return out


def table(s: dict, env: dict) -> str:
    where = env["cuda"] or f"{env['machine']}, {env['threads']} threads"
    lines = [f"{where}, torch {env['torch']}, commit {env['commit']}; {s['prompts']} held-out prompts, "
             f"greedy ids equal to plain in {s['same_as_plain']}/{s['prompts']}", "",
             "| sampling | tokens per target forward | acceptance | speedup vs own plain | head step ms | target step ms | head / target |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in SAMPLINGS:
        r = s[name]
        lines.append(f"| {name} | {r['tokens_per_forward']:.2f} | {r['acceptance']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['head_step_ms']:.2f} | {s['target_step_ms']:.2f} | {r['head_step_ms'] / s['target_step_ms']:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
