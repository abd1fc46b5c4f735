"""An EAGLE-3 style draft head: one decoder layer over the target's own hidden states. It drafts through the
target's tied embedding restricted to a draft vocabulary, and is saved in the EAGLE-3 checkpoint layout
that vLLM and SGLang load.

Slot t of the head pairs the target's features at position t (a learned fusion `fc` of the residual stream
entering three decoder layers: low, middle, high) with the embedding of token t + 1, and predicts token t + 2.
Drafting K tokens after the last verified slot runs the layer K times: the first pass over every newly
verified slot, then K - 1 passes that feed the head's own output (its pre-norm hidden state) back in place
of the target's features. Training ("training-time test", `ttt_forward`) unrolls exactly those K passes.

Checkpoint layout (EAGLE-3, as in vLLM's `Eagle3LlamaForCausalLM` / SGLang's `LlamaForCausalLMEagle3`):
`fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v}_proj.weight` (input 2H), `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight` [draft V, H], `d2t` [draft V]
(target id = draft id + d2t[draft id]) and `t2d` [V] (bool: in the draft vocabulary); no `embed_tokens`
(the target's is shared). Aux layer ids follow vLLM: id i = the residual stream entering decoder layer i,
i.e. Hugging Face's `hidden_states[i]`. The shipped folder leaves `lm_head.weight` out where it is the target's
embedding rows of the draft ids (frozen in training: 85% of the file for a whole-vocabulary head); `load_head`
rebuilds it bit for bit, and `python -m flashspec_core.draft_head export OUT` writes the whole file those engines
load.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashspec_core.fast_path import head_size, linear
from flashspec_core.gguf_weights import Int8Weight, Q4_1Weight, Q8_0Weight, int8_rows, q4_1_rows, q8_0_rows
from kernels import layer_ops

CONFIG_FILE, WEIGHTS_FILE, CARD_FILE = "config.json", "model.safetensors", "card.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # H: the head's width, equal to the target's
    intermediate_size: int  # the MLP's inner width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # D
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary V
    draft_vocab_size: int  # rows of the head's output layer (the most frequent target ids)
    aux_layers: tuple[int, ...]  # residual streams entering these target decoder layers (HF hidden_states[i])
    target_layers: int  # decoder layers of the target, to check the aux ids and the pairing
    max_position_embeddings: int
    draft_temperature: float = 1.0  # sampled drafts draw from softmax(logits / (the target's temperature * this))
    num_layers: int = 1  # decoder layers: the first reads the token and the features, later ones the layer below
    # (more than one: training and teacher-forced evaluation only; the drafters step one-layer heads)

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers!r}")
        if not 0 < self.draft_temperature <= 4:
            raise ValueError(f"draft_temperature must be in (0, 4], got {self.draft_temperature!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if not self.aux_layers or not all(0 <= i < self.target_layers for i in self.aux_layers):
            raise ValueError(f"aux_layers {list(self.aux_layers)} must be decoder layer ids in 0..{self.target_layers - 1}")

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.hidden_size

    @classmethod
    def for_target(cls, config, draft_vocab_size: int, aux_layers=None) -> "HeadConfig":
        """A head as wide as the target (a Hugging Face Llama-family config); aux layers default to vLLM's and
        SGLang's choice for EAGLE-3, (2, L // 2, L - 3)."""
        L = config.num_hidden_layers
        aux = tuple(aux_layers) if aux_layers is not None else (min(2, L - 1), L // 2, max(0, L - 3))
        rope = dict(getattr(config, "rope_parameters", None) or {})
        return cls(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                   head_dim=head_size(config),
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(rope.get("rope_theta", 10000.0)),
                   vocab_size=config.vocab_size, draft_vocab_size=int(draft_vocab_size), aux_layers=aux,
                   target_layers=L, max_position_embeddings=int(config.max_position_embeddings))


class _Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, inputs: int = 2):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(inputs * H, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(inputs * H, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(inputs * H, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)  # on the fused features (or the head's own output)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)


class _LaterLayer(nn.Module):
    """A plain Llama decoder layer over the layer below's output; it starts as the identity (its attention's and
    MLP's output products zero), so a head grown from a trained one computes what that one did."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg, inputs=1)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)
        nn.init.zeros_(self.self_attn.o_proj.weight)
        nn.init.zeros_(self.mlp.down_proj.weight)


class DraftHead(nn.Module):
    """The head's parameters and its two forwards: `step` (inference, through a `HeadCache`) and `ttt_forward`
    (training). `embed` is the target's input embedding [V, H], shared, never saved with the head."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_size, H, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.later_layers = nn.ModuleList(_LaterLayer(cfg) for _ in range(cfg.num_layers - 1))
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # rows of the target's tied embedding, frozen
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed = embed.detach()  # the target's (shared storage); not a parameter, not in the state dict
        self.columns = False  # inference on the CPU: "columns" products for a few tokens (see fast_path.linear)
        # inference only: products through packed weights (`pack`)
        self.packed: dict[str, Int8Weight | Q4_1Weight | Q8_0Weight] = {}
        self.native_layer: list[torch.Tensor] | None = None  # the native layer's weights, where `pack` set it up
        self._rope = torch.empty(2, 0, cfg.head_dim)  # the native layer's cos and signed sin by position (grown on use)
        self.layer_ops = "auto"  # a captured step's small ops: "torch", "triton" (kernels.layer_ops) or "auto" (`_kernels`)
        self._table: torch.Tensor | None = None  # cos and signed sin by slot, for the kernels (`_rope_table`)
        self._joined_key, self._joined_weights = None, {}  # the kernels' step's stacked weights (`_joined`)
        D = cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # -- vocabulary --------------------------------------------------------------------------------
    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [draft V]: the target id of each draft id; lm_head becomes those rows of the target's
        embedding (the tied output layer of the target), d2t/t2d the EAGLE-3 maps."""
        ids = draft_ids.to(torch.int64).to(self.d2t.device)
        if ids.numel() != self.cfg.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.cfg.draft_vocab_size} distinct draft ids, got {ids.numel()}")
        self.unpack()
        with torch.no_grad():
            self.lm_head.weight.copy_(embedding_rows(self.embed, ids, self.lm_head.weight.dtype))
            self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft V] target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    # -- the layer, in pieces shared by both forwards -----------------------------------------------
    def pack(self, native: bool) -> None:
        """Run every product (the output layer included) through packed weights, for inference on the CPU: Q8_0
        blocks for the native kernel (`csrc/q4_1.cpp`; float32 or bfloat16 activations) where native, with the
        output layer's rows as Q4_1 blocks (20 bytes a block, not 34: that product only streams its weights), else
        int8 with one scale per row (torch's `_weight_int8pack_mm`, bfloat16 only, about half as fast). q, k and v
        are one product, gate and up another. A drafter need not be exact: verification keeps the output exact. Training
        ignores it; `set_draft_vocab` drops it. Native packing of a float32 head on the CPU also runs the whole
        layer as one native op (`_native_step`)."""
        self.check_one_layer()
        if not native and next(self.parameters()).dtype != torch.bfloat16:
            raise ValueError("int8 rows take bfloat16 activations: load the head in torch.bfloat16")
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        make = q8_0_rows if native else int8_rows
        self.packed = {name: make(torch.cat([m.weight.detach() for m in layers])) for name, layers in
                       {"fc": [self.fc], "qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
                        "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}.items()}
        out = self.lm_head.weight.detach()
        self.packed["lm_head"] = q4_1_rows(out) if native and out.shape[0] % 16 == 0 else make(out)
        self.native_layer = self._native_weights() if native else None

    def unpack(self) -> None:
        """Back to the float products (drops what `pack` made)."""
        self.packed, self.native_layer = {}, None

    def _native_weights(self) -> list[torch.Tensor] | None:
        """The native layer's 11 weights (csrc `head_layer`), or None where it cannot run this head: float32 on the
        CPU, head_dim a multiple of 16 up to 128, every product's rows a multiple of 16."""
        layer, p = self.midlayer, self.packed
        shapes_fit = self.cfg.head_dim % 16 == 0 and self.cfg.head_dim <= 128 and all(
            p[n].shape[0] % 16 == 0 for n in ("qkv", "o", "gate_up", "down"))
        if not shapes_fit or next(self.parameters()).dtype != torch.float32 or self.embed.device.type != "cpu":
            return None
        norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm]
        w = [n.weight.detach().contiguous() for n in norms]
        return [w[0], w[1], p["qkv"].packed, p["qkv"].scales, p["o"].packed, p["o"].scales, w[2], p["gate_up"].packed,
                p["gate_up"].scales, p["down"].packed, p["down"].scales]

    def _product(self, name: str, x: torch.Tensor, *layers: nn.Linear):
        """x through `layers` (one input, outputs apart): the packed product `name` where packed, in x's dtype."""
        packed = self.packed.get(name)
        if packed is None:
            outs = [linear(x, m.weight, None, self.columns) for m in layers]
            return outs if len(layers) > 1 else outs[0]
        out = packed(x).to(x.dtype)
        return out.split([m.out_features for m in layers], dim=-1) if len(layers) > 1 else out

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's aux features [..., F] -> the head's hidden size [..., H] (`fc`)."""
        return self._product("fc", features, self.fc)

    def _rotary(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D] (or [B, 1, T, D] for per-row positions [B, T]) at positions pos [T] (or [B, T])."""
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq  # [(B,) T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        return (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [B, heads, T, D] (`_rotary`'s cos and sin)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """tokens [B, T], hidden [B, T, H] -> q [B, nh, T, D], k and v [B, nkv, T, D] (rotated)."""
        layer = self.midlayer
        e = F.embedding(tokens, self.embed).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        attn = layer.self_attn
        return self._rotated_heads(*self._product("qkv", x, attn.q_proj, attn.k_proj, attn.v_proj), pos)

    def _later_qkv(self, layer: _LaterLayer, hidden: torch.Tensor, pos: torch.Tensor):
        """`_qkv` of a later layer: its input is the layer below's output [B, T, H] alone."""
        attn, x = layer.self_attn, layer.input_layernorm(hidden)
        return self._rotated_heads(*(linear(x, m.weight, None, self.columns) for m in
                                     (attn.q_proj, attn.k_proj, attn.v_proj)), pos)

    def _rotated_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """q [B, T, nh * D], k and v [B, T, nkv * D] -> q [B, nh, T, D], k and v [B, nkv, T, D], q and k rotated."""
        cfg = self.cfg
        B, T, _ = q.shape
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = self._rotary(pos, q.dtype)  # once for q and k
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _finish(self, hidden: torch.Tensor, attended: torch.Tensor, layer: nn.Module | None = None) -> torch.Tensor:
        """The residual update after attention: hidden [B, T, H] (the un-normed input), attended [B, nh, T, D]
        -> the layer's pre-norm output [B, T, H] (what the next draft step reads as its hidden state). layer: the
        midlayer (default; its products packed where `pack` packed them) or a later one."""
        B, _, T, _ = attended.shape
        layer = self.midlayer if layer is None else layer
        h = hidden + self._product("o", attended.transpose(1, 2).reshape(B, T, -1), layer.self_attn.o_proj)
        mlp, x = layer.mlp, layer.post_attention_layernorm(h)
        gate, up = self._product("gate_up", x, mlp.gate_proj, mlp.up_proj)
        return h + self._product("down", F.silu(gate) * up, mlp.down_proj)

    def logits(self, h: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """Pre-norm output [..., H] -> logits over the draft vocabulary [..., draft V], or over its first
        `limit` ids (the most frequent ones, for a cheaper step)."""
        packed = self.packed.get("lm_head")
        if packed is not None:
            return packed.first(limit)(self.norm(h))
        normed = layer_ops.rms_norm(h, self.norm.weight, self.norm.eps) if self.uses_kernels(h) else self.norm(h)
        return linear(normed, self.lm_head.weight[:limit], None, self.columns)

    # -- inference ----------------------------------------------------------------------------------
    def step(self, cache: "HeadCache", tokens: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append T slots to the cache: tokens [B, T] (token t + 1 of each slot) and hidden [B, T, H] (fused
        features, or the head's own last output); returns the pre-norm outputs [B, T, H].

        By default slot s of the cache sits at position s and the new slots see every cached slot and each other
        causally (a chain). A tree level passes its own: positions [T] int64 (a node's depth past the verified
        slots) and mask [T, length + T] bool, True where a new slot may attend (the cached slots, then the new
        ones): the verified slots, the node's ancestors and itself."""
        self.check_one_layer()
        T = tokens.shape[1]
        start = cache.length
        if mask is not None and tuple(mask.shape) != (T, start + T):
            raise ValueError(f"mask must be [T, length + T] = [{T}, {start + T}], got {tuple(mask.shape)}")
        if self.native_layer is not None and (positions is None or positions.dim() == 1):
            return self._native_step(cache, tokens, hidden, positions, mask)
        slots = torch.arange(start, start + T, device=tokens.device)
        q, k, v = self._qkv(tokens, hidden, slots if positions is None else positions)
        keys, values = cache.append(k, v)
        if mask is None and T > 1:  # causal among the new slots; every cached slot is visible
            mask = torch.arange(start + T, device=q.device)[None, :] <= slots[:, None]  # [T, start + T]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self._finish(hidden, attended)

    def _native_step(self, cache: "HeadCache", tokens: torch.Tensor, hidden: torch.Tensor,
                     positions: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """`step` as one native op (Q8_0 products, float32, attention over each slot's visible keys in slot order:
        a tree level gives its nodes the bits of a chain over their paths, and slots stepped together the bits of
        slots stepped one at a time)."""
        B, T = tokens.shape
        cfg, start = self.cfg, cache.length
        cache.reserve(start + T)
        slots = cache.slots[start:start + T]
        if mask is None:  # every cached slot, and the new ones causally
            mask = cache.slots[:start + T][None, :] <= slots[:, None]
        e = F.embedding(tokens, self.embed).view(B * T, -1).float()
        out = torch.ops.flashspec.head_layer(
            e, hidden.reshape(B * T, -1).float().contiguous(), self._rope_at(slots if positions is None else positions),
            slots, mask.to(torch.uint8), [B, T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim], cfg.rms_norm_eps,
            cfg.head_dim ** -0.5, self.native_layer, [cache.k, cache.v])
        cache.length = start + T
        return out.view(B, T, -1)

    def _rope_at(self, pos: torch.Tensor) -> torch.Tensor:
        """[2, T, D] float32: cos and the signed sin (rotate_half's sign on the first half) at positions pos [T]."""
        if self._rope.shape[1] <= int(pos.max()):
            cos, sin = self._rotary(torch.arange(max(2 * int(pos.max()) + 2, 256)), torch.float32)
            half = self.cfg.head_dim // 2
            self._rope = torch.stack([cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)])
        return self._rope[:, pos].contiguous()

    def step_at(self, cache: "HeadCache", tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                S: int) -> torch.Tensor:
        """`step` for a captured round: fixed shapes, no host reads. Slots pos [T] (a device tensor, a chain:
        pos[t] = pos[0] + t) are written in place and attend to the cache's first S slots at positions <= their own
        (the verified slots, earlier new slots, and nothing stale: every slot below a query's position is current).
        The cache's `length` (a host count) is left to the caller."""
        self.check_one_layer()
        if self.uses_kernels(hidden):
            return self._step_kernels(cache, tokens, hidden, pos, pos, cache.slots[:S][None, :] <= pos[:, None])
        q, k, v = self._qkv(tokens, hidden, pos)
        keys, values = cache.write_at(k, v, pos, S)
        mask = cache.slots[:S][None, :] <= pos[:, None]  # [T, S]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self._finish(hidden, attended)

    def step_tree_at(self, cache: "HeadCache", tokens: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor,
                     rope: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A tree level for a captured round: T new slots written at cache slots [T] (device), rotated at rope [T],
        each attending where mask [T, S] (bool, over the cache's first S slots) allows: the verified slots, its
        ancestors and itself. Fixed shapes, no host reads (a draft's bits need not be a chain's)."""
        self.check_one_layer()
        if self.uses_kernels(hidden):
            return self._step_kernels(cache, tokens, hidden, slots, rope, mask)
        q, k, v = self._qkv(tokens, hidden, rope)
        keys, values = cache.write_at(k, v, slots, mask.shape[1])
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self._finish(hidden, attended)

    def check_one_layer(self) -> None:
        """The drafting steps (and `pack`) run the midlayer alone: a head with later layers is for training and
        teacher-forced evaluation (`ttt_forward`) only."""
        if self.later_layers:
            raise ValueError(f"this draft head has {self.cfg.num_layers} decoder layers; drafting runs one-layer "
                             "heads only (more layers: training and teacher-forced evaluation)")

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether the captured step, the logits' norm and a captured tree's levels (`kernels.tree_level`) run Triton
        kernels (`kernels.layer_ops`' for the step; "auto": as the target chooses, `layer_ops.auto`; "folded" and
        "fused" run the same small kernels here, the head's own norms and products as they are)."""
        cfg = self.cfg
        ops = self.layer_ops if self.layer_ops != "auto" else \
            layer_ops.auto(x.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return ops in ("triton", "folded", "fused")

    def _step_kernels(self, cache: "HeadCache", tokens: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor,
                      rope: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`step_at` and `step_tree_at` with the norms, the rotary and cache write, the attention and SiLU * up as
        Triton kernels (the target's `layer_ops`; the rotary's bits are `_rotate`'s, the rest within a rounding of
        the torch ops); the products stay torch's, one GEMM each (`_joined_product`: q, k, v as one, gate, up as one,
        the residuals added inside the o and down GEMMs). Tokens go to cache slots [T] at rotary positions rope [T] and
        read the cache's first S slots where visible [T, S] (bool) allows."""
        layer, cfg = self.midlayer, self.cfg
        (B, T), H, KV, D = tokens.shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shape = (B, T, H, KV, D)
        same = self.embed.dtype == hidden.dtype  # the kernel reads the tokens' embedding rows itself
        e, rows = (self.embed, tokens) if same else (F.embedding(tokens, self.embed).to(hidden.dtype), None)
        x = layer_ops.rms_norm_pair(e, layer.input_layernorm.weight, hidden, layer.hidden_norm.weight,
                                    cfg.rms_norm_eps, a_rows=rows)  # [B, T, 2H]: both norms side by side, one kernel
        qkv = self._joined_product("qkv", x.view(B * T, -1))
        table = self._rope_table(cache.k.shape[2], x.dtype, x.device)  # cos, sin rows read at `rope` in the kernel
        q = layer_ops.rope_and_cache(qkv, table[0], table[1], slots, cache.kv, shape, at=rope)
        S = visible.shape[1]
        o = layer_ops.attention(q, cache.k[:, :, :S], cache.v[:, :, :S], visible, D ** -0.5, shape)
        h = self._joined_product("o", o, hidden.reshape(B * T, -1))
        both = self._joined_product("gate_up", layer_ops.rms_norm(h, layer.post_attention_layernorm.weight,
                                                                  cfg.rms_norm_eps))
        # h is this step's own tensor: the down GEMM adds into it in place (one device copy less a step)
        return self._joined_product("down", layer_ops.silu_mul(both), h, own=not h.requires_grad).view(B, T, -1)

    def _joined_product(self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None,
                        own: bool = False) -> torch.Tensor:
        """x [M, in] through product `name` (q, k, v as one; gate, up as one) plus residual [M, out] if given, in
        as few kernels as the weights allow: a float weight adds the residual in its GEMM (beta = 1). own: the
        residual is the caller's to overwrite, so the sum lands in it (`addmm_`: no copy of it first)."""
        packed = self.packed.get(name)
        if packed is not None:
            out = packed(x).to(x.dtype)
            if residual is None:
                return out
            return residual.add_(out) if own else residual + out
        weight = self._joined()[name]
        if residual is None:
            return F.linear(x, weight)
        return residual.addmm_(x, weight.t()) if own else torch.addmm(residual, x, weight.t())

    def _joined(self) -> dict[str, torch.Tensor]:
        """The captured step's float weights, one a product (q, k, v stacked; gate, up stacked), remade when a
        weight changes; the modules keep the EAGLE-3 layout that is saved and trained."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        groups = {"qkv": (attn.q_proj, attn.k_proj, attn.v_proj), "o": (attn.o_proj,),
                  "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}
        key = tuple((m.weight.data_ptr(), m.weight._version) for ms in groups.values() for m in ms)
        if self._joined_key != key:
            self._joined_weights = {n: torch.cat([m.weight.detach() for m in ms]) for n, ms in groups.items()}
            self._joined_key = key
        return self._joined_weights

    def _rope_table(self, slots: int, dtype: torch.dtype, device) -> torch.Tensor:
        """[2, slots, D] in dtype: cos and the signed sin (rotate_half's sign on the first half), made once per
        cache size: `_rotary`'s values at every slot."""
        table = self._table
        if table is None or table.shape[1] < slots or table.dtype != dtype or table.device != device:
            cos, sin = self._rotary(torch.arange(slots, device=device), dtype)
            half = self.cfg.head_dim // 2
            self._table = table = torch.stack([cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)])
        return table

    # -- training -----------------------------------------------------------------------------------
    def ttt_forward(self, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: the K = steps draft passes of inference, for every slot at once.

        features [B, T, F] are the target's aux hidden states, ids [B, T] the tokens. Pass j at slot t reads
        token t + 1 + j and (j = 0) the fused features of position t or (j > 0) its own pass j - 1 output, sits
        at position t + j, and attends to the pass-0 slots up to t plus its own earlier passes at slot t,
        exactly what the head's cache holds when it drafts j tokens past verified slot t. Returns each pass's
        pre-norm output [B, T, H]; pass j at slot t predicts token t + 2 + j (ids past the end read as 0).
        """
        B, T = ids.shape
        hidden = self.fuse(features)
        slots = torch.arange(T, device=ids.device)
        causal = slots[None, :] <= slots[:, None]  # [T, T]
        keys, values = [[] for _ in range(self.cfg.num_layers)], [[] for _ in range(self.cfg.num_layers)]
        outs = []
        for j in range(steps):
            tokens = F.pad(ids[:, 1 + j:], (0, 1 + j))  # token t + 1 + j at slot t
            h = hidden
            for i, layer in enumerate([self.midlayer, *self.later_layers]):
                q, k, v = self._qkv(tokens, h, slots + j) if i == 0 else self._later_qkv(layer, h, slots + j)
                keys[i].append(k)
                values[i].append(v)
                h = self._finish(h, _ttt_attention(q, keys[i], values[i], causal), layer)
            hidden = h
            outs.append(hidden)
        return outs


def _ttt_attention(q, keys, values, causal) -> torch.Tensor:
    """q [B, nh, T, D]; keys/values: one [B, nkv, T, D] per pass so far. Slot t attends to pass-0 slots <= t
    (causal) and to its own slot in every later pass (a diagonal), under one softmax."""
    rep = q.shape[1] // keys[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)
    scores = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * k.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [B, nh, T, 1]
    probs = torch.cat([scores, *diag], dim=-1).softmax(dim=-1)
    T = scores.shape[-1]
    out = probs[..., :T] @ v0
    for i, v in enumerate(values[1:]):
        out = out + probs[..., T + i:T + i + 1] * v.repeat_interleave(rep, 1)
    return out


class HeadCache:
    """The head's KV cache for B rows: slots [0, length) are valid; rolling back moves `length`."""

    def __init__(self, cfg: HeadConfig, batch: int, capacity: int, device, dtype):
        self.kv = torch.zeros((2, batch, cfg.num_kv_heads, capacity, cfg.head_dim), device=device, dtype=dtype)
        self.k, self.v = self.kv[0], self.kv[1]  # views: the kernels write both through kv
        self.slots = torch.arange(capacity, device=device)  # slot positions (a captured step's mask)
        self.length = 0

    def reserve(self, end: int) -> None:
        """Room for slots [0, end) (doubling the buffers when full)."""
        if end > self.k.shape[2]:
            more = max(end, 2 * self.k.shape[2]) - self.k.shape[2]
            self.kv = F.pad(self.kv, (0, 0, 0, more))
            self.k, self.v = self.kv[0], self.kv[1]
            self.slots = torch.arange(self.k.shape[2], device=self.k.device)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, nkv, T, D] after the valid slots (doubling the buffers when full); return the keys
        and values of all valid slots."""
        end = self.length + k.shape[2]
        self.reserve(end)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def write_at(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, S: int):
        """Write k, v [B, nkv, T, D] at the slots pos [T] (a device tensor; the buffers never grow here, so a
        captured step keeps its addresses); return the keys and values of the first S slots."""
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k[:, :, :S], self.v[:, :, :S]

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(0, length))


# ----------------------------------------------------------------------------------------------------
# Saving and loading (EAGLE-3 layout)


def eagle3_config(cfg: HeadConfig) -> dict:
    """config.json as vLLM and SGLang read an EAGLE-3 draft: a one-layer Llama with draft_vocab_size and the
    target's aux layer ids (top level: vLLM's key, same meaning; SGLang's default for these ids is the same
    layers, so `eagle_config` names none), plus the FlashSpec fields needed to rebuild `HeadConfig`."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "eagle_config": {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True},
        "flashspec": {k: v for k, v in {**asdict(cfg), "aux_layers": list(cfg.aux_layers)}.items()
                      if k != "num_layers"},  # num_hidden_layers says it
    }


def save_head(head: DraftHead, folder: Path, card: dict | None = None, dtype=torch.bfloat16,
              full: bool = False) -> Path:
    """Write config.json, model.safetensors (EAGLE-3 names, float weights in `dtype`) and card.json. full=False leaves
    `lm_head.weight` out where it equals the target's embedding rows of the draft ids in `dtype` (`load_head`
    rebuilds them); full=True writes it always (the file vLLM and SGLang load)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
               for n, t in head.state_dict().items()}
    if not full and torch.equal(tensors[LM_HEAD], embedding_rows(head.embed, head.draft_ids, dtype).cpu()):
        del tensors[LM_HEAD]
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(eagle3_config(head.cfg), indent=2) + "\n")
    if card is not None:
        (folder / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    return folder


def embedding_rows(embed: torch.Tensor, draft_ids: torch.Tensor, dtype) -> torch.Tensor:
    """The output layer a head gets from the target: the embedding's rows of its draft ids, rounded to `dtype`."""
    return embed.detach()[draft_ids.to(embed.device)].to(dtype)


class HeadMismatchError(ValueError):
    """A head file that is missing, malformed, or made for another target."""


def load_head(folder: Path, target_config, embed: torch.Tensor, device=None, dtype=torch.float32) -> DraftHead:
    """Load a head saved by `save_head` for a target with this config and input embedding [V, H].
    Raises HeadMismatchError with a short reason for a missing, malformed or mismatched file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
        fields = dict(raw["flashspec"])
        cfg = HeadConfig(**{**fields, "aux_layers": tuple(fields["aux_layers"]),
                            "num_layers": int(raw.get("num_hidden_layers", 1))})
        weights = load_file(str(folder / WEIGHTS_FILE))
    except FileNotFoundError as e:  # safetensors' own error carries no file name
        name = Path(e.filename).name if e.filename else WEIGHTS_FILE
        raise HeadMismatchError(f"draft head file missing: {name} in {folder.name}/") from None
    except (KeyError, TypeError, ValueError, json.JSONDecodeError, SafetensorError) as e:
        raise HeadMismatchError(f"draft head in {folder.name}/ is malformed: {e}") from None
    expected = (target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers)
    if (cfg.hidden_size, cfg.vocab_size, cfg.target_layers) != expected or tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise HeadMismatchError(f"draft head in {folder.name}/ was made for a target with hidden size, vocabulary "
                                f"and layers {(cfg.hidden_size, cfg.vocab_size, cfg.target_layers)}; this target has "
                                f"{expected}")
    head = DraftHead(cfg, embed)
    missing, unexpected = head.load_state_dict(weights, strict=False)
    if missing == [LM_HEAD]:  # left out by `save_head`: the embedding's rows, as saved
        stored = next(t.dtype for t in weights.values() if t.is_floating_point())
        with torch.no_grad():
            head.lm_head.weight.copy_(embedding_rows(embed, head.draft_ids, stored))
        missing = []
    if missing or unexpected:
        raise HeadMismatchError(f"draft head in {folder.name}/ does not match its config: missing {missing[:3]}, "
                                f"unexpected {unexpected[:3]}")
    inv_freq = head.inv_freq  # rotary frequencies stay float32 whatever the weights' dtype
    head = head.to(device=device or embed.device, dtype=dtype).eval()
    head.inv_freq = inv_freq.to(head.inv_freq.device)
    return head


def export_eagle3(out: Path, target: str = "embedded", folder: Path | None = None) -> Path:
    """The shipped head of `target` (or the head in `folder`) as the whole EAGLE-3 file, lm_head included: the folder
    vLLM and SGLang load beside the target."""
    from flashspec_core.engine import HEADS
    from flashspec_core.models import load_model

    folder = Path(folder or HEADS[target].folder)
    model, _ = load_model(target, torch.device("cpu"), torch.float32)
    head = load_head(folder, model.config, model.get_input_embeddings().weight)
    card = json.loads((folder / CARD_FILE).read_text()) if (folder / CARD_FILE).exists() else None
    return save_head(head, out, card, full=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flashspec_core.draft_head",
                                 description="export OUT: the shipped draft head as the whole EAGLE-3 file (lm_head "
                                             "included) that vLLM and SGLang load")
    ap.add_argument("command", choices=["export"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--head", type=Path, default=None, help="a head folder for that target (default: the shipped one)")
    args = ap.parse_args()
    print(export_eagle3(args.out, args.target, args.head))
