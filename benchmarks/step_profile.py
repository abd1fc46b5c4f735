"""Where one forward of the embedded target goes on the CPU: whole-forward times by token count, then a profile of
a 1-token step and an 8-token verify by kind of op (products, LM head, attention, norms, rotary, cache writes, ...),
and a prompt's prefill into the empty cache (--prefill token counts).

    python -m benchmarks.step_profile [--precision gguf|float32] [--context 300] [--reps 30] [--prefill 48 128]

Each time is the median over --reps forwards from the same cache length (cropped back before each), random ids,
the token counts taking turns call by call.
The profile sums each op's own time over --reps forwards (torch.profiler); "outside ops" is the wall time no op
accounts for (Python, dispatch). Writes JSON under benchmarks/results/ and prints tables. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from statistics import median

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.run import RESULTS, environment, shown_path
from flashspec_core.fast_path import StaticCausalLM
from flashspec_core.models import embedded_gguf, load_model

TOKENS = (1, 2, 3, 4, 5, 8, 9)
KINDS = {  # op name fragment -> kind; the first fragment found in an op's name wins
    "int4pack": "4-bit products", "int8pack": "LM head (int8)", "addmm": "products", "aten::mm": "products",
    "linear": "products", "bmm": "attention", "scaled_dot_product": "attention", "softmax": "attention",
    "flash_attention": "attention", "rms_norm": "norms", "index_copy": "cache writes", "embedding": "embedding",
    "copy_": "copies and casts", "aten::to": "copies and casts", "contiguous": "copies and casts", "clone": "copies and casts",
    "mul": "elementwise", "add": "elementwise", "silu": "elementwise", "flip": "elementwise", "cat": "copies and casts",
    "where": "masks", "le": "masks", "repeat": "masks", "index": "indexing",
}


def kind(op: str) -> str:
    return next((k for frag, k in KINDS.items() if frag in op), "other")


def time_forwards(lm, context: int, counts, reps: int, keep: int = 0) -> dict[int, float]:
    """{T: median ms of one forward of T random tokens after `context` tokens (0: a prompt's prefill into the empty
    cache), logits for the last `keep` (0 = all)}, the token counts interleaved call by call, so that a slow spell of a
    shared machine lands on all of them alike."""
    ids = {T: torch.randint(0, lm.vocab_size, (1, T)) for T in counts}
    times = {T: [] for T in counts}
    for _ in range(reps + 2):  # two warm-up rounds
        for T in counts:
            lm.crop(context)
            t0 = time.perf_counter()
            lm.forward(ids[T], logits_to_keep=keep)
            times[T].append(1e3 * (time.perf_counter() - t0))
    return {T: median(ts[2:]) for T, ts in times.items()}


def profile_forward(lm, context: int, T: int, reps: int) -> dict:
    """{kind: ms per forward} by the ops' own CPU time, plus the wall time per forward and what no op accounts for."""
    ids = torch.randint(0, lm.vocab_size, (1, T))
    for _ in range(2):
        lm.crop(context)
        lm.forward(ids)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            lm.crop(context)
            lm.forward(ids)
        wall = 1e3 * (time.perf_counter() - t0) / reps
    kinds, ops, calls = defaultdict(float), {}, 0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / reps
        kinds[kind(e.key)] += ms
        ops[e.key] = {"ms": ms, "calls": e.count / reps}
        calls += e.count / reps
    kinds = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"])[:25])
    return {"wall_ms_profiled": wall, "ops_ms": sum(kinds.values()), "op_calls": calls, "kinds_ms": kinds, "top_ops": top}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("gguf", "float32"), default="gguf")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefill", type=int, nargs="*", default=[48, 128], help="prompt lengths to time a prefill of")
    ap.add_argument("--tag", default="", help="a suffix for the result file")
    args = ap.parse_args(argv)

    model, _ = load_model("embedded", torch.device("cpu"), torch.float32)
    gguf = embedded_gguf(model.config) if args.precision == "gguf" else None
    lm = StaticCausalLM(model, max_len=1024, gguf=gguf)
    torch.manual_seed(0)
    lm.forward(torch.randint(0, lm.vocab_size, (1, args.context)))
    times = time_forwards(lm, args.context, TOKENS, args.reps)
    profiles = {T: profile_forward(lm, args.context, T, args.reps) for T in (1, 8)}
    prefills = time_forwards(lm, 0, args.prefill, max(4, args.reps // 3), keep=1)  # last: it empties the cache
    payload = {"command": "python -m benchmarks.step_profile " + " ".join(sys.argv[1:] if argv is None else argv),
               "env": environment(), "path": lm.path, "context": args.context, "reps": args.reps,
               "forward_ms": times, "x_one_token": {T: ms / times[1] for T, ms in times.items()},
               "prefill_ms": prefills, "profiles": profiles}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"step_profile_cpu_{args.precision}{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(payload, indent=2))
    env = payload["env"]
    print(f"{env['machine']}, {env['threads']} threads, torch {env['torch']}, commit {env['commit']}; {lm.path}; "
          f"{args.context}-token context, medians of {args.reps}; {shown_path(out)}")
    print()
    print("| tokens | " + " | ".join(str(T) for T in TOKENS) + " |")
    print("|---|" + "---:|" * len(TOKENS))
    print("| ms | " + " | ".join(f"{times[T]:.2f}" for T in TOKENS) + " |")
    print("| x 1 token | " + " | ".join(f"{times[T] / times[1]:.2f}" for T in TOKENS) + " |")
    if prefills:
        print("prefill into the empty cache: " + ", ".join(f"{P} tokens {ms:.2f} ms" for P, ms in prefills.items()))
    for T, p in profiles.items():
        print()
        print(f"{T} token(s): {p['wall_ms_profiled']:.2f} ms a forward under the profiler, {p['op_calls']:.0f} op calls, "
              f"ops {p['ops_ms']:.2f} ms, outside ops {p['wall_ms_profiled'] - p['ops_ms']:.2f} ms")
        print("| kind | ms |")
        print("|---|---:|")
        for k, ms in p["kinds_ms"].items():
            print(f"| {k} | {ms:.2f} |")
        print("| op | ms | calls |")
        print("|---|---:|---:|")
        for op, v in list(p["top_ops"].items())[:15]:
            print(f"| {op} | {v['ms']:.3f} | {v['calls']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
