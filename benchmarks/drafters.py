"""Host cost of the model-free drafters per round, on a long context; optionally the target's forward-cost curve.

    python -m benchmarks.drafters                 # drafters only (no model forward)
    python -m benchmarks.drafters --forward-costs  # also forward(T) / forward(1) of the embedded model, T = 1..33

A round, as the engine runs it: `propose_ids(row, 16)` at the current context (the pulled arm's draft), then
`observe(rows, kept)` with the round's new tokens, then `propose_ids(before, 16)` at the pre-round context (the
counterfactual score of an arm that was not pulled). The context is real token ids (the example prompts, encoded
and repeated) of `--context` tokens; each round emits a random 1..6 of the text that follows, so copies match.
"3/2/1-gram scan" is the previous prompt lookup (a rescan of the context for the last 3, 2, 1 tokens each call),
kept here as the reference. Numbers, not assertions; JSON and CSV under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.run import RESULTS, ROOT, environment
from flashspec_core.drafters import NgramCache, PromptLookup
from flashspec_core.sampling import SamplingConfig


def scan_3_2_1(row, k):
    """The previous prompt lookup: the most recent earlier occurrence of the last 3, 2 or 1 tokens."""
    T = len(row)
    for n in range(min(3, T - 1), 0, -1):
        tail = row[T - n:]
        for start in range(T - n - 1, -1, -1):
            if row[start:start + n] == tail:
                return row[start + n:start + n + k]
    return []


class ScanReference:
    name = "3/2/1-gram scan (before)"

    def start(self, rows, sampling, generator):
        pass

    def propose_ids(self, row, k):
        return scan_3_2_1(row, k)

    def observe(self, rows, kept):
        pass


def context_tokens(tokenizer, n: int, seed: int) -> tuple[list[int], list[int]]:
    """n tokens of real text for the prompt, and the text that follows it for the rounds to emit."""
    prompts = json.loads((ROOT / "assets" / "examples.json").read_text())
    text = [t for p in prompts for t in tokenizer.encode(p["prompt"])]
    rng = random.Random(seed)
    stream = []
    while len(stream) < 2 * n:
        start = rng.randrange(len(text))
        stream += text[start:start + rng.randint(20, 200)]  # pieces of the prompts, so copies are found
    return stream[:n], stream[n:]


def time_drafter(drafter, prompt, follow, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    rows = [list(prompt)]
    t0 = time.perf_counter()
    drafter.start(rows, SamplingConfig(), None)
    start_s = time.perf_counter() - t0
    propose, observe, counterfactual, new_tokens, drafted = [], [], [], 0, 0
    pos = 0
    for _ in range(rounds):
        before = rows[0][:]
        t0 = time.perf_counter()
        draft = drafter.propose_ids(rows[0], 16)
        t1 = time.perf_counter()
        n = rng.randint(1, 6)
        rows[0].extend(follow[pos:pos + n])
        pos += n
        t2 = time.perf_counter()
        drafter.observe(rows, len(before))
        t3 = time.perf_counter()
        drafter.propose_ids(before, 16)
        t4 = time.perf_counter()
        propose.append(t1 - t0)
        observe.append(t3 - t2)
        counterfactual.append(t4 - t3)
        new_tokens += n
        drafted += len(draft)
    us = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731
    return {"drafter": drafter.name, "context": len(prompt), "rounds": rounds, "start_ms": 1e3 * start_s,
            "propose_us": us(propose), "observe_us": us(observe), "counterfactual_us": us(counterfactual),
            "round_us": us([a + b + c for a, b, c in zip(propose, observe, counterfactual)]),
            "observe_us_per_token": 1e6 * sum(observe) / new_tokens, "mean_draft_len": drafted / rounds}


def forward_costs(engine, context: int, reps: int = 5) -> dict[int, float]:
    """forward(T) / forward(1) of the target at `context` tokens of cache: min over reps, T = 1..33."""
    import torch

    lm = engine.target
    ids = torch.randint(0, lm.vocab_size, (1, context))
    best: dict[int, float] = {}
    with torch.inference_mode():
        for _ in range(reps):
            for T in (1, 2, 3, 4, 5, 6, 8, 9, 12, 17, 25, 33):
                lm.reset()
                lm.forward(ids, logits_to_keep=1)
                t0 = time.perf_counter()
                lm.forward(torch.randint(0, lm.vocab_size, (1, T)), logits_to_keep=T)
                best[T] = min(best.get(T, float("inf")), time.perf_counter() - t0)
    return {T: s / best[1] for T, s in sorted(best.items())} | {"step_ms": 1e3 * best[1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-costs", action="store_true", help="also time the embedded model's forward(T)")
    args = ap.parse_args(argv)

    from flashspec_core import Engine

    engine = Engine.from_preset("embedded")
    prompt, follow = context_tokens(engine.tokenizer, args.context, args.seed)
    rows = [time_drafter(d, prompt, follow, args.rounds, args.seed)
            for d in (PromptLookup(), NgramCache(), ScanReference())]
    payload = {"command": "python -m benchmarks.drafters " + " ".join(sys.argv[1:] if argv is None else argv),
               "env": environment(), "rows": rows}
    if args.forward_costs:
        payload["forward_costs"] = forward_costs(engine, 300)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "drafters_cpu.json").write_text(json.dumps(payload, indent=2))
    with open(RESULTS / "drafters_cpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    env = payload["env"]
    print(f"{env['machine']}, {env['threads']} threads, python {env['python']}, commit {env['commit']}; "
          f"{args.context}-token context, {args.rounds} rounds, medians")
    print()
    print("| drafter | start ms | propose us | observe us | counterfactual us | round us | observe us/token | mean draft |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['drafter']} | {r['start_ms']:.1f} | {r['propose_us']:.0f} | {r['observe_us']:.0f} | "
              f"{r['counterfactual_us']:.0f} | {r['round_us']:.0f} | {r['observe_us_per_token']:.1f} | "
              f"{r['mean_draft_len']:.1f} |")
    if args.forward_costs:
        costs = payload["forward_costs"]
        print()
        print(f"forward(T) / forward(1), one step = {costs['step_ms']:.1f} ms: "
              + ", ".join(f"T={t}: {c:.2f}" for t, c in costs.items() if t != "step_ms"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
