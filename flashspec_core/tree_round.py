"""A round that verifies a draft tree: the head drafts a tree (`DraftHeadDrafter.propose_tree`), the target reads
it in one forward under the tree's mask (`forward_tree`), the exact tree test (`kernels.verify_tree`) walks it,
the target's cache keeps the accepted path only (`compact`) and every drafter learns the round (the head from the
hidden states of the kept slots). Eager on every model path; one device-to-host copy a round (`pack_tree`)
besides the one the head's drafting makes for the tree's shape (`DraftHeadDrafter._rerank`).

    run_tree(round, rows, drafter, TreeSize(depth, top_k, size), sampling, generator) -> RoundOutput
    launch_tree(round, drafter, TreeSize(...), sampling) -> Launched  on the captured round (`DeviceRound.launch`)
    land_tree(round, rows, launched) -> RoundOutput                 its landing (`DeviceRound.land`)

The captured version (`CapturedRound.tree_body`) does the same on the device with fixed shapes: the head's levels
of fixed width (`DraftHeadDrafter.propose_tree_at`), the tree as device tensors (`tree.TensorTree`), the target's
tree forward at the device length (`forward_tree_at`) and both caches compacted there (`compact_at`): one graph a
round on a GPU, one host read.

Rows advance together by the shortest accepted path plus one, as in the chain round. The RoundOutput reads as a
chain: `draft` is row 0's accepted path, then the children of the node where its walk stopped (every one of them
was tried and rejected), so events show the accepted path and the branches that failed at its end; beside it,
`drafted_tree` keeps row 0's whole tree (every node's token and parent, and the accepted path) for display.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from flashspec_core.captured import Shape, law, pack_tree
from flashspec_core.checks import is_int, shown
from flashspec_core.drafters import DraftHeadDrafter
from flashspec_core.gamma import MAX_GAMMA
from flashspec_core.round import RoundTimer
from flashspec_core.sampling import SamplingConfig, logits_to_probs
from flashspec_core.stream import DraftedTree, RoundOutput
from flashspec_core.tree import DraftTree
from kernels import verify_tree


COPY_SOURCES = ("prompt_lookup", "ngram_cache")  # the drafters whose chains join a tree (`TreeSize.copy`), in turn


@dataclass(frozen=True)
class TreeSize:
    depth: int  # levels below the pending token
    top_k: int  # children per expanded node, and nodes expanded per level
    size: int  # nodes kept (the tree verified in one forward has size + 1 slots)
    auto: bool = False  # verify only the best first n of the size nodes, n chosen per round from measured costs
    copy: int = 0  # greedy: up to this many copied tokens join as one more branch (eager rounds: a copy drafter's
    #                chain, `CopyDrafter.branch`; captured ones: prompt lookup on the device, `CapturedRound.copied`)

    def __post_init__(self):
        for name in ("depth", "top_k", "size", "copy"):
            value, least = getattr(self, name), 0 if name == "copy" else 1
            if not is_int(value) or not least <= value <= MAX_GAMMA:
                raise ValueError(f"tree {name} must be an integer in {least}..{MAX_GAMMA}, got {shown(value)}")
        if not isinstance(self.auto, bool):
            raise ValueError(f"tree auto must be True or False, got {shown(self.auto)}")

    @property
    def width(self) -> int:
        """The nodes a greedy tree expands per level below the root: its min(top_k, size) best candidates."""
        return min(self.top_k, self.size)

    @property
    def longest(self) -> int:
        """The most drafted tokens one round may accept: the depth, or a copied branch's length."""
        return max(self.depth, self.copy)

    def taken(self, greedy: bool) -> "TreeSize":
        """The shape a stream takes: a copied branch joins greedy trees only."""
        return self if greedy or not self.copy else replace(self, copy=0)

    def within(self, limit: int) -> "TreeSize":
        """This shape cut to what a round may still draft (a stream's end): depth and copied branch at most `limit`."""
        return replace(self, depth=min(self.depth, limit), copy=min(self.copy, limit))

    @property
    def verify_tokens(self) -> int:
        """The tokens an eager tree round's verify forward takes at most: the pending one, the nodes, the copies."""
        return self.size + self.copy + 1

    @property
    def nodes(self) -> int:
        """The nodes of a greedy tree of this shape: `size`, or the candidates its levels offer where fewer (the
        root's top_k children, then top_k children of each of the `width` nodes a level expands)."""
        return min(self.size, self.top_k + (self.depth - 1) * self.width * self.top_k)

    @functools.cached_property
    def sampled(self) -> DraftTree:
        """The shape a sampled tree of this size takes, fixed before any draw (`DraftTree.static`; made once: a
        captured round's launch reads its node count every round)."""
        return DraftTree.static(self.depth, self.top_k, self.size)

    @property
    def fixed(self) -> "TreeSize":
        """This shape at a fixed size (auto's bound): what a captured round verifies, one graph per shape."""
        return replace(self, auto=False)


