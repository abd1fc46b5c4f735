"""GPU benchmark of the fast path (`StaticCausalLM` + CUDA graphs) against Hugging Face eager, with random weights.

For Llama shapes of 160M, 1.1B (TinyLlama) and 8B (Llama-3-8B) in bf16 at a 512-token context it measures:
the ms of one plain decoding step against the weight-streaming floor (parameter bytes / the copy bandwidth it
measures first), the ms to verify T = 2..17 tokens, HF eager's ms per forward and `generate()` tok/s, and
speculative tok/s for 160M -> 1.1B and 1.1B -> 8B at controlled acceptance rates next to the ideal implied by
the measured costs. Writes benchmarks/results/gpu_<device>.json and prints markdown tables.

    python -m benchmarks.gpu               # CUDA only; well under 8 minutes on an H200
    python -m benchmarks.gpu --cpu-smoke   # the whole script with tiny shapes on the CPU, graphs off
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.run import RESULTS, ROOT
from flashspec_core.fast_path import StaticCausalLM
from flashspec_core.models import CausalLM
from kernels import resolve_backend, verify

SHAPES = {  # Llama shapes; random weights are fine for timing
    "160M": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=2048, vocab_size=32000),
    "1.1B": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=32000),  # TinyLlama
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 500000.0}),  # Llama-3-8B
}
SMOKE_SHAPES = {  # the same names, tiny: --cpu-smoke runs every code path in seconds
    "160M": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=64, vocab_size=101),
    "1.1B": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=101),
    "8B": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=160, vocab_size=131),
}
PAIRS = (("160M", "1.1B"), ("1.1B", "8B"))  # (draft, target)
RATES = (0.5, 0.7, 0.9)


@dataclass(frozen=True)
class Settings:
    context: int  # prompt tokens in the cache when timing
    max_len: int  # StaticCausalLM max_len
    verify_tokens: tuple[int, ...]  # T = K + 1 to time
    hf_new_tokens: int  # generate() length for the HF baseline
    spec_new_tokens: int  # tokens per speculative run
    warmup: int  # untimed calls before timing
    iters: int  # calls per timed sample
    reps: int  # samples; the median is reported
    hf_iters: int  # calls per sample for HF eager (slow)
    copy_elems: int  # elements of the bandwidth probe (bf16)


GPU = Settings(context=512, max_len=1024, verify_tokens=tuple(range(2, 18)), hf_new_tokens=64, spec_new_tokens=192,
               warmup=5, iters=20, reps=5, hf_iters=5, copy_elems=1 << 29)
SMOKE = Settings(context=24, max_len=96, verify_tokens=(2, 3, 5), hf_new_tokens=6, spec_new_tokens=12,
                 warmup=1, iters=2, reps=2, hf_iters=1, copy_elems=1 << 20)


# ----------------------------------------------------------------------------------------------------
# Measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, s: Settings, iters: int | None = None) -> float:
    """Median over s.reps samples of the mean ms per call of fn (CUDA events on CUDA), after s.warmup calls."""
    iters = iters or s.iters
    for _ in range(s.warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(s.reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, s: Settings) -> float:
    """Bytes read + written per second by a large device-to-device copy of random bf16 data."""
    x = torch.randn(s.copy_elems, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device, s, iters=10)
    bandwidth = 2 * x.numel() * x.element_size() / (ms / 1e3)
    del x, y
    return bandwidth


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied tensors counted once


# ----------------------------------------------------------------------------------------------------
# Models


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """A random LlamaForCausalLM built directly on `device` in `dtype`; matrices ~ N(0, 0.02), norms = 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
    probe = model.lm_head.weight.float()
    assert probe.std() > 0.01 and probe.abs().max() > 0, "random weights expected, never zeros"
    model.generation_config.eos_token_id = None  # generate() runs its full length
    return model.eval()


