"""Exact acceptance on a draft tree: the emitted tokens follow the target p, whichever branches the drafter offered.

A batch of B trees shares one shape (N nodes below the root, children tried in node order: any `TreeShape`, such
as `flashspec_core.tree.DraftTree`, which this module does not import, as kernels sit below the engine) and holds
its own tokens. The target gives p at every slot (slot 0 = the root, slot i + 1 = node i); `p` = target, `q` =
draft, everywhere in this file. Per row the verifier walks down from the root and returns the accepted nodes (the
path), then one more token drawn from the target: the same shape of answer as the chain verifier
(`kernels/verify.py`), which a chain tree reproduces bit for bit on the same randoms.

Greedy: at each node emit argmax p; if a child carries that token, move to the first such child and go on; if
none does, stop. The output is plain greedy decoding's, token for token.

Sampling: recursive rejection sampling over siblings (SpecInfer, Miao et al. 2023, "multi-step speculative
sampling"; EAGLE-2, Li et al. 2024, verifies its tree with the same rule). At a node whose target law is p, try the
children c_1..c_m in order, with p_1 = p:
    accept c_j (token x_j) when u_j * q_j(x_j) < p_j(x_j), i.e. with probability min(1, p_j(x_j) / q_j(x_j));
    else p_{j+1} = norm(max(0, p_j - q_j)) and try c_{j+1}.
On acceptance move to c_j and start again there with p = the target's law after c_j (a leaf instead emits a bonus
token from it); when c_m is rejected too, emit a token from norm(max(0, p_m - q_m)), and stop.

q_j is the law x_j was drawn from given everything the walk has seen when it tries c_j (the path to the parent,
the earlier siblings, their rejection), never given the verifier's draws; the caller passes it per node as
draft_probs[:, j]. Drafts that are a function of the context alone (deterministic heads, EAGLE-2's dynamic shapes)
always qualify; sampled drafts qualify when a node's subtree is drafted given the path to it only:
  - siblings drawn i.i.d. from the parent's q: q_j = q for every sibling (SpecInfer's case);
  - siblings drawn without replacement: q_j = q with x_1..x_{j-1} removed, renormalised;
  - deterministic siblings (the EAGLE head's top-k; draft_probs=None): q_j one-hot at x_j. The test becomes
    u_j < p_j(x_j), and the residual is p_j with x_j's mass removed, renormalised: a rejected token cannot come
    back, neither as a later sibling nor as the emitted token.

Why the emitted token at a node follows p exactly. Let H_j be everything decided before c_j is tried (which fixes
p_j and q_j). Claim: given H_j, the token emitted at this node (x_j if accepted, or whatever the later siblings or
the final residual give) follows p_j. For j = m + 1 (no sibling left) the token is drawn from p_{m+1}: true. Step:
given H_j, x_j ~ q_j and u_j is uniform and independent, so
    P(accept and emit y) = q_j(y) min(1, p_j(y) / q_j(y)) = min(p_j(y), q_j(y)),
    P(reject) = 1 - sum_y min(p_j, q_j)(y) = sum_y max(0, p_j - q_j)(y) = Z_j,
and given a rejection (whatever x_j was) the rest emits y with probability p_{j+1}(y) = max(0, p_j - q_j)(y) / Z_j
by the claim for j + 1 (p_{j+1} depends on H_j only, not on x_j). In total min(p_j, q_j)(y) + max(0, p_j - q_j)(y)
= p_j(y). With j = 1 the node emits y ~ p. Accepting y moves to the child carrying y, where the target's law is
the law of the next token given y; so by induction down the tree every emitted token follows the target given the
tokens before it, which is the target's joint law (Leviathan et al. / Chen et al. 2023 is the case m = 1).

Randomness is explicit so that backends compare bit for bit; it is the chain verifier's (`draw_randoms(B, N, V)`):
  uniform [B, N] float32 in [0, 1): node i's acceptance draw (each node is tried at most once).
  noise   [B, V] float32 Exp(1): the one sampled token per row (residual or bonus) is argmax(w / noise) over the
          vocabulary, w the unnormalised residual max(0, p_m - q_m) (p_m where that is empty) or the leaf's p.
Between siblings the residual is normalised by its mass Z, which is summed exactly: each entry in fixed point
(truncated to a multiple of 2^-60, int64) and the integers added, so that any reduction order gives the same Z
(target rows must sum to about 1: below 8, so that the sum fits). A residual whose fixed-point mass is 0 is not
normalised: the next sibling is tried against p_j again (a rejection there had probability 0, up to rounding).

The pure-PyTorch reference comes first (it is the specification), then the Triton kernel (one program walks
BLOCK_B rows through the whole tree; the current law of a row whose sibling was rejected lives in a [B, V]
scratch), its launcher with the same signature, and the backend switch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kernels.verify import argmax, draw_randoms, resolve_backend

_FIX = 2.0**60  # the residual mass is summed in multiples of 2^-60 (int64), exactly, in any order
_UNFIX = 2.0**-60


@runtime_checkable
class TreeShape(Protocol):
    """What the verifier needs of a tree's shape (flashspec_core.tree.DraftTree has it)."""

    @property
    def N(self) -> int: ...  # nodes below the root

    @property
    def max_depth(self) -> int: ...  # D: the most nodes one path holds

    def child_table(self, device=None) -> torch.Tensor: ...  # [N+1, W] int64, slot s's children in order, -1 padded