def run_tree(round_, rows: list[list[int]], drafter: DraftHeadDrafter, shape: TreeSize, sampling: SamplingConfig,
             generator, nodes=None) -> RoundOutput:
    """One tree round over rows of equal length (`round_` a `DeviceRound`): draft, verify, accept, compact, update.
    nodes: a function of row 0's node scores (host floats, best first) and of the copied tokens that join them, that
    says how many of the drafted nodes to verify (greedy tree "auto", `HostPolicy.tree_plan`); None: all of them."""
    timer, target = RoundTimer(round_.device, round_.stream), round_.target
    guessers = round_._guessers()
    guesses = [round_.drafters[name].guess for name in guessers]
    proposal = drafter.propose_tree(rows, shape.depth, shape.top_k, shape.size)  # draft
    chain = _copied(round_, rows, shape.copy) if sampling.greedy and shape.copy else None
    if nodes is not None and proposal.tree.N:  # the cut prices the copied branch's tokens too
        proposal = proposal.first(nodes(proposal.score[0].tolist(), 0 if chain is None else chain.shape[1]))
    drafted = proposal.tree.max_depth  # the head's levels (a copied branch may go deeper)
    if chain is not None:
        proposal = proposal.graft(chain)
    if not proposal.tree.N:  # nothing drafted, or nothing worth its verify: a plain step
        return round_.run(rows, drafter, 0, sampling, generator)
    tree = proposal.tree
    timer.drafted()
    start = target.length  # the root's (the pending token's) cache position
    fed = torch.cat([round_.pending, proposal.tokens.clamp_min(0)], dim=1)  # (a row's missing copy: -1, never kept)
    logits = target.forward_tree(fed, tree)  # [B, N+1, V] verify
    p = logits if sampling.greedy else logits_to_probs(logits, sampling)
    result = verify_tree(tree, proposal.tokens, proposal.q, p, generator=generator, greedy=sampling.greedy,
                         backend=round_.kernel_backend)  # accept test
    shown = logits.softmax(dim=-1) if sampling.greedy else p
    timer.launched()
    host = pack_tree(result, shown, proposal.tokens, guesses, tree).tolist()  # the round's one device-to-host copy
    B, L = len(rows), len(rows[0])
    counts, tokens, paths = _accept(rows, host, tree.max_depth)
    m = min(counts)
    kept = torch.tensor([[start] + [start + 1 + node for node in path[:m]] for path in paths])  # [B, m+1]
    target.compact(kept)  # roll back: the root and the first m accepted nodes of each row
    round_.pending = result.tokens[:, m:m + 1]
    aux = target.aux  # [B, N+1, F] by slot: the kept ones' features, in path order
    hidden = None if aux is None else aux.gather(1, (kept - start).to(aux.device)[..., None].expand(-1, -1, aux.shape[-1]))
    round_._update(rows, L + m, hidden)
    nodes = [int(t) for t in host[B + 2][:tree.N]]
    return _output(tree, nodes, counts, tokens, paths[0], host[B], host[B + 1], guessers, timer.done(), drafted)


def _copied(round_, rows: list[list[int]], k: int) -> torch.Tensor | None:
    """A copy drafter's chains for the tree's extra branch (`CopyDrafter.branch`): prompt lookup's, else the n-gram
    cache's, of those the stream keeps current (`DeviceRound.fed`); None if neither copies anything."""
    for name in COPY_SOURCES:
        drafter = round_.drafters.get(name)
        chain = drafter.branch(rows, k) if drafter in round_.fed else None
        if chain is not None:
            return chain
    return None


def captured_nodes(shape: TreeSize, greedy: bool) -> int:
    """The nodes a captured tree round of this shape verifies: greedy, `shape.nodes` and the copied branch's;
    sampled, its static shape's."""
    return shape.nodes + shape.copy if greedy else shape.sampled.N


