"""One level of a greedy draft tree (EAGLE-2's expansion): each frontier node's best children under the draft head,
and the nodes the next level expands, as the PyTorch reference and as two Triton kernels.

    tree_level(logits [B, W, V], base [B, W], k, w, first, backend) -> Level
        score [B, W * k]    base + log q of each node's k best children (candidate c = node * k + rank, best first)
        child [B, W * k]    their indices in the draft vocabulary
        chosen [w]          candidate ids (first + c) of the w best by row 0's scores, best first (ties: lower c)
        up [w]              their frontier nodes (c // k)
        picked_score, picked_child [B, w]   the chosen candidates' scores and children in every row

q is softmax(logits) over the row (temperature 1). The shape is row 0's; each row keeps its own tokens there.
PyTorch runs a level as a log-softmax, a top-k in two passes, a sort and five gathers: ~17 kernels and, on an
H200, ~40 us of top-k over 16,384 draft ids. The kernels: one program per (row, chunk of CHUNK ids) for the chunk's
maximum, its sum of exponentials and its k best; then one program that merges the chunks of every row into the
row's log-sum-exp and k best, and picks row 0's w best. Ties among children go to the lower id, among candidates
to the lower c; the values are within a rounding of the reference's (the log-sum-exp is summed by chunks).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still runs
    triton = None

CHUNK = 512  # draft ids a program of the first kernel takes


class Level(NamedTuple):
    score: torch.Tensor  # [B, W * k] float32
    child: torch.Tensor  # [B, W * k] int64
    chosen: torch.Tensor  # [w] int64, first + c
    up: torch.Tensor  # [w] int64
    picked_score: torch.Tensor  # [B, w] float32
    picked_child: torch.Tensor  # [B, w] int64


def chunked_topk(x: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` (values, indices; best first) in two passes over long rows: the k best of each chunk of
    `chunk` entries, then the k best of those. A GPU runs one long row's top-k on one block (~40-50 us a level of
    the head's tree over 16,384 draft ids); short slices spread over its blocks. Ties may come in another order."""
    V = x.shape[-1]
    if V <= chunk or V % chunk or k > chunk:
        return x.topk(k, dim=-1)
    part = x.unflatten(-1, (V // chunk, chunk)).topk(k, dim=-1)  # [..., V / chunk, k] each
    values, where = part.values.flatten(-2).topk(k, dim=-1)
    base = torch.arange(0, V, chunk, device=x.device)[:, None]  # each chunk's first index
    return values, (part.indices + base).flatten(-2).gather(-1, where)


def tree_level_torch(logits: torch.Tensor, base: torch.Tensor, k: int, w: int, first: int = 0) -> Level:
    """The reference (see the module's docstring)."""
    logq, child = chunked_topk(logits.log_softmax(dim=-1, dtype=torch.float32), k)  # [B, W, k] each
    score, child = (base[..., None] + logq).flatten(1), child.flatten(1)
    c = score[0].sort(descending=True, stable=True).indices[:w]  # ties: the earlier candidate first
    return Level(score, child, first + c, c // k, score[:, c], child[:, c])


if triton is not None:
    @triton.jit
    def _level_part_kernel(x_ptr, m_ptr, s_ptr, v_ptr, i_ptr, V, C, CHUNK: tl.constexpr, K: tl.constexpr):
        """One program per (row r, chunk c): the chunk's maximum m, sum of exp(x - m) and k best (value, id)."""
        r, c = tl.program_id(0), tl.program_id(1)
        lane = tl.arange(0, CHUNK)
        n = c * CHUNK + lane
        x = tl.load(x_ptr + r.to(tl.int64) * V + n, mask=n < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        tl.store(m_ptr + r * C + c, m)
        tl.store(s_ptr + r * C + c, tl.sum(tl.exp(x - m), axis=0))
        for j in tl.static_range(K):
            at = tl.argmax(x, axis=0, tie_break_left=True)
            tl.store(v_ptr + (r * C + c) * K + j, tl.max(x, axis=0))
            tl.store(i_ptr + (r * C + c) * K + j, (c * CHUNK + at).to(tl.int64))
            x = tl.where(lane == at, float("-inf"), x)

    @triton.jit
    def _level_merge_kernel(m_ptr, s_ptr, v_ptr, i_ptr, base_ptr, score_ptr, child_ptr, chosen_ptr, up_ptr,
                            picked_score_ptr, picked_child_ptr, C, first, R: tl.constexpr, B: tl.constexpr,
                            W: tl.constexpr, w: tl.constexpr, K: tl.constexpr, CP: tl.constexpr,
                            CKP: tl.constexpr, WKP: tl.constexpr):
        """One program: every row's log-sum-exp and k best from its chunks, then row 0's w best candidates (loop
        bounds are constexprs: Python ints under TRITON_INTERPRET=1; one compile per tree shape)."""
        cc, e = tl.arange(0, CP), tl.arange(0, CKP)
        for r in range(R):
            cm = tl.load(m_ptr + r * C + cc, mask=cc < C, other=float("-inf"))
            M = tl.max(cm, axis=0)
            lse = M + tl.log(tl.sum(tl.load(s_ptr + r * C + cc, mask=cc < C, other=0.0) * tl.exp(cm - M), axis=0))
            vals = tl.load(v_ptr + r * C * K + e, mask=e < C * K, other=float("-inf"))
            ids = tl.load(i_ptr + r * C * K + e, mask=e < C * K, other=0)
            b = tl.load(base_ptr + r).to(tl.float32)
            for j in tl.static_range(K):
                at = tl.argmax(vals, axis=0, tie_break_left=True)
                tl.store(score_ptr + r * K + j, b + (tl.max(vals, axis=0) - lse))
                tl.store(child_ptr + r * K + j, tl.sum(tl.where(e == at, ids, 0), axis=0))
                vals = tl.where(e == at, float("-inf"), vals)
        tl.debug_barrier()  # the scores above, written by other threads of this program, are read below
        q = tl.arange(0, WKP)
        row0 = tl.load(score_ptr + q, mask=q < W * K, other=float("-inf"))
        for j in range(w):
            at = tl.argmax(row0, axis=0, tie_break_left=True)
            tl.store(chosen_ptr + j, (first + at).to(tl.int64))
            tl.store(up_ptr + j, (at // K).to(tl.int64))
            for b in range(B):
                tl.store(picked_score_ptr + b * w + j, tl.load(score_ptr + b * W * K + at))
                tl.store(picked_child_ptr + b * w + j, tl.load(child_ptr + b * W * K + at))
            row0 = tl.where(q == at, float("-inf"), row0)


def tree_level_triton(logits: torch.Tensor, base: torch.Tensor, k: int, w: int, first: int = 0) -> Level:
    """`tree_level_torch` in two kernels (fixed shapes, no host reads: fit for a CUDA graph)."""
    B, W, V = logits.shape
    C, R, dev = triton.cdiv(V, CHUNK), B * W, logits.device
    m, s = (torch.empty(R, C, dtype=torch.float32, device=dev) for _ in range(2))
    values = torch.empty(R, C, k, dtype=torch.float32, device=dev)
    ids = torch.empty(R, C, k, dtype=torch.int64, device=dev)
    _level_part_kernel[(R, C)](logits.contiguous(), m, s, values, ids, V, C, CHUNK=CHUNK, K=k)
    score = torch.empty(B, W * k, dtype=torch.float32, device=dev)
    child = torch.empty(B, W * k, dtype=torch.int64, device=dev)
    chosen, up = (torch.empty(w, dtype=torch.int64, device=dev) for _ in range(2))
    picked_score = torch.empty(B, w, dtype=torch.float32, device=dev)
    picked_child = torch.empty(B, w, dtype=torch.int64, device=dev)
    _level_merge_kernel[(1,)](m, s, values, ids, base.contiguous(), score, child, chosen, up, picked_score,
                              picked_child, C, first, R=R, B=B, W=W, w=w, K=k, CP=triton.next_power_of_2(C),
                              CKP=triton.next_power_of_2(C * k), WKP=triton.next_power_of_2(W * k))
    return Level(score, child, chosen, up, picked_score, picked_child)


def tree_level(logits: torch.Tensor, base: torch.Tensor, k: int, w: int, first: int = 0,
               backend: str = "torch") -> Level:
    """A tree level (the module's docstring) by `backend`: "torch" or "triton" (CUDA, or TRITON_INTERPRET=1)."""
    B, W, V = logits.shape
    if not 1 <= k <= min(V, CHUNK) or not 0 <= w <= W * k or base.shape != (B, W):
        raise ValueError(f"a tree level needs 1 <= k <= min(V, {CHUNK}), 0 <= w <= W * k and base [B, W]; got k={k}, "
                         f"w={w}, logits {tuple(logits.shape)}, base {tuple(base.shape)}")
    if backend == "triton":
        if triton is None:
            raise ValueError("backend 'triton' needs the triton package")
        return tree_level_triton(logits, base, k, w, first)
    if backend != "torch":
        raise ValueError(f"unknown backend {backend!r}; expected 'torch' or 'triton'")
    return tree_level_torch(logits, base, k, w, first)
