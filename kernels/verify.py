"""Speculative verification: the exact accept/reject test of Leviathan et al. / Chen et al. (2023).

Given K draft tokens with their draft distribution q and the target distribution p at K + 1 positions,
accept draft token x_i with probability min(1, p_i(x) / q_i(x)); at the first rejection emit one token
from norm(max(0, p_i - q_i)); after a full accept emit a bonus token from p_K. The emitted tokens then
follow p exactly. `p` = target, `q` = draft, everywhere in this file.

Two Triton kernels give the same result: `_verify_kernel` streams whole rows, one program each (enough when the
rows alone fill the GPU); `_verify_split_kernel` also splits V in chunks over programs, in the same single launch,
and the last program to finish a row reduces the chunks' partial maxima. The launcher picks between them.

Layout follows the Triton tutorials: the pure-PyTorch reference first (it is the specification), then
the Triton kernel, then its launcher with the same signature, then the backend switch.

Randomness is explicit so that backends can be compared bit for bit:
  uniform [B, K]  float32 in [0, 1): acceptance draws.
  noise   [B, V]  float32 Exp(1) draws: the residual or bonus token is argmax(w / noise) over the vocabulary,
                  where w is the unnormalised residual max(0, p - q) (or p for the bonus). This is the
                  exponential-race form of sampling from norm(w): no normalise-and-cumsum pass is needed.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

BACKENDS = ("torch", "triton", "auto")


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per row
    tokens: torch.Tensor  # [B, K+1] int64: accepted drafts, then the resampled/bonus token, then -1


def _check_inputs(draft_tokens, draft_probs, target_probs, uniform, noise):
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[0] != B or target_probs.shape[1] != K + 1:
        raise ValueError(f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K, V):
        raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, {V}], got {tuple(draft_probs.shape)}")
    if uniform is not None and tuple(uniform.shape) != (B, K):
        raise ValueError(f"uniform must be [B, K] = [{B}, {K}], got {tuple(uniform.shape)}")
    if noise is not None and tuple(noise.shape) != (B, V):
        raise ValueError(f"noise must be [B, V] = [{B}, {V}], got {tuple(noise.shape)}")
    return B, K, V


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the same indices (the first of equal maxima; NaN counts as the maximum). On the CPU through
    NumPy's argmax, which is vectorised where torch's reduction is not (3 x 49,152 float32 logits: 12 against 86 us on
    a 2-core AMD EPYC; the round's verify, the head's draws and the plain step each take one), other dtypes through
    max(dim=-1) (2-3x faster than argmax there); elsewhere argmax itself."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    if x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1), dtype=np.int64))
    return x.max(dim=-1).indices


def draw_randoms(B: int, K: int, V: int, device, generator: torch.Generator | None = None):
    """The uniform [B, K] and Exp(1) noise [B, V] draws that one verification consumes."""
    uniform = torch.rand((B, K), device=device, generator=generator, dtype=torch.float32)
    noise = torch.empty((B, V), device=device, dtype=torch.float32).exponential_(generator=generator)
    return uniform, noise


# ----------------------------------------------------------------------------------------------------
# Reference (the specification)


def verify_torch(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, None when the drafter is deterministic (q one-hot)
    target_probs: torch.Tensor,  # [B, K+1, V] float32, already temperature/top-k/top-p processed
    *,
    uniform: torch.Tensor | None = None,  # [B, K]
    noise: torch.Tensor | None = None,  # [B, V]
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> VerifyResult:
    B, K, V = _check_inputs(draft_tokens, draft_probs, target_probs, uniform, noise)
    rows = torch.arange(B, device=draft_tokens.device)
    if greedy:
        best = argmax(target_probs)  # [B, K+1]
        accept = draft_tokens == best[:, :K]
    else:
        if uniform is None or noise is None:
            u, e = draw_randoms(B, K, V, target_probs.device, generator)
            uniform = u if uniform is None else uniform
            noise = e if noise is None else noise
        p_x = target_probs[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        accept = uniform * q_x < p_x  # u < p/q without dividing; q = 0 accepts whenever p > 0
    num_accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]

    if greedy:
        final = best[rows, num_accepted]
    else:
        p_n = target_probs[rows, num_accepted]  # [B, V]; position K is the bonus position
        if draft_probs is None:  # one-hot at the rejected draft (none after a full accept); no host sync
            at = draft_tokens.gather(1, num_accepted.clamp(max=K - 1)[:, None]) if K else num_accepted[:, None] * 0
            q_n = torch.zeros_like(p_n).scatter_(-1, at, (num_accepted < K)[:, None].to(p_n.dtype))
        else:
            q_pad = torch.cat([draft_probs, draft_probs.new_zeros((B, 1, V))], dim=1)  # [B, K+1, V]
            q_n = q_pad[rows, num_accepted]
        residual = (p_n - q_n).clamp_min(0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q: the residual is empty; fall back to p
        w = torch.where(empty, p_n, residual)
        final = argmax(w / noise)

    positions = torch.arange(K + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)  # [B, K+1]
    tokens = torch.where(positions < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens[rows, num_accepted] = final
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


# ----------------------------------------------------------------------------------------------------
# Triton kernel and launcher (same signature as the reference)

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend still works without triton
    triton = None

verify_triton = None  # defined below when triton is importable

if triton is not None:

    # -- helpers shared by both kernels (Triton inlines them) ------------------------------------------

    @triton.jit
    def _keep_max(score, v, best, best_idx):
        """Lane-wise running max: where score beats best (strictly, so an earlier block wins a tie), take it and v."""
        better = score > best
        return tl.where(better, score, best), tl.where(better, v[None, :], best_idx)

    @triton.jit
    def _lowest_argmax(best, best_idx):
        """Per row: the max over the lanes, and the lowest index that holds it (torch.argmax's rule on ties)."""
        top = tl.max(best, axis=1)
        return top, tl.min(tl.where(best == top[:, None], best_idx, 2147483647), axis=1)

    @triton.jit
    def _argmax_over_v(row_ptrs, stride_v, noise_rows, stride_nv, row_mask, v_start, V: tl.constexpr, V_LEN: tl.constexpr,
                       BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, DIVIDE: tl.constexpr):
        """Per row: (max, lowest index holding it) of row[v] (or row[v] / noise[v] when DIVIDE) over
        v_start <= v < min(v_start + V_LEN, V)."""
        offs_v = tl.arange(0, BLOCK_V)
        best = tl.full((BLOCK_B, BLOCK_V), float("-inf"), tl.float32)  # per lane: best score so far
        best_idx = tl.full((BLOCK_B, BLOCK_V), 2147483647, tl.int32)  # and the index that holds it
        for v0 in tl.range(0, V_LEN, BLOCK_V, num_stages=NUM_STAGES):
            v = v_start + v0 + offs_v
            m = row_mask[:, None] & (v < V)[None, :]
            score = tl.load(row_ptrs[:, None] + v[None, :] * stride_v, mask=m, other=0.0)
            if DIVIDE:
                e = tl.load(noise_rows[:, None] + v[None, :] * stride_nv, mask=m, other=1.0)
                score = tl.math.div_rn(score, e)  # rounds like torch's fp32 division
            best, best_idx = _keep_max(tl.where(m, score, float("-inf")), v, best, best_idx)
        return _lowest_argmax(best, best_idx)

    @triton.jit
    def _accept_test(x, p_rows, stride_pk, stride_pv, q_rows, stride_qk, stride_qv, u_rows, stride_uk, offs_k, in_bk,
                     K, V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, HAS_Q: tl.constexpr):
        """Per row: the first rejected position of u * q(x) < p(x) over the K drafts x [BLOCK_B, BLOCK_K]; K after a
        full accept. q is one-hot at x (q(x) = 1) for a deterministic drafter."""
        in_vocab = in_bk & (x >= 0) & (x < V)  # memory safety only: drafts must lie in [0, V)
        p_x = tl.load(p_rows[:, None] + offs_k[None, :] * stride_pk + x * stride_pv, mask=in_vocab, other=0.0)
        if HAS_Q:
            q_x = tl.load(q_rows[:, None] + offs_k[None, :] * stride_qk + x * stride_qv, mask=in_vocab, other=0.0)
        else:
            q_x = tl.full((BLOCK_B, BLOCK_K), 1.0, tl.float32)
        u = tl.load(u_rows[:, None] + offs_k[None, :] * stride_uk, mask=in_bk, other=0.0)
        rejected = in_bk & ~(u * q_x < p_x)
        return tl.min(tl.where(rejected, offs_k[None, :], K), axis=1)

    @triton.jit
    def _residual_race(p_n, stride_pv, q_n, stride_qv, x_n, has_draft, noise_rows, stride_nv, in_b, v_start,
                       V: tl.constexpr, V_LEN: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                       NUM_STAGES: tl.constexpr, HAS_Q: tl.constexpr, FALLBACK: tl.constexpr):
        """Over v_start <= v < min(v_start + V_LEN, V), per row: the race of the residual w = max(0, p_n - q_n) against
        the noise (max of w / noise and its lowest index), the max of w (<= 0: the residual is empty) and, when
        FALLBACK, the race of p_n itself (max of p_n / noise and its lowest index; else -inf and a sentinel).
        q_n is the draft's row at n, or one-hot at x_n without HAS_Q; zero where the row has no draft (n == K)."""
        offs_v = tl.arange(0, BLOCK_V)
        best = tl.full((BLOCK_B, BLOCK_V), float("-inf"), tl.float32)
        best_idx = tl.full((BLOCK_B, BLOCK_V), 2147483647, tl.int32)
        fb = tl.full((BLOCK_B, BLOCK_V), float("-inf"), tl.float32)  # p_n / noise, for the fall-back
        fb_idx = tl.full((BLOCK_B, BLOCK_V), 2147483647, tl.int32)
        mass = tl.zeros((BLOCK_B, BLOCK_V), tl.float32)  # per-lane max of the residual
        for v0 in tl.range(0, V_LEN, BLOCK_V, num_stages=NUM_STAGES):
            v = v_start + v0 + offs_v
            m = in_b[:, None] & (v < V)[None, :]
            p = tl.load(p_n[:, None] + v[None, :] * stride_pv, mask=m, other=0.0)
            if HAS_Q:
                q = tl.load(q_n[:, None] + v[None, :] * stride_qv, mask=m & has_draft[:, None], other=0.0)
            else:
                q = tl.where(v[None, :] == x_n[:, None], 1.0, 0.0)
            e = tl.load(noise_rows[:, None] + v[None, :] * stride_nv, mask=m, other=1.0)
            w = tl.maximum(p - q, 0.0)
            mass = tl.maximum(mass, w)
            best, best_idx = _keep_max(tl.where(m, tl.math.div_rn(w, e), float("-inf")), v, best, best_idx)
            if FALLBACK:
                fb, fb_idx = _keep_max(tl.where(m, tl.math.div_rn(p, e), float("-inf")), v, fb, fb_idx)
        top, top_idx = _lowest_argmax(best, best_idx)
        fb_top, fb_top_idx = _lowest_argmax(fb, fb_idx)
        return top, top_idx, tl.max(mass, axis=1), fb_top, fb_top_idx

    @triton.jit
    def _resample(p_n, stride_pv, q_n, stride_qv, x_n, has_draft, noise_rows, stride_nv, in_b, V: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_Q: tl.constexpr):
        """The token emitted at n over the whole vocabulary: the residual max(0, p_n - q_n) raced against the noise
        (q_n = 0 at the bonus position n == K), or p_n's race where the residual is empty (p == q; a second pass
        over V, run only when some row needs it)."""
        w_max, final, mass, fb_max, fb_idx = _residual_race(p_n, stride_pv, q_n, stride_qv, x_n, has_draft, noise_rows,
                                                            stride_nv, in_b, 0, V, V, BLOCK_B, BLOCK_V, NUM_STAGES,
                                                            HAS_Q, False)
        empty = in_b & (mass <= 0.0)
        if tl.max(empty.to(tl.int32), axis=0) > 0:
            fb_max, fallback = _argmax_over_v(p_n, stride_pv, noise_rows, stride_nv, empty, 0, V, V, BLOCK_B, BLOCK_V,
                                              NUM_STAGES, True)
            final = tl.where(empty, fallback, final)
        return final

    @triton.jit
    def _greedy_step(best_k, x_k, k, K, n, final, active):
        """One position k of the greedy walk: active rows emit argmax p_k and go on while it equals their draft."""
        final = tl.where(active, best_k, final)
        match = active & (k < K) & (best_k == x_k)
        return tl.where(match, n + 1, n), final, match

    @triton.jit
    def _store_outputs(num_accepted_ptr, tokens_ptr, stride_tb, stride_tk, rows, in_b, offs_k, x, n, final, K):
        """num_accepted = n; tokens = the n accepted drafts, the final (resampled or bonus) token, then -1."""
        tl.store(num_accepted_ptr + rows, n.to(tl.int64), mask=in_b)
        pos = offs_k[None, :]
        tokens = tl.where(pos < n[:, None], x, tl.where(pos == n[:, None], final[:, None].to(tl.int64), -1))
        tl.store(tokens_ptr + rows[:, None] * stride_tb + pos * stride_tk, tokens, mask=in_b[:, None] & (pos < K + 1))

    # -- the split kernel's partials, one program's chunk of V, and their reduction by the last program ----------

    @triton.jit
    def _greedy_partials(p_rows, stride_pk, stride_pv, noise_rows, stride_nv, in_b, v_start, val, idx, K,
                         V: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
        """Slot k of the partials (val, idx [BLOCK_B] pointers) = max of p_k over this chunk and its lowest index, for
        every position k <= K (which position n is needed is only known once all chunks are in)."""
        k = 0
        while k <= K:  # a while loop: a runtime range() bound breaks the interpreter on numpy >= 2.4
            top, at = _argmax_over_v(p_rows + k * stride_pk, stride_pv, noise_rows, stride_nv, in_b, v_start,
                                     V, CHUNK, BLOCK_B, BLOCK_V, NUM_STAGES, False)
            tl.store(val + k, top, mask=in_b)
            tl.store(idx + k, at, mask=in_b)
            k += 1

    @triton.jit
    def _store_sampled_partials(val, idx, in_b, top, top_idx, mass, fb_top, fb_idx):
        """Sampled slots: 0 = the residual's race (max of w / noise, its lowest index), 1 = max of w, 2 = p_n's race."""
        tl.store(val, top, mask=in_b)
        tl.store(idx, top_idx, mask=in_b)
        tl.store(val + 1, mass, mask=in_b)
        tl.store(val + 2, fb_top, mask=in_b)
        tl.store(idx + 2, fb_idx, mask=in_b)

    @triton.jit
    def _reduce_greedy(vals, idxs, in_bc, in_b, x_rows, stride_dk, K, BLOCK_B: tl.constexpr):
        """(n, final) of the greedy walk over every chunk's slot-k maxima (vals, idxs [BLOCK_B, BLOCK_C] pointers):
        the lowest index among the chunk maxima equal to the overall one is the reference's argmax (chunks cover
        disjoint index ranges)."""
        n = tl.zeros((BLOCK_B,), tl.int32)
        final = tl.zeros((BLOCK_B,), tl.int32)
        active = in_b
        k = 0
        while k <= K:
            c_vals = tl.load(vals + k, mask=in_bc, other=float("-inf"), cache_modifier=".cg")
            c_idx = tl.load(idxs + k, mask=in_bc, other=2147483647, cache_modifier=".cg")
            top, best_k = _lowest_argmax(c_vals, c_idx)
            x_k = tl.load(x_rows + k * stride_dk, mask=active & (k < K), other=-1)
            n, final, active = _greedy_step(best_k, x_k, k, K, n, final, active)
            k += 1
        return n, final

    @triton.jit
    def _reduce_sampled(vals, idxs, in_bc):
        """The emitted token from every chunk's sampled slots: the residual's race, or p_n's where the residual is
        empty everywhere (p == q)."""
        c_vals = tl.load(vals, mask=in_bc, other=float("-inf"), cache_modifier=".cg")
        c_idx = tl.load(idxs, mask=in_bc, other=2147483647, cache_modifier=".cg")
        top, final = _lowest_argmax(c_vals, c_idx)
        c_mass = tl.load(vals + 1, mask=in_bc, other=0.0, cache_modifier=".cg")
        empty = tl.max(c_mass, axis=1) <= 0.0
        c_vals = tl.load(vals + 2, mask=in_bc, other=float("-inf"), cache_modifier=".cg")
        c_idx = tl.load(idxs + 2, mask=in_bc, other=2147483647, cache_modifier=".cg")
        fb_top, fallback = _lowest_argmax(c_vals, c_idx)
        return tl.where(empty, fallback, final)

    # -- the kernels -----------------------------------------------------------------------------------

    @triton.jit
    def _verify_kernel(
        draft_tokens_ptr, draft_probs_ptr, target_probs_ptr, uniform_ptr, noise_ptr,
        num_accepted_ptr, tokens_ptr,
        stride_db, stride_dk,
        stride_qb, stride_qk, stride_qv,
        stride_pb, stride_pk, stride_pv,
        stride_ub, stride_uk,
        stride_nb, stride_nv,
        stride_tb, stride_tk,
        B, K, V: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr,
        HAS_Q: tl.constexpr, GREEDY: tl.constexpr,
    ):
        """BLOCK_B rows per program: accept test over K positions, first rejection, residual/bonus draw.

        V is a constexpr: one compile per vocabulary size, which is fixed per model pair. (It also keeps the
        V loop's bound a Python int under TRITON_INTERPRET=1, whose scalar handling breaks on numpy >= 2.4,
        triton-lang/triton#9171.) NUM_STAGES > 1 lets triton prefetch later V blocks (cp.async) while one is
        being reduced.
        """
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        in_b = rows < B
        rows = rows.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)  # BLOCK_K >= K + 1
        in_bk = in_b[:, None] & (offs_k < K)[None, :]  # [BLOCK_B, BLOCK_K]
        x = tl.load(draft_tokens_ptr + rows[:, None] * stride_db + offs_k[None, :] * stride_dk, mask=in_bk, other=0)
        p_rows = target_probs_ptr + rows * stride_pb
        noise_rows = noise_ptr + rows * stride_nb

        if GREEDY:
            # accept while draft == argmax p; each row stops at its first mismatch (or at the bonus position)
            n = tl.zeros((BLOCK_B,), tl.int32)
            final = tl.zeros((BLOCK_B,), tl.int32)
            active = in_b
            searching = tl.max(active.to(tl.int32), axis=0) > 0
            while searching:
                p_max, best = _argmax_over_v(p_rows + n * stride_pk, stride_pv, noise_rows, stride_nv, active, 0,
                                             V, V, BLOCK_B, BLOCK_V, NUM_STAGES, False)
                x_n = tl.load(draft_tokens_ptr + rows * stride_db + n * stride_dk, mask=active & (n < K), other=-1)
                n, final, active = _greedy_step(best, x_n, n, K, n, final, active)
                searching = tl.max(active.to(tl.int32), axis=0) > 0
        else:
            n = _accept_test(x, p_rows, stride_pk, stride_pv, draft_probs_ptr + rows * stride_qb, stride_qk, stride_qv,
                             uniform_ptr + rows * stride_ub, stride_uk, offs_k, in_bk, K, V, BLOCK_B, BLOCK_K, HAS_Q)
            has_draft = in_b & (n < K)
            x_n = tl.load(draft_tokens_ptr + rows * stride_db + n * stride_dk, mask=has_draft, other=-1)
            final = _resample(p_rows + n * stride_pk, stride_pv, draft_probs_ptr + rows * stride_qb + n * stride_qk,
                              stride_qv, x_n, has_draft, noise_rows, stride_nv, in_b, V, BLOCK_B, BLOCK_V, NUM_STAGES,
                              HAS_Q)

        _store_outputs(num_accepted_ptr, tokens_ptr, stride_tb, stride_tk, rows, in_b, offs_k, x, n, final, K)

    @triton.jit
    def _verify_split_kernel(
        draft_tokens_ptr, draft_probs_ptr, target_probs_ptr, uniform_ptr, noise_ptr,
        num_accepted_ptr, tokens_ptr, part_val_ptr, part_idx_ptr, count_ptr,
        stride_db, stride_dk,
        stride_qb, stride_qk, stride_qv,
        stride_pb, stride_pk, stride_pv,
        stride_ub, stride_uk,
        stride_nb, stride_nv,
        stride_tb, stride_tk,
        B, K, n_chunks, V: tl.constexpr, CHUNK: tl.constexpr, SLOTS: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
        NUM_STAGES: tl.constexpr, HAS_Q: tl.constexpr, GREEDY: tl.constexpr,
    ):
        """The same result with V split over programs: grid (row blocks, n_chunks), one launch.

        Each program redoes its rows' accept test (K gathered loads), reduces its CHUNK of the vocabulary to
        partials in part_val/part_idx [B, n_chunks, SLOTS] (`_greedy_partials`, `_store_sampled_partials`), and
        bumps its row block's counter; the program that bumps it last reduces the n_chunks partials
        (`_reduce_greedy`, `_reduce_sampled`) and writes the outputs.
        """
        pid_b = tl.program_id(0)
        chunk = tl.program_id(1)
        rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        in_b = rows < B
        rows = rows.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)  # BLOCK_K >= K + 1
        in_bk = in_b[:, None] & (offs_k < K)[None, :]  # [BLOCK_B, BLOCK_K]
        x = tl.load(draft_tokens_ptr + rows[:, None] * stride_db + offs_k[None, :] * stride_dk, mask=in_bk, other=0)
        p_rows = target_probs_ptr + rows * stride_pb
        noise_rows = noise_ptr + rows * stride_nb
        v_start = chunk * CHUNK
        part = (rows * n_chunks + chunk) * SLOTS  # [BLOCK_B]: this program's partials

        if GREEDY:
            _greedy_partials(p_rows, stride_pk, stride_pv, noise_rows, stride_nv, in_b, v_start, part_val_ptr + part,
                             part_idx_ptr + part, K, V, CHUNK, BLOCK_B, BLOCK_V, NUM_STAGES)
        else:
            n = _accept_test(x, p_rows, stride_pk, stride_pv, draft_probs_ptr + rows * stride_qb, stride_qk, stride_qv,
                             uniform_ptr + rows * stride_ub, stride_uk, offs_k, in_bk, K, V, BLOCK_B, BLOCK_K, HAS_Q)
            has_draft = in_b & (n < K)
            x_n = tl.load(draft_tokens_ptr + rows * stride_db + n * stride_dk, mask=has_draft, other=-1)
            top, idx, mass, fb_top, fb_idx = _residual_race(
                p_rows + n * stride_pk, stride_pv, draft_probs_ptr + rows * stride_qb + n * stride_qk, stride_qv, x_n,
                has_draft, noise_rows, stride_nv, in_b, v_start, V, CHUNK, BLOCK_B, BLOCK_V, NUM_STAGES, HAS_Q, True)
            _store_sampled_partials(part_val_ptr + part, part_idx_ptr + part, in_b, top, idx, mass, fb_top, fb_idx)

        # all of this program's partial stores happen before its counter bump (barrier, then a release at gpu
        # scope); the last program's acquire then sees every chunk's partials (read past L1: .cg)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_b, 1, sem="acq_rel", scope="gpu")
        if done == n_chunks - 1:
            offs_c = tl.arange(0, BLOCK_C)
            in_bc = in_b[:, None] & (offs_c < n_chunks)[None, :]  # [BLOCK_B, BLOCK_C]
            parts = (rows[:, None] * n_chunks + offs_c[None, :]) * SLOTS
            if GREEDY:
                n, final = _reduce_greedy(part_val_ptr + parts, part_idx_ptr + parts, in_bc, in_b,
                                          draft_tokens_ptr + rows * stride_db, stride_dk, K, BLOCK_B)
            else:
                final = _reduce_sampled(part_val_ptr + parts, part_idx_ptr + parts, in_bc)
            _store_outputs(num_accepted_ptr, tokens_ptr, stride_tb, stride_tk, rows, in_b, offs_k, x, n, final, K)

    @functools.lru_cache(maxsize=None)
    def _num_sms(device_index: int) -> int:
        return torch.cuda.get_device_properties(device_index).multi_processor_count

    def _chunking(V: int, block_v: int, n_chunks: int) -> tuple[int, int]:
        """(CHUNK, n_chunks): at most `n_chunks` chunks of a multiple of block_v covering V, none of them empty."""
        n_chunks = max(1, min(n_chunks, triton.cdiv(V, block_v)))
        chunk = triton.cdiv(triton.cdiv(V, n_chunks), block_v) * block_v
        return chunk, triton.cdiv(V, chunk)

    def _launch_config(B: int, V: int, device: torch.device) -> tuple[int, int, int, int, int]:
        """(BLOCK_B, BLOCK_V, num_warps, num_stages, n_chunks). On CUDA one row per program and V split in chunks so
        that there are about 4 programs per SM (`python -m benchmarks.kernels --sweep` times the alternatives,
        n_chunks = 1 included); the interpreter runs programs one after another in Python, so there each program
        takes many rows, and V is split in a few chunks so that the split path is what the tests exercise."""
        if device.type == "cuda":
            block_v = min(triton.next_power_of_2(V), 2048)
            index = device.index if device.index is not None else torch.cuda.current_device()
            _, n_chunks = _chunking(V, block_v, triton.cdiv(4 * _num_sms(index), B))
            if n_chunks == 1:  # enough rows to fill the GPU: whole rows per program, as tuned before the split
                return 1, min(triton.next_power_of_2(V), 4096), 8, 1, 1
            return 1, block_v, 4, 1, n_chunks
        block_v = min(triton.next_power_of_2(triton.cdiv(V, 3)), 8192)
        return min(triton.next_power_of_2(B), max(1, 2**18 // block_v)), block_v, 1, 1, 3

    def _verify_triton_launch(draft_tokens, draft_probs, target_probs, uniform, noise, greedy,
                              block_b: int, block_v: int, num_warps: int, num_stages: int = 1,
                              n_chunks: int = 1) -> VerifyResult:
        """Allocate the outputs and launch once; inputs are checked and randoms drawn by the caller. n_chunks == 1
        runs `_verify_kernel` (a program streams whole rows); more runs `_verify_split_kernel` over at most that many
        chunks of V (see `_chunking`), with a [B, n_chunks, SLOTS] scratch and a zeroed counter per row block."""
        B, K, V = draft_tokens.shape[0], draft_tokens.shape[1], target_probs.shape[2]
        num_accepted = torch.empty((B,), dtype=torch.int64, device=target_probs.device)
        tokens = torch.empty((B, K + 1), dtype=torch.int64, device=target_probs.device)
        if B == 0:
            return VerifyResult(num_accepted=num_accepted, tokens=tokens)

        # the kernel never reads an argument it does not need (greedy: randoms; K == 0: drafts);
        # it gets a one-element stand-in of the right dtype rather than an empty or absent tensor
        def stand_in(t, dtype, dims):
            if t is not None and t.numel() > 0:
                return t, t.stride()
            return target_probs.new_empty((1,), dtype=dtype), (0,) * dims

        d, d_strides = stand_in(draft_tokens, torch.int64, 2)
        q, q_strides = stand_in(draft_probs, torch.float32, 3)
        u, u_strides = stand_in(uniform, torch.float32, 2)
        e, e_strides = stand_in(noise, torch.float32, 2)
        strides = (*d_strides, *q_strides, *target_probs.stride(), *u_strides, *e_strides, *tokens.stride())
        block_k = triton.next_power_of_2(K + 1)
        chunk, n_chunks = _chunking(V, block_v, n_chunks)
        if n_chunks == 1:
            _verify_kernel[(triton.cdiv(B, block_b),)](
                d, q, target_probs, u, e, num_accepted, tokens, *strides,
                B, K, V,
                BLOCK_B=block_b, BLOCK_K=block_k, BLOCK_V=block_v, NUM_STAGES=num_stages,
                HAS_Q=draft_probs is not None, GREEDY=greedy,
                num_warps=num_warps,
            )
            return VerifyResult(num_accepted=num_accepted, tokens=tokens)
        slots = K + 1 if greedy else 3
        part_val = torch.empty((B, n_chunks, slots), dtype=torch.float32, device=target_probs.device)
        part_idx = torch.empty((B, n_chunks, slots), dtype=torch.int32, device=target_probs.device)
        count = torch.zeros((triton.cdiv(B, block_b),), dtype=torch.int32, device=target_probs.device)
        _verify_split_kernel[(triton.cdiv(B, block_b), n_chunks)](
            d, q, target_probs, u, e, num_accepted, tokens, part_val, part_idx, count, *strides,
            B, K, n_chunks, V, CHUNK=chunk, SLOTS=slots,
            BLOCK_B=block_b, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_C=triton.next_power_of_2(n_chunks),
            NUM_STAGES=num_stages, HAS_Q=draft_probs is not None, GREEDY=greedy,
            num_warps=num_warps,
        )
        return VerifyResult(num_accepted=num_accepted, tokens=tokens)

    def verify_triton(
        draft_tokens: torch.Tensor,  # [B, K] int64
        draft_probs: torch.Tensor | None,  # [B, K, V] float32, None when the drafter is deterministic (q one-hot)
        target_probs: torch.Tensor,  # [B, K+1, V] float32
        *,
        uniform: torch.Tensor | None = None,  # [B, K]
        noise: torch.Tensor | None = None,  # [B, V]
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> VerifyResult:
        """The reference in one kernel launch, with no host synchronisation: same randoms, same tokens."""
        B, K, V = _check_inputs(draft_tokens, draft_probs, target_probs, uniform, noise)
        if draft_tokens.dtype != torch.int64:
            raise ValueError(f"draft_tokens must be int64 for the triton backend, got {draft_tokens.dtype}")
        for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs), ("uniform", uniform), ("noise", noise)):
            if t is not None and t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 for the triton backend, got {t.dtype}")
        if greedy:
            uniform = noise = None  # not read
        elif uniform is None or noise is None:
            u, e = draw_randoms(B, K, V, target_probs.device, generator)  # the reference's draws, in its order
            uniform = u if uniform is None else uniform
            noise = e if noise is None else noise
        return _verify_triton_launch(draft_tokens, draft_probs, target_probs, uniform, noise, greedy,
                                     *_launch_config(B, V, target_probs.device))


# ----------------------------------------------------------------------------------------------------
# Backend switch


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when the Triton backend can run on `device` (CUDA, or any device under TRITON_INTERPRET=1)."""
    if verify_triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    dev = torch.device(device) if device is not None else None
    return torch.cuda.is_available() and (dev is None or dev.type == "cuda")


def resolve_backend(name: str, device: torch.device | str | None = None) -> str:
    """Map "torch" | "triton" | "auto" to the backend that will run; raise on unknown names."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(BACKENDS)}")
    if name == "auto":
        dev = torch.device(device) if device is not None else None
        on_cuda = dev is not None and dev.type == "cuda"
        return "triton" if on_cuda and triton_available(dev) else "torch"
    if name == "triton" and not triton_available(device):
        raise ValueError("backend 'triton' needs CUDA (or TRITON_INTERPRET=1) and the triton package; use 'torch' or 'auto'")
    return name


def verify(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (deterministic drafter)
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    *,
    uniform: torch.Tensor | None = None,  # [B, K]
    noise: torch.Tensor | None = None,  # [B, V]
    generator: torch.Generator | None = None,
    greedy: bool = False,
    backend: str = "auto",
) -> VerifyResult:
    """Run the exact speculative test with the chosen backend ("torch" | "triton" | "auto")."""
    chosen = resolve_backend(backend, target_probs.device)
    if chosen == "triton":
        return verify_triton(draft_tokens, draft_probs, target_probs, uniform=uniform, noise=noise,
                             generator=generator, greedy=greedy)
    return verify_torch(draft_tokens, draft_probs, target_probs, uniform=uniform, noise=noise,
                        generator=generator, greedy=greedy)