def random_ids(n: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


# ----------------------------------------------------------------------------------------------------
# One model: fast path vs floor, verify costs, HF eager


def bench_fast(name: str, model, fast: StaticCausalLM, s: Settings, bandwidth: float) -> dict:
    device, V = fast.device, model.config.vocab_size
    ctx = random_ids(s.context, V, 0, device)
    fast.reset()
    fast.forward(ctx, logits_to_keep=1)  # prefill (eager)
    L = fast.length
    extra = random_ids(max(s.verify_tokens), V, 1, device)

    def step(T):
        def run():
            fast.forward(extra[:, :T])
            fast.crop(L)
        return run

    decode_ms = time_ms(step(1), device, s)
    verify_ms = {T: time_ms(step(T), device, s) for T in s.verify_tokens}
    tok_s = greedy_tok_s(fast, ctx, s.hf_new_tokens)
    floor_ms = param_bytes(model) / bandwidth * 1e3
    print(f"  {name}: fast T=1 {decode_ms:.3f} ms (floor {floor_ms:.3f} ms), verify T={max(s.verify_tokens)} "
          f"{verify_ms[max(s.verify_tokens)]:.3f} ms, greedy {tok_s:.1f} tok/s, {len(fast.graphs)} graphs",
          flush=True)
    return dict(model=name, params=sum(p.numel() for p in model.parameters()), param_bytes=param_bytes(model),
                path=fast.path, floor_ms=floor_ms, decode_ms=decode_ms, verify_ms=verify_ms,
                fast_greedy_tok_s=tok_s, graphs=len(fast.graphs))


def greedy_tok_s(lm, ctx: torch.Tensor, n: int) -> float:
    """Plain greedy decoding with the host reading each token (one sync per token, as the engine's round)."""
    lm.reset()
    logits = lm.forward(ctx[:, :-1], logits_to_keep=1)
    logits = lm.forward(ctx[:, -1:])
    sync(lm.device)
    t0 = time.perf_counter()
    for _ in range(n):
        token = int(logits[0, -1].argmax())
        logits = lm.forward(torch.tensor([[token]], device=lm.device))
    sync(lm.device)
    return n / (time.perf_counter() - t0)


def bench_hf(name: str, model, s: Settings) -> dict:
    device, V = next(model.parameters()).device, model.config.vocab_size
    ctx = random_ids(s.context, V, 0, device)
    hf = CausalLM(model)
    hf.reset()
    hf.forward(ctx, logits_to_keep=1)
    L = hf.length
    one = ctx[:, :1]

    def step():
        hf.forward(one)
        hf.crop(L)

    forward_ms = time_ms(step, device, s, iters=s.hf_iters)
    del hf
    mask = torch.ones_like(ctx)
    rates = []
    with torch.inference_mode():
        for run in range(3):  # a full-length warm-up (the first run is several times slower), then the better of two
            sync(device)
            t0 = time.perf_counter()
            out = model.generate(ctx, attention_mask=mask, max_new_tokens=s.hf_new_tokens, do_sample=False,
                                 pad_token_id=0)
            sync(device)
            if run:
                rates.append((out.shape[1] - ctx.shape[1]) / (time.perf_counter() - t0))
    print(f"  {name}: HF eager forward {forward_ms:.2f} ms, generate {max(rates):.1f} tok/s "
          f"(runs {', '.join(f'{r:.1f}' for r in rates)}; attention {model.config._attn_implementation})", flush=True)
    return dict(hf_forward_ms=forward_ms, hf_generate_tok_s=max(rates), hf_attention=model.config._attn_implementation)


# ----------------------------------------------------------------------------------------------------
# Speculative decoding with a synthetic drafter at a controlled acceptance rate


def expected_tokens(a: float, K: int) -> float:
    """E[tokens per round] when each draft token is accepted with probability a: (1 - a^(K+1)) / (1 - a)."""
    return (1 - a ** (K + 1)) / (1 - a)


def best_k(a: float, draft_ms: float, verify_ms: dict[int, float]) -> int:
    """The K (with a timed verify of K + 1 tokens) that maximises E / (K t_draft + t_verify(K + 1))."""
    ks = [T - 1 for T in verify_ms if T >= 2]
    return max(ks, key=lambda K: expected_tokens(a, K) / (K * draft_ms + verify_ms[K + 1]))


def greedy_continuation(target, seq: list[int], n: int, vocab: int) -> list[int]:
    """The target's next n greedy tokens after seq (its cache holds seq[:-1]); the cache is restored after."""
    start = target.length
    token = torch.tensor([[seq[-1]]], device=target.device)
    out = []
    for _ in range(n):
        token = target.forward(token)[0, -1, :vocab].argmax().view(1, 1)
        out.append(token)
    target.crop(start)
    return torch.cat(out, dim=1)[0].tolist()


def speculative_run(draft, target, ctx: list[int], a: float, K: int, n_new: int, vocab: int, seed: int,
                    backend: str) -> dict:
    """Greedy speculative decoding where draft token i is the target's own greedy token with probability a.

    The draft model runs K real forwards per round (its cost), but the ids it proposes are synthetic: the
    target's reference greedy token (from plain T = 1 decoding, untimed) with probability a, else a wrong one.
    Verification is the real greedy test (`kernels.verify`) on the target's logits. Only rounds are timed.
    When bf16 rounding makes the verify forward pick a different token than the reference pass did, the
    reference is recomputed from there (untimed); `ref_refreshes` counts that.
    """
    rng = random.Random(seed)
    device = target.device
    target.reset()
    draft.reset()
    target.forward(torch.tensor([ctx[:-1]], device=device), logits_to_keep=1)
    draft.forward(torch.tensor([ctx[:-1]], device=device), logits_to_keep=1)
    seq, ref = list(ctx), []  # ref[i]: the target's greedy token i of the generation (as far as known)
    produced = rounds = accepted = refreshes = 0
    seconds = 0.0
    while produced < n_new:
        if len(ref) < produced + K + 1:
            ref += greedy_continuation(target, seq, produced + K + 1 - len(ref) + 32, vocab)
        props = []
        for i in range(K):
            right = ref[produced + i]
            wrong = rng.randrange(vocab - 1)
            props.append(right if rng.random() < a else wrong + (wrong >= right))
        sync(device)
        t0 = time.perf_counter()
        fed = torch.tensor([seq[draft.length:]], device=device)  # 1 token, or 2 after a full accept
        block = torch.tensor([[seq[-1]] + props], device=device)  # [1, K+1]: pending token, then the drafts
        for i in range(K):  # draft: real forwards; its own picks are computed and replaced by props
            logits = draft.forward(fed if i == 0 else block[:, i:i + 1], logits_to_keep=1)
            logits[0, -1, :vocab].argmax()
        p = target.forward(block)[..., :vocab]  # verify: [1, K+1, V] logits (greedy needs no softmax)
        result = verify(block[:, 1:], None, p, greedy=True, backend=backend)
        emitted = [t for t in result.tokens[0].tolist() if t >= 0]  # the one device->host sync
        seconds += time.perf_counter() - t0
        n = len(emitted) - 1
        target.crop(len(seq) + n)  # holds seq + the accepted drafts; the last emitted token is pending
        draft.crop(min(draft.length, len(seq) + n))
        if emitted != ref[produced:produced + n + 1]:  # a near tie went the other way: the reference is stale
            ref = ref[:produced] + emitted
            refreshes += 1
        seq += emitted
        produced += n + 1
        rounds += 1
        accepted += n
    return dict(tokens=produced, rounds=rounds, proposed=rounds * K, accepted=accepted, seconds=seconds,
                ref_refreshes=refreshes)


def bench_pair(draft_name, target_name, draft, target, rows: dict, s: Settings, backend: str) -> list[dict]:
    vocab = min(draft.vocab_size, target.vocab_size)
    ctx = random_ids(s.context, vocab, 2, target.device)[0].tolist()
    t_d, t_v = rows[draft_name]["decode_ms"], rows[target_name]["verify_ms"]
    out = []
    for a in RATES:
        K = best_k(a, t_d, t_v)
        # warm-up (untimed): compiles the verify kernel for this K and captures any graph the run needs
        speculative_run(draft, target, ctx, a, K, 2 * (K + 1), vocab, seed=0, backend=backend)
        run = speculative_run(draft, target, ctx, a, K, s.spec_new_tokens, vocab, seed=int(a * 100), backend=backend)
        E = expected_tokens(a, K)
        round_ms = K * t_d + t_v[K + 1]
        measured = run["tokens"] / run["seconds"]
        row = dict(pair=f"{draft_name} -> {target_name}", a=a, K=K, measured_tok_s=measured,
                   ideal_tok_s=E / round_ms * 1e3, expected_tokens_per_round=E,
                   tokens_per_round=run["tokens"] / run["rounds"],
                   acceptance=run["accepted"] / max(run["proposed"], 1),
                   ideal_at_measured_acceptance_tok_s=run["tokens"] / run["rounds"] / round_ms * 1e3,
                   round_ms_model=round_ms, round_ms_measured=run["seconds"] * 1e3 / run["rounds"],
                   target_plain_tok_s=rows[target_name]["fast_greedy_tok_s"],
                   target_hf_generate_tok_s=rows[target_name].get("hf_generate_tok_s"), **run)
        print(f"  {row['pair']} a={a} K={K}: {measured:.1f} tok/s measured, {row['ideal_tok_s']:.1f} ideal "
              f"(acceptance {row['acceptance']:.2f}, {run['ref_refreshes']} reference refreshes)", flush=True)
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------------------
# Report


def device_slug(device: torch.device, smoke: bool) -> str:
    if smoke:
        return "cpu-smoke"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "flashspec_core", "kernels", "benchmarks"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if commit.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def markdown(report: dict) -> str:
    lines = [f"### {report['device']} (copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s read+write)", "",
             "| model | params | floor ms | fast T=1 ms | fast / floor | fast greedy tok/s | HF forward ms "
             "| HF generate tok/s | fast greedy / HF generate |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["models"]:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['floor_ms']:.3f} | {r['decode_ms']:.3f} | "
                     f"{r['decode_ms'] / r['floor_ms']:.2f} | {r['fast_greedy_tok_s']:.1f} | {r['hf_forward_ms']:.2f} | "
                     f"{r['hf_generate_tok_s']:.1f} | {r['fast_greedy_tok_s'] / r['hf_generate_tok_s']:.1f}x |")
    names = [r["model"] for r in report["models"]]
    lines += ["", "Verify cost, ms for T = K + 1 tokens (fast path)", "",
              "| T | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for T in [1, *report["settings"]["verify_tokens"]]:
        cells = [f"{(r['decode_ms'] if T == 1 else r['verify_ms'][T]):.3f}" for r in report["models"]]
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    lines += ["", "Speculative decoding, synthetic drafter at acceptance a (greedy, exact)", "",
              "| pair | a | K | measured tok/s | ideal tok/s | measured / ideal | tokens/round (E) | accepted / proposed "
              "| x target plain (fast) | x HF generate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["speculative"]:
        hf = r["target_hf_generate_tok_s"]
        lines.append(f"| {r['pair']} | {r['a']} | {r['K']} | {r['measured_tok_s']:.1f} | {r['ideal_tok_s']:.1f} | "
                     f"{r['measured_tok_s'] / r['ideal_tok_s']:.2f} | {r['tokens_per_round']:.2f} "
                     f"({r['expected_tokens_per_round']:.2f}) | {r['acceptance']:.2f} | "
                     f"{r['measured_tok_s'] / r['target_plain_tok_s']:.2f} | "
                     f"{(r['measured_tok_s'] / hf) if hf else float('nan'):.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Main


def free(*objects) -> None:
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, graphs off (a dry run)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where to write gpu_<device>.json (default benchmarks/results; a temp dir for --cpu-smoke)")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("benchmarks.gpu needs CUDA (none is available here). Use --cpu-smoke for a dry run on the CPU.",
              file=sys.stderr)
        return 2
    import transformers

    device = torch.device("cpu" if smoke else "cuda")
    s, shapes = (SMOKE, SMOKE_SHAPES) if smoke else (GPU, SHAPES)
    dtype = torch.float32 if smoke else torch.bfloat16
    backend = resolve_backend("auto", device)
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="flashspec-smoke-")) if smoke else RESULTS)
    t_start = time.perf_counter()

    bandwidth = copy_bandwidth(device, s)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)", flush=True)
    rows, fast, spec = {}, {}, []

    def load(name, seed):
        t0 = time.perf_counter()
        model = build_model(shapes[name], device, dtype, seed)
        fast[name] = StaticCausalLM(model, max_len=s.max_len, use_graphs=not smoke)
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s, {param_bytes(model) / 1e9:.2f} GB, "
              f"{fast[name].path}", flush=True)
        rows[name] = {**bench_fast(name, model, fast[name], s, bandwidth), **bench_hf(name, model, s)}

    load("160M", 1)
    load("1.1B", 2)
    spec += bench_pair("160M", "1.1B", fast["160M"], fast["1.1B"], rows, s, backend)
    free(fast.pop("160M"))
    load("8B", 3)
    spec += bench_pair("1.1B", "8B", fast["1.1B"], fast["8B"], rows, s, backend)
    free(fast.pop("1.1B"), fast.pop("8B"))

    report = dict(device="CPU (smoke run)" if smoke else torch.cuda.get_device_name(device), smoke=smoke,
                  torch=torch.__version__, transformers=transformers.__version__,
                  triton=_version("triton"), cuda=torch.version.cuda, git_commit=git_commit(), verify_backend=backend,
                  dtype=str(dtype).replace("torch.", ""), copy_bandwidth_GBps=bandwidth / 1e9,
                  settings={k: (list(v) if isinstance(v, tuple) else v) for k, v in s.__dict__.items()},
                  shapes=shapes, models=[rows[n] for n in ("160M", "1.1B", "8B")], speculative=spec,
                  seconds=time.perf_counter() - t_start)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_{device_slug(device, smoke)}.json"
    path.write_text(json.dumps(report, indent=1))
    print("\n" + markdown(report))
    print(f"\nwrote {path} ({report['seconds']:.0f} s)")
    return 0


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
