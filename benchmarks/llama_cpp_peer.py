"""llama.cpp (llama-cpp-python) as the CPU peer of `benchmarks/run.py --peers llama.cpp`: greedy decoding of the
same prompt token ids on the same GGUF file, timed like the engine (wall time from the prompt to the last token,
prefill included, a fresh KV cache each run).

Runs in its own interpreter, the one that has llama-cpp-python (it is not in requirements.txt):

    python -m venv /tmp/llama-venv && /tmp/llama-venv/bin/pip install llama-cpp-python
    echo '{"gguf": "...", "threads": 2, "runs": [{"ids": [1, 2], "max_new_tokens": 96}]}' | \\
        /tmp/llama-venv/bin/python benchmarks/llama_cpp_peer.py

On a CPU with AMX (an Intel Xeon here) the default native build segfaulted in its first decode; built without
its AMX code it runs: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" before pip.

Reads one JSON request on stdin, writes one JSON answer on stdout. Imports neither torch nor flashspec.
"""
from __future__ import annotations

import json
import sys
import time


def run_one(llm, ids: list[int], max_new_tokens: int, eos: set[int]) -> dict:
    """One cold greedy run: tokens, seconds, tok/s and the ids (the end-of-turn token included, as the engine)."""
    llm.reset()  # no prefix of an earlier run stays in the KV cache
    out = []
    t0 = time.perf_counter()
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if token in eos or len(out) >= max_new_tokens:
            break
    seconds = time.perf_counter() - t0
    return {"tokens": len(out), "seconds": seconds, "tok_per_s": len(out) / seconds, "ids": out}


def main() -> int:
    import llama_cpp
    from llama_cpp import Llama

    request = json.load(sys.stdin)
    llm = Llama(model_path=request["gguf"], n_threads=request["threads"], n_threads_batch=request["threads"],
                n_ctx=request.get("n_ctx", 2048), n_batch=512, seed=0, verbose=False)
    eos = set(request.get("eos_ids", [])) or {llm.token_eos()}
    runs = request["runs"]
    if runs:  # warm-up, as the engine's: page the weights in
        run_one(llm, runs[0]["ids"], 8, eos)
    results = [run_one(llm, r["ids"], r["max_new_tokens"], eos) for r in runs]
    json.dump({"version": llama_cpp.__version__, "results": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
