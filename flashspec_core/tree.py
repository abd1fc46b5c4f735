"""A draft tree's shape and what every model path derives from it: attention mask, positions, paths, KV compaction.

A round verifies the pending token (the root, not itself a draft) and N drafted nodes below it. The shape is one
frozen `DraftTree` of parent indices, shared by every row of a batch; the drafted tokens are a [B, N] tensor beside
it (one token per node and row). Nodes are numbered so that a parent comes before its children, and siblings are
numbered in the order verification tries them: the drafter puts the sibling with the highest draft probability
first. A chain of K drafts is the tree with parents [-1, 0, 1, ..., K-2].

Two numberings appear below: node i (0 <= i < N, -1 for the root) and slot i + 1 (slot 0 is the root). Slots are
the order of the tree block in a forward: the target reads [root, node 0, ..., node N-1] after the context, so
`target_probs[:, slot]` is the target's distribution after that node, and the cache entry of slot s sits at
context_len + s.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Any

import torch


def _best_first(depth: int, top_k: int, size: int, first: float, ratio: float) -> list[tuple[int, float]]:
    """(parent, log prior) of `DraftTree.static`'s nodes, best first."""
    prior = [math.log(first * ratio ** r) for r in range(top_k)]
    heap = [(-prior[r], r, -1, 1) for r in range(top_k)]  # (minus log prior, tie order, parent, depth)
    nodes: list[tuple[int, float]] = []
    order = top_k
    while heap and len(nodes) < size:
        score, _, parent, d = heapq.heappop(heap)
        nodes.append((parent, -score))
        if d < depth:
            for r in range(top_k):
                heapq.heappush(heap, (score - prior[r], order, len(nodes) - 1, d + 1))
                order += 1
    return nodes


