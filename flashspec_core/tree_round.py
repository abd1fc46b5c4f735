"""A round that verifies a draft tree: the head drafts a tree (`DraftHeadDrafter.propose_tree`), the target reads
it in one forward under the tree's mask (`forward_tree`), the exact tree test (`kernels.verify_tree`) walks it,
the target's cache keeps the accepted path only (`compact`) and every drafter learns the round (the head from the
hidden states of the kept slots). Eager on every model path; one device-to-host copy a round (`pack_tree`)
besides the one the head's drafting makes for the tree's shape (`DraftHeadDrafter._rerank`).

    run_tree(round, rows, drafter, TreeSize(depth, top_k, size), sampling, generator) -> RoundOutput

Rows advance together by the shortest accepted path plus one, as in the chain round. The RoundOutput reads as a
chain: `draft` is row 0's accepted path, then the children of the node where its walk stopped (every one of them
was tried and rejected), so events show the accepted path and the branches that failed at its end; beside it,
`drafted_tree` keeps row 0's whole tree (every node's token and parent, and the accepted path) for display.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashspec_core.checks import is_int, shown
from flashspec_core.drafters import DraftHeadDrafter
from flashspec_core.gamma import MAX_GAMMA
from flashspec_core.round import RoundTimer
from flashspec_core.sampling import SamplingConfig, logits_to_probs
from flashspec_core.stream import DraftedTree, RoundOutput
from kernels import verify_tree


@dataclass(frozen=True)
class TreeSize:
    depth: int  # levels below the pending token
    top_k: int  # children per expanded node, and nodes expanded per level
    size: int  # nodes kept (the tree verified in one forward has size + 1 slots)
    auto: bool = False  # verify only the best first n of the size nodes, n chosen per round from measured costs

    def __post_init__(self):
        for name in ("depth", "top_k", "size"):
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value <= MAX_GAMMA:
                raise ValueError(f"tree {name} must be an integer in 1..{MAX_GAMMA}, got {shown(value)}")
        if not isinstance(self.auto, bool):
            raise ValueError(f"tree auto must be True or False, got {shown(self.auto)}")


def run_tree(round_, rows: list[list[int]], drafter: DraftHeadDrafter, shape: TreeSize, sampling: SamplingConfig,
             generator, nodes=None) -> RoundOutput:
    """One tree round over rows of equal length (`round_` a `DeviceRound`): draft, verify, accept, compact, update.
    nodes: a function of row 0's node scores (host floats, best first) that says how many of the drafted nodes to
    verify (greedy tree "auto", `HostPolicy.tree_plan`); None verifies them all."""
    timer, target = RoundTimer(round_.device, round_.stream), round_.target
    guessers = round_._guessers()
    guesses = [round_.drafters[name].guess for name in guessers]
    proposal = drafter.propose_tree(rows, shape.depth, shape.top_k, shape.size)  # draft
    if nodes is not None and proposal.tree.N:
        proposal = proposal.first(nodes(proposal.score[0].tolist()))
    if not proposal.tree.N:  # nothing drafted, or nothing worth its verify: a plain step
        return round_.run(rows, drafter, 0, sampling, generator)
    tree = proposal.tree
    timer.drafted()
    start = target.length  # the root's (the pending token's) cache position
    logits = target.forward_tree(torch.cat([round_.pending, proposal.tokens], dim=1), tree)  # [B, N+1, V] verify
    p = logits if sampling.greedy else logits_to_probs(logits, sampling)
    result = verify_tree(tree, proposal.tokens, proposal.q, p, generator=generator, greedy=sampling.greedy,
                         backend=round_.kernel_backend)  # accept test
    shown = logits.softmax(dim=-1) if sampling.greedy else p
    timer.launched()
    host = pack_tree(result, shown, proposal.tokens, guesses, tree).tolist()  # the round's one device-to-host copy
    B, D = len(rows), tree.max_depth
    counts = [int(r[0]) for r in host[:B]]
    tokens = [[int(t) for t in r[1:D + 2]] for r in host[:B]]
    paths = [[int(x) for x in r[D + 2:2 * D + 2]] for r in host[:B]]
    m, L = min(counts), len(rows[0])
    for row, toks in zip(rows, tokens):  # accept
        row.extend(toks[:m + 1])
    kept = torch.tensor([[start] + [start + 1 + node for node in path[:m]] for path in paths])  # [B, m+1]
    target.compact(kept)  # roll back: the root and the first m accepted nodes of each row
    round_.pending = result.tokens[:, m:m + 1]
    aux = target.aux  # [B, N+1, F] by slot: the kept ones' features, in path order
    hidden = None if aux is None else aux.gather(1, (kept - start).to(aux.device)[..., None].expand(-1, -1, aux.shape[-1]))
    round_._update(rows, L + m, hidden)
    nodes = [int(t) for t in host[B + 2][:tree.N]]
    return _output(tree, nodes, counts, tokens, paths[0], host[B], host[B + 1], guessers, timer)


def _output(tree, nodes: list[int], counts, tokens, path, p_row, guess_row, guessers, timer) -> RoundOutput:
    """Row 0's round as a chain for events: its accepted path, then the stop node's children (all rejected); and its
    whole tree, for a view of every branch."""
    n = counts[0]
    stop = path[n - 1] + 1 if n else 0  # the stop node's slot (0 = the root)
    shown = path[:n] + list(tree.children[stop])  # node indices: the accepted path, then the children tried
    draft = [nodes[i] for i in shown]
    K = len(draft)
    p = [p_row[i] for i in shown] + [p_row[tree.N]]
    draft_s, verify_s, device_s = timer.done()
    return RoundOutput(counts, [t + [-1] * (K + 1 - len(t)) for t in tokens], draft, p, [1.0] * K, draft_s,
                       verify_s, {name: int(g) for name, g in zip(guessers, guess_row)}, device_s,
                       tree=(tree.N, tree.max_depth),
                       drafted_tree=DraftedTree(tuple(nodes), tree.parents, tuple(path[:n])))


def pack_tree(result, p: torch.Tensor, drafted: torch.Tensor, guesses: list[torch.Tensor], tree) -> torch.Tensor:
    """The tree round's host record in one float32 tensor [B + 3, W], copied to the host once.

    Rows 0..B-1: [num_accepted, tokens (D + 1), path (D)]. Row B: row 0's p of every node's token (drafted [B, N])
    at its parent's slot (N values), then p of its emitted token at the slot where its walk stopped. Row B+1: the
    guesses' row 0. Row B+2: row 0's drafted tokens. p is [B, N+1, V]. Ids < 2^24 are exact in float32."""
    n0 = result.num_accepted[:1]  # [1]
    p_nodes = p[0].index_select(0, tree.parent_slots(p.device)).gather(-1, drafted[0][:, None]).squeeze(-1)  # [N]
    last = result.path[0].gather(0, (n0 - 1).clamp(min=0))  # the last accepted node (if any)
    stop = torch.where(n0 > 0, last + 1, torch.zeros_like(last))  # its slot, or the root's
    p_last = p[0].index_select(0, stop).gather(-1, result.tokens[0].gather(0, n0)[:, None]).view(1)
    guess = torch.stack([g[0] for g in guesses]).float() if guesses else p.new_zeros(0)
    parts = [torch.cat([result.num_accepted[:, None], result.tokens, result.path], dim=1).float(),
             torch.cat([p_nodes, p_last])[None], guess[None], drafted[:1].float()]
    W = max(x.shape[1] for x in parts)
    return torch.cat([F.pad(x, (0, W - x.shape[1])) for x in parts], dim=0)
