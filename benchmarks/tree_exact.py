"""Whether the target's forwards keep plain decoding's bits on this machine: a verify of T tokens against T
one-token steps, a chain through `forward_tree` against `forward`, and every node of a branching tree against a
chain forward over its path; then greedy tree rounds (`benchmarks.tree_round.decode`) against plain decoding.

    python -m benchmarks.tree_exact [--precision auto] [--prompts 4] [--max-new-tokens 96]

On CUDA the layer kernels make a token's bits independent of the verify's width and, since a tree node reads its
path laid out as a chain, of the tree's shape; a row that differs here names the check that broke. Writes JSON
under benchmarks/results/ and prints a table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.run import RESULTS, environment, load_prompt_set
from benchmarks.tree_round import decode
from flashspec_core import Engine, SamplingConfig
from flashspec_core.tree import DraftTree
from flashspec_core.tree_round import TreeSize

TREE = DraftTree((-1, -1, 0, 0, 1, 2, 2, 4, 5, 5, 7))  # branching, depth 5
SHAPES = (TreeSize(6, 2, 10), TreeSize(6, 4, 16), TreeSize(6, 4, 32))


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def forward_checks(lm, context: list[int]) -> list[dict]:
    """Max |logit difference| of each check (0 = the same bits), after `context` in the cache."""
    toks = torch.randint(0, lm.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0)).to(lm.device)
    lm.reset()
    lm.forward(torch.tensor([context], device=lm.device))
    L = lm.length
    steps = torch.cat([lm.forward(toks[:, t:t + 1])[:, -1:] for t in range(33)], 1)
    rows = []
    for T in (2, 8, 11, 17, 33):
        lm.crop(L)
        wide = lm.forward(toks[:, :T])
        lm.crop(L)
        chain = lm.forward_tree(toks[:, :T], DraftTree.chain(T - 1))
        rows += [{"check": f"{T}-token verify vs one-token steps", "max_diff": diff(wide, steps[:, :T])},
                 {"check": f"chain of {T} through forward_tree vs forward", "max_diff": diff(chain, wide)}]
    lm.crop(L)
    tree = lm.forward_tree(toks[:, :TREE.N + 1], TREE)
    worst = 0.0
    for s in range(TREE.N + 1):
        lm.crop(L)
        path = [0] + [n + 1 for n in TREE.path_to(s - 1)]
        worst = max(worst, diff(tree[:, s], lm.forward(toks[:, path])[:, -1]))
    rows.append({"check": f"{TREE.N}-node tree: each node vs a chain over its path", "max_diff": worst})
    lm.reset()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="auto", choices=["auto", "gguf", "float32"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    engine = Engine.from_preset("embedded", precision=args.precision, captured="off")
    prompts = load_prompt_set("open")[:args.prompts]
    rows = forward_checks(engine.target, engine.encode(prompts[0]["prompt"]))
    greedy = SamplingConfig()
    for i, p in enumerate(prompts):
        ids = engine.encode(p["prompt"])
        plain = decode(engine, ids, 0, greedy, i, args.max_new_tokens)["ids"]
        for shape in SHAPES:
            got = decode(engine, ids, shape, greedy, i, args.max_new_tokens)["ids"]
            first = next((j for j, (a, b) in enumerate(zip(got, plain)) if a != b), None)
            rows.append({"check": f"greedy tree d{shape.depth} k{shape.top_k} s{shape.size} vs plain, {p['kind']}",
                         "same": got == plain, "first_difference": first})
    env = environment()
    env.update(precision=engine.precision)
    device = "cuda" if engine.target.device.type == "cuda" else "cpu"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"tree_exact_{device}_{engine.precision}.json").write_text(json.dumps(
        {"command": "python -m benchmarks.tree_exact " + " ".join(sys.argv[1:] if argv is None else argv), "env": env,
         "rows": rows}, indent=2))
    print(f"{env['machine']}, precision {engine.precision}\n\n| check | result |\n|---|---|")
    for r in rows:
        result = f"max diff {r['max_diff']:.3g}" if "max_diff" in r else \
            ("same tokens" if r["same"] else f"differs from token {r['first_difference']}")
        print(f"| {r['check']} | {result} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
