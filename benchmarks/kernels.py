"""Microbenchmark of the verify op: the fused Triton kernel against the PyTorch reference on CUDA.

Times with `triton.testing.do_bench` (median, after warm-up, L2 flushed between calls) for B in {1, 8, 32},
K in {4, 8}, V in {32000, 49152, 128256} with a model drafter (draft_probs given), once with the randoms drawn
beforehand and once drawn inside the call (what the engine does). Each shape is checked for identical outputs
before it is timed. The bytes-moved floor reads p [B, K+1, V] and q [B, K, V] once at the device-to-device copy
bandwidth measured at start; the kernel itself only touches one row of p, q and the noise per batch row (plus
K gathered entries), so it can run below that floor: the `touched` floor is given beside it. `variant` names the
kernel that the default configuration ran (`row`: one program per row; `split NxC`: V in N chunks of C), and
`row kernel us` times the one-program-per-row kernel as it was tuned (BLOCK_V 4096, 8 warps) on the same inputs.

    python -m benchmarks.kernels               # CUDA: table on stdout, JSON in benchmarks/results/
    python -m benchmarks.kernels --sweep       # also time other (BLOCK_V, num_warps, num_stages, split) configurations
    python -m benchmarks.kernels --cpu-smoke   # one tiny shape under TRITON_INTERPRET=1: proves the script runs
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch  # does not import triton; triton and kernels are imported in main(), after TRITON_INTERPRET is set

if not __package__:  # `python benchmarks/kernels.py` would shadow the kernels package with this file
    sys.exit("run from the repository root as: python -m benchmarks.kernels")

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("FLASHSPEC_RESULTS") or REPO / "benchmarks" / "results")  # as benchmarks.run's
SHAPES = [(B, K, V) for V in (32000, 49152, 128256) for B in (1, 8, 32) for K in (4, 8)]
SMOKE_SHAPES = [(2, 4, 1000)]
SWEEP = [  # (BLOCK_V, num_warps, num_stages, programs per SM): 0 = one program streams a whole row (n_chunks = 1);
    # otherwise V is split in n_chunks = ceil(programs per SM * SMs / B) chunks. The default is (2048, 4, 1, 4).
    (4096, 8, 1, 0), (1024, 4, 3, 0),
    (1024, 4, 1, 4), (2048, 4, 1, 4), (2048, 8, 1, 4), (4096, 8, 1, 4), (2048, 4, 2, 4),
    (2048, 4, 1, 2), (2048, 4, 1, 8), (1024, 4, 1, 8),
]
ROW_CONFIG = (1, 4096, 8, 1, 1)  # the one-program-per-row kernel as it was tuned: timed beside the default


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="one tiny shape on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--sweep", action="store_true", help="also time other (BLOCK_V, num_warps, num_stages, split) configurations")
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/kernels_<device>.json)")
    return parser.parse_args()


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "benchmarks/kernels.py"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_timer(device):
    """Median microseconds of fn(): do_bench on CUDA; wall clock (synchronous) on the CPU smoke run."""
    import triton.testing

    if device.type == "cuda":
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    def wall(fn):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    return wall


def copy_bandwidth(device, timer) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    n = (512 << 20) // 4 if device.type == "cuda" else (16 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (timer(lambda: dst.copy_(src)) * 1e-6)


def make_inputs(kv, B, K, V, device):
    """Peaky p and q (softmax of randn * 3), drafts sampled from q, randoms drawn once."""
    g = torch.Generator(device).manual_seed(B * 100_003 + K * 1_009 + V)
    q_logits = torch.randn(B, K, V, device=device, generator=g) * 3
    p = torch.softmax(torch.cat([q_logits + torch.randn(B, K, V, device=device, generator=g),
                                 torch.randn(B, 1, V, device=device, generator=g) * 3], dim=1), dim=-1)  # [B, K+1, V]
    q = torch.softmax(q_logits, dim=-1)  # [B, K, V]
    draft = torch.multinomial(q.reshape(B * K, V), 1, generator=g).reshape(B, K)  # [B, K]
    uniform, noise = kv.draw_randoms(B, K, V, device, g)
    return draft, q, p, uniform, noise


def graphed(fn):
    """fn captured in a CUDA graph, as a replay callable; None (and the reason) if it cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, None
    except Exception as exc:  # noqa: BLE001 - reported in the results, not hidden
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {exc}"[:200]


