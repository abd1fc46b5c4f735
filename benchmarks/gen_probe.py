"""Generation throughput of one process on a GPU at the draft-head data's shapes: a random model of the embedded
target's shape (no weights needed), bfloat16, a static KV cache at a large batch: generate() with its own
multinomial sampling, eager and compiled, or (--rows) the data's own path, `head_data.generate` (one call for
mixed temperatures, Gumbel-max per row, compiled; or `--cache continuous`: transformers' continuous batching, one
call per temperature; or `--cache slots`: `slot_decode`, rows refilled from a ring cache, its step a CUDA graph).
`--attention grouped` (the data's choice) decodes with
`flashspec_core.grouped_attention`, `sdpa` with transformers' own (key/value heads repeated). Random weights never end an answer early, so every new token
counts. Prints new tokens per second; numbers, not assertions.

    python -m benchmarks.gen_probe [--batch 2048] [--width 128] [--new 128] [--rows [--cache static|continuous|slots]
        [--prompts N]] [--attention grouped|sdpa]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from flashspec_core.grouped_attention import use_grouped_attention


def model_like_smollm2():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


@torch.inference_mode()
def timed(model, batch: int, width: int, new: int, compile_: bool) -> dict:
    model.generation_config.disable_compile = not compile_
    ids = torch.randint(3, 49152, (batch, width), device="cuda")
    out = {}
    for name in ("first", "second"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=True,
                       temperature=1.0, top_k=0, top_p=1.0, cache_implementation="static", pad_token_id=2)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        out[name] = {"seconds": round(s, 2), "new_tokens_per_s": round(batch * new / s)}
    return out


class _Ids:
    """A tokenizer stand-in: each text is already its ids (a list of ints)."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t) for t in texts]}


def timed_rows(model, batch: int, width: int, new: int, cache: str, prompts: int) -> dict:
    from flashspec_core.head_data import generate

    model.generation_config.disable_compile = False
    model.generation_config.eos_token_id = 2
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, 49152, (int(torch.randint(20, width, (1,), generator=g)),), generator=g).tolist()
             for _ in range(prompts or batch)]
    temps = [(0.0, 0.7, 1.0)[i % 3] for i in range(len(texts))]
    out = {}
    for name in ("first", "second"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        answers = generate(model, _Ids(), texts, new, temps, batch, cache=cache)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        out[name] = {"seconds": round(s, 2), "new_tokens_per_s": round(sum(map(len, answers)) / s)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rows", action="store_true", help="time head_data.generate (mixed temperatures) instead")
    ap.add_argument("--prompts", type=int, default=0, help="with --rows: prompts in all (0 = --batch)")
    ap.add_argument("--attention", choices=("grouped", "sdpa"), default="grouped")
    ap.add_argument("--cache", choices=("static", "continuous", "slots"), default="static",
                    help="with --rows: head_data's static shapes, continuous batching (generate_batch) or slot_decode")
    args = ap.parse_args(argv)
    model = model_like_smollm2()
    if args.attention == "grouped":
        use_grouped_attention(model)
    if args.rows:
        rows = {f"head_data.generate, {args.cache}": timed_rows(model, args.batch, args.width, args.new, args.cache,
                                                                      args.prompts)}
    else:
        rows = {mode: timed(model, args.batch, args.width, args.new, mode == "compiled") for mode in ("eager", "compiled")}
    print(json.dumps({"gpu": torch.cuda.get_device_name(), **vars(args), **rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
