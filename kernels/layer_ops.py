"""The CUDA layer's small ops as Triton kernels, each beside the PyTorch it replaces (`StaticCausalLM(layer_ops=)`).

    rope_and_cache(qkv, cos, sin, pos, kv, shape) -> q   rotary on q and k, k and v written into the cache at
                                                           `pos`, q laid out for attention: one kernel for six
                                                           (`at=`: cos, sin as tables read at rows `at`, no gather)
    attention(q, k, v, mask, scaling, shape) -> o          masked attention (softmaxes over chunks of keys, merged),
                                                           o laid out for the o projection: two for four (five at
                                                           T > 1)
    silu_mul(gate_up) -> silu(gate) * up                   one kernel for two
    rope_and_cache(..., rows=x, eps=)                      the same with qkv a product over x's raw rows, each row
                                                           first scaled by x's 1 / rms (the norm's weight folded
                                                           into the product's: layer_ops="folded")
    silu_mul(gate_up, rows=x, eps=)                        likewise
    rms_norm(x, weight, eps)                               HF's RMSNorm (float32, round, scale): one for two
    rms_norm_pair(a, wa, b, wb, eps)                       [rms_norm(a) | rms_norm(b)]: one for two (`a_rows=`:
                                                           side 0 from a table's rows: the head's embedding gather)
    norm_linear(x, norm_weight, eps, weight)               rms_norm(x) @ weight.T (q/k/v, the LM head): one for two
    norm_gate_up_silu(x, norm_weight, eps, weight)         silu(g) * u of [g | u] = rms_norm(x) @ weight.T: one for
                                                           three
    add_linear_(x, a, weight)                              x += a @ weight.T (o, down): one for one

A one-token step of a small model is bound by how many kernels it launches (about 19 a layer, ~2 us each inside a
CUDA graph), not by its weights; the small ops take a layer to 10 (4 of them cuBLAS's products), the norms folded
into the products to 8 (layer_ops="folded"), the three GEMV products (layer_ops="fused") to 7. Every kernel here
treats each token on its own, so in a verify of K tokens it computes each token as a one-token step does
(cuBLAS's products are not bound to: they may pick other kernels for other widths; the GEMV kernels split a
product by its weight's shape only). The roundings are the torch ops' (the folded scale adds one rounding of the
products' outputs): the rotary rounds x * cos and the swapped half * sin to the activations' dtype before their
sum, as the in-place torch ops do (and runs without fused multiply-adds, which the GPU's compiler would otherwise form),
and the tests check the kernels bit for bit (rotary, cache, layout) or within a rounding (the norm's sum order,
silu, the attention's softmax) under TRITON_INTERPRET=1 and on a GPU.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references still run
    triton = None


# ----------------------------------------------------------------------------------------------------
# References (what the layer loop runs without the kernels)


def scaled_rows_torch(y: torch.Tensor, x: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y [M, N] with each row times its row of x's RMSNorm scale, 1 / sqrt(mean(x^2) + eps) in float32, rounded to
    y's dtype: a product over x's raw rows with the norm's weight folded into its own (layer_ops="folded") made
    the product over the normed rows. x None: y as it is."""
    if x is None:
        return y
    scale = 1.0 / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.float() * scale).to(y.dtype)


def rope_and_cache_torch(qkv, cos, sin, pos, kv, shape, rows=None, eps: float = 0.0) -> torch.Tensor:
    """qkv [B*T, (H + 2 KV) * D]; cos, sin [T, D] (sin signed: rotate_half up to sign); pos [T] cache slots; kv the
    layer's cache [2, B, KV, capacity, D]; shape (B, T, H, KV, D). Rotates q and k in place, writes k and v at
    `pos`, returns q as [B, KV, R * T, D] (row r * T + t: query head r of each kv head, token t). rows [B*T, hidden]:
    qkv is a product over these raw rows, scaled first (`scaled_rows_torch`)."""
    B, T, H, KV, D = shape
    if rows is not None:
        qkv = scaled_rows_torch(qkv, rows, eps)
    R = H // KV
    qkv = qkv.view(B, T, H + 2 * KV, D)
    qk = qkv[:, :, :H + KV]
    rot = qk.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)  # halves swapped (a copy)
    qk.mul_(cos[:, None]).add_(rot.mul_(sin[:, None]))
    kv.index_copy_(3, pos, qkv[:, :, H:].view(B, T, 2, KV, D).permute(2, 0, 3, 1, 4))
    return qkv[:, :, :H].view(B, T, KV, R, D).permute(0, 2, 3, 1, 4).reshape(B, KV, R * T, D)


