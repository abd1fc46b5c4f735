"""The host's work per speculative round on the CPU: the milliseconds a round spends in `DeviceRound.land` (the host
record, the rows, the drafters' updates; "observe": the model-free drafters' share of it) and in `HostPolicy.gamma`
(K), on a tiny target and draft head run as captured rounds without graphs (captured="eager"), so that the models'
time stays small beside the host's.

    python -m benchmarks.host_round [--drafters draft_head] [--gamma auto] [--streams 20] [--max-new-tokens 64]

Each call is timed with the host clock (on the CPU a captured round's device work runs inside `launch`, so `land`
is host work only); the figures are the median over --streams streams of each stream's mean per round. The ids'
digest lets two runs (e.g. two commits) be checked for the same tokens. Writes benchmarks/results/host_round_cpu
[_TAG].json and prints it. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from statistics import median

import torch

from benchmarks.run import RESULTS, environment
from flashspec_core import Engine
from tests.conftest import tiny_llama
from tests.flashspec_core.test_draft_head import tiny_head

PROMPT = [3, 17, 4, 9, 3, 17, 4, 22, 8, 3, 17, 4, 9, 30, 11, 5, 3, 17]


def timed(obj, name: str, spent: list[float]) -> None:
    """Wrap obj.name (on the instance) so that each call adds its seconds to spent[0] and counts in spent[1]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="*", default=["draft_head"], help="the stream's arms (none: all)")
    ap.add_argument("--gamma", default="auto", help='"auto" or a fixed K')
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = tiny_llama(vocab=50, seed=3, layers=4)
    engine = Engine.from_models(target, [tiny_head(target), "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    spent = {"land": [0.0, 0], "observe": [0.0, 0], "gamma": [0.0, 0]}
    timed(engine.round, "land", spent["land"])
    for name in ("prompt_lookup", "ngram_cache"):  # inside land: the model-free drafters' updates
        timed(engine.drafters[name], "observe", spent["observe"])
    timed(engine.policy, "gamma", spent["gamma"])
    per_round = {k: [] for k in spent}
    digest = hashlib.sha1()
    engine.generate(PROMPT, args.max_new_tokens, gamma=gamma, drafters=args.drafters or None)  # warm-up
    for i in range(args.streams):
        for v in spent.values():
            v[:] = [0.0, 0]
        result = engine.generate(PROMPT, args.max_new_tokens, gamma=gamma, drafters=args.drafters or None, seed=i)
        digest.update(json.dumps(result.token_ids).encode())
        rounds = len(result.events)
        for k, (seconds, _) in spent.items():
            per_round[k].append(1e3 * seconds / rounds)
    out = {"command": "python -m benchmarks.host_round", "drafters": args.drafters, "gamma": args.gamma,
           "ms_per_round": {k: round(median(v), 4) for k, v in per_round.items()}, "rounds": rounds,
           "ids_sha1": digest.hexdigest()[:16], "env": environment()}
    path = RESULTS / f"host_round_cpu{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("drafters", "gamma", "ms_per_round", "rounds", "ids_sha1")}), "->", path)


if __name__ == "__main__":
    main()
