"""One level of a greedy draft tree (EAGLE-2's expansion): each frontier node's best children under the draft head,
and the nodes the next level expands, as the PyTorch reference and as two Triton kernels; and the tree ranked from
its levels, with its views, in one kernel.

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

    rank_tree_triton(scores [B, M], parents [M], tokens [B, M], size, depth, width) -> Ranked

    next_frontier(level, ids [V'], h [B, W, H], visible [W, S], own [w, S], backend) -> tokens, h, visible

Between levels, what the head's step over the chosen nodes reads: their tokens (`ids[picked_child]`), their
parents' hidden states (`h[:, up]`) and what each sees (its parent's visible slots and its own: `visible[up] |
own`): four torch kernels, or one.

After the last level, the tree: the `size` best of all levels' candidates by row 0's scores, numbered best first,
with its parents, tokens, scores, and the views a captured round reads (ancestors, depths, child table, path
table), in one kernel where torch takes ~40 (its reference: `flashspec_core.drafters._best_nodes` and
`flashspec_core.tree.TensorTree`'s views, which this module does not import: kernels sit below the engine).

    copy_graft_triton(history [B, P], length [1], parents [N], tokens [B, N], scores [B, N], C, depth, width,
                      longest)
        -> Ranked of N + C nodes

A copied branch on the greedy tree (`TreeSize.copy`): prompt lookup over each row's emitted ids, the chain hung
below the node where row 0's copy leaves the tree, and the grown tree's views, in one kernel where torch takes
~100 (`CapturedRound.copied`, `TreeProposal.graft_at`, `TensorTree`'s views).
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
FRONTIER_SLOTS = 1024  # head cache slots a program of the frontier kernel takes


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
                            W: tl.constexpr, w: tl.constexpr, K: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr,
                            CKP: tl.constexpr, KP: tl.constexpr):
        """One program, every row at once: its log-sum-exp and k best from its chunks, then row 0's w best
        candidates (rows 0..W-1, candidate c = r * K + j; ties: the lower c)."""
        r, cc, e, j = tl.arange(0, RP), tl.arange(0, CP), tl.arange(0, CKP), tl.arange(0, KP)
        rows = r[:, None] < R
        cm = tl.load(m_ptr + r[:, None] * C + cc[None, :], mask=rows & (cc[None, :] < C), other=float("-inf"))
        top = tl.max(cm, axis=1)
        top = tl.where(r < R, top, 0.0)  # padded rows: finite, never stored
        sums = tl.load(s_ptr + r[:, None] * C + cc[None, :], mask=rows & (cc[None, :] < C), other=0.0)
        lse = top + tl.log(tl.where(r < R, tl.sum(sums * tl.exp(cm - top[:, None]), axis=1), 1.0))
        live = rows & (e[None, :] < C * K)
        vals = tl.load(v_ptr + r[:, None] * C * K + e[None, :], mask=live, other=float("-inf"))
        ids = tl.load(i_ptr + r[:, None] * C * K + e[None, :], mask=live, other=0)
        base = tl.load(base_ptr + r, mask=r < R, other=0.0).to(tl.float32)
        score = tl.full([RP, KP], float("-inf"), tl.float32)
        child = tl.zeros([RP, KP], tl.int64)
        for k in tl.static_range(K):
            at = tl.argmax(vals, axis=1, tie_break_left=True)
            here = e[None, :] == at[:, None]
            score = tl.where(j[None, :] == k, (base + tl.max(vals, axis=1) - lse)[:, None], score)
            child = tl.where(j[None, :] == k, tl.sum(tl.where(here, ids, 0), axis=1)[:, None], child)
            vals = tl.where(here, float("-inf"), vals)
        out = rows & (j[None, :] < K)
        tl.store(score_ptr + r[:, None] * K + j[None, :], score, mask=out)
        tl.store(child_ptr + r[:, None] * K + j[None, :], child, mask=out)
        flat = tl.reshape(tl.where((r[:, None] < W) & (j[None, :] < K), score, float("-inf")), [RP * KP])
        f = tl.arange(0, RP * KP)
        for n in tl.static_range(w):
            at = tl.argmax(flat, axis=0, tie_break_left=True)
            node, rank = at // KP, at % KP
            tl.store(chosen_ptr + n, (first + node * K + rank).to(tl.int64))
            tl.store(up_ptr + n, node.to(tl.int64))
            for b in tl.static_range(B):
                pick = (r[:, None] == b * W + node) & (j[None, :] == rank)
                tl.store(picked_score_ptr + b * w + n, tl.sum(tl.sum(tl.where(pick, score, 0.0), axis=1), axis=0))
                tl.store(picked_child_ptr + b * w + n, tl.sum(tl.sum(tl.where(pick, child, 0), axis=1), axis=0))
            flat = tl.where(f == at, float("-inf"), flat)


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
                              picked_child, C, first, R=R, B=B, W=W, w=w, K=k, RP=triton.next_power_of_2(R),
                              CP=triton.next_power_of_2(C), CKP=triton.next_power_of_2(C * k),
                              KP=triton.next_power_of_2(k))
    return Level(score, child, chosen, up, picked_score, picked_child)


def tree_level(logits: torch.Tensor, base: torch.Tensor, k: int, w: int, first: int = 0,
               backend: str = "torch") -> Level:
    """A tree level (the module's docstring) by `backend`: "torch" or "triton" (CUDA, or TRITON_INTERPRET=1)."""
    B, W, V = logits.shape
    if not 1 <= k <= min(V, CHUNK) or not 0 <= w <= W * k or base.shape != (B, W):
        raise ValueError(f"a tree level needs 1 <= k <= min(V, {CHUNK}), 0 <= w <= W * k and base [B, W]; got k={k}, "
                         f"w={w}, logits {tuple(logits.shape)}, base {tuple(base.shape)}")
    return _by_backend(backend, tree_level_torch, tree_level_triton)(logits, base, k, w, first)


def _by_backend(backend: str, reference, kernel):
    """The function `backend` names: "torch" (the reference) or "triton" (the kernel; needs the package)."""
    if backend == "triton":
        if triton is None:
            raise ValueError("backend 'triton' needs the triton package")
        return kernel
    if backend != "torch":
        raise ValueError(f"unknown backend {backend!r}; expected 'torch' or 'triton'")
    return reference


# ----------------------------------------------------------------------------------------------------
# The next level's inputs from the chosen nodes


def next_frontier_torch(level: Level, ids: torch.Tensor, h: torch.Tensor, visible: torch.Tensor,
                        own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference (see the module's docstring)."""
    return ids[level.picked_child], h[:, level.up], visible[level.up] | own


if triton is not None:
    @triton.jit
    def _frontier_kernel(up_ptr, picked_ptr, ids_ptr, h_ptr, visible_ptr, own_ptr, token_ptr, h_out_ptr,
                         visible_out_ptr, W, S, B: tl.constexpr, w: tl.constexpr, H: tl.constexpr,
                         HP: tl.constexpr, BLOCK_S: tl.constexpr):
        """Program (n, part): part 0 writes chosen node n's token and its parent's hidden state in every row, part
        p > 0 its visible slots (the parent's or its own) in block p - 1 of BLOCK_S slots."""
        n, part = tl.program_id(0), tl.program_id(1)
        u = tl.load(up_ptr + n)
        if part == 0:
            d = tl.arange(0, HP)
            for b in tl.static_range(B):
                tl.store(token_ptr + b * w + n, tl.load(ids_ptr + tl.load(picked_ptr + b * w + n)))
                row = tl.load(h_ptr + (b * W + u) * H + d, mask=d < H)
                tl.store(h_out_ptr + (b * w + n) * H + d, row, mask=d < H)
        else:
            s = (part - 1) * BLOCK_S + tl.arange(0, BLOCK_S)
            seen = tl.load(visible_ptr + u * S + s, mask=s < S, other=0) | tl.load(own_ptr + n * S + s, mask=s < S,
                                                                                   other=0)
            tl.store(visible_out_ptr + n * S + s, seen, mask=s < S)


def next_frontier_triton(level: Level, ids: torch.Tensor, h: torch.Tensor, visible: torch.Tensor,
                         own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`next_frontier_torch` in one kernel (fixed shapes, no host reads)."""
    (B, W, H), (w, S) = h.shape, own.shape
    tokens = torch.empty(B, w, dtype=ids.dtype, device=h.device)
    h_out = torch.empty(B, w, H, dtype=h.dtype, device=h.device)
    seen = torch.empty(w, S, dtype=torch.bool, device=h.device)
    _frontier_kernel[(w, 1 + triton.cdiv(S, FRONTIER_SLOTS))](level.up, level.picked_child.contiguous(), ids, h.contiguous(),
                             visible.contiguous().view(torch.uint8), own.contiguous().view(torch.uint8), tokens,
                             h_out, seen.view(torch.uint8), W, S, B=B, w=w, H=H, HP=triton.next_power_of_2(H),
                             BLOCK_S=FRONTIER_SLOTS)
    return tokens, h_out, seen


def next_frontier(level: Level, ids: torch.Tensor, h: torch.Tensor, visible: torch.Tensor, own: torch.Tensor,
                  backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next level's inputs (the module's docstring) by `backend`: "torch" or "triton"."""
    w, S = own.shape
    if level.up.shape != (w,) or visible.shape[1] != S or visible.dtype != torch.bool or own.dtype != torch.bool:
        raise ValueError(f"a frontier needs up [w], visible [W, S] and own [w, S] (bool); got up "
                         f"{tuple(level.up.shape)}, visible {visible.dtype} {tuple(visible.shape)}, own {own.dtype} "
                         f"{tuple(own.shape)}")
    return _by_backend(backend, next_frontier_torch, next_frontier_triton)(level, ids, h, visible, own)


# ----------------------------------------------------------------------------------------------------
# The tree from its levels' candidates: the best `size` by row 0's scores, and its views, in one kernel


class Ranked(NamedTuple):
    parents: torch.Tensor  # [N] int64 node parents (-1: the root), nodes numbered best first
    tokens: torch.Tensor  # [B, N] the nodes' tokens
    scores: torch.Tensor  # [B, N] float32
    ancestors: torch.Tensor  # [N+1, D+1] int64: slot s's j-th ancestor slot (j = 0: s), 0 (the root) past it
    depth: torch.Tensor  # [N+1] int64 slot depths (0: the root)
    child_table: torch.Tensor  # [N+1, W] int64: slot s's children (node indices, in node order), -1 padded
    path_table: torch.Tensor  # [N+1, D+1] int32: slot s's path from the root down to s, then j past it


if triton is not None:
    @triton.jit
    def _tree_views(node_parent_ptr, anc_ptr, depth_ptr, child_ptr, path_ptr, N: tl.constexpr, D: tl.constexpr,
                    W: tl.constexpr, NP: tl.constexpr, DP: tl.constexpr, WP: tl.constexpr):
        """A tree's views from its node parents (stored before the call): the slots' ancestors and depths, paths
        and children (a node's rank among its siblings), each phase reading what the one before stored."""
        slot = tl.arange(0, NP)
        live = slot <= N
        anc, depth = slot.to(tl.int64), tl.zeros([NP], tl.int64)
        tl.store(anc_ptr + slot * (D + 1), anc, mask=live)
        for j in tl.static_range(1, D + 1):
            depth += (anc != 0).to(tl.int64)
            anc = tl.where(anc > 0, tl.load(node_parent_ptr + anc - 1, mask=live & (anc > 0), other=-1) + 1, 0)
            tl.store(anc_ptr + slot * (D + 1) + j, anc, mask=live)
        tl.store(depth_ptr + slot, depth, mask=live)
        node = tl.arange(0, NP)
        p = tl.load(node_parent_ptr + node, mask=node < N, other=-2)
        sibling = tl.sum(((p[None, :] == p[:, None]) & (node[None, :] < node[:, None])).to(tl.int32), axis=1)
        c = tl.arange(0, WP)
        tl.store(child_ptr + slot[:, None] * W + c[None, :], tl.full([NP, WP], -1, tl.int64),
                 mask=live[:, None] & (c[None, :] < W))
        tl.debug_barrier()
        j = tl.arange(0, DP)
        above = depth[:, None] - j[None, :]  # how far above s the path's entry j sits
        inside = live[:, None] & (j[None, :] <= D)
        path = tl.load(anc_ptr + slot[:, None] * (D + 1) + tl.maximum(above, 0), mask=inside, other=0)
        tl.store(path_ptr + slot[:, None] * (D + 1) + j[None, :],
                 tl.where(above >= 0, path, j[None, :]).to(tl.int32), mask=inside)
        tl.store(child_ptr + (p + 1) * W + sibling, node.to(tl.int64), mask=(node < N) & (sibling < W))

    @triton.jit
    def _rank_kernel(score_ptr, parent_ptr, token_ptr, node_parent_ptr, token_out_ptr, score_out_ptr, anc_ptr,
                     depth_ptr, child_ptr, path_ptr, M, B: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                     W: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, DP: tl.constexpr, WP: tl.constexpr):
        """One program. A candidate's node is its rank by row 0's score (higher first, ties: the lower id); a kept
        one's parent node is its parent candidate's rank. Then the tree's views (`_tree_views`)."""
        m = tl.arange(0, MP)
        s = tl.load(score_ptr + m, mask=m < M, other=float("-inf"))
        beats = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (m[None, :] < m[:, None]))
        rank = tl.sum((beats & (m[None, :] < M)).to(tl.int32), axis=1)
        kept = (m < M) & (rank < N)
        up = tl.load(parent_ptr + m, mask=m < M, other=-1)
        up_rank = tl.sum(tl.where(m[None, :] == up[:, None], rank[None, :], 0), axis=1)
        tl.store(node_parent_ptr + rank, tl.where(up >= 0, up_rank, -1).to(tl.int64), mask=kept)
        for b in tl.static_range(B):
            tl.store(token_out_ptr + b * N + rank, tl.load(token_ptr + b * M + m, mask=m < M), mask=kept)
            tl.store(score_out_ptr + b * N + rank, tl.load(score_ptr + b * M + m, mask=m < M), mask=kept)
        tl.debug_barrier()
        _tree_views(node_parent_ptr, anc_ptr, depth_ptr, child_ptr, path_ptr, N, D, W, NP, DP, WP)


def empty_ranked(B: int, N: int, D: int, W: int, tokens: torch.Tensor, scores: torch.Tensor) -> Ranked:
    """A `Ranked`'s buffers for B rows of an N-node tree with depth bound D and child bound W (tokens and scores
    give the dtypes and the device)."""
    dev, slots = tokens.device, N + 1
    return Ranked(torch.empty(N, dtype=torch.int64, device=dev), torch.empty(B, N, dtype=tokens.dtype, device=dev),
                  torch.empty(B, N, dtype=scores.dtype, device=dev),
                  torch.empty(slots, D + 1, dtype=torch.int64, device=dev),
                  torch.empty(slots, dtype=torch.int64, device=dev),
                  torch.empty(slots, W, dtype=torch.int64, device=dev),
                  torch.empty(slots, D + 1, dtype=torch.int32, device=dev))


def rank_tree_triton(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, size: int, depth: int,
                     width: int) -> Ranked:
    """The `size` best candidates by row 0's scores [B, M] (candidate parents [M], -1 the root; tokens [B, M]) as a
    tree numbered best first, and its views for a depth bound `depth` and child bound `width`: what
    `flashspec_core.drafters._best_nodes` and `TensorTree`'s views give, in one kernel. A child must never score
    above its parent (a parent ties first: it is the earlier candidate), as a tree level's scores never do."""
    B, M = scores.shape
    N, D = min(size, M), depth
    out = empty_ranked(B, N, D, width, tokens, scores)
    _rank_kernel[(1,)](scores.contiguous(), parents.contiguous(), tokens.contiguous(), out.parents, out.tokens,
                       out.scores, out.ancestors, out.depth, out.child_table, out.path_table, M, B=B, N=N, D=D,
                       W=width, MP=triton.next_power_of_2(M), NP=triton.next_power_of_2(N + 1),
                       DP=triton.next_power_of_2(D + 1), WP=triton.next_power_of_2(width), num_warps=8)
    return out


# ----------------------------------------------------------------------------------------------------
# A copied branch: prompt lookup over the emitted ids, grafted below the tree, and the grown tree's views


if triton is not None:
    @triton.jit
    def _lookup(hist_ptr, end, P, b, chain_ptr, C: tl.constexpr, LONGEST: tl.constexpr, CP: tl.constexpr,
                BLOCK: tl.constexpr):
        """Row b's copied chain into chain_ptr[b]: the C ids after the latest earlier occurrence of the longest
        (2..LONGEST) run of its last ids (the pending one, at `end`, last); -1 where there is none or past `end`.
        The scan reads positions below `end` only."""
        row = hist_ptr + b * P
        best, start = tl.full([], -1, tl.int64), end * 0
        while start < end:  # (a loop bound read from memory: a while, which the interpreter runs too)
            pos = start + tl.arange(0, BLOCK).to(tl.int64)
            run, score = pos < end, tl.full([BLOCK], -1, tl.int64)
            for g in tl.static_range(LONGEST):  # the g + 1 ids ending at pos equal the g + 1 ending at `end`
                last = tl.load(row + tl.maximum(end - g, 0))
                run = run & (tl.load(row + tl.maximum(pos - g, 0), mask=pos < end, other=-2) == last) & (pos >= g)
                if g > 0:
                    score = tl.where(run, g * P + pos, score)  # longer runs first, then the latest
            best = tl.maximum(best, tl.max(score))
            start += BLOCK
        c = tl.arange(0, CP)
        src = best % P + 1 + c
        ids = tl.load(row + tl.minimum(src, P - 1), mask=c < C, other=-1)
        tl.store(chain_ptr + b * C + c, tl.where((best >= 0) & (src <= end), ids, -1), mask=c < C)

    @triton.jit
    def _graft_kernel(hist_ptr, length_ptr, parent_ptr, token_ptr, score_ptr, chain_ptr, node_parent_ptr,
                      token_out_ptr, score_out_ptr, anc_ptr, depth_ptr, child_ptr, path_ptr, P, B: tl.constexpr,
                      N: tl.constexpr, C: tl.constexpr, LONGEST: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                      NP: tl.constexpr, CP: tl.constexpr, DP: tl.constexpr, WP: tl.constexpr,
                      BLOCK: tl.constexpr):
        """One program: every row's copied chain (`_lookup`); the node `at` where row 0's chain leaves the tree
        (m of its ids held from the root); the grown tree's parents (the N nodes', at, then a chain below it),
        tokens (the chain's ids from m on, then -1) and scores (at's, the root's 0); then its views. N, D, W are
        the grown tree's; the input tree has N - C nodes."""
        end = tl.load(length_ptr)
        for b in tl.static_range(B):
            _lookup(hist_ptr, end, P, b, chain_ptr, C, LONGEST, CP, BLOCK)
        tl.debug_barrier()
        n, c = tl.arange(0, NP), tl.arange(0, CP)
        old = n < N - C
        up = tl.load(parent_ptr + n, mask=old, other=-3)
        first = tl.load(token_ptr + n, mask=old, other=-3)
        at, m = tl.full([], -1, tl.int64), tl.full([], 0, tl.int64)
        for j in tl.static_range(C):  # at's child carrying the chain's id j, while the tree holds them all
            hit = old & (up == at) & (first == tl.load(chain_ptr + j)) & (m == j)
            held = tl.max(hit.to(tl.int32)) > 0
            at = tl.where(held, tl.min(tl.where(hit, n, NP)).to(tl.int64), at)
            m += held.to(tl.int64)
        new = tl.where(c == 0, at, N - C + c - 1)
        tl.store(node_parent_ptr + n, up, mask=old)
        tl.store(node_parent_ptr + N - C + c, new, mask=c < C)
        take = m + c
        for b in tl.static_range(B):
            tl.store(token_out_ptr + b * N + n, tl.load(token_ptr + b * (N - C) + n, mask=old), mask=old)
            tl.store(score_out_ptr + b * N + n, tl.load(score_ptr + b * (N - C) + n, mask=old), mask=old)
            ids = tl.load(chain_ptr + b * C + tl.minimum(take, C - 1), mask=c < C, other=-1)
            tl.store(token_out_ptr + b * N + N - C + c, tl.where(take < C, ids, -1), mask=c < C)
            above = tl.load(score_ptr + b * (N - C) + tl.maximum(at, 0))
            tl.store(score_out_ptr + b * N + N - C + c, tl.where(at >= 0, above, 0.0) + tl.zeros([CP], tl.float32),
                     mask=c < C)
        tl.debug_barrier()
        _tree_views(node_parent_ptr, anc_ptr, depth_ptr, child_ptr, path_ptr, N, D, W, NP, DP, WP)


def copy_graft_triton(history: torch.Tensor, length: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
                      scores: torch.Tensor, C: int, depth: int, width: int, longest: int) -> Ranked:
    """A greedy tree (parents [N], tokens [B, N], scores [B, N] float32; depth and child bounds) grown by prompt
    lookup's chain as one more branch, in one kernel: each row's C ids after the latest earlier occurrence of the
    longest (2..longest) run of its last ids in history [B, P] (the emitted ids; the pending one at length [1]),
    hung below the node where row 0's chain leaves the tree, the ids the tree held as -1s; always C new nodes,
    scoring as the node they hang from. The grown tree and its views for bounds depth + C and width + 1: what
    `CapturedRound.copied`, `TreeProposal.graft_at` and `TensorTree`'s views give in ~100 torch kernels."""
    (B, N), P = tokens.shape, history.shape[1]
    G, D, W = N + C, depth + C, width + 1
    out = empty_ranked(B, G, D, W, tokens, scores)
    chain = torch.empty(B, C, dtype=torch.int64, device=tokens.device)
    _graft_kernel[(1,)](history, length, parents.contiguous(), tokens.contiguous(), scores.contiguous(), chain,
                        out.parents, out.tokens, out.scores, out.ancestors, out.depth, out.child_table,
                        out.path_table, P, B=B, N=G, C=C, LONGEST=longest, D=D, W=W,
                        NP=triton.next_power_of_2(G + 1), CP=triton.next_power_of_2(C),
                        DP=triton.next_power_of_2(D + 1), WP=triton.next_power_of_2(W), BLOCK=1024, num_warps=8)
    return out
