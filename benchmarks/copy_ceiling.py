"""How much of plain decoding's answer a copy could draft: the ceiling of the copy arms on each prompt.

    python -m benchmarks.copy_ceiling [--prompt-set examples|open] [--only KIND ...] [--precision P] [--tag T]

For each prompt the target's greedy answer (plain decoding, chat template), then tokens per target forward of:
- an oracle copy of at most K tokens a round: at each round the longest run of the coming answer that occurs anywhere
  in the context so far (prompt and answer), plus the target's own token; no drafter can copy more per forward;
- the copy drafters as they are (`PromptLookup`, `NgramCache`, up to 16 a round at flat verify costs), teacher-forced
  on that answer.
A prompt is copy-heavy for this target when its answer is: the same request can get an answer that rewrites
rather than copies. Numbers, not assertions; JSON and CSV under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys

from benchmarks.run import PROMPT_SETS, RESULTS, environment, load_prompt_set
from flashspec_core import Engine
from flashspec_core.drafters import NgramCache, PromptLookup
from flashspec_core.gamma import CostModel
from flashspec_core.sampling import SamplingConfig


def longest_copy(history: list[int], answer: list[int], p: int) -> int:
    """The longest run answer[p:p + L] that occurs in `history` (which may run on into the answer itself)."""
    best = 0
    for s in range(len(history)):
        L = 0
        while p + L < len(answer) and s + L < len(history) and history[s + L] == answer[p + L]:
            L += 1
        best = max(best, L)
    return best


def oracle_tokens_per_forward(context: list[int], answer: list[int], K: int) -> float:
    p = rounds = 0
    while p < len(answer):
        p += min(longest_copy(context + answer[:p], answer, p), K) + 1
        rounds += 1
    return len(answer) / max(rounds, 1)


def drafter_tokens_per_forward(drafter, context: list[int], answer: list[int], K: int) -> float:
    """The drafter proposing up to K tokens a round at the answer's prefix, each round emitting its matching prefix and
    the target's next token (greedy acceptance, teacher-forced). Its verify costs are flat (as on a GPU), so its own
    cut (`CopyDrafter._length`) drops only the tokens its odds give almost no chance."""
    drafter.costs = CostModel(decay=0.0)
    for T in (1, K + 1):
        drafter.costs.observe(T, 1.0)
    rows = [list(context)]
    drafter.start(rows, SamplingConfig(), None)
    p = rounds = 0
    while p < len(answer):
        draft, m = drafter.propose_ids(rows[0], K), 0
        while m < len(draft) and p + m < len(answer) and draft[m] == answer[p + m]:
            m += 1
        before = len(rows[0])
        rows[0].extend(answer[p:p + m + 1])
        drafter.observe(rows, before)
        p, rounds = p + m + 1, rounds + 1
    return len(answer) / max(rounds, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-set", default="examples", choices=sorted(PROMPT_SETS))
    ap.add_argument("--only", nargs="*", help="prompt kinds to run (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override each prompt's own length")
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32], help="the oracle's longest copy a round")
    ap.add_argument("--precision", default="auto", choices=["auto", "gguf", "float32"], help="the target's weights")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    engine = Engine.from_preset("embedded", precision=args.precision)
    rows = []
    for p in load_prompt_set(args.prompt_set):
        if args.only and p["kind"] not in args.only:
            continue
        context = engine.encode(p["prompt"], True)
        answer = engine.generate(p["prompt"], args.max_new_tokens or p["max_new_tokens"], mode="plain").token_ids
        row = {"prompt": p.get("name", p["kind"]), "kind": p["kind"], "tokens": len(answer)}
        row |= {f"oracle_K{K}": oracle_tokens_per_forward(context, answer, K) for K in args.ks}
        row |= {f"{d.name}_K16": drafter_tokens_per_forward(d, context, answer, 16)
                for d in (PromptLookup(), NgramCache())}
        rows.append(row)
        print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)
    tag = "_" + args.tag if args.tag else ""
    name = f"copy_ceiling_{engine.target.device.type}_{engine.precision}_{args.prompt_set}{tag}"
    payload = {"command": "python -m benchmarks.copy_ceiling " + " ".join(sys.argv[1:] if argv is None else argv),
               "env": environment(), "precision": engine.precision, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = [k for k in rows[0] if k not in ("prompt", "kind", "tokens")]
    env = payload["env"]
    print(f"\n{env['cuda'] or env['machine']}, precision {engine.precision}, commit {env['commit']}: tokens per target "
          "forward on plain decoding's greedy answer\n")
    print("| prompt | tokens | " + " | ".join(cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['kind']} | {r['tokens']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
