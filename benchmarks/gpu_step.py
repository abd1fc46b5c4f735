"""What one forward of the embedded model's shape costs on a GPU, and where: the captured step as it is, its kernels
by name, and the same step compiled by `torch.compile` (Inductor's fused kernels, replayed in our own CUDA graph).

    python -m benchmarks.gpu_step [--tokens 1 7] [--context 256] [--no-compile | --compile-tokens 1]
                                  [--layer-ops torch triton fused] [--products]

Random weights in the SmolLM2-135M shape (30 layers, hidden 576, 9 query and 3 key/value heads, vocabulary 49152),
bfloat16, `StaticCausalLM` (static cache, fused q/k/v and gate/up). For each token count T: the replay time of the
captured forward over a `--context`-slot bucket (median of 200 replays, CUDA events), the kernels one eager
forward launches (count, and the slowest names by total time), then the compiled forward captured the same way.
`--layer-ops triton` measures the step with `kernels.layer_ops` (one row per choice, the same weights); `folded`
with the norms folded into the products; `fused` with its GEMV products. `--products` then times each projection
of a layer of `--shape` (and the LM head) alone at M = 1, 8 and 17 rows (`--product-rows`): cuBLAS's product, the
"triton" loop's ops for the same job (RMSNorm kernel + cuBLAS, + silu_mul), and the fused GEMV kernel under its
default tiles and a few others of each of `--kinds` (the block variants: 8 rows a program at once in registers, or 16
on the tensor cores; the stream: K in chunks, for a large K), each a CUDA graph of 100 calls (`--cold`: over copies
of the weight that overflow the L2 cache, as a step reads them), median replay / 100, with the weight's bytes a
second, each fused row's largest difference from the "triton" ops and whether its M rows equal the rows alone bit
for bit. The weight floor divides by the device's stated bandwidth (`HBM_BYTES_PER_S`).
Writes JSON under benchmarks/results/ after every row (a failure keeps what was measured) and prints tables.
Numbers, not assertions. CUDA only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median

import torch
import torch.nn.functional as F

from benchmarks.run import RESULTS, environment
from flashspec_core.fast_path import StaticCausalLM
from kernels import layer_ops

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, EPS = 576, 1536, 49152, 9, 3, 1e-5  # the embedded model's shape
PRODUCT_ROWS = (1, 8, 17)  # one token, a verify of 8, the widest verify (17: three of the block variant's row blocks)


SHAPES = {  # --shape: the embedded model's, and a 1.1B Llama's (TinyLlama-1.1B's sizes) for the weight floor
    "smollm2-135m": dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=30,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=True),
    "llama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False),
}
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # memory bandwidth as the maker states it (H100: SXM)


def products_of(shape: str) -> dict[str, tuple[int, int, str]]:
    """name: (K, weight rows N, kind) of each product of a layer of `shape`, and the LM head."""
    c = SHAPES[shape]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * (hidden // c["num_attention_heads"])
    return {"qkv": (hidden, qkv, "norm_linear"), "o": (hidden, hidden, "add_linear_"),
            "gate_up": (hidden, 2 * inter, "norm_gate_up_silu"), "down": (inter, hidden, "add_linear_"),
            "lm_head": (hidden, c["vocab_size"], "norm_linear")}


def hbm_bytes_per_s() -> float:
    """The device's stated memory bandwidth (an H200's for a device not in HBM_BYTES_PER_S)."""
    name = torch.cuda.get_device_name()
    return next((b for key, b in HBM_BYTES_PER_S.items() if key in name), HBM_BYTES_PER_S["H200"])


def build(max_len: int = 1024, layer_ops: str = "torch", shape: str = "smollm2-135m") -> StaticCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=EPS, rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    return StaticCausalLM(model, max_len=max_len, layer_ops=layer_ops)


def weight_floor_ms(lm: StaticCausalLM) -> float:
    """The ms a step needs to read every weight once at the memory's stated bandwidth (the embedding's rows aside:
    a step reads T of them)."""
    embed = lm.model.get_input_embeddings().weight
    tied = lm.model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    read = sum(p.numel() * p.element_size() for p in lm.model.parameters() if p is not embed or tied)
    return 1e3 * read / hbm_bytes_per_s()


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


def per_call_us(fns: list, calls: int = 100) -> float:
    """Median us of one call, from a CUDA graph of `calls` calls taking the callables `fns` in turn (one: always
    the same inputs; several, each over its own copy of the weights: as cold as a step's, see `copies_for`)."""
    def many():
        for i in range(calls):
            fns[i % len(fns)]()
    return replay_ms(capture(many), reps=50) * 1e3 / calls


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
    ids = torch.randint(0, lm.vocab_size, (1, T), device="cuda")
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


def copies_for(K: int, N: int, cold: bool) -> int:
    """Copies of a product's weight to take in turn: enough to fill the L2 cache twice when `cold` (a step reads
    each weight once, from memory; one copy timed 100 times reads a small weight from L2), else one."""
    if not cold:
        return 1
    return max(1, -(-2 * torch.cuda.get_device_properties(0).L2_cache_size // (N * K * 2)))


def product_inputs(K: int, N: int, kind: str, M: int, copy: int = 0) -> dict:
    """Random bf16 inputs of one product: x [M, K] (the residual [M, N] for add_linear_), its norm's weight,
    the weight [N, K] and a [M, K] (add_linear_'s input); `copy` seeds another set."""
    g = torch.Generator(device="cuda").manual_seed(M * 7919 + N + copy * 104729)
    new = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)
    rows = N if kind == "add_linear_" else K
    return {"x": new(M, rows), "norm": 1 + new(K, scale=0.1), "weight": new(N, K, scale=0.02), "a": new(M, K)}


def product_call(kind: str, op: str, t: dict, tiles=None):
    """fn() for one product: op "cublas" (the product alone), "triton" (the "triton" loop's ops for the same job)
    or "fused" (the GEMV kernel under `tiles`). add_linear_ adds into t["x"] in place."""
    x, norm, w, a = t["x"], t["norm"], t["weight"], t["a"]
    if kind == "add_linear_":
        return (lambda: layer_ops.add_linear_(x, a, w, tiles=tiles)) if op == "fused" else (lambda: x.addmm_(a, w.t()))
    if op == "cublas":
        return lambda: F.linear(x, w)
    if op == "fused":
        fused = layer_ops.norm_linear if kind == "norm_linear" else layer_ops.norm_gate_up_silu
        return lambda: fused(x, norm, EPS, w, tiles=tiles)
    if kind == "norm_linear":
        return lambda: F.linear(layer_ops.rms_norm(x, norm, EPS), w)
    return lambda: layer_ops.silu_mul(F.linear(layer_ops.rms_norm(x, norm, EPS), w))


def tile_choices(M: int, kinds):
    """The fused kernel's default tiles, then a few others, of the GEMV `kinds` (duplicates are dropped by the
    caller)."""
    choices = [*loop_block_dot_choices(M), *stream_choices()]
    yield from (t for t in choices if t.kind in kinds)


def stream_choices():
    for pdl in (False, True):  # each call a programmatic dependent launch: the next call's start overlaps its end
        yield layer_ops.GemvTiles(kind="stream", pdl=pdl)
        for block_n in (4, 8, 16):
            for block_k in (256, 512, 1024):
                yield layer_ops.GemvTiles(kind="stream", block_n=block_n, block_k=block_k, pdl=pdl)
        for warps in (2, 8):
            yield layer_ops.GemvTiles(kind="stream", warps=warps, pdl=pdl)


def loop_block_dot_choices(M: int):
    yield layer_ops.GemvTiles()
    for block_n in (4, 8, 16):
        yield layer_ops.GemvTiles(block_n=block_n)
    for warps in (2, 4, 8):
        yield layer_ops.GemvTiles(warps=warps)
    for rows in ((1, 2, 8) if M > 1 else ()):
        yield layer_ops.GemvTiles(rows=rows)
    # the block variants: a fixed number of rows a program at once, whatever M (registers, or tl.dot's 16)
    yield layer_ops.GemvTiles(kind="block")
    for block_rows, block_n, block_k, warps in ((4, 4, 64, 4), (8, 8, 64, 4), (8, 4, 128, 4), (8, 4, 64, 2),
                                                (8, 4, 64, 8), (16, 4, 64, 4), (8, 2, 64, 4)):
        yield layer_ops.GemvTiles(kind="block", block_rows=block_rows, block_n=block_n, block_k=block_k, warps=warps)
    yield from dot_choices()


def dot_choices():
    """tl.dot's fixed 16-row blocks: K in chunks up to the whole row; fewer than 16 outputs a program in a 16-wide
    tile (its other lanes masked: the stream's many small programs, on the tensor cores); the K loop pipelined."""
    yield layer_ops.GemvTiles(kind="dot")
    for block_n, block_k, warps in ((16, 256, 4), (32, 256, 4), (64, 256, 4), (4, 256, 4), (4, 256, 2),
                                    (4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 4), (4, 1024, 4)):
        yield layer_ops.GemvTiles(kind="dot", block_n=block_n, block_k=block_k, warps=warps)  # under 16: padded
    yield layer_ops.GemvTiles(kind="dot", pdl=True)
    yield layer_ops.GemvTiles(kind="dot", block_n=4, pdl=True)
    for block_n, block_k, stages in ((4, 64, 4), (8, 64, 4), (32, 64, 4), (64, 64, 4), (4, 128, 3), (32, 128, 3)):
        yield layer_ops.GemvTiles(kind="dot", block_n=block_n, block_k=block_k, stages=stages)  # K loop pipelined


def resolve(product: tuple[int, int, str], tiles):
    """The tiles the fused kernel runs for a product (K, N, kind) (defaults filled in for this device)."""
    K, N, kind = product
    paired = kind == "norm_gate_up_silu"
    return tiles.resolved(N // 2 if paired else N, K, paired, torch.device("cuda"))


def fused_checks(kind: str, t: dict, tiles, reference: torch.Tensor) -> dict:
    """The fused output's largest difference from the "triton" ops' and whether its rows equal the rows alone."""
    def run(rows: slice) -> torch.Tensor:
        part = {k: v[rows].clone() if k in ("x", "a") else v for k, v in t.items()}
        return product_call(kind, "fused", part, tiles)()
    every = run(slice(None))
    alone = torch.cat([run(slice(m, m + 1)) for m in range(every.shape[0])])
    return {"max_diff_vs_triton": float((every.float() - reference.float()).abs().max()),
            "rows_equal_alone": bool(torch.equal(every, alone))}


def measure_product(name: str, product: tuple[int, int, str], M: int, op: str, tiles=None, reference=None,
                    cold: bool = False) -> dict:
    """One row of the products table (`cold`: the weights read from memory, `copies_for`); an error becomes the
    row's "error"."""
    K, N, kind = product
    row = {"product": name, "M": M, "K": K, "N": N, "op": op, "weight_copies": copies_for(K, N, cold)}
    try:
        t = product_inputs(K, N, kind, M)
        if tiles is not None:
            row["tiles"] = vars(resolve(product, tiles))
            row.update(fused_checks(kind, t, tiles, reference))
        sets = [t] + [product_inputs(K, N, kind, M, c) for c in range(1, row["weight_copies"])]
        row["us"] = per_call_us([product_call(kind, op, s, tiles) for s in sets])
        row["tb_per_s"] = N * K * 2 / row["us"] / 1e6  # the bf16 weight's bytes a microsecond, in TB/s
    except Exception as e:  # noqa: BLE001 - a failed kernel is a result; the other rows still run
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
    return row


@torch.inference_mode()
def products(write_rows, shape: str, kinds, rows_at=PRODUCT_ROWS, cold: bool = False) -> list[dict]:
    """Every product of `shape` at each M of rows_at: cuBLAS, the "triton" ops, the fused kernel under each tile
    choice of the GEMV `kinds` (`cold`: each timed over copies of its weights that overflow the L2 cache)."""
    rows = []
    for name, product in products_of(shape).items():
        K, N, kind = product
        for M in rows_at:
            for op in ("cublas", "triton"):
                rows.append(measure_product(name, product, M, op, cold=cold))
                write_rows(rows)
            t = product_inputs(K, N, kind, M)
            reference = product_call(kind, "triton", {**t, "x": t["x"].clone()})()
            seen = set()
            for tiles in tile_choices(M, kinds):
                if resolve(product, tiles) not in seen:
                    seen.add(resolve(product, tiles))
                    rows.append(measure_product(name, product, M, "fused", tiles, reference, cold))
                    write_rows(rows)
    return rows


def print_products(rows: list[dict]) -> None:
    print("\n| product | M | op | kind | block_n | rows (loop, stream) / at once | warps | block_k | us | TB/s | x cuBLAS | "
          "max diff vs triton | rows = alone |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base = {(r["product"], r["M"]): r.get("us") for r in rows if r["op"] == "cublas"}
    for r in rows:
        if "error" in r:
            print(f"| {r['product']} | {r['M']} | {r['op']} | | | | | | failed: {r['error']} | | | | |")
            continue
        t, cublas = r.get("tiles", {}), base.get((r["product"], r["M"]))
        ratio = f"{r['us'] / cublas:.2f}" if cublas else "-"
        rows_ = t.get("rows", "") if t.get("kind") in ("loop", "stream") else t.get("block_rows", "")
        stages = f" {t['stages']} stages" if (t.get("stages") or 1) > 1 else ""
        kind = t.get("kind", "") + (" pdl" if t.get("pdl") else "") + stages
        print(f"| {r['product']} | {r['M']} | {r['op']} | {kind} | {t.get('block_n', '')} | {rows_} | "
              f"{t.get('warps', '')} | {t.get('block_k') or ''} | {r['us']:.2f} | {r['tb_per_s']:.2f} | {ratio} | "
              f"{r.get('max_diff_vs_triton', '')} | {r.get('rows_equal_alone', '')} |")


def write(rows: list[dict], args, argv, product_rows: list[dict] | None = None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "".join(f"_{part}" for part in (args.shape if args.shape != "smollm2-135m" else "", args.tag) if part)
    out = RESULTS / f"gpu_step_{torch.cuda.get_device_name().replace(' ', '-').lower()}{suffix}.json"
    command = "python -m benchmarks.gpu_step " + " ".join(sys.argv[1:] if argv is None else argv)
    data = {"command": command, "env": environment(), "rows": rows}
    if product_rows is not None:
        data["products"] = product_rows
    out.write_text(json.dumps(data, indent=2))


def step_rows(args, argv) -> list[dict]:
    """The step's rows, one per (layer ops, token count); a failure becomes the row's "error"."""
    rows, first = [], {}
    for ops in args.layer_ops:
        choice, _, flag = ops.partition("+")  # folded+pdl: the Triton kernels as programmatic dependent launches
        name, _, kind = choice.partition(":")  # fused:block = the fused products of that GEMV kind
        layer_ops.GEMV_KIND, layer_ops.PDL = kind or "loop", flag == "pdl"
        try:
            lm = build(layer_ops=name, shape=args.shape)
        except Exception as e:  # noqa: BLE001 - the other choices still run
            rows.append({"layer_ops": ops, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        for T in args.tokens:
            compiled = not args.no_compile and T in args.compile_tokens
            try:
                row = {"layer_ops": ops, "shape": args.shape, "weight_floor_ms": weight_floor_ms(lm),
                       **measure(lm, T, args.context, compiled)}
                logits = row.pop("logits")
                row["max_logit_diff_vs_first"] = float((logits - first.setdefault(T, logits)).abs().max())
            except Exception as e:  # noqa: BLE001
                row = {"layer_ops": ops, "tokens": T, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            write(rows, args, argv)  # after each row: a later failure keeps what was measured
        del lm
    return rows


def print_steps(rows: list[dict]) -> None:
    print("| layer ops | tokens | graph ms | weight floor ms | kernels | logit diff vs first | compiled graph ms | "
          "compiled kernels | compile s | compiled logit diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layer_ops']} | {r.get('tokens', '-')} | failed: {r['error']} | | | | | | | |")
            continue
        c = r.get("compiled_kernels", {})
        print(f"| {r['layer_ops']} | {r['tokens']} | {r['graph_ms']:.3f} | {r['weight_floor_ms']:.3f} | "
              f"{r['eager_kernels']['count']} | "
              f"{r['max_logit_diff_vs_first']:.3g} | {r.get('compiled_graph_ms', 0):.3f} | {c.get('count', '-')} | "
              f"{r.get('compile_s', 0):.0f} | {r.get('compiled_max_logit_diff', 0):.3g} |")
        if "compile_error" in r:
            print(f"  compile failed: {r['compile_error']}")
    for r in rows:
        for kind in ("eager_kernels", "compiled_kernels"):
            if kind in r:
                top = "; ".join(f"{k['name']} x{k['calls']} {k['ms']:.3f} ms" for k in r[kind]["top"])
                print(f"\n{r['layer_ops']} T={r['tokens']} {kind}: {top}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 7])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-tokens", type=int, nargs="*", default=[1], help="token counts also compiled")
    ap.add_argument("--layer-ops", nargs="*", default=["torch"],
                    choices=[c + pdl for pdl in ("", "+pdl") for c in ("torch", "triton", "folded", "fused",
                                                                        *(f"fused:{k}" for k in layer_ops.KINDS))],
                    help="the step under each choice (none: no step rows; fused:KIND, the products of that GEMV "
                         "kind; +pdl: the Triton kernels as programmatic dependent launches, FLASHSPEC_PDL=1)")
    ap.add_argument("--tag", default="", help="a suffix for the results file")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES),
                    help="random weights of this shape for the step rows and the products")
    ap.add_argument("--kinds", nargs="*", default=list(layer_ops.KINDS), choices=layer_ops.KINDS,
                    help="the GEMV kinds whose tiles --products sweeps")
    ap.add_argument("--product-rows", type=int, nargs="*", default=list(PRODUCT_ROWS), help="M of --products")
    ap.add_argument("--products", action="store_true",
                    help=f"also time each projection alone at M = {', '.join(map(str, PRODUCT_ROWS))}: cuBLAS, the "
                         "triton ops, the fused GEMV under several tiles")
    ap.add_argument("--cold", action="store_true", help="--products reads its weights from memory, as a step does "
                    "(each product timed over copies of its weight that fill the L2 cache twice)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_step needs CUDA")
    rows = step_rows(args, argv)
    print_steps(rows)
    if args.products:
        print_products(products(lambda product_rows: write(rows, args, argv, product_rows), args.shape, args.kinds,
                                args.product_rows, args.cold))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
