"""The CUDA layer's small ops as Triton kernels, each beside the PyTorch it replaces (`StaticCausalLM(layer_ops=)`).

    rope_and_cache(qkv, cos, sin, pos, kv, shape) -> q   rotary on q and k, k and v written into the cache at
                                                           `pos`, q laid out for attention: one kernel for six
    silu_mul(gate_up) -> silu(gate) * up                   one kernel for two
    rms_norm(x, weight, eps)                               HF's RMSNorm (float32, round, scale): one for two

A one-token step of a small model is bound by how many kernels it launches (about 19 a layer, ~2 us each inside a
CUDA graph), not by its weights; these take a layer to about 11. Every kernel treats each token on its own, so a
verify of K tokens computes each token exactly as a one-token step does. The roundings are the torch ops': the
rotary rounds x * cos and the swapped half * sin to the activations' dtype before their sum, as the in-place torch
ops do, and the tests check the kernels bit for bit (rotary, cache, layout) or within a rounding (silu, the norm's
sum order) under TRITON_INTERPRET=1 and on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references still run
    triton = None


# ----------------------------------------------------------------------------------------------------
# References (what the layer loop runs without the kernels)


def rope_and_cache_torch(qkv, cos, sin, pos, kv, shape) -> torch.Tensor:
    """qkv [B*T, (H + 2 KV) * D]; cos, sin [T, D] (sin signed: rotate_half up to sign); pos [T] cache slots; kv the
    layer's cache [2, B, KV, capacity, D]; shape (B, T, H, KV, D). Rotates q and k in place, writes k and v at
    `pos`, returns q as [B, KV, R * T, D] (row r * T + t: query head r of each kv head, token t)."""
    B, T, H, KV, D = shape
    R = H // KV
    qkv = qkv.view(B, T, H + 2 * KV, D)
    qk = qkv[:, :, :H + KV]
    rot = qk.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)  # halves swapped (a copy)
    qk.mul_(cos[:, None]).add_(rot.mul_(sin[:, None]))
    kv.index_copy_(3, pos, qkv[:, :, H:].view(B, T, 2, KV, D).permute(2, 0, 3, 1, 4))
    return qkv[:, :, :H].view(B, T, KV, R, D).permute(0, 2, 3, 1, 4).reshape(B, KV, R * T, D)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


# ----------------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _round(x, dt: tl.constexpr):
        """float32 x rounded to dt's precision, to nearest even, kept in float32 (bfloat16 by its bits: Triton's
        interpreter truncates when it converts to bfloat16, the GPU rounds; this is the same on both)."""
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dt).to(tl.float32)

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, kv_ptr, q_ptr, T, capacity,
                           B: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr):
        """One program per (token, head) of qkv: rotate (q, k), then store into q's layout or the cache."""
        row, head = tl.program_id(0), tl.program_id(1)
        b, t = row // T, row % T
        d = tl.arange(0, D)
        src = qkv_ptr + (row * (H + 2 * KV) + head) * D
        x = tl.load(src + d)
        partner = tl.load(src + (d + D // 2) % D).to(tl.float32)
        c, s = tl.load(cos_ptr + t * D + d).to(tl.float32), tl.load(sin_ptr + t * D + d).to(tl.float32)
        dt = x.dtype
        turned = _round(_round(x.to(tl.float32) * c, dt) + _round(partner * s, dt), dt).to(dt)
        slot = tl.load(pos_ptr + t)
        kind = (head - H) // KV  # 0: k, 1: v (for q heads negative)
        kvh = (head - H) % KV
        cache_at = kv_ptr + (((kind * B + b) * KV + kvh) * capacity + slot) * D
        q_at = q_ptr + ((b * H + head) * T + t) * D  # [B, KV, R*T, D] is [B, H, T, D]: head h = kv head h // R
        dst = tl.where(head < H, q_at, cache_at)
        tl.store(dst + d, tl.where(head < H + KV, turned, x))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
        row, blk = tl.program_id(0), tl.program_id(1)
        i = blk * BLOCK + tl.arange(0, BLOCK)
        keep = i < I
        g = tl.load(gu_ptr + row * 2 * I + i, mask=keep, other=0.0)
        u = tl.load(gu_ptr + row * 2 * I + I + i, mask=keep, other=0.0).to(tl.float32)
        dt = g.dtype
        gf = g.to(tl.float32)
        silu = _round(gf / (1.0 + tl.exp(-gf)), dt)
        tl.store(out_ptr + row * I + i, _round(silu * u, dt).to(dt), mask=keep)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        n = tl.arange(0, BLOCK)
        keep = n < N
        x = tl.load(x_ptr + row * N + n, mask=keep, other=0.0)
        dt = x.dtype
        xf = x.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = _round(xf * scale, dt)
        w = tl.load(w_ptr + n, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + n, _round(w * normed, dt).to(dt), mask=keep)


def rope_and_cache(qkv, cos, sin, pos, kv, shape) -> torch.Tensor:
    """`rope_and_cache_torch` in one kernel (qkv is left as it was; only q's layout and the cache are written)."""
    B, T, H, KV, D = shape
    q = torch.empty(B, KV, (H // KV) * T, D, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(B * T, H + 2 * KV)](qkv.contiguous(), cos.contiguous(), sin.contiguous(), pos, kv, q, T,
                                            kv.shape[3],
                                            B=B, H=H, KV=KV, D=D)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, I = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()  # a no-op for the projections' own outputs
    out = torch.empty(rows, I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(rows, triton.cdiv(I, BLOCK))](gate_up, out, I, BLOCK=BLOCK)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    rows = x.reshape(-1, N)  # a copy only where x is a strided view (the final norm's kept rows)
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, N, eps, BLOCK=triton.next_power_of_2(N))
    return out.view(x.shape)