def variant_name(kv, V, block_v, n_chunks) -> str:
    """'row' when one program streams a whole row, else 'split <n_chunks>x<CHUNK>'."""
    chunk, n_chunks = kv._chunking(V, block_v, n_chunks)
    return "row" if n_chunks == 1 else f"split {n_chunks}x{chunk}"


def check_same(ref, out, what: str, B, K, V, tokens_only: bool = False) -> None:
    """Raise unless `out` emits the reference's tokens (and accepted counts) at this shape."""
    same = torch.equal(ref.tokens, out.tokens) and (tokens_only or torch.equal(ref.num_accepted, out.num_accepted))
    if not same:
        raise AssertionError(f"{what} disagrees at B={B} K={K} V={V}")


def timing_rows(kv, inputs, ref, shape, device, timer, floors) -> list[dict]:
    """Torch against Triton with randoms pre-drawn and drawn inside (and on CUDA each as a graph), the whole-row
    kernel beside them."""
    draft, q, p, uniform, noise = inputs
    B, K, V = shape
    floor_us, touched_us = floors
    g = torch.Generator(device).manual_seed(0)
    calls = {
        "pre-drawn": {
            "torch": lambda: kv.verify_torch(draft, q, p, uniform=uniform, noise=noise),
            "triton": lambda: kv.verify_triton(draft, q, p, uniform=uniform, noise=noise),
        },
        "drawn inside": {
            "torch": lambda: kv.verify_torch(draft, q, p, generator=g),
            "triton": lambda: kv.verify_triton(draft, q, p, generator=g),
        },
    }
    config = kv._launch_config(B, V, device)
    row_fn = lambda: kv._verify_triton_launch(draft, q, p, uniform, noise, False, *ROW_CONFIG)  # noqa: E731
    check_same(ref, row_fn(), "the one-program-per-row kernel", B, K, V)
    rows = []
    for randoms, fns in calls.items():
        row = {"B": B, "K": K, "V": V, "randoms": randoms,
               "torch_us": timer(fns["torch"]), "triton_us": timer(fns["triton"]),
               "floor_us": floor_us, "touched_floor_us": touched_us,
               "variant": variant_name(kv, V, config[1], config[4]),
               "triton_row_us": timer(row_fn) if randoms == "pre-drawn" else None}
        row["speedup"] = row["torch_us"] / row["triton_us"]
        row["triton_over_floor"] = row["triton_us"] / floor_us
        row["triton_over_touched"] = row["triton_us"] / touched_us
        if device.type == "cuda" and randoms == "pre-drawn":
            for name in ("torch", "triton"):
                replay, why = graphed(fns[name])
                row[f"{name}_graph_us"] = timer(replay) if replay else None
                if why:
                    row[f"{name}_graph_error"] = why
        rows.append(row)
    return rows