def launch_tree(round_, drafter: DraftHeadDrafter, shape: TreeSize, sampling: SamplingConfig = SamplingConfig()):
    """A tree round on the captured round (every drafted node verified; sampled: the static shape), queued as one
    graph (`CapturedRound.tree_body`) with its record's copy to the host: a `round.Launched` that `land_tree`
    finishes. It reads nothing from the device, so it may be launched while the round before it is in flight."""
    from flashspec_core.round import Launched

    timer, c, target = RoundTimer(round_.device, round_.stream), round_.captured, round_.target
    current = round_.head_ready(True, 0)  # the head takes its backlog before it drafts
    guessers = [drafter.name] if target.aux_layers and drafter.h is not None and current else []
    N = captured_nodes(shape, sampling.greedy)
    S = target.bucket(target.length + max(N + 1, shape.depth * min(shape.top_k, shape.size)))  # the verify's slots,
    timer.drafted()  # the head's levels' slots (from the same start); the head drafts inside the round (verify_s)
    packed = round_._to_host(c.run(Shape(True, N, S, observe=bool(target.aux_layers), tree=shape, **law(sampling))))
    timer.launched()
    launched = Launched(N, packed, guessers, timer, captured=True, ready=timer.end if timer.cuda else None, tree=shape)
    target.length += launched.most  # the most the round keeps (the device compacts it; `land_tree` crops)
    return launched


def land_tree(round_, rows: list[list[int]], launched, first=None) -> RoundOutput:
    """`DeviceRound.land` for a launched tree round: read its record, accept on the rows, move the host's lengths
    and let the drafters learn (`first` now, the others at `settle`)."""
    host = launched.packed.tolist()
    B, L, depth = len(rows), len(rows[0]), launched.tree.depth + launched.tree.copy  # the record's path length
    counts, tokens, paths = _accept(rows, host, depth)
    round_.landed(rows, L + min(counts), first)  # the device compacted the accepted path; the host's count follows
    nodes = [int(t) for t in host[B + 2][:launched.K]]
    while nodes and nodes[-1] < 0:  # a copied branch's trailing -1 nodes (copies the tree held) are not shown
        nodes.pop()
    tree = DraftTree(tuple(int(x) for x in host[B + 3][:len(nodes)]))
    return _output(tree, nodes, counts, tokens, paths[0], host[B], host[B + 1], launched.guessers,
                   round_.landing_times(launched.timer), launched.tree.depth)


def _accept(rows: list[list[int]], host: list[list[float]], D: int):
    """Each row's accepted count, tokens (D + 1) and path (D) from the record's first rows (`pack_tree`); every row
    takes the shortest accepted path and the token after it."""
    B = len(rows)
    counts = [int(r[0]) for r in host[:B]]
    tokens = [[int(t) for t in r[1:D + 2]] for r in host[:B]]
    paths = [[int(x) for x in r[D + 2:2 * D + 2]] for r in host[:B]]
    n = min(counts)
    for row, toks in zip(rows, tokens):
        row.extend(toks[:n + 1])
    return counts, tokens, paths


def _output(tree, nodes: list[int], counts, tokens, path, p_row, guess_row, guessers, times,
            drafted: int) -> RoundOutput:
    """Row 0's round as a chain for events: its accepted path, then the stop node's children (all rejected); and its
    whole tree, for a view of every branch. drafted: the head's levels (`RoundOutput.tree`'s depth, what the
    policy prices its drafting by)."""
    n = counts[0]
    stop = path[n - 1] + 1 if n else 0  # the stop node's slot (0 = the root)
    shown = path[:n] + list(tree.children[stop])  # node indices: the accepted path, then the children tried
    draft = [nodes[i] for i in shown]
    K = len(draft)
    p = [p_row[i] for i in shown] + [p_row[tree.N]]
    draft_s, verify_s, device_s = times  # `RoundTimer.done`'s
    return RoundOutput(counts, [t + [-1] * (K + 1 - len(t)) for t in tokens], draft, p, [1.0] * K, draft_s,
                       verify_s, {name: int(g) for name, g in zip(guessers, guess_row)}, device_s,
                       tree=(tree.N, drafted),
                       drafted_tree=DraftedTree(tuple(nodes), tree.parents, tuple(path[:n])))
