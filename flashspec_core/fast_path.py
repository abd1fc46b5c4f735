"""`StaticCausalLM`: a drop-in `CausalLM` for the Llama family (Llama, SmolLM2, TinyLlama, Qwen2) with a static
KV cache and, on CUDA, one CUDA graph per (token count, context bucket); `fast_or_eager` picks it or `CausalLM`.

It runs its own compact forward over the Hugging Face model's parameters and matches HF's numerics up to rounding
(RMSNorm in float32, rotary tables from HF's own `inv_freq`, attention scores rounded to the model dtype, softmax in
float32). To launch fewer kernels it fuses a few ops whose results differ from HF's only in the last bit: one GEMM
for q/k/v and one for gate/up (over concatenated copies of those weights, about 55% of a Llama's parameter bytes
extra; `fuse=False` shares the HF weights instead), residual adds inside the o and down GEMMs (beta = 1),
the attention scale and mask inside the scores GEMM, softmax rounding straight to the model dtype.
Rollback is moving `length` back: attention masks every cache slot past each query's position, so stale
entries are never read and are overwritten by the next forward. A draft tree (`forward_tree`) runs the same
layers under the tree's mask; `compact` then moves the accepted path's entries together before that roll-back.
Positions and lengths live on the host; nothing in `forward` or `crop` waits for the device (`compact` reads the
kept positions on the host).
"""
from __future__ import annotations

import os
import warnings
from types import SimpleNamespace
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

from flashspec_core import native
from flashspec_core.gguf_weights import GROUP, PACKED, GGUFFile, Int4Weight, Int8Weight, Q4_1Weight, int8_rows
from flashspec_core.models import CausalLM
from flashspec_core.tree import DraftTree, compaction
from kernels import layer_ops as layer_ops_kernels

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies fixed at init (no seq_len-dependent update)
MODES = ("auto", "on", "off")
ATTENTION = ("auto", "math", "sdpa", "ordered")
GEMMS = ("auto", "rows", "columns")
LOOPS = ("auto", "native", "script", "python")
COLUMNS_MAX_TOKENS = 10  # "columns" GEMMs serve forwards of up to this many tokens (measured: rows win at 12-14)
MAX_GRAPH_TOKENS = 41  # verify of K + 1 tokens, K <= 40: a 32-node tree with an 8-token copied branch
SLACK = MAX_GRAPH_TOKENS  # cache slots past max_len: a verify (or a draft model up to K tokens ahead) past the window
DEFAULT_MAX_LEN = 4096
PREFILL_GRAPH_TOKENS = 512  # prompts padded up to this long prefill as one captured graph (CUDA)
PREFILL_MIN = 16  # the shortest padded prompt


# ----------------------------------------------------------------------------------------------------
# Support check and factory


def head_size(config) -> int:
    """A Llama-family config's attention head size (its own `head_dim`, else hidden size / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def is_supported(model) -> tuple[bool, str]:
    """(True, "") when `StaticCausalLM` reproduces `model` exactly; else (False, why not)."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return False, f"architecture {name} is not one of {list(ARCHITECTURES)}"
    config = model.config
    if getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None:
        return False, "quantized weights"
    if getattr(config, "hidden_act", "silu") != "silu":
        return False, f"activation {config.hidden_act!r} (the fast path implements SwiGLU with silu)"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        return False, "sliding-window attention is in use"
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        return False, f"rope type {rope_type!r} (supported: {list(STATIC_ROPE)})"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return False, "partial rotary embeddings"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return False, "no rotary embedding module at model.model.rotary_emb"
    if len(model.model.layers) != config.num_hidden_layers:
        return False, f"{len(model.model.layers)} layers but config.num_hidden_layers = {config.num_hidden_layers}"
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes <= {torch.float32, torch.float16, torch.bfloat16} or len(dtypes) != 1:
        return False, f"parameter dtypes {sorted(str(d) for d in dtypes)} (expected one of float32/float16/bfloat16)"
    if len({p.device for p in model.parameters()}) != 1:
        return False, "parameters are spread over several devices"
    return True, ""


def fast_or_eager(model, vocab_size: int | None = None, mode: str = "auto", max_len: int | None = None,
                  gguf: GGUFFile | None = None):
    """The model wrapper the engine should drive; `.path` says which one and, for eager, why.

    mode "auto": `StaticCausalLM` for supported models (with CUDA graphs on CUDA; on the CPU its "columns" GEMMs
                 make a decode step about twice as fast as Hugging Face's eager forward), else `CausalLM`.
    mode "on":   `StaticCausalLM`; raises if the model is unsupported.
    mode "off":  `CausalLM`.
    gguf: run the linear layers on this GGUF file's own 4-bit weights (`StaticCausalLM`'s `gguf`); needs the
    static path.
    """
    if mode not in MODES:
        raise ValueError(f"unknown fast path mode {mode!r}; expected one of {list(MODES)}")
    ok, reason = is_supported(model)
    if gguf is not None:
        if mode == "off" or not ok:
            raise ValueError(f"the GGUF precision runs on the fast path only, which cannot run this model: "
                             f"{reason if not ok else 'fast path off'}; use precision 'float32'")
        return StaticCausalLM(model, vocab_size, max_len=max_len, gguf=gguf)
    if mode == "off":
        reason = "fast path off"
    elif not ok and mode == "on":
        raise ValueError(f"the fast path cannot run this model: {reason}; use fast_path='auto' or 'off'")
    elif ok:
        return StaticCausalLM(model, vocab_size, max_len=max_len)
    lm = CausalLM(model, vocab_size)
    lm.path = f"eager ({reason})"
    return lm


# ----------------------------------------------------------------------------------------------------
# The model


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Chunks' outputs [B, t_i, ...] as one contiguous [B, sum t_i, ...] (a lone contiguous chunk: no copy)."""
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)


def fresh_logits(logits: torch.Tensor, shared: bool) -> torch.Tensor:
    """float32 logits the caller owns: a copy of a graph's buffer (`shared`, overwritten by its next replay), else
    the eager forward's own tensor (contiguous)."""
    return logits.to(torch.float32, copy=True) if shared else logits.to(torch.float32).contiguous()


def padded(T: int) -> int:
    """The tokens a prompt of T prefills as on `StaticCausalLM.prefill_graphs`: the next power of two, >= 16."""
    return max(PREFILL_MIN, 1 << (T - 1).bit_length())


