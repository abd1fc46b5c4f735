"""Chains against trees of the shipped draft head, through the engine's own rounds: tokens per target forward and
tok/s on the hand-written open prompts (or the app's examples).

    python -m benchmarks.tree_round [--prompts 12] [--max-new-tokens 96] [--precision float32] [--temperature 0]
                                    [--captured off|auto] [--trees 6,4,32 6,2,10 auto auto,copy8] [--eager-trees]
                                    [--prompt-set open|examples]

For each prompt (through the chat template) the embedded model decodes --max-new-tokens tokens four ways from the
same state, each through `DeviceRound` with its own arms (plain feeds no drafter): plain (K = 0), head chains of
4 and 6 (`run`), and head trees (`run_tree`, `TREES`; "auto" sized each round by the engine's policy from this
machine's measured costs, except on a captured round, where the engine verifies its bound; ",copyN": prompt
lookup's chain as one more branch), ignoring end-of-text so that every row makes the same number of tokens.
Greedy rows must equal plain decoding token for token; at --temperature > 0 the rows are seeded samples (same seed per prompt).
Writes JSON under benchmarks/results/ and prints a table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from statistics import mean

import torch

from benchmarks.run import PROMPT_SETS, RESULTS, environment, load_prompt_set, parse_tree
from flashspec_core import Engine, SamplingConfig
from flashspec_core.stream import StreamState
from flashspec_core.tree_round import TreeSize

CHAINS = (4, 6)
TREES = (TreeSize(6, 2, 10), TreeSize(6, 4, 16), TreeSize(6, 4, 32), TreeSize(6, 4, 32, auto=True))


@dataclass(frozen=True)
class Eager:
    """A tree row whose rounds run eagerly (`--eager-trees`): the head's levels from the host, the target's tree
    verify on its own graphs, as trees ran at temperature > 0 before their captured rounds."""
    tree: TreeSize


def decode(engine: Engine, ids: list[int], config, sampling: SamplingConfig, seed: int, max_new: int) -> dict:
    """max_new tokens from ids by rounds of one kind: an int K (chain, 0 = plain), a TreeSize or an Eager one."""
    round_, head = engine.round, engine.drafters["draft_head"]
    captured = not isinstance(config, Eager)  # trees: one graph a round (auto at its bound), as the engine
    config = config if captured else config.tree
    rows, gen = [list(ids)], torch.Generator(device=engine.target.device).manual_seed(seed)  # as the engine
    s = StreamState(rows, sampling, "auto", "speculative", ["draft_head"], max_new, gen, None, tree=config)
    tree = isinstance(config, TreeSize)
    arms = ["draft_head"] if config else ["no_draft"]  # plain feeds no drafter, as the engine's plain mode
    arms += ["prompt_lookup"] if tree and config.copy else []  # a copied branch's source, fed as the engine feeds it
    round_.start(rows, sampling, gen, len(ids) + max_new + 40, 16, arms=arms, captured=captured,
                 tree_tokens=config.verify_tokens if tree else 0,
                 tree=config.fixed if tree and captured else None)  # graphs captured here, outside the timed rounds
    on_graph = tree and round_.captured is not None
    outs, t0 = [], time.perf_counter()
    while len(rows[0]) - len(ids) < max_new:
        room = max_new - (len(rows[0]) - len(ids)) - 1  # drafts that still fit
        if on_graph and room < config.longest:  # the stream's end: as the engine,
            out = round_.run(rows, head, room, sampling, gen)  # a chain on its graph (a cut tree has none)
        elif on_graph:
            out = round_.run_tree(rows, head, config.fixed, sampling, gen)
        elif isinstance(config, TreeSize) and room > 0:  # tree "auto" sized as the engine sizes it (tree_plan)
            shape, nodes = engine.policy.tree_plan(s, "draft_head", config.within(room))
            out = round_.run_tree(rows, head, shape, sampling, gen, nodes)
            engine.policy.learn_acceptance(s, "draft_head", out)
        elif isinstance(config, TreeSize):
            out = round_.run(rows, engine.drafters["no_draft"], 0, sampling, gen)
        else:
            out = round_.run(rows, head if config else engine.drafters["no_draft"], min(config, room), sampling, gen)
        outs.append(out)
    seconds = time.perf_counter() - t0
    new = rows[0][len(ids):len(ids) + max_new]
    return {"tokens": len(new), "forwards": len(outs), "tokens_per_forward": len(new) / len(outs),
            "tok_per_s": len(new) / seconds, "ids": new, **round_times(outs, seconds)}


def round_times(outs: list, seconds: float) -> dict:
    """Where a round's wall time goes (ms a round): drafting, the rest (verify, accept, roll back, update) and, on a
    GPU, the device's time for the rest (well below the rest's wall time: the host is what the round waits on)."""
    ms = lambda xs: 1e3 * mean(xs) if xs else None  # noqa: E731
    device = [o.device_s for o in outs if o.device_s is not None]
    return {"round_ms": 1e3 * seconds / len(outs), "draft_ms": ms([o.draft_s for o in outs]),
            "rest_ms": ms([o.verify_s for o in outs]), "rest_device_ms": ms(device)}


def name_of(config) -> str:
    if isinstance(config, Eager):
        return "eager " + name_of(config.tree)
    if not isinstance(config, TreeSize):
        return "plain" if config == 0 else f"chain {config}"
    size = f"auto<={config.size}" if config.auto else f"s{config.size}"
    return f"tree d{config.depth} k{config.top_k} {size}" + (f" copy{config.copy}" if config.copy else "")


def summarise(rows: list[dict]) -> dict:
    """One config's rows (a prompt each) in means, and how many kept plain decoding's tokens."""
    timed = {k: [r[k] for r in rows if r[k] is not None] for k in ("round_ms", "draft_ms", "rest_ms", "rest_device_ms")}
    return {"tokens_per_forward": mean(r["tokens_per_forward"] for r in rows),
            "tok_per_s": mean(r["tok_per_s"] for r in rows), "same_as_plain": sum(r["same_as_plain"] for r in rows),
            **{k: mean(v) if v else None for k, v in timed.items()}}


def times_cell(s: dict) -> str:
    cell = f"{s['round_ms']:.2f}, {s['draft_ms']:.2f}, {s['rest_ms']:.2f}"
    return cell + (f" ({s['rest_device_ms']:.2f})" if s["rest_device_ms"] is not None else "")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-set", default="open", choices=sorted(PROMPT_SETS),
                    help="the hand-written open requests or the app's examples")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--precision", default="float32", choices=["auto", "gguf", "float32"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto", help="auto = float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--tag", default="")
    ap.add_argument("--captured", default="off", choices=["auto", "eager", "off"],
                    help="the engine's captured rounds (auto: CUDA graphs on a GPU) for the chains, the plain rows and "
                         "trees (tree auto at its bound: sized per round only without a captured round)")
    ap.add_argument("--eager-trees", action="store_true",
                    help="also run every tree row with eager rounds (the head's levels from the host)")
    ap.add_argument("--trees", nargs="+", default=None, metavar="D,K,S|auto[,copyN]",
                    help="the tree rows (default: " + " ".join(name_of(t) for t in TREES) + ")")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    trees = TREES if args.trees is None else tuple(parse_tree(t) for t in args.trees)
    engine = Engine.from_preset("embedded", dtype=args.dtype, precision=args.precision, captured=args.captured)
    engine.warm_up(1024)  # the measured costs that tree "auto" sizes its trees by, and the chains' graphs
    sampling = SamplingConfig(temperature=args.temperature)
    prompts = load_prompt_set(args.prompt_set)[:args.prompts]
    configs = [0, *CHAINS, *trees, *(Eager(t) for t in trees if args.eager_trees)]
    rows = []
    for i, p in enumerate(prompts):
        ids = engine.encode(p["prompt"])
        decode(engine, ids, 0, sampling, i, 8)  # warm-up
        runs = {name_of(c): decode(engine, ids, c, sampling, i, args.max_new_tokens) for c in configs}
        for name, r in runs.items():
            r.update(prompt=p["kind"], config=name, same_as_plain=r["ids"] == runs["plain"]["ids"])
            rows.append(r)
        print(f"{p['kind']:>16} " + "  ".join(f"{n} {r['tokens_per_forward']:.2f}" for n, r in runs.items()),
              flush=True)
    report(engine, args, rows, [name_of(c) for c in configs], len(prompts),
           "python -m benchmarks.tree_round " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


def report(engine, args, rows: list[dict], names: list[str], n_prompts: int, command: str) -> None:
    """Summarise the rows per config, write the JSON under benchmarks/results/ and print the table."""
    env = environment()
    env.update(precision=engine.precision, temperature=args.temperature, captured=args.captured)
    summary = {name: summarise([r for r in rows if r["config"] == name]) for name in names}
    device = "cuda" if engine.target.device.type == "cuda" else "cpu"
    stem = f"tree_round_{device}_{engine.precision}" + ("_examples" if args.prompt_set == "examples" else "") + \
        (f"_t{args.temperature:g}" if args.temperature else "") + \
        (f"_{args.tag}" if args.tag else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": command, "env": env,
         "summary": summary, "rows": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}, indent=2))
    chain = summary[f"chain {CHAINS[-1]}"]["tokens_per_forward"]
    print(f"\n{env['machine']}, precision {engine.precision}, temperature {args.temperature:g}, "
          f"{n_prompts} prompts ({args.prompt_set}), "
          f"{args.max_new_tokens} tokens each\n")
    plain = summary["plain"]["tok_per_s"]
    print("| config | tokens per target forward | vs chain 6 | tok/s | vs plain | same ids as plain "
          "| ms a round: all, draft, rest (its device time) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        print(f"| {name} | {s['tokens_per_forward']:.2f} | {s['tokens_per_forward'] / chain:.2f}x | "
              f"{s['tok_per_s']:.1f} | {s['tok_per_s'] / plain:.2f}x | {s['same_as_plain']}/{n_prompts} | "
              f"{times_cell(s)} |")


if __name__ == "__main__":
    raise SystemExit(main())