@dataclass(frozen=True)
class DraftTree:
    parents: tuple[int, ...]  # [N] parent node of each node, -1 for the root's children; parents[i] < i

    def __post_init__(self):
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}] = {p}: a parent must be -1 (the root) or an earlier node in [0, {i})")

    @classmethod
    def chain(cls, K: int) -> "DraftTree":
        """K drafts one after another: the chain verifier's case."""
        return cls(tuple(range(-1, K - 1)))

    @classmethod
    def full(cls, widths) -> "DraftTree":
        """Every node at depth d has widths[d] children (the root is depth 0), numbered level by level, so that
        siblings are consecutive: (2, 2) is two children of the root with two children each, N = 6."""
        parents: list[int] = []
        level = [-1]
        for width in widths:
            nxt = []
            for parent in level:
                for _ in range(width):
                    parents.append(parent)
                    nxt.append(len(parents) - 1)
            level = nxt
        return cls(tuple(parents))

    @classmethod
    def static(cls, depth: int, top_k: int, size: int, first: float = 0.6, ratio: float = 1 / 3) -> "DraftTree":
        """`size` nodes, at most `depth` levels and `top_k` children a node, chosen before anything is drafted (the
        shape of sampled trees, which must not depend on the draws): best first under a prior in which a node's r-th
        child (r = 0, 1, ...) is accepted with probability first * ratio^r and a path with the product of its
        children's. A chain comes first, then second children near the root. Numbered in the order chosen, so
        parents precede children and siblings come in rank order."""
        return cls(tuple(parent for parent, _ in _best_first(depth, top_k, size, first, ratio)))

    @staticmethod
    def static_prior(depth: int, top_k: int, size: int, first: float = 0.6, ratio: float = 1 / 3) -> list[float]:
        """Each node of `static(depth, top_k, size, first, ratio)`: its log prior chance of acceptance."""
        return [score for _, score in _best_first(depth, top_k, size, first, ratio)]

    @property
    def N(self) -> int:
        return len(self.parents)

    @functools.cached_property
    def depth(self) -> tuple[int, ...]:
        """[N] depth of each node; the root's children have depth 1."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return tuple(depth)

    @property
    def max_depth(self) -> int:
        """D: the most drafts one round can accept."""
        return max(self.depth, default=0)

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """[N+1] per slot (0 = root, i + 1 = node i): its children's node indices, in the order they are tried."""
        kids: list[list[int]] = [[] for _ in range(self.N + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    @functools.cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Every root-to-leaf path, as node indices from the root's child down to the leaf, leaves in node order."""
        return tuple(self.path_to(i) for i in range(self.N) if not self.children[i + 1])

    def path_to(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to `node` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.N - 1))

    # -- tensors for the model paths and the verifier ------------------------------------------------------

    @functools.lru_cache(maxsize=8)
    def child_table(self, device=None) -> torch.Tensor:
        """[N+1, W] int64: row s lists slot s's children (node indices) in order, padded with -1; W >= 1.
        Built once per device and shared: read it, do not write to it."""
        width = max(1, max(len(k) for k in self.children))
        table = [list(k) + [-1] * (width - len(k)) for k in self.children]
        return torch.tensor(table, dtype=torch.int64, device=device)

    @functools.lru_cache(maxsize=8)
    def path_table(self, device=None) -> torch.Tensor:
        """[N+1, D+1] int32: row s lists slot s's path (0 = the root, i + 1 = node i) from the root down to s itself,
        then j for the j-th entry past it: where a chain forward over that path would have put those tokens,
        relative to the tree's first slot. Built once per device and shared: read it, do not write to it."""
        table = [[0, *(n + 1 for n in self.path_to(s - 1))] if s else [0] for s in range(self.N + 1)]
        width = self.max_depth + 1
        return torch.tensor([row + list(range(len(row), width)) for row in table], dtype=torch.int32, device=device)

    def parent_slots(self, device=None) -> torch.Tensor:
        """[N] int64: the slot of each node's parent, i.e. where the target's (and the drafter's) law that the node
        is tested against sits: target_probs[:, tree.parent_slots()] is [B, N, V]."""
        return torch.tensor([p + 1 for p in self.parents], dtype=torch.int64, device=device)

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[N+1, N+1] bool over slots: [s, t] is True when slot t is slot s itself or one of its ancestors
        (the root is every slot's ancestor)."""
        mask = torch.eye(self.N + 1, dtype=torch.bool, device=device)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i + 1] |= mask[p + 1]
        return mask

    def attention_mask(self, context_len: int, device=None) -> torch.Tensor:
        """[N+1, context_len+N+1] bool, True where query slot s may attend: the whole context, then its ancestors
        and itself among the tree's slots (keys are the context, the root, node 0, ..., node N-1)."""
        context = torch.ones((self.N + 1, context_len), dtype=torch.bool, device=device)
        return torch.cat([context, self.ancestor_mask(device)], dim=1)

    def position_ids(self, context_len: int, device=None) -> torch.Tensor:
        """[N+1] int64 per slot: context_len for the root, context_len + depth for node i."""
        return torch.tensor((0,) + self.depth, dtype=torch.int64, device=device) + context_len

    def check_ids(self, ids: torch.Tensor) -> int:
        """T = N + 1, the slots of a tree forward, after checking that ids [B, T] carry one token per slot."""
        T = self.N + 1
        if ids.dim() != 2 or ids.shape[1] != T:
            raise ValueError(f"a tree of {self.N} nodes needs ids [B, {T}] (the root, then one token per node), "
                             f"got {tuple(ids.shape)}")
        return T

    def kept_slots(self, path: torch.Tensor, context_len: int = 0) -> torch.Tensor:
        """[B, D+1] int64 from the accepted nodes `path` [B, D] (-1 padded): the cache positions to keep, in
        order, after acceptance: the root's (context_len), then context_len + 1 + node for each accepted node,
        then -1. Moving entry k of a row to context_len + k compacts that row's cache onto the accepted path."""
        if path.dim() != 2 or path.shape[1] != self.max_depth:
            raise ValueError(f"path must be [B, D] = [B, {self.max_depth}], got {tuple(path.shape)}")
        root = torch.full_like(path[:, :1], context_len)
        nodes = torch.where(path >= 0, path + 1 + context_len, torch.full_like(path, -1))
        return torch.cat([root, nodes], dim=1)


@dataclass(frozen=True)
class TensorTree:
    """A draft tree whose shape lives on the device: what a captured tree round verifies, the host never reading it
    before the round ends. The node count N, the depth bound D and the child bound W are fixed (a graph keeps its
    shapes); parents [N] int64 (-1: a child of the root; parents[i] < i) are a round's (a captured round's replays
    recompute them and every view in place). Its views are `DraftTree`'s (tested equal), each a few tensor ops with
    no host read; the ancestor table they start from is made once per tree."""
    parents: torch.Tensor  # [N] int64 on the round's device
    max_depth: int  # D >= every node's depth: paths are [B, D], -1 past a node's own depth
    width: int  # W >= every slot's child count: child_table is [N+1, W]
    views: Any = None  # the views already made (`kernels.tree_level.Ranked`: ancestors, depth, child_table,
    #                    path_table), else each is made here from parents

    @property
    def N(self) -> int:
        return self.parents.shape[0]

    def ancestors(self) -> torch.Tensor:
        """[N+1, D+1] int64 slots: column j is slot s's j-th ancestor (j = 0: s itself), 0 (the root) past it."""
        return self._ancestors if self.views is None else self.views.ancestors

    @functools.cached_property
    def _ancestors(self) -> torch.Tensor:
        up = torch.cat([self.parents.new_zeros(1), self.parents + 1])  # each slot's parent slot; the root's is 0
        columns = [torch.arange(self.N + 1, device=self.parents.device)]
        for _ in range(self.max_depth):
            columns.append(up[columns[-1]])
        return torch.stack(columns, dim=1)

    def slot_depth(self, ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """[N+1] int64: 0 for the root, then each node's depth (from `ancestors()`, given or computed)."""
        if self.views is not None and ancestors is None:
            return self.views.depth
        return ((self.ancestors() if ancestors is None else ancestors)[:, :-1] != 0).sum(dim=1)

    def child_table(self, device=None) -> torch.Tensor:
        """[N+1, W] int64: slot s's children (node indices, in node order), -1 padded."""
        if self.views is not None:
            return self.views.child_table
        N, dev = self.N, self.parents.device
        of = (self.parents + 1)[None, :] == torch.arange(N + 1, device=dev)[:, None]  # [N+1, N] node i of slot s
        rank = of.cumsum(dim=1) - 1
        column = torch.where(of & (rank < self.width), rank, torch.full_like(rank, self.width))
        table = torch.full((N + 1, self.width + 1), -1, dtype=torch.int64, device=dev)
        table.scatter_(1, column, torch.arange(N, device=dev).expand(N + 1, N))
        return table[:, :self.width].contiguous()  # the tree verify kernel reads rows of stride W

    def path_table(self, device=None) -> torch.Tensor:
        """[N+1, D+1] int32: `DraftTree.path_table`: slot s's path from the root down to s, then j past it."""
        if self.views is not None:
            return self.views.path_table
        j, ancestors = torch.arange(self.max_depth + 1, device=self.parents.device), self.ancestors()
        up = self.slot_depth(ancestors)[:, None] - j[None, :]  # how far above s the path's entry j sits
        path = ancestors.gather(1, up.clamp_min(0))
        return torch.where(up >= 0, path, j[None, :]).to(torch.int32)

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[N+1, N+1] bool: [s, t] True when slot t is s or one of its ancestors (the root is everyone's)."""
        mask = torch.zeros((self.N + 1, self.N + 1), dtype=torch.bool, device=self.parents.device)
        return mask.scatter_(1, self.ancestors(), True)

    def parent_slots(self, device=None) -> torch.Tensor:
        return self.parents + 1

    def position_ids(self, context_len, device=None) -> torch.Tensor:
        """[N+1] int64: context_len (an int or a device tensor [1]) plus each slot's depth."""
        return self.slot_depth() + context_len

    def check_ids(self, ids: torch.Tensor) -> int:
        return DraftTree.check_ids(self, ids)


def compaction(kept: torch.Tensor, length: int) -> tuple[int, torch.Tensor]:
    """What a model path's `compact` moves: (start, index [B, n] int64 on the host) from kept cache positions
    [B, D+1] (`DraftTree.kept_slots`, -1 padded) in a cache of `length` tokens. Entry k of each row moves to
    start + k, start being the root's position (the same in every row). Every row must keep the same count n: the
    engine advances the rows of a batch together, by the shortest accepted path, and cuts the longer ones to it."""
    kept = kept.detach().to("cpu", torch.int64)  # a small host copy: lengths are host numbers
    if kept.dim() != 2 or kept.shape[1] < 1:
        raise ValueError(f"kept must be [B, D+1] cache positions, got shape {tuple(kept.shape)}")
    counts = (kept >= 0).sum(1)
    n = int(counts[0])
    if not (counts == n).all():
        raise ValueError(f"every row must keep the same number of slots, got {counts.tolist()}; cut every row to "
                         f"the shortest accepted path first")
    index = kept[:, :n]
    start = int(index[0, 0]) if n else -1
    if n == 0 or not (index[:, 0] == start).all() or (index.diff(dim=1) <= 0).any() or int(index.max()) >= length:
        raise ValueError(f"kept positions must start at one root position shared by the rows, increase along each "
                         f"row, be followed only by -1 and lie below the cache length {length}; got {kept.tolist()}")
    return start, index
