"""What one forward of the embedded model's shape costs on a GPU, and where: the captured step as it is, its kernels
by name, and the same step compiled by `torch.compile` (Inductor's fused kernels, replayed in our own CUDA graph).

    python -m benchmarks.gpu_step [--tokens 1 7] [--context 256] [--no-compile | --compile-tokens 1] [--layer-ops torch triton]

Random weights in the SmolLM2-135M shape (30 layers, hidden 576, 9 query and 3 key/value heads, vocabulary 49152),
bfloat16, `StaticCausalLM` (static cache, fused q/k/v and gate/up). For each token count T: the replay time of the
captured forward over a `--context`-slot bucket (median of 200 replays, CUDA events), the kernels one eager
forward launches (count, and the slowest names by total time), then the compiled forward captured the same way.
`--layer-ops triton` measures the step with `kernels.layer_ops` (one row per choice, the same weights).
Writes JSON under benchmarks/results/ and prints a table. Numbers, not assertions. CUDA only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median

import torch

from benchmarks.run import RESULTS, environment
from flashspec_core.fast_path import StaticCausalLM


def build(max_len: int = 1024, layer_ops: str = "torch") -> StaticCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    return StaticCausalLM(model, max_len=max_len, layer_ops=layer_ops)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 200) -> float:
    """Median ms of one replay (each timed alone with CUDA events)."""
    times = []
    for _ in range(reps + 10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return median(times[10:])


def capture(fn, *args) -> torch.cuda.CUDAGraph:
    """Warm fn(*args) up on a side stream, then capture one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return graph


def kernels(fn, *args, top: int = 8) -> dict:
    """The kernels one call launches: their count, total CUDA ms, and the `top` names by total time."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name[:90], []).append(e.device_time / 1e3)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"count": len(events), "total_ms": sum(e.device_time for e in events) / 1e3,
            "top": [{"name": n, "calls": len(t), "ms": sum(t)} for n, t in ranked]}


def compiled_row(lm: StaticCausalLM, ids, pos, S: int, T: int) -> dict:
    fn = torch.compile(lm._forward, dynamic=False)
    t0 = time.perf_counter()
    fn(ids, pos, S, T)
    torch.cuda.synchronize()
    row = {"compile_s": time.perf_counter() - t0, "compiled_graph_ms": replay_ms(capture(fn, ids, pos, S, T)),
           "compiled_kernels": kernels(fn, ids, pos, S, T)}
    logits = lm._forward(ids, pos, S, T)[0].float()
    row["compiled_max_logit_diff"] = float((fn(ids, pos, S, T)[0].float() - logits).abs().max())
    return row


@torch.inference_mode()
def measure(lm: StaticCausalLM, T: int, S: int, compiled: bool) -> dict:
    ids = torch.randint(0, 49152, (1, T), device="cuda")
    pos = torch.arange(S - T - 8, S - 8, device="cuda")
    row = {"tokens": T, "context": S}
    row["graph_ms"] = replay_ms(capture(lm._forward, ids, pos, S, T))
    row["eager_kernels"] = kernels(lm._forward, ids, pos, S, T)
    if compiled:
        try:
            row.update(compiled_row(lm, ids, pos, S, T))
        except Exception as e:  # noqa: BLE001 - a failed compile is a result (Inductor and user kernels)
            row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[-1][:300]}"
    row["logits"] = lm._forward(ids, pos, S, T)[0].float()  # compared across layer ops in main, then dropped
    return row


def write(rows: list[dict], argv) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"gpu_step_{torch.cuda.get_device_name().replace(' ', '-').lower()}.json"
    command = "python -m benchmarks.gpu_step " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps({"command": command, "env": environment(), "rows": rows}, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 7])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-tokens", type=int, nargs="*", default=[1], help="token counts also compiled")
    ap.add_argument("--layer-ops", nargs="*", default=["torch"], choices=["torch", "triton"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_step needs CUDA")
    rows, first = [], {}
    for ops in args.layer_ops:
        lm = build(layer_ops=ops)
        for T in args.tokens:
            row = {"layer_ops": ops, **measure(lm, T, args.context, not args.no_compile and T in args.compile_tokens)}
            logits = row.pop("logits")
            row["max_logit_diff_vs_first"] = float((logits - first.setdefault(T, logits)).abs().max())
            rows.append(row)
            write(rows, argv)  # after each row: a later failure keeps what was measured
        del lm
    print("| layer ops | tokens | graph ms | kernels | logit diff vs first | compiled graph ms | compiled kernels "
          "| compile s | compiled logit diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r.get("compiled_kernels", {})
        print(f"| {r['layer_ops']} | {r['tokens']} | {r['graph_ms']:.3f} | {r['eager_kernels']['count']} | "
              f"{r['max_logit_diff_vs_first']:.3g} | {r.get('compiled_graph_ms', 0):.3f} | {c.get('count', '-')} | "
              f"{r.get('compile_s', 0):.0f} | {r.get('compiled_max_logit_diff', 0):.3g} |")
        if "compile_error" in r:
            print(f"  compile failed: {r['compile_error']}")
    for r in rows:
        for kind in ("eager_kernels", "compiled_kernels"):
            if kind in r:
                top = "; ".join(f"{k['name']} x{k['calls']} {k['ms']:.3f} ms" for k in r[kind]["top"])
                print(f"\n{r['layer_ops']} T={r['tokens']} {kind}: {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
