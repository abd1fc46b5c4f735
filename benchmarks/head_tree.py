"""What drafting a dynamic tree costs the shipped draft head on the CPU, against a chain of 6: the drafting alone,
no target forward.

    python -m benchmarks.head_tree [--prompts 3] [--reps 10] [--float32]

The embedded model's head as the CPU engine runs it beside the 4-bit target (packed products, `head_for`: the
native kernel's Q8_0 blocks, else int8 rows; its 12288-id draft vocabulary; --float32 for the float32 head),
observed over the first --prompts hand-written open prompts (`benchmarks/open_prompts.json`, the prompt text as
is). Each row is the median over prompts and --reps calls of `propose(rows, 6)` or `propose_tree(rows, depth,
top_k, size)` from the same state (the first call warms up), with the tree's drafted depth and the head steps it
ran (depth - 1 masked steps over up to top_k nodes each).
Writes JSON under benchmarks/results/ and prints a table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median

import torch

from benchmarks.run import GREEDY, RESULTS, ROOT, environment, shown_path
from flashspec_core.engine import head_for
from flashspec_core.models import load_model

CHAIN = 6
TREES = ((6, 4, 8), (6, 4, 16), (6, 4, 32), (6, 8, 32))  # (depth, top_k, size)


def observed(drafter, model, tokenizer, prompt: str) -> list[list[int]]:
    """Start the drafter on the prompt with the target's features (the prompt but its last token); the rows."""
    rows = [tokenizer(prompt)["input_ids"]]
    with torch.no_grad():
        states = model(torch.tensor(rows), output_hidden_states=True).hidden_states
    features = torch.cat([states[i] for i in drafter.aux_layers], dim=-1)[:, :-1]
    drafter.start(rows, GREEDY, None, features)
    return rows


def time_calls(call, reps: int) -> list[float]:
    """ms of each of reps calls, after one warm-up call."""
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def measure(drafter, rows, reps: int) -> dict[str, dict]:
    """Per drafting: its times (ms) and, for trees, the drafted depth."""
    out = {f"chain {CHAIN}": {"ms": time_calls(lambda: drafter.propose(rows, CHAIN), reps), "nodes": CHAIN,
                              "depth": CHAIN, "steps": CHAIN - 1}}
    for depth, top_k, size in TREES:
        tree = drafter.propose_tree(rows, depth, top_k, size).tree
        ms = time_calls(lambda: drafter.propose_tree(rows, depth, top_k, size), reps)
        out[f"tree d{depth} k{top_k} s{size}"] = {"ms": ms, "nodes": tree.N, "depth": tree.max_depth,
                                                   "steps": depth - 1}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--float32", action="store_true", help="the float32 head instead of packed products")
    args = ap.parse_args(argv)

    model, tokenizer = load_model("embedded", torch.device("cpu"), torch.float32)
    drafter = head_for("embedded", model, packed=not args.float32)
    prompts = [r["prompt"] for r in json.loads((ROOT / "benchmarks" / "open_prompts.json").read_text())][:args.prompts]
    runs = []
    for prompt in prompts:
        rows = observed(drafter, model, tokenizer, prompt)
        runs.append({"context": len(rows[0]), "rows": measure(drafter, rows, args.reps)})
    names = list(runs[0]["rows"])
    table = [{"name": n, "ms": median(t for run in runs for t in run["rows"][n]["ms"]),
              "nodes": [run["rows"][n]["nodes"] for run in runs], "depth": [run["rows"][n]["depth"] for run in runs],
              "steps": runs[0]["rows"][n]["steps"]} for n in names]
    for row in table:
        row["x_chain"] = row["ms"] / table[0]["ms"]
    precision = "float32" if args.float32 else "packed"
    payload = {"command": "python -m benchmarks.head_tree " + " ".join(sys.argv[1:] if argv is None else argv),
               "env": environment(), "precision": precision, "contexts": [r["context"] for r in runs],
               "reps": args.reps, "table": table, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"head_tree_cpu_{precision}.json"
    out.write_text(json.dumps(payload, indent=2))
    env = payload["env"]
    print(f"{env['machine']}, {env['threads']} threads, torch {env['torch']}, commit {env['commit']}; head {precision}; "
          f"contexts {payload['contexts']}, medians of {args.reps} x {len(runs)}; {shown_path(out)}")
    print()
    print("| drafting | head steps | nodes | drafted depth | ms | x chain 6 |")
    print("|---|---:|---:|---|---:|---:|")
    for r in table:
        print(f"| {r['name']} | {r['steps']} | {'/'.join(map(str, r['nodes']))} | {'/'.join(map(str, r['depth']))} "
              f"| {r['ms']:.2f} | {r['x_chain']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
