"""What a draft-tree verify costs the target on the static path: one token, a chain of 8 drafts, and trees of 8,
16 and 32 nodes, each one forward after a context of --context tokens; and the compaction that follows a tree.

    python -m benchmarks.tree_forward [--precision gguf|float32] [--context 300] [--reps 15]

The embedded model (SmolLM2-135M) on the CPU; gguf = its own Q4_1 weights (the CPU default). Each row is the
median over --reps calls of one forward from the same cache length (the cache is cropped back before each), tokens
drawn at random. The chain runs twice: through `forward` (the chain path) and as a chain tree through
`forward_tree` (what the tree mask costs by itself); two trees run again with one slot's logits (logits_to_keep=1),
which leaves the layers' share of the cost. On gguf every row runs twice, in the same process, where the native
kernels load: with attention="ordered" (their default: each query's visible keys in slot order, trees exact, see
`StaticCausalLM`) and with SDPA. Writes JSON under benchmarks/results/ and prints a table.
Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median

import torch

from benchmarks.run import RESULTS, environment, shown_path
from flashspec_core import native
from flashspec_core.fast_path import StaticCausalLM
from flashspec_core.models import embedded_gguf, load_model
from flashspec_core.tree import DraftTree

TREES = {  # name -> (tree or None for a plain forward of N + 1 tokens, N, logits_to_keep)
    "1 token (forward)": (None, 0, 0),
    "chain 8 (forward)": (None, 8, 0),
    "chain 8 (forward_tree)": (DraftTree.chain(8), 8, 0),
    "tree 2x3": (DraftTree.full((2, 3)), 8, 0),
    "tree 4x3": (DraftTree.full((4, 3)), 16, 0),
    "tree 4x7": (DraftTree.full((4, 7)), 32, 0),
    "tree 2x3, 1 slot's logits": (DraftTree.full((2, 3)), 8, 1),  # the LM head on one row: the layers' share
    "tree 4x7, 1 slot's logits": (DraftTree.full((4, 7)), 32, 1),
}


def time_call(lm, context: int, ids: torch.Tensor, tree: DraftTree | None, keep: int, reps: int) -> float:
    """Median ms of one forward (or forward_tree) of ids [1, T] from a cache of `context` tokens."""
    times = []
    for _ in range(reps + 1):  # the first call warms up
        lm.crop(context)
        t0 = time.perf_counter()
        lm.forward(ids, keep) if tree is None else lm.forward_tree(ids, tree, keep)
        times.append(1e3 * (time.perf_counter() - t0))
    return median(times[1:])


def time_compact(lm, context: int, tree: DraftTree, reps: int) -> float:
    """Median ms of compact onto the tree's last leaf path, right after the tree's forward."""
    leaf = tree.paths[-1]
    path = torch.tensor([list(leaf) + [-1] * (tree.max_depth - len(leaf))])
    ids = torch.randint(0, lm.vocab_size, (1, tree.N + 1))
    times = []
    for _ in range(reps):
        lm.crop(context)
        lm.forward_tree(ids, tree)
        t0 = time.perf_counter()
        lm.compact(tree.kept_slots(path, context))
        times.append(1e3 * (time.perf_counter() - t0))
    return median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("gguf", "float32"), default="gguf")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)

    model, _ = load_model("embedded", torch.device("cpu"), torch.float32)
    gguf = embedded_gguf(model.config) if args.precision == "gguf" else None
    kinds = ["sdpa", "ordered"] if gguf is not None and native.load() else ["auto"]
    lms = {a: StaticCausalLM(model, max_len=1024, gguf=gguf, attention=a) for a in kinds}
    torch.manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (1, args.context))
    for lm in lms.values():
        lm.forward(context)
    rows = []
    for name, (tree, N, keep) in TREES.items():
        ids = torch.randint(0, model.config.vocab_size, (1, N + 1))
        row = {"name": name, "nodes": N, "tokens": N + 1, "logits_to_keep": keep}
        row.update({f"ms_{a}": time_call(lm, args.context, ids, tree, keep, args.reps) for a, lm in lms.items()})
        rows.append(row)
    for row in rows:
        row.update({f"x_one_token_{a}": row[f"ms_{a}"] / rows[0][f"ms_{a}"] for a in kinds})
    lm = lms[kinds[-1]]
    compact_ms = time_compact(lm, args.context, TREES["tree 4x7"][0], args.reps)
    payload = {"command": "python -m benchmarks.tree_forward " + " ".join(sys.argv[1:] if argv is None else argv),
               "env": environment(), "path": lm.path, "attention": kinds, "context": args.context, "reps": args.reps,
               "rows": rows, "compact_ms_tree_4x7": compact_ms}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"tree_forward_cpu_{args.precision}.json"
    out.write_text(json.dumps(payload, indent=2))
    env = payload["env"]
    print(f"{env['machine']}, {env['threads']} threads, torch {env['torch']}, commit {env['commit']}; {lm.path}; "
          f"{args.context}-token context, medians of {args.reps}; {shown_path(out)}")
    print()
    print("| forward | nodes | tokens | " + " | ".join(f"ms ({a}) | x 1 token ({a})" for a in kinds) + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(kinds))
    for r in rows:
        cells = " | ".join(f"{r[f'ms_{a}']:.1f} | {r[f'x_one_token_{a}']:.2f}" for a in kinds)
        print(f"| {r['name']} | {r['nodes']} | {r['tokens']} | {cells} |")
    print()
    print(f"compact after tree 4x7 (depth 2 path kept): {compact_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
