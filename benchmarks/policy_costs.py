"""The engine's choices under another machine's measured costs: the policy (the bandit, its sure copies, gamma
"auto") replayed on this CPU with the costs a GPU run measured, to see what it plays there without the GPU.

    python -m benchmarks.policy_costs --costs benchmarks/results/engine_embedded_cuda_ex_h100_s66.json
        [--prompt-set examples] [--every 1] [--launch-ahead both|on|off] [--keep-late-choices] [--tree auto]
        [--tag T]

The embedded model runs captured rounds eagerly (`captured="eager"`, the code a GPU's graphs replay, launching
the next round before the last lands as a GPU does), its costs replaced by the JSON's `env.calibration` (the
target's forward by tokens fed, each drafter's drafting), and the head drafts whole chains as on a GPU (on the
CPU it ends them by its own step's price). Greedy, so every row is plain decoding's tokens; what the policy
decides shows as tokens per target forward and the arms' rounds, per prompt, for the bandit and the head alone
(the CPU's 4-bit target may answer a prompt with other tokens than the GPU's). `--tree` as `benchmarks.run`'s: the
head's trees, on the captured round's tree path (`tree auto` is the app's default on a GPU). `--keep-late-choices`:
a copy arm chosen while the last round was in flight always plays (as before `HostPolicy.still_sure`), for
comparison. Writes benchmarks/results/policy_costs[_TAG].json and prints a table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import geometric_mean

from benchmarks.run import RESULTS, environment, load_prompt_set, parse_tree, shown_path
from flashspec_core import Engine
from flashspec_core.gamma import CostModel, DraftCost


def load_costs(engine: Engine, path: Path) -> dict:
    """Set the policy's costs to those a benchmark run measured (`env.calibration` of its JSON); returns them."""
    calibration = json.loads(path.read_text())["env"]["calibration"]
    costs = CostModel()
    for tokens, ms in calibration["forward_ms"].items():
        costs.observe(int(tokens), ms / 1e3)
    engine.policy.set_costs(costs)
    for name, c in calibration["draft_ms"].items():
        if name in engine.drafters:
            engine.policy.set_draft_cost(name, DraftCost(c["per_token"] / 1e3, c["per_round"] / 1e3))
    return calibration


def run_row(engine: Engine, prompt: dict, drafters, launch_ahead: bool, tree=None) -> dict:
    """One cold stream: tokens per forward, the arms' rounds and tokens, and the rounds chosen again on landing."""
    engine.launch_ahead = launch_ahead
    engine.reset_session()
    rechosen = engine.rechosen
    result = engine.generate(prompt["prompt"], prompt.get("max_new_tokens", 96), drafters=drafters, tree=tree)
    stats = result.stats
    arms = {arm: {"rounds": n, "tokens": sum(len(e.emitted) for e in result.events if e.drafter == arm)}
            for arm, n in stats["pulls"].items()}
    return {"prompt": prompt["kind"], "config": "bandit" if drafters is None else "+".join(drafters),
            "launch_ahead": launch_ahead, "tokens": stats["new_tokens"], "rounds": stats["rounds"],
            "tokens_per_forward": stats["tokens_per_forward"], "arms": arms, "rechosen": engine.rechosen - rechosen}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--costs", type=Path, required=True, help="a benchmarks.run JSON whose env.calibration to use")
    ap.add_argument("--prompt-set", default="examples", choices=["examples", "open"])
    ap.add_argument("--every", type=int, default=1, help="every n-th prompt of the set")
    ap.add_argument("--launch-ahead", default="both", choices=["both", "on", "off"])
    ap.add_argument("--keep-late-choices", action="store_true",
                    help="never choose a copy arm again on the landed rows (the engine before `still_sure`)")
    ap.add_argument("--tree", default=None, help="the head's trees: DEPTH,TOP_K,SIZE or auto, optionally ,copyN")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    tree = parse_tree(args.tree)
    engine = Engine.from_preset("embedded", captured="eager")
    engine.warm_up(512, trees=[tree] if tree else ())
    calibration = load_costs(engine, args.costs)
    engine.drafters["draft_head"].sets_length = False  # whole chains, as on a GPU
    if args.keep_late_choices:
        engine.policy.still_sure = lambda s, arm: True
    aheads = {"both": (True, False), "on": (True,), "off": (False,)}[args.launch_ahead]
    rows = []
    for prompt in load_prompt_set(args.prompt_set)[::args.every]:
        for ahead in aheads:
            rows.append(run_row(engine, prompt, None, ahead, tree))
        rows.append(run_row(engine, prompt, ["draft_head"], aheads[0], tree))
    print(table(rows))
    out = RESULTS / f"policy_costs{'_' + args.tag if args.tag else ''}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.policy_costs " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps({"command": command, "costs_from": str(args.costs), "calibration": calibration,
                               "env": environment(), "rows": rows}, indent=1))
    print(f"wrote {shown_path(out)}")
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| prompt | config | launch ahead | tokens | rounds | tokens/forward | rechosen | arms: rounds / tokens |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        arms = ", ".join(f"{a} {v['rounds']}/{v['tokens']}" for a, v in r["arms"].items())
        lines.append(f"| {r['prompt']} | {r['config']} | {r['launch_ahead']} | {r['tokens']} | {r['rounds']} | "
                     f"{r['tokens_per_forward']:.2f} | {r['rechosen']} | {arms} |")
    for config in dict.fromkeys((r["config"], r["launch_ahead"]) for r in rows):
        tpf = [r["tokens_per_forward"] for r in rows if (r["config"], r["launch_ahead"]) == config]
        lines.append(f"\n{config[0]}, launch ahead {config[1]}: {geometric_mean(tpf):.3f} tokens a forward "
                     f"(geometric mean over {len(tpf)} prompts)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