def silu_mul_torch(gate_up: torch.Tensor, rows=None, eps: float = 0.0) -> torch.Tensor:
    gate, up = scaled_rows_torch(gate_up, rows, eps).chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def norm_linear_torch(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """rms_norm(x) @ weight.T: x [..., K], weight [N, K] -> [..., N] (the q/k/v product, the LM head)."""
    return F.linear(rms_norm_torch(x, norm_weight, eps), weight)


def norm_gate_up_silu_torch(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for [g | u] = rms_norm(x) @ weight.T: weight [2I, K] (the gate rows, then the up rows) -> [..., I].
    g and u are rounded to x's dtype (the product's output) before silu_mul."""
    return silu_mul_torch(norm_linear_torch(x, norm_weight, eps, weight))


def add_linear_torch_(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x += a @ weight.T in place: x [M, N], a [M, K], weight [N, K] (cuBLAS adds x to the float32 sums and rounds
    once: beta = 1)."""
    return x.addmm_(a, weight.t())


def attention_torch(q, k, v, mask, scaling: float, shape, slots=None) -> torch.Tensor:
    """q [B, KV, R*T, D] (row r * T + t) over k, v [B, KV, S, D] with the additive mask [R*T, S] (or a bool one [T, S],
    True where token t sees key n, for its R query heads) -> o [B*T, H*D]
    (token-major, head kv * R + r: the o projection's input). HF's eager attention (scores * scaling + mask,
    softmax in float32, rounded, @ v) in four ops: one GEMM scales and adds the mask (copied into its output).
    It reads the cache as laid out: `attention`'s slots (a per-token layout) are the kernel's alone."""
    if slots is not None:
        raise ValueError("attention_torch reads the cache as laid out (slots=None); per-token slots need the kernel")
    B, T, H, KV, D = shape
    if mask.dtype == torch.bool:  # [T, S], True where visible: one row a token for its R query heads
        mask = torch.where(mask, 0.0, -math.inf).to(q.dtype).repeat(H // KV, 1)
    q, k, v = q.reshape(B * KV, -1, D), k.reshape(B * KV, -1, D), v.reshape(B * KV, -1, D)
    scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scaling)  # [B*KV, R*T, S]
    o = torch.bmm(F.softmax(scores, dim=-1), v)
    return o.view(B, KV, H // KV, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)  # a copy only at T > 1


# ----------------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _wait_for_inputs(GDC: tl.constexpr):
        """Under a programmatic dependent launch (GDC), let the next kernel launch, then wait until the kernel
        before this one is done and its writes are seen: before any of this kernel's loads and stores."""
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _round(x, dt: tl.constexpr):
        """float32 x rounded to dt's precision, to nearest even, kept in float32 (bfloat16 by its bits: Triton's
        interpreter truncates when it converts to bfloat16, the GPU rounds; this is the same on both)."""
        x = x.to(tl.float32)  # a float64 scalar (eps under torch.compile) would widen the product
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dt).to(tl.float32)

    @triton.jit
    def _silu_mul(g, u, dt: tl.constexpr):
        """silu(g) * u for float32 g and u as torch's two ops in dt: silu rounded to dt, then the product rounded."""
        return _round(_round(g / (1.0 + tl.exp(-g)), dt) * u, dt)

    @triton.jit
    def _inv_rms(x, K, eps):
        """1 / sqrt(mean(x^2) + eps) of a float32 row x (K long, zeros past it): the RMSNorm's scale."""
        return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)

    @triton.jit
    def _normed(x, weight, K, eps, dt: tl.constexpr):
        """HF's RMSNorm of a float32 row x (K long, zeros past it): normalised in float32, rounded to dt, scaled by
        the float32 weight, rounded again (kept in float32)."""
        return _scaled(x, _inv_rms(x, K, eps), weight, dt)

    @triton.jit
    def _scaled(x, scale, weight, dt: tl.constexpr):
        """x * scale (the RMSNorm's 1 / rms) rounded to dt, times the float32 weight, rounded again (in float32)."""
        return _round(weight * _round(x * scale, dt), dt)

    @triton.jit
    def _row_scale(rows_ptr, row, N, eps, BLOCK: tl.constexpr):
        """`_inv_rms` of row `row` of rows [M, N], loaded here."""
        n = tl.arange(0, BLOCK)
        return _inv_rms(tl.load(rows_ptr + row * N + n, mask=n < N, other=0.0).to(tl.float32), N, eps)

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, at_ptr, at_stride, pos_ptr, kv_ptr, q_ptr, T, capacity,
                           rows_ptr, N, eps, B: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                           AT: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr, GDC: tl.constexpr):
        """One program per (token, head) of qkv: rotate (q, k), then store into q's layout or the cache. Token t
        reads row t of cos and sin, or (AT) row at[t] of them as tables (at's elements at_stride apart: 0 for one
        position expanded over a tree level's nodes). NORM: qkv is a product over rows' raw rows, each value first
        scaled by its row's RMSNorm scale and rounded."""
        _wait_for_inputs(GDC)
        row, head = tl.program_id(0), tl.program_id(1)
        b, t = row // T, row % T
        d = tl.arange(0, D)
        src = qkv_ptr + (row * (H + 2 * KV) + head) * D
        x = tl.load(src + d)
        dt = x.dtype
        partner = tl.load(src + (d + D // 2) % D).to(tl.float32)
        if NORM:
            scale = _row_scale(rows_ptr, row, N, eps, BLOCK_N)
            x = _round(x.to(tl.float32) * scale, dt).to(dt)
            partner = _round(partner * scale, dt)
        r = tl.load(at_ptr + t * at_stride).to(tl.int64) if AT else t
        c, s = tl.load(cos_ptr + r * D + d).to(tl.float32), tl.load(sin_ptr + r * D + d).to(tl.float32)
        turned = _round(_round(x.to(tl.float32) * c, dt) + _round(partner * s, dt), dt).to(dt)
        slot = tl.load(pos_ptr + t)
        kind = (head - H) // KV  # 0: k, 1: v (for q heads negative)
        kvh = (head - H) % KV
        cache_at = kv_ptr + (((kind * B + b) * KV + kvh) * capacity + slot) * D
        q_at = q_ptr + ((b * H + head) * T + t) * D  # [B, KV, R*T, D] is [B, H, T, D]: head h = kv head h // R
        dst = tl.where(head < H, q_at, cache_at)
        tl.store(dst + d, tl.where(head < H + KV, turned, x))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, I, rows_ptr, N, eps, BLOCK: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_N: tl.constexpr, GDC: tl.constexpr):
        """silu(g) * u of a row [g | u]; NORM: g and u first scaled by rows' row's RMSNorm scale and rounded."""
        _wait_for_inputs(GDC)
        row, blk = tl.program_id(0), tl.program_id(1)
        i = blk * BLOCK + tl.arange(0, BLOCK)
        keep = i < I
        g = tl.load(gu_ptr + row * 2 * I + i, mask=keep, other=0.0)
        dt = g.dtype
        g = g.to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * I + I + i, mask=keep, other=0.0).to(tl.float32)
        if NORM:
            scale = _row_scale(rows_ptr, row, N, eps, BLOCK_N)
            g, u = _round(g * scale, dt), _round(u * scale, dt)
        tl.store(out_ptr + row * I + i, _silu_mul(g, u, dt).to(dt), mask=keep)

    @triton.jit
    def _norm_row(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
        """One row of N: x_ptr's, normed with w_ptr's weights (`_normed`), into out_ptr."""
        n = tl.arange(0, BLOCK)
        keep = n < N
        x = tl.load(x_ptr + n, mask=keep, other=0.0)
        w = tl.load(w_ptr + n, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, _normed(x.to(tl.float32), w, N, eps, x.dtype).to(x.dtype), mask=keep)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, GDC: tl.constexpr):
        _wait_for_inputs(GDC)
        row = tl.program_id(0)
        _norm_row(x_ptr + row * N, w_ptr, out_ptr + row * N, N, eps, BLOCK)

    @triton.jit
    def _rms_norm_pair_kernel(a_ptr, a_rows_ptr, wa_ptr, b_ptr, wb_ptr, out_ptr, N, eps, BLOCK: tl.constexpr,
                              GATHER: tl.constexpr, GDC: tl.constexpr):
        """Program (row, side): side 0 norms a's row (GATHER: row a_rows[row] of a) into out[row, :N], side 1 b's
        into out[row, N:] ([rows, 2N])."""
        _wait_for_inputs(GDC)
        row, side = tl.program_id(0), tl.program_id(1)
        out = out_ptr + row * 2 * N + side * N
        if side == 0:
            a_row = tl.load(a_rows_ptr + row).to(tl.int64) if GATHER else row
            _norm_row(a_ptr + a_row * N, wa_ptr, out, N, eps, BLOCK)
        else:
            _norm_row(b_ptr + row * N, wb_ptr, out, N, eps, BLOCK)

    @triton.jit
    def _tile(w_ptr, n, k, live_n, live_k, K):
        """Rows n of a row-major [*, K] weight, columns k (zeros where n or k is out of range), in float32."""
        return tl.load(w_ptr + n[:, None] * K + k[None, :], mask=live_n[:, None] & live_k[None, :],
                       other=0.0).to(tl.float32)

    @triton.jit(do_not_specialize=["M", "rows"])
    def _gemv_kernel(a_ptr, norm_ptr, w_ptr, out_ptr, M, N, K, eps, rows, NORM: tl.constexpr, SILU: tl.constexpr,
                     ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr):
        """out [M, N] from the rows of a [M, K] and a weight [N, K] ([2N, K] with SILU): one program per (BLOCK_N
        outputs, `rows` rows). It loads its whole weight tile at once (with SILU two: gate rows n, up rows N + n),
        then takes its rows in turn (the next row's load in flight meanwhile): the row RMSNorm'd (NORM), the
        tile's products summed in float32 (tl.sum), rounded to out's dtype, then silu(g) * u (SILU), or x's value
        added before the rounding (ADD: out is x, cuBLAS's beta = 1). M and rows are not specialised on: every row
        runs the same code whatever M, so a row's bits do not depend on how many rows come with it (the launcher
        keeps a's alignment, which shapes its loads' layout, the same too)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        live_n, live_k = n < N, k < K
        dt = out_ptr.dtype.element_ty
        w = _tile(w_ptr, n, k, live_n, live_k, K)
        if SILU:
            w_up = _tile(w_ptr + N * K, n, k, live_n, live_k, K)
        if NORM:
            norm = tl.load(norm_ptr + k, mask=live_k, other=0.0).to(tl.float32)
        _wait_for_inputs(GDC)  # the weights (never written) loaded before the wait
        first = tl.program_id(1) * rows
        last = tl.minimum(first + rows, M)
        a = tl.load(a_ptr + first * K + k, mask=live_k, other=0.0)
        m = first
        while m < last:  # a while loop: a runtime range() bound breaks the interpreter (see kernels/verify.py)
            following = tl.load(a_ptr + (m + 1) * K + k, mask=live_k & (m + 1 < last), other=0.0)
            if ADD:  # loaded before the sums, so that its latency overlaps them
                residual = tl.load(out_ptr + m * N + n, mask=live_n, other=0.0).to(tl.float32)
            h = a.to(tl.float32)
            if NORM:
                h = _normed(h, norm, K, eps, dt)
            y = tl.sum(w * h[None, :], axis=1)
            if SILU:
                y = _silu_mul(_round(y, dt), _round(tl.sum(w_up * h[None, :], axis=1), dt), dt)
            if ADD:
                y += residual
            tl.store(out_ptr + m * N + n, _round(y, dt).to(dt), mask=live_n)
            a = following
            m += 1

    @triton.jit
    def _block(ptr, r, k, live_r, K: tl.constexpr):
        """Rows r, columns k of a row-major [*, K] tensor (zeros where r or k is out of range), in its dtype."""
        return tl.load(ptr + r[:, None] * K + k[None, :], mask=live_r[:, None] & (k < K)[None, :], other=0.0)

    @triton.jit
    def _weights(w_ptr, n, k, live_n, N, K: tl.constexpr, SILU: tl.constexpr):
        """A GEMV's weight tile for outputs n, columns k, and with SILU the up rows' beside it (all masked, no load,
        without)."""
        return _block(w_ptr, n, k, live_n, K), _block(w_ptr + N * K, n, k, live_n & SILU, K)

    @triton.jit
    def _chunk_product(y, h, w, DOT: tl.constexpr, WIDE: tl.constexpr):
        """y [rows, n] += h [rows, k] @ w [n, k].T for one K chunk: on the tensor cores (DOT, float32 sums), or as a
        [rows, n, k] tile of products summed over k (tl.sum: each output's order set by the shapes alone)."""
        if DOT:
            return tl.dot(h.to(WIDE), tl.trans(w.to(WIDE)), y, input_precision="ieee")
        return y + tl.sum(h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)

    @triton.jit
    def _block_chunk(y, y_up, squares, w, w_up, a_ptr, norm_ptr, m, live_m, k, K: tl.constexpr, NORM: tl.constexpr,
                     SILU: tl.constexpr, DOT: tl.constexpr, WIDE: tl.constexpr, dt: tl.constexpr):
        """`_gemv_block_kernel`'s K chunk k: the rows' x (with NORM their squares summed into `squares` and x times
        the norm's weight, rounded once to dt) times the weight tile w (and w_up: the up rows), added into y (and
        y_up) by `_chunk_product`."""
        x = _block(a_ptr, m, k, live_m, K).to(tl.float32)
        if NORM:
            squares += tl.sum(x * x, axis=1)
            x = x * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        h = x.to(dt)  # the product reads h at out's dtype
        y = _chunk_product(y, h, w, DOT, WIDE)
        if SILU:
            y_up = _chunk_product(y_up, h, w_up, DOT, WIDE)
        return y, y_up, squares

    @triton.jit(do_not_specialize=["M"])
    def _gemv_block_kernel(a_ptr, norm_ptr, w_ptr, out_ptr, M, N, eps, K: tl.constexpr, NORM: tl.constexpr,
                           SILU: tl.constexpr, ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           ROWS_BLOCK: tl.constexpr, DOT: tl.constexpr, WIDE: tl.constexpr, GDC: tl.constexpr,
                           TILE_N: tl.constexpr, STAGES: tl.constexpr):
        """`_gemv_kernel`'s job with a program's rows all at once: one program per (BLOCK_N outputs, ROWS_BLOCK rows),
        out[rows, n] = h[rows, :K] @ w[n, :K].T over K in BLOCK_K chunks (float32 sums; `_block_chunk`): unrolled,
        or with STAGES > 1 a loop whose loads Triton pipelines that many chunks ahead (the same sums in the same
        order). With NORM, RMSNorm in the same pass: h is x times the norm's weight and each row's squares are
        summed beside the product, whose float32 sums are scaled by the row's 1 / rms at the end (no first pass over
        the rows before the weights: the "folded" ops' order, the norm's weight on x's side). h is rounded to out's
        dtype before the product, g and u rounded before silu, x added before the one rounding. Rows past M are zeros
        and never stored; ROWS_BLOCK is fixed and M is not specialised on, so a row's bits do not depend on M or on
        the rows beside it. The first chunk's weights are loaded before `_wait_for_inputs` (the stream kernel's
        prefetch under a programmatic dependent launch).
        TILE_N >= BLOCK_N: the tile's width (tl.dot's 16 at least), its lanes past BLOCK_N masked (never read or
        stored), so a product of few outputs a program still runs on the tensor cores."""
        j = tl.arange(0, TILE_N)
        n = tl.program_id(0) * BLOCK_N + j
        m = tl.program_id(1) * ROWS_BLOCK + tl.arange(0, ROWS_BLOCK)
        live_n, live_m = (j < BLOCK_N) & (n < N), m < M
        dt = out_ptr.dtype.element_ty
        k0 = tl.arange(0, BLOCK_K)
        w0, w0_up = _weights(w_ptr, n, k0, live_n, N, K, SILU)
        _wait_for_inputs(GDC)
        y = tl.zeros([ROWS_BLOCK, TILE_N], dtype=tl.float32)
        y_up = tl.zeros([ROWS_BLOCK, TILE_N], dtype=tl.float32)
        squares = tl.zeros([ROWS_BLOCK], dtype=tl.float32)
        y, y_up, squares = _block_chunk(y, y_up, squares, w0, w0_up, a_ptr, norm_ptr, m, live_m, k0, K, NORM, SILU, DOT,
                                        WIDE, dt)
        if STAGES > 1:
            for c in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
                k = c + k0
                w, w_up = _weights(w_ptr, n, k, live_n, N, K, SILU)
                y, y_up, squares = _block_chunk(y, y_up, squares, w, w_up, a_ptr, norm_ptr, m, live_m, k, K, NORM, SILU,
                                                DOT, WIDE, dt)
        else:
            for c in tl.static_range(BLOCK_K, K, BLOCK_K):
                k = c + k0
                w, w_up = _weights(w_ptr, n, k, live_n, N, K, SILU)
                y, y_up, squares = _block_chunk(y, y_up, squares, w, w_up, a_ptr, norm_ptr, m, live_m, k, K, NORM, SILU,
                                                DOT, WIDE, dt)
        if NORM:
            scale = (1.0 / tl.sqrt(squares / K + eps))[:, None]
            y, y_up = y * scale, y_up * scale
        at = out_ptr + m[:, None] * N + n[None, :]
        live = live_m[:, None] & live_n[None, :]
        if SILU:
            y = _silu_mul(_round(y, dt), _round(y_up, dt), dt)
        if ADD:
            y += tl.load(at, mask=live, other=0.0).to(tl.float32)
        tl.store(at, _round(y, dt).to(dt), mask=live)

    @triton.jit
    def _stream_chunk(acc, acc_up, w, w_up, row_ptr, norm_ptr, k, live_k, scale, NORM: tl.constexpr,
                      SILU: tl.constexpr, dt: tl.constexpr):
        """`_gemv_stream_kernel`'s K chunk k: the row's h (normed with NORM, rounded to dt) times the weight tile w
        (and w_up: the up rows), added into the float32 tiles acc (and acc_up)."""
        h = tl.load(row_ptr + k, mask=live_k, other=0.0).to(tl.float32)
        if NORM:
            h = _scaled(h, scale, tl.load(norm_ptr + k, mask=live_k, other=0.0).to(tl.float32), dt)
        acc += w.to(tl.float32) * h[None, :]
        if SILU:
            acc_up += w_up.to(tl.float32) * h[None, :]
        return acc, acc_up

    @triton.jit(do_not_specialize=["M", "rows"])
    def _gemv_stream_kernel(a_ptr, norm_ptr, w_ptr, out_ptr, M, N, eps, rows, K: tl.constexpr, NORM: tl.constexpr,
                            SILU: tl.constexpr, ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            KP: tl.constexpr, GDC: tl.constexpr):
        """`_gemv_kernel`'s job for a large K: one program per (BLOCK_N outputs, `rows` rows), each row in turn
        streaming the weight tile in BLOCK_K chunks (unrolled) into a [BLOCK_N, BLOCK_K] float32 tile of
        products, summed once at the end (tl.sum). The first chunk's weights are loaded once,
        before the rows: with GDC (a programmatic dependent launch) before waiting for the kernel before this
        one, whose outputs are this one's rows, so a chain of products streams weights across its kernels'
        boundaries. The row's RMSNorm scale (NORM) is `_row_scale`'s over the whole row (KP: K's power of two);
        the roundings are `_gemv_kernel`'s. Every row runs the same code whatever M, so a row's bits do not
        depend on M or on the rows beside it."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = n < N
        dt = out_ptr.dtype.element_ty
        k0 = tl.arange(0, BLOCK_K)
        w0, w0_up = _weights(w_ptr, n, k0, live_n, N, K, SILU)
        _wait_for_inputs(GDC)  # the first chunk's weights (never written) loaded before the wait
        m = tl.program_id(1) * rows
        last = tl.minimum(m + rows, M)
        while m < last:  # a while loop: a runtime range() bound breaks the interpreter (see kernels/verify.py)
            row = a_ptr + m * K
            scale = 1.0
            if NORM:
                scale = _row_scale(a_ptr, m, K, eps, KP)
            if ADD:
                residual = tl.load(out_ptr + m * N + n, mask=live_n, other=0.0).to(tl.float32)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc, acc_up = _stream_chunk(acc, acc_up, w0, w0_up, row, norm_ptr, k0, k0 < K, scale, NORM, SILU, dt)
            for c in tl.static_range(BLOCK_K, K, BLOCK_K):
                k = c + k0
                w, w_up = _weights(w_ptr, n, k, live_n, N, K, SILU)
                acc, acc_up = _stream_chunk(acc, acc_up, w, w_up, row, norm_ptr, k, k < K, scale, NORM, SILU, dt)
            y = tl.sum(acc, axis=1)
            if SILU:
                y = _silu_mul(_round(y, dt), _round(tl.sum(acc_up, axis=1), dt), dt)
            if ADD:
                y += residual
            tl.store(out_ptr + m * N + n, _round(y, dt).to(dt), mask=live_n)
            m += 1

    @triton.jit
    def _attention_part_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, slot_ptr, part_ptr, T, S, scaling, k_batch, k_head,
                               k_slot, v_batch, v_head, v_slot, KV: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                               CHUNK: tl.constexpr, CHUNKS: tl.constexpr, WIDE: tl.constexpr, GATHER: tl.constexpr,
                               VISIBLE: tl.constexpr, GDC: tl.constexpr):
        """One program per (batch row and kv head, token t, chunk c of CHUNK keys): the R query heads' softmax
        over the chunk's keys, unnormalised (its max, its sum, p @ v), into part [B*KV, T, CHUNKS, 16, D + 2].
        The R rows are padded to 16 for the tensor cores; a token's rows never meet another token's. GATHER: key
        n of token t is the cache's slot slots[t, n] (slot_ptr, int32 [T, S]), else slot n. VISIBLE: the mask is
        [T, S] bytes, nonzero where token t sees key n (for all R heads), else additive [R*T, S]."""
        _wait_for_inputs(GDC)
        bk, t, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kvh = bk // KV, bk % KV
        r, d = tl.arange(0, 16), tl.arange(0, D)
        n = c * CHUNK + tl.arange(0, CHUNK)
        live, inside = r < R, n < S
        at = tl.load(slot_ptr + t * S + n, mask=inside, other=0) if GATHER else n
        rows = r * T + t  # the mask's and q's row of query head r at token t
        q = tl.load(q_ptr + (bk * R * T + rows)[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(WIDE)
        keys = tl.load(k_ptr + b * k_batch + kvh * k_head + at[:, None] * k_slot + d[None, :], mask=inside[:, None],
                       other=0.0)
        scores = tl.dot(q, tl.trans(keys.to(WIDE)), input_precision="ieee") * scaling
        if VISIBLE:  # adding 0 or -inf, within float32 rounding (a GPU may fuse the additive form otherwise)
            seen = tl.load(mask_ptr + t * S + n, mask=inside, other=0)
            scores = tl.where(seen[None, :] != 0, scores, float("-inf"))
        else:
            scores += tl.load(mask_ptr + rows[:, None] * S + n[None, :], mask=live[:, None] & inside[None, :],
                              other=float("-inf")).to(tl.float32)
        scores = tl.where(live[:, None], scores, 0.0)  # padded rows: finite, never read
        best = tl.maximum(tl.max(scores, axis=1), -1e30)  # finite: a chunk with no visible key weighs exactly 0
        p = tl.exp(scores - best[:, None])
        values = tl.load(v_ptr + b * v_batch + kvh * v_head + at[:, None] * v_slot + d[None, :], mask=inside[:, None],
                         other=0.0)
        acc = tl.dot(p.to(values.dtype).to(WIDE), values.to(WIDE), input_precision="ieee")  # p rounded, as flash
        out = part_ptr + ((bk * T + t) * CHUNKS + c) * 16 * (D + 2) + r * (D + 2)
        tl.store(out[:, None] + d[None, :], acc, mask=live[:, None])
        tl.store(out + D, best, mask=live)
        tl.store(out + D + 1, tl.sum(p, axis=1), mask=live)

    @triton.jit
    def _attention_merge_kernel(part_ptr, o_ptr, T, used, KV: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                                CHUNKS: tl.constexpr, GDC: tl.constexpr):
        """One program per (batch row and kv head, token t, query head r): the chunks' softmaxes merged. It reads
        CHUNKS (the cache's capacity) chunks whatever the context bucket, the unused ones as empty, so the sums
        keep one order and a token gets the same bits in every bucket and verify width as in a one-token step."""
        _wait_for_inputs(GDC)
        bk, t, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        c, d = tl.arange(0, CHUNKS), tl.arange(0, D)
        at = part_ptr + ((bk * T + t) * CHUNKS + c) * 16 * (D + 2) + r * (D + 2)
        real = c < used
        best = tl.load(at + D, mask=real, other=-1e30)
        weight = tl.exp(best - tl.max(best, axis=0))
        total = tl.sum(weight * tl.load(at + D + 1, mask=real, other=0.0), axis=0)
        acc = tl.sum(weight[:, None] * tl.load(at[:, None] + d[None, :], mask=real[:, None], other=0.0), axis=0)
        b, kvh = bk // KV, bk % KV
        o_at = o_ptr + ((b * T + t) * (KV * R) + kvh * R + r) * D  # o [B*T, H*D], token-major
        tl.store(o_at + d, (acc / total).to(o_ptr.dtype.element_ty))


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter multiplies bfloat16 by its bits: widen
_TL = {} if triton is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
CHUNK = 64  # keys a program of the attention takes
ROWS = 4  # rows a GEMV program takes in turn (more rows go to more programs, which read the same weight tiles)
KINDS = ("loop", "block", "dot", "stream")  # the GEMV variants (GemvTiles.kind)
BLOCK_ROWS = {"block": 8, "dot": 16}  # rows a program of the block variants takes at once (never M's; tl.dot: >= 16)
BLOCK_K = 64  # the K chunk of the block variants (576 = 9 chunks: no padding for the embedded model)
STREAM_K = 1024  # the stream variant's K chunk (at most K's power of two)
DOT_K = int(os.environ.get("FLASHSPEC_DOT_K", "256"))  # the dot variant's K chunk by default (at most K's power of two)
DOT_N = int(os.environ.get("FLASHSPEC_DOT_N", "0"))  # the dot variant's outputs a program (0: by the product's shape)
DOT_STAGES = int(os.environ.get("FLASHSPEC_DOT_STAGES", "1"))  # the dot variant's K loop: unrolled (1) or pipelined
PDL = os.environ.get("FLASHSPEC_PDL", "0") == "1"  # the kernels here as programmatic dependent launches (`pdl_on`)
GEMV_KIND = os.environ.get("FLASHSPEC_GEMV", "loop")  # the products' kind by default (GemvTiles.kind; A/B runs)


@dataclass(frozen=True)
class GemvTiles:
    """How `norm_linear`, `norm_gate_up_silu` and `add_linear_` split a product. `rows` never changes a result's
    bits; `kind`, `block_n`, `warps`, `block_rows` and `block_k` change the order of the sums, so they must not
    depend on M (the defaults depend on the weight's shape and the device only). Kinds: "loop" takes a program's
    rows in turn, each over its whole weight tile; "block" takes `block_rows` rows at once, K in chunks, products
    summed in registers; "dot" the same on the tensor cores; "stream" takes its rows in turn like the loop, each
    streaming the weight tile in `block_k` chunks (a large K: a 1.1B model's products)."""

    kind: str = "loop"
    block_n: int | None = None  # outputs a program computes (None: loop 16, 8 or 4, the largest giving every SM one;
    #                             block 4; dot 32, or 64 for 8192+ outputs; stream `stream_tile`'s)
    rows: int = ROWS  # rows a program takes in turn (the loop's and the stream's)
    warps: int | None = None  # warps a program runs (None: 4, or 8 for loop tiles of over 4096 values)
    block_rows: int | None = None  # the block variants' rows at once (None: BLOCK_ROWS[kind])
    block_k: int | None = None  # the block variants' K chunk (None: BLOCK_K; dot: DOT_K; stream: `stream_tile`'s)
    pdl: bool | None = None  # the kernel as a programmatic dependent launch (None: `pdl_on`'s)
    stages: int | None = None  # the block variants' K loop: unrolled (1), or pipelined that many chunks deep (None:
    #                            1; dot: DOT_STAGES)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("block_n", "block_rows", "block_k"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.rows < 1 or (self.stages or 1) < 1:
            raise ValueError(f"rows and stages must be positive, got {self}")
        if (self.stages or 1) > 1 and self.kind not in ("block", "dot"):
            raise ValueError(f"stages are the block variants', not the {self.kind}'s: {self}")
        if self.kind == "dot" and min(self.block_rows or 16, self.block_k or 16) < 16:
            raise ValueError(f"tl.dot needs blocks of at least 16 rows and K, got {self}")  # block_n: padded
        if self.kind == "loop" and (self.block_k or self.block_rows):
            raise ValueError(f"block_k and block_rows are the block variants', not the loop's: {self}")
        if self.kind == "stream" and self.block_rows:
            raise ValueError(f"block_rows is the block variants', not the stream's: {self}")

    def resolved(self, n_out: int, K: int, paired: bool, device: torch.device) -> "GemvTiles":
        """These tiles with the defaults filled in for n_out outputs over K inputs (paired: two weight rows each)."""
        if self.kind == "stream":
            block_n, block_k = stream_tile(n_out, K)
            return replace(self, block_n=self.block_n or block_n, warps=self.warps or 4, pdl=self._pdl(device),
                           block_k=min(self.block_k or block_k, triton.next_power_of_2(K)))
        if self.kind != "loop":
            block_k = self.block_k or (DOT_K if self.kind == "dot" else BLOCK_K)
            dot_n = DOT_N or (64 if n_out >= 8192 else 32)  # the fastest alone on an H200 (an LM head; a layer's)
            return replace(self, block_n=self.block_n or (dot_n if self.kind == "dot" else 4), warps=self.warps or 4,
                           block_rows=self.block_rows or BLOCK_ROWS[self.kind], pdl=self._pdl(device),
                           block_k=min(block_k, triton.next_power_of_2(K)),
                           stages=self.stages or (DOT_STAGES if self.kind == "dot" else 1))
        # the interpreter runs its programs one after another: as if on one SM, the fewest programs
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        block_n = self.block_n or next((b for b in (16, 8) if triton.cdiv(n_out, b) >= sms), 4)
        values = block_n * triton.next_power_of_2(K) * (2 if paired else 1)
        return replace(self, block_n=block_n, warps=self.warps or (4 if values <= 4096 else 8), pdl=self._pdl(device))

    def _pdl(self, device: torch.device) -> bool:
        return pdl_on(device) if self.pdl is None else self.pdl and hopper(device)


def stream_tile(n_out: int, K: int) -> tuple[int, int]:
    """The stream kernel's default (outputs a program, K chunk) for n_out outputs over K inputs: an LM head (16384+
    outputs) 16 x 256, a large K (4096+) 8 x STREAM_K, else 4 x STREAM_K. The fastest one-row products read from memory
    on an H100 (`benchmarks.gpu_step --products --cold`, PDL): the 135M's gate/up 3.15 us at 4 against 3.46 at 8 and
    LM head 22.5 against 27.6 at 8 x 1024; the 1.1B's q/k/v 4.91 / 5.44, gate/up 17.8 / 18.8, down (K = 5632) 8.36 at 8
    against 13.5 at 4, LM head 45.3 against 53.8."""
    if n_out >= 16384:
        return 16, 256
    return (8 if K >= 4096 else 4), STREAM_K


def hopper(device: torch.device) -> bool:
    """Whether the device runs programmatic dependent launches: a GPU of compute capability 9+, not the interpreter."""
    return not INTERPRETED and device.type == "cuda" and _capability(device.index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_on(device: torch.device) -> bool:
    """Whether the kernels here launch as programmatic dependent launches (PDL: FLASHSPEC_PDL=1, on a `hopper`
    device): each lets the next kernel launch at once and waits for the one before it inside (`_wait_for_inputs`),
    so a chain of kernels inside a CUDA graph overlaps its launch gaps, and the GEMVs read their first weights
    during the kernel before. The same arithmetic, the same bits."""
    return PDL and hopper(device)


def _launch(device: torch.device, pdl: bool | None = None) -> dict:
    """A kernel's GDC argument and launch keywords: a programmatic dependent launch where `pdl` (None: `pdl_on`)."""
    on = pdl_on(device) if pdl is None else pdl
    return {"GDC": True, "launch_pdl": True} if on else {"GDC": False}


def auto(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str:
    """What layer_ops="auto" runs: the environment's FLASHSPEC_LAYER_OPS (torch | triton | folded | fused, for A/B
    runs) where set, else the kernels with the norms folded into the products ("folded"; the model falls back to
    "triton" where it cannot fold) on CUDA where they take these heads, else torch."""
    fits = device.type == "cuda" and triton is not None and supported(heads, kv_heads, head_dim)
    return os.environ.get("FLASHSPEC_LAYER_OPS") or ("folded" if fits else "torch")


def supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels take a model of these heads (the attention's: at most 16 query heads a kv head, a
    power-of-two head size of at least 16)."""
    return heads // kv_heads <= 16 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def attention(q, k, v, mask, scaling: float, shape, slots=None) -> torch.Tensor:
    """`attention_torch` in two kernels (softmaxes over chunks of 64 keys, then merged; float32 throughout, so
    within a rounding of the torch ops, not their bits). k and v are slices [:, :, :S] of a cache whose capacity
    (slots per head of their storage) fixes the merge's order. slots (int32 [T, S], optional): token t reads the
    cache's slot slots[t, n] as its key n, under mask row t; a draft tree's node reads its path laid out as a chain
    would be (`StaticCausalLM.forward_tree`), so each key keeps its chunk and lane, and the node the bits of plain
    decoding's token (the sums' order follows the lanes; masked keys add exact zeros)."""
    B, T, H, KV, D = shape
    S, R = k.shape[2], H // KV
    visible = mask.dtype == torch.bool
    if mask.shape != ((T if visible else R * T), S):
        raise ValueError(f"mask must be bool [T, S] or additive [R*T, S] with T={T}, R={R}, S={S}, got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if not supported(H, KV, D) or k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError(f"the attention kernel needs at most 16 query heads a kv head and a power-of-two head size "
                         f">= 16 with unit stride, got {R} and {D}")
    if slots is not None and (slots.shape != (T, S) or slots.dtype != torch.int32 or not slots.is_contiguous()):
        raise ValueError(f"slots must be contiguous int32 [T, S] = [{T}, {S}], got {slots.dtype} {tuple(slots.shape)}")
    chunks = triton.next_power_of_2(triton.cdiv(k.stride(1) // k.stride(2), CHUNK))
    part = torch.empty(B * KV, T, chunks, 16, D + 2, dtype=torch.float32, device=q.device)
    used = triton.cdiv(S, CHUNK)
    mask = mask.contiguous().view(torch.uint8) if visible else mask.contiguous()
    _attention_part_kernel[(B * KV, T, used)](q.contiguous(), k, v, mask,
                                              k if slots is None else slots, part, T, S, scaling,
                                              *k.stride()[:3], *v.stride()[:3], KV=KV, R=R, D=D, CHUNK=CHUNK,
                                              CHUNKS=chunks, WIDE=tl.float32 if INTERPRETED else _TL[q.dtype],
                                              GATHER=slots is not None, VISIBLE=visible, **_launch(q.device))
    o = torch.empty(B * T, H * D, dtype=q.dtype, device=q.device)
    _attention_merge_kernel[(B * KV, T, R)](part, o, T, used, KV=KV, R=R, D=D, CHUNKS=chunks, **_launch(q.device))
    return o


def rope_and_cache(qkv, cos, sin, pos, kv, shape, at: torch.Tensor | None = None, rows=None,
                   eps: float = 0.0) -> torch.Tensor:
    """`rope_and_cache_torch` in one kernel (qkv is left as it was; only q's layout and the cache are written). With
    `at` [T] (any stride), cos and sin are tables [P, D] and token t rotates by their row at[t]
    (`rope_and_cache_torch(qkv, cos[at], sin[at], ...)` without the gathers). rows: as the reference's (the
    scale computed in the kernel, by each program for its token)."""
    B, T, H, KV, D = shape
    q = torch.empty(B, KV, (H // KV) * T, D, dtype=qkv.dtype, device=qkv.device)
    rows = _norm_rows(rows, B * T)
    _rope_cache_kernel[(B * T, H + 2 * KV)](qkv.contiguous(), cos.contiguous(), sin.contiguous(),
                                            pos if at is None else at, 0 if at is None else at.stride(0), pos, kv,
                                            q, T, kv.shape[3], qkv if rows is None else rows,
                                            1 if rows is None else rows.shape[1], eps,
                                            B=B, H=H, KV=KV, D=D, AT=at is not None, NORM=rows is not None,
                                            BLOCK_N=1 if rows is None else triton.next_power_of_2(rows.shape[1]),
                                            enable_fp_fusion=False, **_launch(qkv.device))
    return q


def silu_mul(gate_up: torch.Tensor, rows=None, eps: float = 0.0) -> torch.Tensor:
    """`silu_mul_torch` in one kernel (rows: as the reference's, the scale computed in the kernel)."""
    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()  # a no-op for the projections' own outputs
    out = torch.empty(M, I, dtype=gate_up.dtype, device=gate_up.device)
    rows, BLOCK = _norm_rows(rows, M), 1024
    _silu_mul_kernel[(M, triton.cdiv(I, BLOCK))](gate_up, out, I, gate_up if rows is None else rows,
                                                 1 if rows is None else rows.shape[1], eps, BLOCK=BLOCK,
                                                 NORM=rows is not None,
                                                 BLOCK_N=1 if rows is None else triton.next_power_of_2(rows.shape[1]),
                                                 **_launch(gate_up.device))
    return out


def _norm_rows(rows: torch.Tensor | None, M: int) -> torch.Tensor | None:
    """rows [M, N] as the kernels read them (contiguous), checked against the product's M rows."""
    if rows is None:
        return None
    rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    if rows.shape[0] != M:
        raise ValueError(f"rows must give the product's {M} rows their scales, got {tuple(rows.shape)}")
    return rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    rows = x.reshape(-1, N).contiguous()  # a copy only where x is a strided view (the final norm's kept rows, an
    # expanded row: the kernel steps N elements a row)
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, N, eps, BLOCK=triton.next_power_of_2(N),
                                       **_launch(x.device))
    return out.view(x.shape)


def rms_norm_pair(a: torch.Tensor, a_weight: torch.Tensor, b: torch.Tensor, b_weight: torch.Tensor,
                  eps: float, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[rms_norm(a) | rms_norm(b)] over the last dimension in one kernel (a and b [..., N], one dtype): `rms_norm`'s
    bits, side by side [..., 2N] (the draft head's input: the token's embedding and the hidden state, normed). With
    a_rows (b's shape but the last dimension), a is a table [P, N] and side 0 norms its rows a_rows (`a[a_rows]`
    without the gather: the draft tokens' embeddings)."""
    N = a.shape[-1]
    a_shape = a.shape if a_rows is None else (*a_rows.shape, N)
    if b.shape != a_shape or b.dtype != a.dtype:
        raise ValueError(f"a and b must match, got {a.dtype} {tuple(a_shape)} and {b.dtype} {tuple(b.shape)}")
    rows_a, rows_b = a.reshape(-1, N).contiguous(), b.reshape(-1, N).contiguous()
    index = rows_b if a_rows is None else a_rows.reshape(-1).contiguous()  # (unread without a_rows)
    out = torch.empty(rows_b.shape[0], 2 * N, dtype=a.dtype, device=a.device)
    _rms_norm_pair_kernel[(rows_b.shape[0], 2)](rows_a, index, a_weight.contiguous(), rows_b, b_weight.contiguous(),
                                                out, N, eps, BLOCK=triton.next_power_of_2(N),
                                                GATHER=a_rows is not None, **_launch(b.device))
    return out.view(*b.shape[:-1], 2 * N)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, *,
                tiles: GemvTiles | None = None) -> torch.Tensor:
    """`norm_linear_torch` in one kernel: every program normalises the row itself (no bias)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # a copy only for strided rows (the LM head's kept rows)
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _gemv(rows, norm_weight.contiguous(), eps, weight, out, tiles)
    return out.view(*x.shape[:-1], weight.shape[0])


def norm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, *,
                      tiles: GemvTiles | None = None) -> torch.Tensor:
    """`norm_gate_up_silu_torch` in one kernel (no bias): a program computes gate rows j and up rows I + j from the
    same normalised row. It rounds where the "triton" loop does: g and u, float32 sums, each rounded to x's dtype
    (cuBLAS's bfloat16 output), then silu(g) rounded and silu(g) * u rounded (`silu_mul`'s two roundings)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _gemv(rows, norm_weight.contiguous(), eps, weight, out, tiles, silu=True)
    return out.view(*x.shape[:-1], weight.shape[0] // 2)


def add_linear_(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, *,
                tiles: GemvTiles | None = None) -> torch.Tensor:
    """`add_linear_torch_` in one kernel: x [M, N] (contiguous) += a [M, K] @ weight.T, x added to the float32 sums
    before the one rounding (no bias)."""
    if x.dim() != 2 or not x.is_contiguous() or a.shape[0] != x.shape[0] or weight.shape[0] != x.shape[1]:
        raise ValueError(f"add_linear_ needs a contiguous x [M, N], a [M, K] and weight [N, K]; got x "
                         f"{tuple(x.shape)}, a {tuple(a.shape)}, weight {tuple(weight.shape)}")
    return _gemv(a.contiguous(), None, 0.0, weight, x, tiles, add=True)


def _gemv(a, norm_weight, eps: float, weight, out, tiles: GemvTiles | None, silu: bool = False, add: bool = False):
    """The GEMV kernel of tiles.kind ("loop" `_gemv_kernel`, "block" / "dot" `_gemv_block_kernel`, "stream";
    None: GEMV_KIND's defaults) over the rows of a [M, K] into out [M, N] (with silu N is half weight's rows)."""
    if a.data_ptr() % 16:  # a fresh copy is aligned: a misaligned view would compile other layouts, other sums
        a = a.clone()
    M, K = a.shape
    if weight.dim() != 2 or weight.shape[1] != K or not weight.is_contiguous():
        raise ValueError(f"the GEMV needs a contiguous weight [N, {K}], got {tuple(weight.shape)} with strides "
                         f"{weight.stride()}")
    n_out = out.shape[1]
    tiles = (tiles or GemvTiles(kind=GEMV_KIND)).resolved(n_out, K, silu, a.device)
    norm = weight if norm_weight is None else norm_weight  # (no norm: a pointer the kernel never reads)
    flags = dict(NORM=norm_weight is not None, SILU=silu, ADD=add, BLOCK_N=tiles.block_n, num_warps=tiles.warps,
                 **_launch(a.device, tiles.pdl))
    if tiles.kind == "stream":
        _gemv_stream_kernel[(triton.cdiv(n_out, tiles.block_n), triton.cdiv(M, tiles.rows))](
            a, norm, weight, out, M, n_out, eps, tiles.rows, K=K, BLOCK_K=tiles.block_k, KP=triton.next_power_of_2(K),
            **flags)
    elif tiles.kind != "loop":
        wide = tl.float32 if INTERPRETED else _TL[out.dtype]  # the interpreter's tl.dot: float32 (exact for bf16)
        _gemv_block_kernel[(triton.cdiv(n_out, tiles.block_n), triton.cdiv(M, tiles.block_rows))](
            a, norm, weight, out, M, n_out, eps, K=K, BLOCK_K=tiles.block_k, ROWS_BLOCK=tiles.block_rows,
            DOT=tiles.kind == "dot", WIDE=wide, STAGES=tiles.stages,
            TILE_N=max(tiles.block_n, 16) if tiles.kind == "dot" else tiles.block_n, **flags)
    else:
        _gemv_kernel[(triton.cdiv(n_out, tiles.block_n), triton.cdiv(M, tiles.rows))](
            a, norm, weight, out, M, n_out, K, eps, tiles.rows, BLOCK_K=triton.next_power_of_2(K), **flags)
    return out