@dataclass(frozen=True)
class TreeVerifyResult:
    num_accepted: torch.Tensor  # [B] int64, accepted draft nodes per row
    path: torch.Tensor  # [B, D] int64: the accepted node indices from the root down, then -1 (for KV compaction)
    tokens: torch.Tensor  # [B, D+1] int64: the accepted drafts' tokens, then the resampled/bonus token, then -1


def _check_inputs(tree, draft_tokens, draft_probs, target_probs, uniform, noise):
    if not isinstance(tree, TreeShape):
        raise ValueError(f"tree must have N, max_depth and child_table() (a DraftTree), got {type(tree).__name__}")
    N = tree.N
    if draft_tokens.dim() != 2 or draft_tokens.shape[1] != N:
        raise ValueError(f"draft_tokens must be [B, N] = [B, {N}], got shape {tuple(draft_tokens.shape)}")
    B = draft_tokens.shape[0]
    if target_probs.dim() != 3 or target_probs.shape[0] != B or target_probs.shape[1] != N + 1:
        raise ValueError(f"target_probs must be [B, N+1, V] = [{B}, {N + 1}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (B, N, V):
        raise ValueError(f"draft_probs must be [B, N, V] = [{B}, {N}, {V}], got {tuple(draft_probs.shape)}")
    if uniform is not None and tuple(uniform.shape) != (B, N):
        raise ValueError(f"uniform must be [B, N] = [{B}, {N}], got {tuple(uniform.shape)}")
    if noise is not None and tuple(noise.shape) != (B, V):
        raise ValueError(f"noise must be [B, V] = [{B}, {V}], got {tuple(noise.shape)}")
    return B, N, V


def _randoms(B, N, V, device, uniform, noise, generator):
    """The given randoms, the missing ones drawn as the chain verifier draws them (same order, same generator)."""
    if uniform is None or noise is None:
        u, e = draw_randoms(B, N, V, device, generator)
        uniform = u if uniform is None else uniform
        noise = e if noise is None else noise
    return uniform, noise


def _emitted_tokens(draft_tokens, num_accepted, path, final):
    """[B, D+1]: the tokens of the accepted nodes, the final token, then -1."""
    B, D = path.shape
    drafted = draft_tokens.gather(1, path.clamp_min(0)) if D else path
    padded = torch.cat([torch.where(path >= 0, drafted, path), path.new_full((B, 1), -1)], dim=1)
    rows = torch.arange(B, device=path.device)
    padded[rows, num_accepted] = final
    return padded


# ----------------------------------------------------------------------------------------------------
# Reference (the specification)


def _runs(mask: torch.Tensor) -> bool:
    """Whether a step's masked block must run. On the host, checking that some row needs it is free and skipping
    saves vocabulary-wide work; on a device the check would be a sync, so there the block always runs (masked)."""
    return mask.device.type != "cpu" or bool(mask.any())


def _record(path, num_accepted, child, taken):
    """path[b, num_accepted[b]] = child[b] where taken[b], in place, without a host read (a boolean index would sync,
    which a captured round cannot): untaken rows write back what they hold."""
    col = num_accepted.clamp_max(path.shape[1] - 1)[:, None]
    path.scatter_(1, col, torch.where(taken[:, None], child[:, None], path.gather(1, col)))


def _greedy_walk_torch(children, draft_tokens, target_probs, D):
    """Follow from the root the first child whose token is the target's argmax at its parent."""
    B = draft_tokens.shape[0]
    rows = torch.arange(B, device=draft_tokens.device)
    slot = torch.zeros(B, dtype=torch.int64, device=draft_tokens.device)
    num_accepted = torch.zeros_like(slot)
    path = torch.full((B, D), -1, dtype=torch.int64, device=draft_tokens.device)
    best = argmax(target_probs[:, 0])  # [B] argmax p at each row's current slot
    active = torch.ones(B, dtype=torch.bool, device=draft_tokens.device)
    for _ in range(D):
        if not _runs(active):
            break
        kids = children[slot]  # [B, W]
        x = draft_tokens.gather(1, kids.clamp_min(0)) if draft_tokens.shape[1] else kids
        match = active[:, None] & (kids >= 0) & (x == best[:, None])
        found = match.any(dim=-1)
        child = kids[rows, match.to(torch.int8).argmax(dim=-1)]  # the first matching child
        _record(path, num_accepted, child, found)
        num_accepted += found
        slot = torch.where(found, child + 1, slot)
        if _runs(found):
            best = torch.where(found, argmax(target_probs[rows, slot]), best)
        active = found
    return num_accepted, path, best


def _fixed_point_mass(r: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B, 1]: the sum of r >= 0 in multiples of 2^-60, exact whatever the order of the additions."""
    return (r * _FIX).to(torch.int64).sum(dim=-1, keepdim=True).to(torch.float32) * _UNFIX


def _sampled_walk_torch(children, draft_tokens, draft_probs, target_probs, uniform, noise, D):
    """Recursive rejection sampling down the tree; one loop step tries one node in every row still walking."""
    B, N = draft_tokens.shape
    W = children.shape[1]
    rows = torch.arange(B, device=draft_tokens.device)
    slot = torch.zeros(B, dtype=torch.int64, device=draft_tokens.device)  # the node whose children are tried
    sib = torch.zeros_like(slot)  # which of them is tried next
    num_accepted = torch.zeros_like(slot)
    path = torch.full((B, D), -1, dtype=torch.int64, device=draft_tokens.device)
    p = target_probs[:, 0]  # [B, V] the law the next child is tested against
    final = argmax(p / noise)  # stands when the root has no children (N == 0): one bonus draw
    active = torch.ones(B, dtype=torch.bool, device=draft_tokens.device)
    for _ in range(N):  # each step tries a node no earlier step tried, so N steps finish every row
        if not _runs(active):
            break
        child = children[slot, sib]  # [B], a node for every active row
        c = child.clamp_min(0)
        x = draft_tokens[rows, c]
        p_x = p[rows, x]
        if draft_probs is None:  # q one-hot at x: max(0, p - q) is p without x (p(x) - 1 <= 0)
            q_x = torch.ones_like(p_x)
            r = p.scatter(1, x[:, None], 0.0)
        else:
            q = draft_probs[rows, c]  # [B, V]
            q_x = q[rows, x]
            r = (p - q).clamp_min(0.0)
        accept = active & (uniform[rows, c] * q_x < p_x)  # u < p/q without dividing
        reject = active & ~accept
        # accepted: record the node, move to it; at a leaf the row ends with a bonus draw from the leaf's p
        _record(path, num_accepted, child, accept)
        num_accepted += accept
        leaf = accept & (children[c + 1, 0] < 0)
        # rejected: the residual r is normalised for the next sibling, or the row ends with a draw from it
        more = (sib + 1 < W) & (children[slot, (sib + 1).clamp_max(W - 1)] >= 0)
        last, cont = reject & ~more, reject & more
        p_child = target_probs[rows, c + 1] if _runs(accept) else p
        if _runs(leaf | last):
            empty = r.sum(dim=-1, keepdim=True) <= 0  # p == q on the support: fall back to p
            w = torch.where(leaf[:, None], p_child, torch.where(empty, p, r))
            final = torch.where(leaf | last, argmax(w / noise), final)
        if _runs(cont):
            mass = _fixed_point_mass(r)
            p = torch.where(cont[:, None] & (mass > 0), r / mass, p)
        p = torch.where(accept[:, None], p_child, p)
        slot = torch.where(accept, child + 1, slot)
        sib = torch.where(accept, 0, torch.where(cont, sib + 1, sib))
        active = active & ~(leaf | last)
    return num_accepted, path, final


def verify_tree_torch(
    tree: TreeShape,
    draft_tokens: torch.Tensor,  # [B, N] int64, the token of each node
    draft_probs: torch.Tensor | None,  # [B, N, V] float32: the law each node was drawn from; None: deterministic
    target_probs: torch.Tensor,  # [B, N+1, V] float32 per slot (0 = root), already temperature/top-k/top-p processed
    *,
    uniform: torch.Tensor | None = None,  # [B, N]
    noise: torch.Tensor | None = None,  # [B, V]
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> TreeVerifyResult:
    B, N, V = _check_inputs(tree, draft_tokens, draft_probs, target_probs, uniform, noise)
    children = tree.child_table(draft_tokens.device)  # [N+1, W]
    if greedy:
        num_accepted, path, final = _greedy_walk_torch(children, draft_tokens, target_probs, tree.max_depth)
    else:
        uniform, noise = _randoms(B, N, V, target_probs.device, uniform, noise, generator)
        num_accepted, path, final = _sampled_walk_torch(children, draft_tokens, draft_probs, target_probs, uniform,
                                                        noise, tree.max_depth)
    return TreeVerifyResult(num_accepted=num_accepted, path=path,
                            tokens=_emitted_tokens(draft_tokens, num_accepted, path, final))


# ----------------------------------------------------------------------------------------------------
# Triton kernel and launcher (same signature as the reference)

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend still works without triton
    triton = None

verify_tree_triton = None  # defined below when triton is importable

if triton is not None:
    from kernels.verify import _argmax_over_v, _keep_max, _lowest_argmax

    FIX: tl.constexpr = tl.constexpr(_FIX)
    UNFIX: tl.constexpr = tl.constexpr(_UNFIX)

    @triton.jit
    def _law_at(t_row, s_row, in_scratch, v, m, stride_pv):
        """The law a row's next child is tested against, at vocabulary indices v: the target's at the row's slot,
        or the normalised residual in the row's scratch once a sibling there was rejected."""
        t = tl.load(t_row + v * stride_pv, mask=m & ~in_scratch, other=0.0)
        s = tl.load(s_row + v, mask=m & in_scratch, other=0.0)
        return tl.where(in_scratch, s, t)

    @triton.jit
    def _draft_at(q_row, x, v, m, stride_qv, HAS_Q: tl.constexpr):
        """q of the child being tried, at vocabulary indices v: its row of draft_probs, or one-hot at its token x."""
        if HAS_Q:
            q = tl.load(q_row + v * stride_qv, mask=m, other=0.0)
        else:
            q = tl.where(v == x, 1.0, 0.0)
        return q

    @triton.jit
    def _residual_pass(t_row, s_row, in_scratch, q_row, x, noise_rows, stride_pv, stride_qv, stride_nv, row_mask,
                       V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, HAS_Q: tl.constexpr):
        """Per row, over the vocabulary: the residual w = max(0, p - q) raced against the noise (the lowest argmax
        of w / noise), p raced the same way (the fall-back when w is empty), the max of w, and the fixed-point mass
        of w (int64, multiples of 2^-60)."""
        offs_v = tl.arange(0, BLOCK_V)
        best = tl.full((BLOCK_B, BLOCK_V), float("-inf"), tl.float32)
        best_idx = tl.full((BLOCK_B, BLOCK_V), 2147483647, tl.int32)
        fb = tl.full((BLOCK_B, BLOCK_V), float("-inf"), tl.float32)
        fb_idx = tl.full((BLOCK_B, BLOCK_V), 2147483647, tl.int32)
        peak = tl.zeros((BLOCK_B, BLOCK_V), tl.float32)
        fixed = tl.zeros((BLOCK_B, BLOCK_V), tl.int64)
        for v0 in tl.range(0, V, BLOCK_V):
            v = v0 + offs_v
            m = row_mask[:, None] & (v < V)[None, :]
            p = _law_at(t_row[:, None], s_row[:, None], in_scratch[:, None], v[None, :], m, stride_pv)
            q = _draft_at(q_row[:, None], x[:, None], v[None, :], m, stride_qv, HAS_Q)
            e = tl.load(noise_rows[:, None] + v[None, :] * stride_nv, mask=m, other=1.0)
            w = tl.where(m, tl.maximum(p - q, 0.0), 0.0)
            peak = tl.maximum(peak, w)
            fixed += (w * FIX).to(tl.int64)
            best, best_idx = _keep_max(tl.where(m, tl.math.div_rn(w, e), float("-inf")), v, best, best_idx)
            fb, fb_idx = _keep_max(tl.where(m, tl.math.div_rn(p, e), float("-inf")), v, fb, fb_idx)
        _, race = _lowest_argmax(best, best_idx)
        _, fallback = _lowest_argmax(fb, fb_idx)
        return race, fallback, tl.max(peak, axis=1), tl.sum(fixed, axis=1)

    @triton.jit
    def _store_normalised(t_row, s_row, in_scratch, q_row, x, mass, stride_pv, stride_qv, row_mask,
                          V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_Q: tl.constexpr):
        """scratch = max(0, p - q) / mass for the masked rows: the law the next sibling is tested against (in place
        when p already is the scratch: each element is read before it is written, by the same lane)."""
        offs_v = tl.arange(0, BLOCK_V)
        for v0 in tl.range(0, V, BLOCK_V):
            v = v0 + offs_v
            m = row_mask[:, None] & (v < V)[None, :]
            p = _law_at(t_row[:, None], s_row[:, None], in_scratch[:, None], v[None, :], m, stride_pv)
            q = _draft_at(q_row[:, None], x[:, None], v[None, :], m, stride_qv, HAS_Q)
            tl.store(s_row[:, None] + v[None, :], tl.math.div_rn(tl.maximum(p - q, 0.0), mass[:, None]), mask=m)

    @triton.jit
    def _walk_start(in_b, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
        """A walk's state at the root: the node whose children are tried (slot 0), no accepted nodes, an empty path,
        the final token, and the rows still walking."""
        slot = tl.zeros((BLOCK_B,), tl.int64)
        n = tl.zeros((BLOCK_B,), tl.int64)
        path = tl.full((BLOCK_B, BLOCK_D), -1, tl.int64)
        final = tl.zeros((BLOCK_B,), tl.int32)
        return slot, n, path, final, in_b

    @triton.jit
    def _greedy_walk(t_rows, noise_rows, children_ptr, x_rows, stride_dn, stride_pk, stride_pv, stride_nv, in_b,
                     W: tl.constexpr, D: tl.constexpr, V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
        """(n, path, final): from the root, move to the first child carrying the target's argmax while there is one;
        the last argmax is the final token."""
        offs_d = tl.arange(0, BLOCK_D)
        offs_w = tl.arange(0, BLOCK_W)
        slot, n, path, final, active = _walk_start(in_b, BLOCK_B, BLOCK_D)
        for step in range(D + 1):  # D moves down at most, then the row's last argmax
            top, best = _argmax_over_v(t_rows + slot * stride_pk, stride_pv, noise_rows, stride_nv, active, 0,
                                       V, V, BLOCK_B, BLOCK_V, 1, False)
            kids = tl.load(children_ptr + slot[:, None] * W + offs_w[None, :],
                           mask=active[:, None] & (offs_w < W)[None, :], other=-1)  # [BLOCK_B, BLOCK_W]
            x = tl.load(x_rows[:, None] + kids * stride_dn, mask=kids >= 0, other=-1)
            first = tl.min(tl.where((kids >= 0) & (x == best[:, None]), offs_w[None, :], BLOCK_W), axis=1)
            found = first < BLOCK_W  # the first child carrying the argmax
            child = tl.sum(tl.where(offs_w[None, :] == first[:, None], kids, 0), axis=1)
            final = tl.where(active, best, final)
            path = tl.where(found[:, None] & (offs_d[None, :] == n[:, None]), child[:, None], path)
            n += found.to(tl.int64)
            slot = tl.where(found, child + 1, slot)
            active = found
        return n, path, final

    @triton.jit
    def _after_reject(t_row, s_rows, in_scratch, q_row, x, noise_rows, stride_pv, stride_qv, stride_nv, reject, last,
                      cont, final, V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, HAS_Q: tl.constexpr):
        """(final, in_scratch) after rejected children: a row whose last sibling failed ends with a draw from the
        residual (p where it is empty); one with a sibling left normalises the residual into its scratch."""
        race, fallback, peak, fixed = _residual_pass(t_row, s_rows, in_scratch, q_row, x, noise_rows, stride_pv,
                                                     stride_qv, stride_nv, reject, V, BLOCK_B, BLOCK_V, HAS_Q)
        final = tl.where(last, tl.where(peak <= 0.0, fallback, race), final)
        renorm = cont & (fixed > 0)
        mass = tl.where(renorm, fixed.to(tl.float32) * UNFIX, 1.0)
        _store_normalised(t_row, s_rows, in_scratch, q_row, x, mass, stride_pv, stride_qv, renorm, V, BLOCK_V, HAS_Q)
        tl.debug_barrier()  # the scratch is read back by other lanes (the gather at the next token)
        return final, in_scratch | renorm

    @triton.jit
    def _sampled_walk(t_rows, s_rows, q_rows, u_rows, noise_rows, children_ptr, x_rows, stride_dn, stride_qn,
                      stride_qv, stride_pk, stride_pv, stride_un, stride_nv, in_b, N: tl.constexpr, W: tl.constexpr,
                      V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
                      HAS_Q: tl.constexpr):
        """(n, path, final): each row tries its node's children in order, accepting one with min(1, p / q) against
        the law at the node (the target's, or the residual left by rejected siblings); a leaf ends with a bonus."""
        offs_d = tl.arange(0, BLOCK_D)
        slot, n, path, final, active = _walk_start(in_b, BLOCK_B, BLOCK_D)
        sib = tl.zeros((BLOCK_B,), tl.int64)  # which child of slot is tried next
        in_scratch = tl.zeros((BLOCK_B,), tl.int1)  # the current law is the scratch, not the target at slot
        if N == 0:  # the root has no children: one bonus draw
            top, final = _argmax_over_v(t_rows, stride_pv, noise_rows, stride_nv, in_b, 0, V, V, BLOCK_B, BLOCK_V, 1,
                                        True)
        for step in range(N):  # each step tries a node no earlier step tried, so N steps finish every row
            child = tl.load(children_ptr + slot * W + sib, mask=active, other=-1)
            c = tl.where(active, child, 0)
            x = tl.load(x_rows + c * stride_dn, mask=active, other=0)
            ok = active & (x >= 0) & (x < V)  # memory safety only: drafts must lie in [0, V)
            t_row = t_rows + slot * stride_pk
            q_row = q_rows + c * stride_qn
            p_x = _law_at(t_row, s_rows, in_scratch, x, ok, stride_pv)
            q_x = _draft_at(q_row, x, x, ok, stride_qv, HAS_Q)
            u = tl.load(u_rows + c * stride_un, mask=active, other=1.0)
            accept = active & (u * q_x < p_x)  # u < p/q without dividing
            reject = active & ~accept
            nxt = tl.load(children_ptr + slot * W + sib + 1, mask=reject & (sib + 1 < W), other=-1)
            last = reject & (nxt < 0)
            cont = reject & (nxt >= 0)
            if tl.max(reject.to(tl.int32), axis=0) > 0:
                final, in_scratch = _after_reject(t_row, s_rows, in_scratch, q_row, x, noise_rows, stride_pv,
                                                  stride_qv, stride_nv, reject, last, cont, final, V, BLOCK_B,
                                                  BLOCK_V, HAS_Q)
            # accepted: record the node and move to it; a leaf ends the row with a bonus draw from its p
            path = tl.where(accept[:, None] & (offs_d[None, :] == n[:, None]), child[:, None], path)
            n += accept.to(tl.int64)
            slot = tl.where(accept, child + 1, slot)
            sib = tl.where(accept, 0, tl.where(cont, sib + 1, sib))
            in_scratch = in_scratch & ~accept
            leaf = accept & (tl.load(children_ptr + slot * W, mask=accept, other=0) < 0)
            if tl.max(leaf.to(tl.int32), axis=0) > 0:
                top, bonus = _argmax_over_v(t_rows + slot * stride_pk, stride_pv, noise_rows, stride_nv, leaf, 0,
                                            V, V, BLOCK_B, BLOCK_V, 1, True)
                final = tl.where(leaf, bonus, final)
            active = active & ~(leaf | last)
        return n, path, final

    @triton.jit
    def _tree_verify_kernel(
        draft_tokens_ptr, draft_probs_ptr, target_probs_ptr, uniform_ptr, noise_ptr, children_ptr, scratch_ptr,
        num_accepted_ptr, path_ptr, tokens_ptr,
        stride_db, stride_dn,
        stride_qb, stride_qn, stride_qv,
        stride_pb, stride_pk, stride_pv,
        stride_ub, stride_un,
        stride_nb, stride_nv,
        stride_ab, stride_ad,
        stride_tb, stride_tk,
        B, N: tl.constexpr, W: tl.constexpr, D: tl.constexpr, V: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        HAS_Q: tl.constexpr, GREEDY: tl.constexpr,
    ):
        """BLOCK_B rows per program walk the tree (children table [N+1, W], slot 0 = root) and write the path,
        its length and the emitted tokens. N, W, D and V are constexprs: one compile per tree shape and vocabulary
        (loop bounds stay Python ints under TRITON_INTERPRET=1, see kernels/verify.py)."""
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        in_b = rows < B
        rows = rows.to(tl.int64)
        t_rows = target_probs_ptr + rows * stride_pb
        noise_rows = noise_ptr + rows * stride_nb
        x_rows = draft_tokens_ptr + rows * stride_db
        if GREEDY:
            n, path, final = _greedy_walk(t_rows, noise_rows, children_ptr, x_rows, stride_dn, stride_pk, stride_pv,
                                          stride_nv, in_b, W, D, V, BLOCK_B, BLOCK_W, BLOCK_D, BLOCK_V)
        else:
            n, path, final = _sampled_walk(t_rows, scratch_ptr + rows * V, draft_probs_ptr + rows * stride_qb,
                                           uniform_ptr + rows * stride_ub, noise_rows, children_ptr, x_rows, stride_dn,
                                           stride_qn, stride_qv, stride_pk, stride_pv, stride_un, stride_nv, in_b, N,
                                           W, V, BLOCK_B, BLOCK_D, BLOCK_V, HAS_Q)
        # outputs: the path, its length, and the emitted tokens (the path's drafts, the final token, then -1)
        offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D >= D + 1
        tl.store(num_accepted_ptr + rows, n, mask=in_b)
        tl.store(path_ptr + rows[:, None] * stride_ab + offs_d[None, :] * stride_ad, path,
                 mask=in_b[:, None] & (offs_d < D)[None, :])
        drafted = tl.load(x_rows[:, None] + path * stride_dn, mask=in_b[:, None] & (path >= 0), other=-1)
        tokens = tl.where(offs_d[None, :] == n[:, None], final[:, None].to(tl.int64), drafted)
        tl.store(tokens_ptr + rows[:, None] * stride_tb + offs_d[None, :] * stride_tk, tokens,
                 mask=in_b[:, None] & (offs_d < D + 1)[None, :])

    def _launch_config(B: int, V: int, device: torch.device) -> tuple[int, int, int]:
        """(BLOCK_B, BLOCK_V, num_warps). On CUDA one row per program, whole-row blocks of the vocabulary; the
        interpreter runs programs one after another in Python, so there each program takes many rows."""
        block_v = min(triton.next_power_of_2(V), 4096)
        if device.type == "cuda":
            return 1, block_v, 8
        return min(triton.next_power_of_2(max(B, 1)), max(1, 2**16 // block_v)), block_v, 1

    def _verify_tree_triton_launch(tree, draft_tokens, draft_probs, target_probs, uniform, noise, greedy,
                                   block_b: int, block_v: int, num_warps: int) -> TreeVerifyResult:
        """Allocate the outputs and launch once; inputs are checked and randoms drawn by the caller."""
        B, N, V = draft_tokens.shape[0], tree.N, target_probs.shape[2]
        D = tree.max_depth
        device = target_probs.device
        children = tree.child_table(device)  # [N+1, W] int64, contiguous
        W = children.shape[1]
        num_accepted = torch.empty((B,), dtype=torch.int64, device=device)
        path = torch.empty((B, D), dtype=torch.int64, device=device)
        tokens = torch.empty((B, D + 1), dtype=torch.int64, device=device)
        if B == 0:
            return TreeVerifyResult(num_accepted=num_accepted, path=path, tokens=tokens)

        # the kernel never reads an argument it does not need (greedy: randoms; no node with a sibling: the
        # scratch; N == 0: drafts); it gets a one-element stand-in of the right dtype
        def stand_in(t, dtype, dims):
            if t is not None and t.numel() > 0:
                return t, t.stride()
            return target_probs.new_empty((1,), dtype=dtype), (0,) * dims

        d, d_strides = stand_in(draft_tokens, torch.int64, 2)
        q, q_strides = stand_in(draft_probs, torch.float32, 3)
        u, u_strides = stand_in(uniform, torch.float32, 2)
        e, e_strides = stand_in(noise, torch.float32, 2)
        a, a_strides = stand_in(path, torch.int64, 2)
        scratch = None if greedy or W < 2 else torch.empty((B, V), dtype=torch.float32, device=device)
        s, _ = stand_in(scratch, torch.float32, 2)
        _tree_verify_kernel[(triton.cdiv(B, block_b),)](
            d, q, target_probs, u, e, children, s, num_accepted, a, tokens,
            *d_strides, *q_strides, *target_probs.stride(), *u_strides, *e_strides, *a_strides, *tokens.stride(),
            B, N, W, D, V,
            BLOCK_B=block_b, BLOCK_W=triton.next_power_of_2(W), BLOCK_D=triton.next_power_of_2(D + 1),
            BLOCK_V=block_v, HAS_Q=draft_probs is not None, GREEDY=greedy,
            num_warps=num_warps,
        )
        return TreeVerifyResult(num_accepted=num_accepted, path=path, tokens=tokens)

    def verify_tree_triton(
        tree: TreeShape,
        draft_tokens: torch.Tensor,  # [B, N] int64
        draft_probs: torch.Tensor | None,  # [B, N, V] float32, None when the drafter is deterministic
        target_probs: torch.Tensor,  # [B, N+1, V] float32
        *,
        uniform: torch.Tensor | None = None,  # [B, N]
        noise: torch.Tensor | None = None,  # [B, V]
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> TreeVerifyResult:
        """The reference in one kernel launch, with no host synchronisation: same randoms, same tokens."""
        B, N, V = _check_inputs(tree, draft_tokens, draft_probs, target_probs, uniform, noise)
        if draft_tokens.dtype != torch.int64:
            raise ValueError(f"draft_tokens must be int64 for the triton backend, got {draft_tokens.dtype}")
        for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs), ("uniform", uniform), ("noise", noise)):
            if t is not None and t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 for the triton backend, got {t.dtype}")
        if greedy:
            uniform = noise = None  # not read
        else:
            uniform, noise = _randoms(B, N, V, target_probs.device, uniform, noise, generator)
        return _verify_tree_triton_launch(tree, draft_tokens, draft_probs, target_probs, uniform, noise, greedy,
                                          *_launch_config(B, V, target_probs.device))


# ----------------------------------------------------------------------------------------------------
# Backend switch


def verify_tree(
    tree: TreeShape,
    draft_tokens: torch.Tensor,  # [B, N] int64
    draft_probs: torch.Tensor | None,  # [B, N, V] float32 or None (deterministic drafter)
    target_probs: torch.Tensor,  # [B, N+1, V] float32
    *,
    uniform: torch.Tensor | None = None,  # [B, N]
    noise: torch.Tensor | None = None,  # [B, V]
    generator: torch.Generator | None = None,
    greedy: bool = False,
    backend: str = "auto",
) -> TreeVerifyResult:
    """Run the exact tree acceptance with the chosen backend ("torch" | "triton" | "auto")."""
    chosen = resolve_backend(backend, target_probs.device)
    fn = verify_tree_triton if chosen == "triton" else verify_tree_torch
    return fn(tree, draft_tokens, draft_probs, target_probs, uniform=uniform, noise=noise, generator=generator,
              greedy=greedy)