def sweep_rows(kv, inputs, ref, shape, device, timer, floors) -> list[dict]:
    """Each launch configuration of SWEEP, checked against the reference, then timed."""
    draft, q, p, uniform, noise = inputs
    B, K, V = shape
    floor_us, touched_us = floors
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    rows = []
    for block_v, num_warps, num_stages, per_sm in SWEEP:
        n_chunks = -(-per_sm * sms // B) if per_sm else 1

        def fn():
            return kv._verify_triton_launch(draft, q, p, uniform, noise, False, 1,  # noqa: B023
                                            block_v, num_warps, num_stages, n_chunks)  # noqa: B023

        check_same(ref, fn(), f"BLOCK_V={block_v} num_warps={num_warps} num_stages={num_stages} n_chunks={n_chunks}",
                   B, K, V, tokens_only=True)
        us = timer(fn)
        rows.append({"B": B, "K": K, "V": V, "block_v": block_v, "num_warps": num_warps, "num_stages": num_stages,
                     "variant": variant_name(kv, V, block_v, n_chunks), "triton_us": us,
                     "triton_over_floor": us / floor_us, "triton_over_touched": us / touched_us})
    return rows


def bench_shape(kv, B, K, V, device, timer, bandwidth, sweep):
    """Timing rows (randoms pre-drawn and drawn inside) and optional launch-configuration rows for one shape."""
    inputs = make_inputs(kv, B, K, V, device)
    draft, q, p, uniform, noise = inputs
    ref = kv.verify_torch(draft, q, p, uniform=uniform, noise=noise)
    check_same(ref, kv.verify_triton(draft, q, p, uniform=uniform, noise=noise), "the Triton backend", B, K, V)
    floor_us = 4 * (B * (K + 1) * V + B * K * V) / bandwidth * 1e6  # p and q read once
    touched_us = 4 * 3 * B * V / bandwidth * 1e6  # p_n, q_n and the noise: one row each per batch row
    floors = (floor_us, touched_us)
    rows = timing_rows(kv, inputs, ref, (B, K, V), device, timer, floors)
    return rows, sweep_rows(kv, inputs, ref, (B, K, V), device, timer, floors) if sweep else []


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def print_tables(rows, sweep_rows):
    print("| B | K | V | randoms | variant | torch us | triton us | row kernel us | speedup | floor us | triton/floor "
          "| touched us | triton/touched | torch graph us | triton graph us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['K']} | {r['V']} | {r['randoms']} | {r['variant']} | {fmt(r['torch_us'])} "
              f"| {fmt(r['triton_us'])} | {fmt(r['triton_row_us'])} "
              f"| {fmt(r['speedup'], '.2f')}x | {fmt(r['floor_us'])} | {fmt(r['triton_over_floor'], '.2f')} "
              f"| {fmt(r['touched_floor_us'])} | {fmt(r['triton_over_touched'], '.2f')} "
              f"| {fmt(r.get('torch_graph_us'))} | {fmt(r.get('triton_graph_us'))} |")
    if sweep_rows:
        print("\n| B | K | V | variant | BLOCK_V | num_warps | num_stages | triton us | triton/floor | triton/touched |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in sweep_rows:
            print(f"| {r['B']} | {r['K']} | {r['V']} | {r['variant']} | {r['block_v']} | {r['num_warps']} "
                  f"| {r['num_stages']} | {fmt(r['triton_us'])} | {fmt(r['triton_over_floor'], '.2f')} "
                  f"| {fmt(r['triton_over_touched'], '.2f')} |")


def main():
    args = parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import triton

    kv = importlib.import_module("kernels.verify")  # the module (the package attribute `verify` is the function)
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("no CUDA device: run with --cpu-smoke to check the script on the CPU")

    timer = make_timer(device)
    bandwidth = copy_bandwidth(device, timer)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    print(f"# {device_name}: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write)\n", flush=True)

    rows, sweep_rows = [], []
    for B, K, V in SMOKE_SHAPES if args.cpu_smoke else SHAPES:
        shape_rows, shape_sweep = bench_shape(kv, B, K, V, device, timer, bandwidth, args.sweep)
        rows += shape_rows
        sweep_rows += shape_sweep
    print_tables(rows, sweep_rows)

    slug = "cpu-smoke" if args.cpu_smoke else re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if args.out:
        out = args.out
    elif args.cpu_smoke:  # never beside the real results
        out = Path(tempfile.gettempdir()) / "flashspec_kernels_cpu-smoke.json"
    else:
        out = RESULTS / f"kernels_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "command": "python -m benchmarks.kernels" + (" --cpu-smoke" if args.cpu_smoke else "") + (" --sweep" if args.sweep else ""),
        "rows": rows,
        "sweep": sweep_rows,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