class StaticCausalLM:
    """A Llama-family causal LM fed incrementally through a static KV cache holding the first `length` tokens.

    Same interface as `CausalLM`: `forward` appends ids [B, T] and returns float32 logits [B, T', V] (sliced to
    `vocab_size`, a fresh tensor); `crop` rolls back; `reset` empties the cache and keeps every buffer and graph.
    The cache holds max_len + SLACK slots per layer (rounded up to a multiple of 64); `context_window` is max_len.

    ctx_buckets: attention reads only the first S cache slots, S the smallest bucket >= length + T, so one
    graph per (T, S) serves every position in the bucket. Defaults: 256, 512, 1024, ... up to the capacity.
    attention: "math" = HF's eager attention op for op (scores rounded to the model dtype, softmax in float32),
    "sdpa" = F.scaled_dot_product_attention, "auto" = math for T <= max_graph_tokens (decode and verify:
    HF-eager numerics; on an H200 as fast as SDPA at a 512-token context, faster at 2000), sdpa beyond.
    "ordered" (the GGUF path's native loop only, and its "auto"): each query reads the keys its mask leaves visible
    in slot order (`csrc/q4_1.cpp` ordered_attention), so a draft tree's node gets the bits of one-token steps along
    its path, where SDPA sums a node's scattered keys in other blocks and can flip a greedy near-tie. The GGUF
    path's other loops run SDPA.
    prefill_chunk: longer forwards (prompts) run eagerly in chunks of this many tokens, which bounds the
    attention mask and activations.
    prefill_graphs: with CUDA graphs, a prompt (a forward at an empty cache) of T tokens with `padded(T)` (the next
    power of two, at least 16) up to this many runs as the replay of the graph of that many (`capture_prefill`
    captures them ahead, else the first use), the pad ids after the prompt: one replay where an eager forward is
    hundreds of launches. The prompt's rows never see the pads (causal), whose cache slots lie past the length. The
    padded size follows from T alone, so every stream of a prompt gets the same bits. Default: 512 with graphs,
    else 0 (an explicit value without graphs runs the same padded forward eagerly, with the graphs' bits).
    fuse: one GEMM for q/k/v and one for gate/up over copies of those weights concatenated here (extra memory:
    their bytes, e.g. 1.25 GB for a 1.1B Llama, 9.1 GB for an 8B); False runs separate GEMMs on the HF weights.
    gemm: how a linear layer multiplies T <= 10 tokens: "rows" = x @ W.T (F.linear), "columns" = (W @ x.T).T with
    at least two columns; "auto" = columns on the CPU, rows elsewhere. On a 2-core AMD EPYC with MKL the
    matrix-vector product of one token streamed the weights at ~12 GB/s and a matrix product with two columns
    at ~35 GB/s, so columns halve a decode step there (51 -> 27 ms for SmolLM2-135M; benchmarks/CPU_NOTES.md).
    gguf: the GGUF file the model was read from (CPU only). Its Q4_1 matrices become the q/k/v, o, gate/up and
    down products as packed 4-bit weights (`gguf_weights.Int4Weight`); activations, the KV cache and attention
    run in bfloat16, the residual stream, norms and embedding in float32; the LM head (the tied Q8_0 embedding)
    runs as int8 weights with one scale per row (re-quantised from the file's blocks of 32) and returns bfloat16
    logits. Every product computes each token's row on its own, so a verify of K + 1 tokens gives the same
    logits as K + 1 one-token steps (greedy speculative = greedy plain).
    loop: how the GGUF path (SDPA attention, no o/down biases) runs its layers. "native": one C++ op
    (`csrc/q4_1.cpp`, built on first use by `native.load`) whose products take the file's Q4_1 blocks as they are
    and quantise activations per block of 32 to int8 (llama.cpp's scheme; exact integer sums, AVX512-VNNI where the
    CPU has it), 2-4x faster than torch's 4-bit kernel; the LM head runs on the file's Q8_0 blocks the same way
    (1.1 ms at 1 token, 1.6 at 8, against 2.0 and 8.0 for int8 rows) and returns float32 logits. "script": torch's 4-bit
    kernel (`Int4Weight`) with the layer loop as one TorchScript function (`gguf_layers`), "python": the same ops
    from Python. "auto": native where it builds with VNNI, else script. Every loop computes each token's row on
    its own, so a verify equals one-token steps bit for bit within a loop (not across loops).
    """

    def __init__(self, model, vocab_size: int | None = None, *, max_len: int | None = None,
                 use_graphs: bool | None = None, ctx_buckets: tuple[int, ...] | None = None,
                 max_graph_tokens: int = MAX_GRAPH_TOKENS, attention: str = "auto", prefill_chunk: int = 512,
                 prefill_graphs: int | None = None, fuse: bool = True, gemm: str = "auto",
                 gguf: GGUFFile | None = None, loop: str = "auto", layer_ops: str = "auto"):
        ok, reason = is_supported(model)
        if not ok:
            raise ValueError(f"StaticCausalLM cannot run this model: {reason}")
        self.model = model.eval()
        self.config = config = model.config
        self.vocab_size = vocab_size or config.vocab_size
        self.device = next(model.parameters()).device
        self.gguf = gguf is not None
        if self.gguf and self.device.type != "cpu":
            raise ValueError(f"the GGUF 4-bit weights run on the CPU only; this model is on {self.device}")
        self.dtype = torch.bfloat16 if self.gguf else model.model.embed_tokens.weight.dtype  # activations, KV cache
        self._size(max_len, use_graphs)
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}; expected one of {list(ATTENTION)}")
        self.attention = "sdpa" if self.gguf and attention == "auto" else attention  # bf16 SDPA: one op, 3x faster
        if self.gguf and ctx_buckets is None:  # no graphs to share: attention reads the cache to the next 64 slots
            ctx_buckets = tuple(range(64, self.max_len + SLACK + 64, 64))
        if gemm not in GEMMS:
            raise ValueError(f"unknown gemm {gemm!r}; expected one of {list(GEMMS)}")
        self.columns = not self.gguf and (gemm == "columns" or (gemm == "auto" and self.device.type == "cpu"))
        self.max_graph_tokens = max_graph_tokens
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.prefill_graphs = (PREFILL_GRAPH_TOKENS if self.use_graphs else 0) if prefill_graphs is None \
            else max(0, int(prefill_graphs))  # the longest padded prompt prefilled as one graph
        self.buckets = self._make_buckets(ctx_buckets)
        self.fuse = bool(fuse)
        self.loop = self._pick_loop(model, loop)
        self.layer_ops = self._pick_ops(layer_ops)  # "torch", "triton" or "fused"
        self.ops = LAYER_OPS[self.layer_ops]
        if self.gguf and attention == "auto" and self.loop == "native":
            self.attention = "ordered"  # each query's keys in slot order: tree verifies equal one-token steps
        self.path = self._describe()
        self._take_weights(model, gguf)
        self._loop = self._make_loop()
        self.batch = 0
        self.kv_cache: list[torch.Tensor] = []  # per layer [2, B, n_kv, capacity, D]
        self.k_cache: list[torch.Tensor] = []  # per layer [B, n_kv, capacity, D], views of kv_cache
        self.v_cache: list[torch.Tensor] = []
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.tree_graphs: dict[tuple[int, int, bool], tuple] = {}  # a tree's forward: graph, logits, aux, mask buffer
        self.aux_layers: tuple[int, ...] = ()  # set by the engine while a drafter reads hidden states
        self.aux: torch.Tensor | None = None  # the last forward's aux hidden states [B, T, len(aux_layers) * H]
        self._pool = None
        self._allocate(1)
        self.length = 0
        self.forwards = 0

    def _size(self, max_len: int | None, use_graphs: bool | None) -> None:
        """The context window (max_len), the cache's slots a layer (capacity) and whether forwards replay graphs."""
        window = int(getattr(self.config, "max_position_embeddings", DEFAULT_MAX_LEN))
        self.max_len = int(max_len or min(window, DEFAULT_MAX_LEN))
        if self.max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len!r}")
        self.capacity = -(-(self.max_len + SLACK) // 64) * 64  # slots per layer, a multiple of 64 (mask alignment)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {self.device}")

    def _describe(self) -> str:
        """The path in words (the app and the benchmarks show it)."""
        if self.loop == "native":
            return "static (GGUF Q4_1 weights, int8 activation blocks, native kernels)"
        if self.gguf:
            return "static (GGUF Q4_1 weights, bfloat16 activations)"
        path = "static+graphs" if self.use_graphs else f"static ({'columns GEMMs, ' if self.columns else ''}no CUDA graphs)"
        ops = {"triton": ", Triton layer ops", "folded": ", Triton layer ops with the norms folded into the products",
               "fused": ", Triton layer ops with fused GEMV products"}
        return path + ops.get(self.layer_ops, "")

    def _take_weights(self, model, gguf: GGUFFile | None) -> None:
        """The shapes, the weights each product runs on (packed from the GGUF's blocks when given) and the
        position tables."""
        config = model.config
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = head_size(config)
        self.scaling = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.embed = model.model.embed_tokens.weight
        self.norm = model.model.norm.weight
        self.lm_head = model.lm_head.weight  # the embedding itself when tied
        self.lm_head_bias = getattr(model.lm_head, "bias", None)
        if self.gguf:
            self.layers = [_Layer.from_gguf(layer, gguf, i, self.loop == "native")
                           for i, layer in enumerate(model.model.layers)]
            with torch.no_grad():
                self.embed, self.norm = self.embed.float(), self.norm.float()
                if self.loop == "native":  # the file's Q8_0 blocks: 1.1 ms at 1 token, 1.6 at 8
                    self.lm_head = gguf.q8_0_weight("output.weight" if "output.weight" in gguf.tensors
                                                    else "token_embd.weight")
                else:  # Q8_0 blocks -> one scale per row: 1.1 ms, bf16 2.7-4.3
                    self.lm_head = int8_rows(self.lm_head)
        else:
            self.layers = [_Layer(layer, self.fuse, fold=self.layer_ops == "folded") for layer in model.model.layers]
        with torch.no_grad():
            self.slots = torch.arange(self.capacity, device=self.device)  # positions 0..capacity-1, int64
            # [capacity, D] in the activations' dtype; float32 for the native loop, which rotates in float32
            self.cos, self.sin = self._rope_tables(model.model.rotary_emb,
                                                   torch.float32 if self.loop == "native" else self.dtype)
            self.neg_inf = torch.tensor(float("-inf"), dtype=self.dtype, device=self.device)
            self.zero = torch.tensor(0.0, dtype=self.dtype, device=self.device)

    def _pick_loop(self, model, loop: str) -> str:
        """The layer loop `loop` asks for, where the model allows it (see the class docstring)."""
        if loop not in LOOPS:
            raise ValueError(f"unknown loop {loop!r}; expected one of {list(LOOPS)}")
        biases = any(l.self_attn.o_proj.bias is not None or l.mlp.down_proj.bias is not None for l in model.model.layers)
        if self.attention == "ordered":
            if not self.gguf or loop not in ("auto", "native") or biases or not native.load():
                raise ValueError("attention='ordered' runs on the GGUF path's native loop only "
                                 f"({native.why_not() or 'gguf, loop auto or native, no o/down biases'})")
            loop = "native"
        if not self.gguf or self.attention not in ("sdpa", "ordered") or biases or loop == "python":
            return "python"
        head_dim = head_size(self.config)
        if loop == "auto":
            fits = head_dim % 16 == 0 and head_dim <= 128
            return "native" if fits and native.load() and torch.ops.flashspec.vnni() else "script"
        if loop == "native" and not native.load():
            raise ValueError(f"the native kernels are unavailable: {native.why_not()}; use loop='script'")
        if loop == "native" and (head_dim % 16 or head_dim > 128):
            raise ValueError(f"the native loop needs a head_dim that is a multiple of 16 up to 128, not {head_dim}; "
                             "use loop='script'")
        return loop

    def _pick_ops(self, layer_ops: str) -> str:
        """The name of the python loop's ops: "torch"; "triton", `kernels.layer_ops`' Triton kernels for the small
        ops (rotary and the cache write, attention, SiLU * up, RMSNorm) beside cuBLAS's products; "folded", those
        kernels with the two norms of a layer folded into the q/k/v and gate/up products (their weights times the
        norm's, the products over the raw residual stream, each row's 1 / rms applied by the rotary and SiLU
        kernels: two kernels fewer a layer; fused weights, no q/k/v or gate/up biases); "fused", the kernels with
        the products as GEMV kernels that take in the norms, SiLU * up and the residual adds (`_fused_layers`;
        fused weights, no biases). Kernels: CUDA, not the GGUF path. "auto": on CUDA, "folded" where the model
        allows it, else "triton" where the kernels take its heads, else torch; the environment's
        FLASHSPEC_LAYER_OPS=torch|triton|folded|fused overrides it (A/B)."""
        config = self.config
        if layer_ops == "auto":  # on CUDA, so never the GGUF path (CPU only)
            layer_ops = layer_ops_kernels.auto(self.device, config.num_attention_heads, config.num_key_value_heads,
                                               head_size(config))
            if layer_ops == "folded" and (self._biased(in_products=True) or not self.fuse):
                layer_ops = "triton"
        if layer_ops not in LAYER_OPS:
            raise ValueError(f"unknown layer_ops {layer_ops!r}; expected one of {list(LAYER_OPS)}")
        if layer_ops in ("triton", "folded", "fused"):
            on = self.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            if not (on and layer_ops_kernels.triton is not None and not self.gguf):
                raise ValueError(f"layer_ops={layer_ops!r} needs CUDA (or TRITON_INTERPRET=1), triton and a model "
                                 "that is not on the GGUF path")
        if layer_ops in ("folded", "fused"):
            biased = self._biased(in_products=layer_ops == "folded")
            if biased or not self.fuse:
                raise ValueError(f"layer_ops={layer_ops!r} runs its products on the fused q/k/v and gate/up weights "
                                 f"without biases; this model has {'fuse=False' if not self.fuse else 'biases'} "
                                 f"({', '.join(biased[:3])}{', ...' if len(biased) > 3 else ''}): use "
                                 f"layer_ops='triton'")
        return layer_ops

    def _biased(self, in_products: bool) -> list[str]:
        """The linear layers with a bias (in_products: only q/k/v, gate and up, the products a norm feeds)."""
        fed = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        return [name for name, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)
                and getattr(m, "bias", None) is not None and (not in_products or name.endswith(fed))]

    def _make_loop(self):
        """f(x, cos, sin, pos, mask, S, shape, aux_layers) -> (x, aux list) running every layer (see `_layers`), or
        None for the Python loop. Scripting happens once, here."""
        if self.loop == "native":
            weights = [t for l in self.layers for t in (l.input_norm, l.qkv.weight.packed, l.qkv.weight.scales,
                                                        l.o.packed, l.o.scales, l.post_norm, l.gate_up.weight.packed,
                                                        l.gate_up.weight.scales, l.down.packed, l.down.scales)]
            op = torch.ops.flashspec.gguf_layers
            ordered = self.attention == "ordered"

            def native_loop(x, cos, sin, pos, mask, S, shape, aux):  # pos: ascending slots
                valid = min(self.widened, int(pos[0]))  # the slots written now are widened again, and those after
                out = op(x, cos, sin, pos, mask, S, shape, self.eps, self.scaling, weights, self.kv_cache, aux, ordered,
                         self.wide, valid)
                self.widened = int(pos[-1]) + 1 if ordered else 0
                return x, out
            return native_loop
        if self.loop == "script":
            weights = [[l.input_norm, l.qkv.weight.packed, l.qkv.weight.scales_zeros, l.o.packed, l.o.scales_zeros,
                        l.post_norm, l.gate_up.weight.packed, l.gate_up.weight.scales_zeros, l.down.packed,
                        l.down.scales_zeros] for l in self.layers]
            with warnings.catch_warnings():  # torch 2.13 marks TorchScript deprecated; "python" is the fallback
                warnings.simplefilter("ignore", DeprecationWarning)
                try:
                    scripted = torch.jit.script(gguf_layers)
                except Exception:  # noqa: BLE001 - a torch without TorchScript: the same ops in Python
                    self.loop = "python"
                    return None
            return lambda x, cos, sin, pos, mask, S, shape, aux: scripted(
                x, cos, sin, pos, mask, S, shape, self.eps, self.scaling, GROUP, weights, self.kv_cache, aux)
        return None

    # ------------------------------------------------------------------------------------------------
    # Buffers

    def _make_buckets(self, ctx_buckets) -> tuple[int, ...]:
        if ctx_buckets is None:
            sizes, s = [], 256
            while s < self.capacity:
                sizes.append(s)
                s *= 2
        else:
            sizes = [int(s) for s in ctx_buckets]
            if any(s < 1 for s in sizes):
                raise ValueError(f"context buckets must be positive, got {list(ctx_buckets)}")
        return tuple(sorted({s for s in sizes if s < self.capacity} | {self.capacity}))

    def _rope_tables(self, rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [capacity, D] as HF computes them: float32 p * inv_freq, duplicated, scaled, cast.

        sin carries the sign of rotate_half: rotate_half(x) * sin == roll(x, D/2) * sin_signed, exactly.
        """
        inv_freq = rotary.inv_freq.to(device=self.device, dtype=torch.float32)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        freqs = self.slots.float()[:, None] * inv_freq[None, :]  # [capacity, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scale).to(dtype)
        sin = (emb.sin() * scale).to(dtype)
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.contiguous(), sin_signed.contiguous()

    def _allocate(self, batch: int) -> None:
        """(Re)allocate the caches and static inputs for `batch` rows; drops captured graphs."""
        shape = (2, batch, self.n_kv, self.capacity, self.head_dim)  # k and v of a layer in one tensor
        self.kv = torch.zeros((len(self.layers), *shape), dtype=self.dtype, device=self.device)  # all layers'
        self.kv_cache = [self.kv[i] for i in range(len(self.layers))]  # per layer: views (not `unbind`'s, which
        # autograd forbids writing in place outside no_grad); `compact_at` moves every layer at once
        self.k_cache = [kv[0] for kv in self.kv_cache]  # views
        self.v_cache = [kv[1] for kv in self.kv_cache]
        # ordered attention's float32 copy of each layer's cache, keys transposed in blocks of 16 slots (pages are
        # touched only as slots fill); its first `widened` slots match the cache, so a step widens only its own
        self.wide = [torch.empty((2, batch, self.n_kv, self.capacity, self.head_dim)) for _ in self.layers] \
            if self.attention == "ordered" else []
        self.widened = 0
        width = max(self.max_graph_tokens, self.prefill_limit)  # a verify's, a padded prompt's
        self.static_ids = torch.zeros((batch, width), dtype=torch.int64, device=self.device)
        self.static_pos = torch.zeros((width,), dtype=torch.int64, device=self.device)
        self.static_rope = torch.zeros((width,), dtype=torch.int64, device=self.device)
        self.graphs.clear()
        self.tree_graphs.clear()
        self.batch = batch

    @property
    def prefill_limit(self) -> int:
        """The longest padded prompt prefilled as one graph: prefill_graphs, within the cache (0: none)."""
        return min(self.prefill_graphs, self.capacity)

    @property
    def context_window(self) -> int:
        return min(self.max_len, int(getattr(self.config, "max_position_embeddings", 1 << 30)))

    def bucket(self, needed: int) -> int:
        """The number of cache slots attention reads when the cache will hold `needed` tokens."""
        for s in self.buckets:
            if s >= needed:
                return s
        raise ValueError(f"{needed} tokens do not fit in the static cache of {self.capacity} slots "
                         f"(max_len={self.max_len}); build the model with a larger max_len")

    # ------------------------------------------------------------------------------------------------
    # CausalLM interface

    def reset(self) -> None:
        """Empty the cache (length = 0); buffers and graphs are kept."""
        self.length = 0
        self.forwards = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ids [B, T] to the cache; return float32 logits [B, T', V] for the last logits_to_keep (0 = all)."""
        B, T = ids.shape
        if T < 1:
            raise ValueError(f"forward needs at least one token, got ids of shape {tuple(ids.shape)}")
        self._fit_batch(B)
        start = self.length
        self.bucket(start + T)  # raises when the cache cannot take them
        keep = T if logits_to_keep <= 0 else min(logits_to_keep, T)
        shared = True  # logits in a graph's own buffer (a replay, or a view of a padded prompt's)
        if start == 0 and padded(T) <= self.prefill_limit:
            logits, self.aux = self._prefill_padded(ids, keep)
        elif self.use_graphs and T <= self.max_graph_tokens and start > 0:
            out, self.aux = self._replay(ids, start)
            logits = out[:, T - keep:]
        else:
            chunks, shared = [], False
            for c0 in range(0, T, self.prefill_chunk):
                c1 = min(T, c0 + self.prefill_chunk)
                rows = max(0, min(c1 - c0, keep - (T - c1)))  # of this chunk's rows, those among the last keep
                chunks.append(self._forward(ids[:, c0:c1], self.slots[start + c0:start + c1],
                                            self.bucket(start + c1), rows))
            logits = joined([c[0] for c in chunks])
            self.aux = joined([c[1] for c in chunks]) if self.aux_layers else None
        self.length += T
        self.forwards += 1
        return fresh_logits(logits[..., : self.vocab_size], shared)

    def _replay(self, ids: torch.Tensor, start: int):
        """ids [B, T] at cache slots start.. as the replay of the (T, S) graph (captured the first time; CPU: eager):
        (logits [B, T, V_model], the graph's own buffer; aux, a fresh tensor or None)."""
        T = ids.shape[1]
        S = self.bucket(start + T)
        if not self.use_graphs:
            return self._forward(ids, self.slots[start:start + T], S, T)
        self.static_ids[:, :T].copy_(ids)
        self.static_pos[:T].copy_(self.slots[start:start + T])  # device to device: no host round trip
        graph, out, aux = self.graphs.get((T, S, bool(self.aux_layers))) or self._capture(T, S)
        graph.replay()
        return out, None if aux is None else aux.clone()

    def _prefill_padded(self, ids: torch.Tensor, keep: int):
        """A prompt ids [B, T] into the empty cache as one forward of `padded(T)` tokens, pad ids after it: (logits
        [B, keep, V_model], a view of the graph's buffer; aux [B, T, F] or None)."""
        T = ids.shape[1]
        out, aux = self._replay(F.pad(ids, (0, padded(T) - T)), 0)
        return out[:, T - keep:T], None if aux is None else aux[:, :T]

    @torch.inference_mode()
    def capture_prefill(self, max_context: int) -> int:
        """Capture the padded prompts' graphs (`prefill_graphs`) for prompts up to max_context tokens, at the current
        `aux_layers`; returns how many were new (0 without graphs). The cache must be empty."""
        if not self.use_graphs:
            return 0
        if self.length:
            raise ValueError("capture_prefill() writes into the cache: call it before generating or after reset()")
        count, P = 0, PREFILL_MIN
        while P <= min(self.prefill_limit, padded(max_context)):
            S = self.bucket(P)
            if (P, S, bool(self.aux_layers)) not in self.graphs:
                self.static_pos[:P].copy_(self.slots[:P])
                self._capture(P, S)
                count += 1
            P *= 2
        return count

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds the first `length` tokens (slots past it are masked)."""
        if length < self.length:
            self.length = max(0, length)

    @torch.inference_mode()
    def forward_tree(self, ids: torch.Tensor, tree, logits_to_keep: int = 0) -> torch.Tensor:
        """Append a draft tree's slots ids [B, N+1] (the root, then node 0..N-1 of `tree`, a `DraftTree` shared by
        the rows) at cache slots length..length+N, each attending to the context, its ancestors and itself, at
        rotary position length + depth; return float32 logits [B, T', V] like `forward` (and its `aux`).

        It runs the same layers as `forward` with the tree's mask in place of the causal one (math attention up to
        max_graph_tokens slots, as `forward`; the GGUF path's SDPA). With CUDA graphs each (T, S) replays its own
        graph (`capture(tree_counts=)` makes them ahead, else the first call does), reading the tree's mask and rotary
        positions from buffers (`_tree_graph`). Follow with `compact` once the path is known."""
        T = tree.check_ids(ids)
        self._fit_batch(ids.shape[0])
        start = self.length
        keep = T if logits_to_keep <= 0 else min(logits_to_keep, T)
        S = self.bucket(start + T)
        rope = tree.position_ids(start).to(self.device)  # [T] rotary positions: start + depth
        mask, paths = self._tree_reads(tree, start, rope, S)
        graphed = self.use_graphs and T <= self.max_graph_tokens and start > 0  # logits in the graph's own buffer
        if graphed:
            self.static_ids[:, :T].copy_(ids)
            self.static_pos[:T].copy_(self.slots[start:start + T])
            self.static_rope[:T].copy_(rope)
            graph, out, aux = self._tree_graph(T, S, mask, paths)
            graph.replay()
            logits, self.aux = out[:, T - keep:], None if aux is None else aux.clone()
        else:
            logits, self.aux = self._layers(ids, rope, self.slots[start:start + T], mask, S, keep, paths)
        self.length += T
        self.forwards += 1
        return fresh_logits(logits[..., : self.vocab_size], graphed)

    def forward_tree_at(self, ids: torch.Tensor, tree, start: torch.Tensor, S: int):
        """`forward_tree` inside a captured round: a `TensorTree`'s slots at cache slots start + s (start [1] on the
        device), rotary positions start + depth, over slots [0, S); fixed shapes, no host reads. Returns the raw
        logits [B, N+1, V_model] and the aux hidden states, as `_forward`; follow with `compact_at`."""
        T = tree.check_ids(ids)
        rope = tree.position_ids(start)
        mask, paths = self._tree_reads(tree, start, rope, S)
        return self._layers(ids, rope, start + self.slots[:T], mask, S, T, paths)

    def _tree_reads(self, tree, start, rope: torch.Tensor, S: int):
        """(mask, paths) of a tree forward at start (an int or a device tensor [1]): each node's path laid out as
        a chain under the causal mask of its depth (`_reads_paths`), else the tree's mask over the cache."""
        if self._reads_paths(tree.N + 1):  # each node reads its path laid out as a chain: plain decoding's bits
            return self._causal_mask(rope, S), self._path_slots(tree, start, S)
        T, rel = tree.N + 1, self.slots[:S] - start  # each key slot's place in the tree block (< 0: the context)
        tree_part = tree.ancestor_mask().to(self.device)[:, rel.clamp(0, T - 1)] & ((rel >= 0) & (rel < T))[None, :]
        allowed = (rel < 0)[None, :] | tree_part  # [T, S]
        return torch.where(allowed, self.zero, self.neg_inf).repeat(self.n_heads // self.n_kv, 1), None

    def _reads_paths(self, T: int) -> bool:
        """Whether a tree's forward over T slots runs the attention kernel with each node's own key layout (the CUDA
        layer kernels, math attention): its chunked sums follow the keys' lanes, so a node reads its path where a
        chain would have it and gets plain decoding's bits (the torch ops and the CPU paths read the tree mask)."""
        return self.layer_ops != "torch" and self._loop is None and self._math(T)

    def _math(self, T: int) -> bool:
        """The math attention (the layer ops') for T tokens, else SDPA."""
        return self.attention == "math" or (self.attention == "auto" and T <= self.max_graph_tokens)

    def _causal_mask(self, positions: torch.Tensor, S: int) -> torch.Tensor:
        """The additive mask [R*T, S] (row r * T + t) of tokens at positions [T] that see every slot up to theirs."""
        visible = self.slots[:S][None, :] <= positions.repeat(self.n_heads // self.n_kv)[:, None]
        return torch.where(visible, self.zero, self.neg_inf)

    def _path_slots(self, tree, start: int, S: int) -> torch.Tensor:
        """int32 [T, S]: the cache slot each tree slot reads as its key n: the context where it is, then its path
        from the root down to itself at start, start + 1, ... (a chain's layout), and slot n past that (masked)."""
        slots = self.slots[:S].to(torch.int32).repeat(tree.N + 1, 1)
        columns = (start + self.slots[:tree.max_depth + 1]).expand(tree.N + 1, -1)  # start may be a device tensor
        return slots.scatter_(1, columns, (start + tree.path_table(self.device)).to(torch.int32))

    @torch.inference_mode()
    def compact(self, kept: torch.Tensor) -> None:
        """Keep only the accepted path of the last tree: kept [B, D+1] cache positions (`DraftTree.kept_slots`, -1
        padded); entry k of each row moves to kept[:, 0] + k and the length ends after the last kept one, so the
        cache holds what a chain forward over the accepted path would have left. Every row must keep the same count."""
        start, index = compaction(kept, self.length)
        n = index.shape[1]
        if (index == index[0]).all():  # one path for every row: move the slots from its first one out of place
            first = next((k for k, slot in enumerate(index[0].tolist()) if slot != start + k), n)
            if first < n:
                src = index[0, first:].to(self.device)
                for kv in self.kv_cache:  # [2, B, n_kv, capacity, D]: k and v of a layer moved together
                    kv[:, :, :, start + first:start + n] = kv.index_select(3, src)  # a new tensor first: no overlap
                self.widened = min(self.widened, start + first)
        else:
            index = index.to(self.device)[None, :, None, :, None].expand(2, self.batch, self.n_kv, n, self.head_dim)
            for kv in self.kv_cache:
                kv[:, :, :, start:start + n] = kv.gather(3, index)
            self.widened = min(self.widened, start)
        self.length = start + n

    @torch.inference_mode()
    def compact_at(self, src: torch.Tensor, start: torch.Tensor) -> None:
        """`compact` inside a captured round: cache slots src [B, n] (device) move to start + 0..n-1 (start [1]),
        every row all n (past a row's accepted path they carry stale slots past the new length, which the next
        forward writes before it reads). The length is the caller's (the round's device count, the host's own)."""
        n, L = src.shape[1], len(self.layers)
        index = src[None, None, :, None, :, None].expand(L, 2, self.batch, self.n_kv, n, self.head_dim)
        # [layers, 2, B, n_kv, capacity, D]: every layer in one gather (a new tensor first, so no overlap)
        self.kv.index_copy_(4, start + self.slots[:n], self.kv.gather(4, index))
        if self.kv.device.type == "cpu":  # the ordered attention's widened keys (`native_loop`) are stale from start:
            self.widened = min(self.widened, int(start))  # the round's own, not the host's count (a round launched
            # ahead runs while the host still counts the round before it at the most it may append)

    def _fit_batch(self, B: int) -> None:
        """Reallocate for B rows when the batch changes, which an empty cache allows."""
        if B != self.batch:
            if self.length:
                raise ValueError(f"batch of {B} rows but the cache holds {self.batch} rows; reset() first")
            self._allocate(B)

    # ------------------------------------------------------------------------------------------------
    # CUDA graphs

    @torch.inference_mode()
    def capture(self, token_counts=range(1, 18), max_context: int | None = None, tree_counts=()) -> int:
        """Capture graphs now for each T in token_counts (and a tree's forward for each T in tree_counts) and every
        bucket up to max_context (default: all).

        Call after reset() or before the first generation: the warm-up forwards write into the cache.
        Returns the number of graphs captured. Without graphs (CPU, use_graphs=False) it does nothing.
        """
        if not self.use_graphs:
            return 0
        if self.length:
            raise ValueError("capture() writes into the cache: call it before generating or after reset()")
        limit = self.capacity if max_context is None else self.bucket(max_context)
        count = 0
        for tree, counts in ((False, token_counts), (True, tree_counts)):
            for T in counts:
                if not 1 <= T <= self.max_graph_tokens:
                    raise ValueError(f"token count {T} outside 1..{self.max_graph_tokens}")
                for S in (S for S in self.buckets if T <= S <= limit):
                    if (T, S, bool(self.aux_layers)) in (self.tree_graphs if tree else self.graphs):
                        continue
                    self.static_pos[:T].copy_(self.slots[S - T:S])
                    if tree:  # any tree of T slots serves: a chain's mask and key slots
                        paths = self._path_slots(DraftTree.chain(T - 1), S - T, S) if self._reads_paths(T) else None
                        self._tree_graph(T, S, self._chain_mask(T, S), paths)
                    else:
                        self._capture(T, S)
                    count += 1
        return count

    def _chain_mask(self, T: int, S: int) -> torch.Tensor:
        """The additive mask [R*T, S] of T tokens at static_pos[:T] (any mask of a tree's shape serves a capture)."""
        self.static_rope[:T].copy_(self.static_pos[:T])
        return self._causal_mask(self.static_pos[:T], S)

    def _capture(self, T: int, S: int):
        """One forward of T tokens over S slots as a graph (the causal mask made inside from the positions)."""
        ids, pos = self.static_ids[:, :T], self.static_pos[:T]
        graph, (out, aux) = self._captured(lambda: self._forward(ids, pos, S, T))  # [B, T, V_model], [B, T, F]
        self.graphs[(T, S, bool(self.aux_layers))] = (graph, out, aux)
        return graph, out, aux

    def _tree_graph(self, T: int, S: int, mask: torch.Tensor, paths: torch.Tensor | None):
        """The graph of a tree's forward over T slots and S cache slots (captured the first time), with `mask` [R*T,
        S] and the nodes' key slots `paths` (`_path_slots`, or None) copied into the buffers it reads: (graph,
        logits, aux)."""
        key = (T, S, bool(self.aux_layers))
        if key not in self.tree_graphs:
            ids, pos, rope = self.static_ids[:, :T], self.static_pos[:T], self.static_rope[:T]
            buffers = (mask.clone(), None if paths is None else paths.clone())
            graph, (out, aux) = self._captured(lambda: self._layers(ids, rope, pos, buffers[0], S, T, buffers[1]))
            self.tree_graphs[key] = (graph, out, aux, buffers)
        graph, out, aux, buffers = self.tree_graphs[key]
        buffers[0].copy_(mask)
        if paths is not None:
            buffers[1].copy_(paths)
        return graph, out, aux

    def _captured(self, run):
        """Warm `run` up on a side stream (it runs on the static inputs as they are), then capture it into the
        shared pool; returns (graph, what run returned)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = run()
        return graph, out

    # ------------------------------------------------------------------------------------------------
    # The transformer

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, S: int, keep: int):
        """ids [B, T] at positions pos [T] (device); attends over cache slots [0, S). Returns logits
        [B, keep, V_model] and, while `aux_layers` is set, the residual streams entering those layers [B, T, F].

        Per layer at T = 1 (B = 1, math attention) this launches 19 ops: norm 2, qkv GEMM 1, rotary 4, cache write 1,
        attention 4 (mask copy + scaled GEMM, softmax, GEMM), o GEMM into the residual 1, norm 2, gate/up GEMM 1,
        SiLU and multiply 2, down GEMM into the residual 1. At T > 1 two reshapes of q and o add a copy each. With
        `layer_ops="triton"` each norm, the rotary with the cache write and q's layout, and SiLU * up are one kernel
        and the attention two (chunks, merge): 10 a layer at any T. `layer_ops="fused"` folds the norms, SiLU * up
        and the residual adds into GEMV products (`_fused_layers`): 7 a layer, and the final norm into the LM head.
        """
        # GQA without repeating K/V: the R query heads of a kv head become R * T query rows (row r * T + t)
        return self._layers(ids, pos, pos, self._causal_mask(pos, S), S, keep)

    def _with_scratch(self, ids, rope, pos, mask, S: int, keep: int):
        """`_layers` with one scratch token more (see `_lone_tail`): at the slot after pos's last, past the cache's
        length (masked from then on), seeing what the last token sees and itself; its outputs are dropped, and the
        real rows compute as in one-token steps."""
        R, T, slot = self.n_heads // self.n_kv, ids.shape[1], int(pos[-1]) + 1
        wide = max(S, self.bucket(slot + 1))
        rows = F.pad(mask.view(R, T, S), (0, wide - S), value=float("-inf"))
        extra = rows[:, -1:].clone()
        extra[..., slot] = 0.0
        mask = torch.cat([rows, extra], dim=1).view(R * (T + 1), wide)
        logits, aux = self._layers(torch.cat([ids, ids[:, -1:]], dim=1), torch.cat([rope, rope[-1:] + 1]),
                                   torch.cat([pos, pos[-1:] + 1]), mask, wide, keep + 1)
        return logits[:, :-1], None if aux is None else aux[:, :-1]

    def _layers(self, ids: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, S: int, keep: int,
                paths: torch.Tensor | None = None):
        """`_forward` under any mask: ids [B, T] rotated at positions rope [T], their K/V written to cache slots
        pos [T], attending over slots [0, S) through the additive mask [R*T, S] (row r * T + t: query head r of
        each kv head, token t). A chain has rope = pos and the causal mask; a tree's slot s has pos = length + s and
        rope = length + its depth, and either the tree's mask or (paths, `_path_slots`) its own key slots under the
        causal mask of its rope position."""
        B, T = ids.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        R = H // KV  # query heads per kv head
        if self.gguf and self.attention != "ordered" and _lone_tail(R * T) and int(pos[-1]) + 1 < self.capacity:
            return self._with_scratch(ids, rope, pos, mask, S, keep)
        x = F.embedding(ids, self.embed).view(B * T, -1)  # [B*T, hidden], the residual stream, updated in place
        cos, sin = self.cos[rope], self.sin[rope]  # [T, D]
        if self._loop is not None:
            x, aux = self._loop(x, cos[:, None], sin[:, None], pos, mask, S, [B, T, H, KV, D], list(self.aux_layers))
            x = x.view(B, T, -1)[:, T - keep:]  # the native LM head quantises float32 rows itself
            x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps) if self.loop == "native" else self._rms_norm(x, self.norm)
            aux = torch.cat(aux, dim=-1).view(B, T, -1) if aux else None
            return linear(x, self.lm_head, self.lm_head_bias), aux
        math = self._math(T)
        if self.layer_ops == "fused":
            return self._fused_layers(x, cos, sin, pos, (mask, paths), S, keep, math, (B, T, H, KV, D))
        columns, folded = self.columns, self.layer_ops == "folded"
        aux = {}  # layer -> the residual stream entering it
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = x.clone()
            # folded: the products run over x itself and the kernels after them scale each row by its 1 / rms
            norm = {"rows": x, "eps": self.eps} if folded else {}
            h = x if folded else self._rms_norm(x, layer.input_norm)
            # q, k, v heads side by side; HF's q * cos + rotate_half(q) * sin (sin carries the sign), k and v into
            # the cache at pos, q as [B, KV, R*T, D]
            q = self.ops.rope_and_cache(layer.qkv(h, columns), cos, sin, pos, self.kv_cache[i], (B, T, H, KV, D),
                                        **norm)
            o = self._attend(q, self.k_cache[i][:, :, :S], self.v_cache[i][:, :, :S], (mask, paths), math,
                             (B, T, H, KV, D))
            _add_linear_(x, o, layer.o, layer.o_bias, columns)
            h = x if folded else self._rms_norm(x, layer.post_norm)
            _add_linear_(x, self.ops.silu_mul(layer.gate_up(h, columns), **norm), layer.down, layer.down_bias,
                         columns)
        x = self._rms_norm(x.view(B, T, -1)[:, T - keep:], self.norm)
        return linear(x, self.lm_head, self.lm_head_bias, columns), self._stacked(aux, B, T)

    def _fused_layers(self, x, cos, sin, pos, seen, S: int, keep: int, math: bool, shape):
        """`_layers`' loop for layer_ops="fused" over the residual stream x [B*T, hidden], 7 kernels a layer: the
        input norm inside the q/k/v product, rotary and cache write, attention (2), the o product adding into x,
        the post norm inside the gate/up product with SiLU * up, the down product adding into x; the final norm runs
        inside the LM head's product. Every kernel computes a token's row on its own (the products' tiles follow
        the weights' shapes, never T), so a verify of T tokens gives the bits of T one-token steps."""
        B, T = shape[:2]
        ops, aux = self.ops, {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = x.clone()
            q = ops.rope_and_cache(ops.norm_linear(x, layer.input_norm, self.eps, layer.qkv.weight), cos, sin, pos,
                                   self.kv_cache[i], shape)
            o = self._attend(q, self.k_cache[i][:, :, :S], self.v_cache[i][:, :, :S], seen, math, shape)
            ops.add_linear_(x, o, layer.o)
            ops.add_linear_(x, ops.norm_gate_up_silu(x, layer.post_norm, self.eps, layer.gate_up.weight), layer.down)
        logits = ops.norm_linear(x.view(B, T, -1)[:, T - keep:], self.norm, self.eps, self.lm_head)
        return logits, self._stacked(aux, B, T)

    def _stacked(self, aux: dict, B: int, T: int) -> torch.Tensor | None:
        """The residual streams entering `aux_layers` (layer -> [B*T, hidden]) side by side, in aux order."""
        return torch.cat([aux[i] for i in self.aux_layers], dim=-1).view(B, T, -1) if aux else None

    def _attend(self, q, k, v, seen, math: bool, shape) -> torch.Tensor:
        """q [B, KV, R*T, D] over k, v [B, KV, S, D] with seen = (the additive mask [R*T, S], the tokens' key slots
        or None) -> o [B*T, H*D] (token-major): HF's eager attention (`layer_ops`) for decode and verify, SDPA
        beyond."""
        mask, paths = seen
        if math:
            return self.ops.attention(q, k, v, mask, self.scaling, shape, paths)
        B, T, H, KV, D = shape
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return o.view(B, KV, H // KV, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm: normalise in float32 (rms_norm upcasts half inputs), round to x's dtype, then scale.
        GGUF weights: the float32 residual stream normalised and scaled in float32, then rounded to bfloat16."""
        if self.gguf:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps).to(self.dtype)
        return self.ops.rms_norm(x, weight, self.eps)


def gguf_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, S: int,
                shape: List[int], eps: float, scaling: float, group: int, weights: List[List[torch.Tensor]],
                kv_cache: List[torch.Tensor], aux_layers: List[int]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """StaticCausalLM's layers on the GGUF path, written for TorchScript: x [B*T, hidden] float32 (updated in place
    and returned) with cos, sin [T, 1, D] at the tokens' rotary positions, their K/V written to cache slots pos [T],
    attending over slots [0, S) through the additive mask [R*T, S]; also the residual streams entering aux_layers
    (in that order). shape = [B, T, H, KV, D]; group: weights per 4-bit group; weights[i] = layer i's input norm, q/k/v packed and scales, o packed
    and scales, post norm, gate/up packed and scales, down packed and scales. The same ops as `_layers`."""
    B, T, H, KV, D = shape[0], shape[1], shape[2], shape[3], shape[4]
    R = H // KV
    hidden = [x.shape[-1]]
    saved: Dict[int, torch.Tensor] = {}
    for i in range(len(weights)):
        w = weights[i]
        if i in aux_layers:
            saved[i] = x.clone()
        h = F.rms_norm(x, hidden, w[0], eps).to(torch.bfloat16)
        qkv = torch.ops.aten._weight_int4pack_mm_for_cpu(h, w[1], group, w[2]).view(B, T, H + 2 * KV, D)
        qk = qkv[:, :, :H + KV]  # one rotary pass for q and k, in place (sin carries rotate_half's sign)
        rot = qk.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)
        qk.mul_(cos).add_(rot.mul_(sin))
        kv_cache[i].index_copy_(3, pos, qkv[:, :, H:].view(B, T, 2, KV, D).permute(2, 0, 3, 1, 4))
        q = qkv[:, :, :H].view(B, T, KV, R, D).permute(0, 2, 3, 1, 4).reshape(B, KV, R * T, D)
        cache = kv_cache[i]
        o = F.scaled_dot_product_attention(q, cache[0, :, :, :S], cache[1, :, :, :S], attn_mask=mask, scale=scaling)
        o = o.view(B, KV, R, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)
        x.add_(torch.ops.aten._weight_int4pack_mm_for_cpu(o, w[3], group, w[4]))
        h = F.rms_norm(x, hidden, w[5], eps).to(torch.bfloat16)
        gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(h, w[6], group, w[7])
        half = gate_up.shape[-1] // 2
        x.add_(torch.ops.aten._weight_int4pack_mm_for_cpu(F.silu(gate_up[:, :half]).mul_(gate_up[:, half:]), w[8], group, w[9]))
    return x, [saved[i] for i in aux_layers]


def _lone_tail(rows: int) -> bool:
    """Whether torch's CPU flash attention would leave one query row alone in its last block: it splits the query
    rows in blocks of 32 (64 from 192 rows, 256 from 768), and a one-row block computes differently. On the GGUF
    path the grouped rows of an 11-token verify (3 x 11 = 33) did: its last token's logits differed from a
    one-token step's in their last bits at about 1 context in 10, which can flip a greedy near-tie (measured:
    gamma 10 with prompt lookup, the summary example). Verify widths stay bit-equal to one-token steps otherwise."""
    block = 256 if rows >= 768 else 64 if rows >= 192 else 32
    return rows > block and rows % block == 1


def _use_columns(columns: bool, x: torch.Tensor) -> bool:
    """Whether a product over the rows of x [..., in] runs as columns: allowed, and at most COLUMNS_MAX_TOKENS rows."""
    return columns and x[..., 0].numel() <= COLUMNS_MAX_TOKENS


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Weight | Int8Weight, bias: torch.Tensor | None = None, columns: bool = False):
    """x [..., in] @ weight.T [in, out] (+ bias). columns=True (for at most COLUMNS_MAX_TOKENS rows) computes it
    as (weight @ x.T).T with at least two columns (one token is duplicated): the same numbers up to rounding,
    through a matrix product instead of a matrix-vector product (see StaticCausalLM's `gemm`). A packed (4-bit or
    int8) weight runs its own kernel (columns do not apply)."""
    if isinstance(weight, PACKED):
        out = weight(x)
        return out if bias is None else out + bias
    if not _use_columns(columns, x):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 1:
        rows = rows.repeat(2, 1)  # a real copy: a stride-0 view takes a slow path
    out = torch.mm(weight, rows.t()).t()[:n]
    out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _add_linear_(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 columns: bool = False) -> torch.Tensor:
    """x += a @ weight.T (+ bias), in place: without a bias (rows) one GEMM reads and writes x (beta = 1)."""
    if bias is None and not isinstance(weight, PACKED) and not _use_columns(columns, a):
        return x.addmm_(a, weight.t())
    return x.add_(linear(a, weight, bias, columns))


# The layer's ops by `layer_ops`: torch's, or kernels.layer_ops' Triton kernels (see StaticCausalLM._forward);
# "fused" adds the GEMV products that `_fused_layers` runs
LAYER_OPS = {"torch": SimpleNamespace(rope_and_cache=layer_ops_kernels.rope_and_cache_torch,
                                      attention=layer_ops_kernels.attention_torch,
                                      silu_mul=layer_ops_kernels.silu_mul_torch,
                                      rms_norm=layer_ops_kernels.rms_norm_torch),
             "triton": SimpleNamespace(rope_and_cache=layer_ops_kernels.rope_and_cache,
                                       attention=layer_ops_kernels.attention,
                                       silu_mul=layer_ops_kernels.silu_mul, rms_norm=layer_ops_kernels.rms_norm)}
LAYER_OPS["folded"] = LAYER_OPS["triton"]  # the same kernels; the loop passes them the rows to scale by
LAYER_OPS["fused"] = SimpleNamespace(**vars(LAYER_OPS["triton"]), norm_linear=layer_ops_kernels.norm_linear,
                                     norm_gate_up_silu=layer_ops_kernels.norm_gate_up_silu,
                                     add_linear_=layer_ops_kernels.add_linear_)


class _Projection:
    """Linear layers applied to one input, outputs side by side [..., sum of out_features].

    fused: one GEMM over a concatenated copy of the weights (and biases; zeros where a layer has none), made once
    here; the HF parameters stay as they are. Unfused: one GEMM per layer on the HF weights, then a cat.
    """

    def __init__(self, linears, fuse: bool):
        self.parts = [(m.weight, m.bias) for m in linears]
        self.weight = self.bias = None
        if fuse:
            with torch.no_grad():
                self.weight = torch.cat([w for w, _ in self.parts])
                if any(b is not None for _, b in self.parts):
                    self.bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in self.parts])

    @classmethod
    def fused(cls, weight: Int4Weight | Q4_1Weight) -> "_Projection":
        """A projection whose weights are fused already (a GGUF file's 4-bit q/k/v or gate/up)."""
        projection = cls([], fuse=False)
        projection.weight = weight
        return projection

    def __call__(self, x: torch.Tensor, columns: bool = False) -> torch.Tensor:
        if self.weight is None:
            return torch.cat([linear(x, w, b, columns) for w, b in self.parts], dim=-1)
        return linear(x, self.weight, self.bias, columns)


class _Layer:
    """One decoder layer's parameters: the HF tensors (biases None where absent) and the q/k/v and gate/up
    projections, fused or not. fold: the fused q/k/v and gate/up copies times the norm weight that feeds them
    (each input column scaled, rounded once to the weights' dtype: layer_ops="folded")."""

    def __init__(self, layer, fuse: bool, fold: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.qkv = _Projection((attn.q_proj, attn.k_proj, attn.v_proj), fuse)
        self.o, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        self.gate_up = _Projection((mlp.gate_proj, mlp.up_proj), fuse)
        self.down, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias
        if fold:
            with torch.no_grad():
                for product, norm in ((self.qkv, self.input_norm), (self.gate_up, self.post_norm)):
                    product.weight = (product.weight.float() * norm.float()).to(product.weight.dtype)

    @classmethod
    def from_gguf(cls, layer, gguf: GGUFFile, i: int, native: bool = False) -> "_Layer":
        """Layer i with its products on the GGUF file's 4-bit weights (packed for the native kernel, else for
        torch's) and its norms in float32 (biases: the Hugging Face layer's, none for Llama)."""
        out = cls.__new__(cls)
        attn, mlp, b = layer.self_attn, layer.mlp, f"blk.{i}."
        if any(m.bias is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)):
            raise ValueError("the GGUF 4-bit path fuses q/k/v and gate/up without biases; this model has biases")
        out.input_norm = layer.input_layernorm.weight.detach().float()
        out.post_norm = layer.post_attention_layernorm.weight.detach().float()
        packed = gguf.q4_1_weight if native else gguf.int4
        out.qkv = _Projection.fused(packed([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]))
        out.o, out.o_bias = packed([b + "attn_output.weight"]), attn.o_proj.bias
        out.gate_up = _Projection.fused(packed([b + "ffn_gate.weight", b + "ffn_up.weight"]))
        out.down, out.down_bias = packed([b + "ffn_down.weight"]), mlp.down_proj.bias
        return out
