"""Drafters: cheap proposers of up to k next tokens, all behind one narrow interface.

    start(rows, sampling, generator, hidden=None)  a new generation; rows are the prompt ids, one list per
                                      batch row
    propose(rows, k) -> Proposal      up to k tokens per row, with q (None for a deterministic drafter)
    observe(rows, kept, hidden=None)  after a round: rows are the new contexts and the first `kept` ids of
                                      each are unchanged since propose (what a draft cache may keep)

`hidden` is given only to drafters whose `aux_layers` names target layers (the draft head): the target's
residual streams entering those layers, [B, n, len(aux_layers) * H], for the positions that became certain
(in `start`, the prompt but its last token; in `observe`, the round's pending token and accepted drafts), after
every round whichever drafter was pulled. Everyone else gets None and pays nothing for it. Such a drafter may
keep `guess` [B] (device): the token it would draft first at the current context, which the engine scores it
by when another arm is pulled.

A deterministic drafter has q = one-hot at its token; the verifier then accepts with probability p(x).
Model-free drafters also expose `propose_ids(row, k)`, which the engine uses to score them
counterfactually after every round at no target cost. A drafter that is not among a stream's arms (the draft head
apart, and the no-draft arm) is neither started nor updated in it (it cannot draft there); one that `remembers`
across streams learns the streams it missed before it is next fed (`round.Transcript`).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashspec_core.draft_head import DraftHead, HeadCache
from flashspec_core.gamma import MAX_GAMMA, CostModel, best_length, length_choice, worth_another
from flashspec_core.models import CausalLM
from flashspec_core.sampling import SamplingConfig, draft_sampling, logits_to_probs, logits_to_probs_at, sample
from flashspec_core.tree import DraftTree, TensorTree
from kernels.tree_level import Level, next_frontier, rank_tree_triton, tree_level
from kernels.verify import argmax


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [B, K] int64 on the engine's device
    q: torch.Tensor | None  # [B, K, V] float32, None when deterministic (or greedy)


@dataclass(frozen=True)
class TreeProposal:
    """Drafts as a tree (`flashspec_core.tree`): the shape, shared by the batch, and one token per node and row.
    q follows `kernels.tree_verify`: the law each node was drawn from, None for deterministic children (one-hot q)."""
    tree: DraftTree
    tokens: torch.Tensor  # [B, N] int64 on the engine's device, in node order
    q: torch.Tensor | None  # [B, N, V] float32, None when deterministic (the head's top-k children)
    score: torch.Tensor  # [B, N] float32: each node's cumulative draft log-probability (sum of log q on its path)

    def first(self, n: int) -> "TreeProposal":
        """The first n nodes (a tree, since a parent precedes its children), each with its token, law and score."""
        return TreeProposal(DraftTree(self.tree.parents[:n]), self.tokens[:, :n],
                            None if self.q is None else self.q[:, :n], self.score[:, :n])

    def graft(self, chain: torch.Tensor) -> "TreeProposal":
        """This (greedy) tree with a copied chain joined as one more branch: chain [B, C] int64, -1 where a row's
        own chain is shorter. Row 0's chain follows the tree from the root while a child carries its next token;
        the rest of it hangs below the node where that stops, one node under the other, tried after that node's
        own children (so no sibling repeats a token there and the walk can take the branch). Other rows carry
        their own chain's tokens at the same places, as they carry their own tokens everywhere (row 0 shapes
        the tree); a -1 is never accepted. New nodes score as the node they hang from."""
        if self.q is not None:
            raise ValueError("a copied branch joins greedy trees only (a sampled tree's nodes need their laws)")
        at, m, tokens = -1, 0, self.tokens[0].tolist()
        kids = self.tree.children
        while m < chain.shape[1]:
            nxt = [c for c in kids[at + 1] if tokens[c] == int(chain[0, m])]
            if not nxt:
                break
            at, m = nxt[0], m + 1
        if m == chain.shape[1]:
            return self
        N, C = self.tree.N, chain.shape[1] - m
        parents = self.tree.parents + (at,) + tuple(range(N, N + C - 1))
        above = self.score[:, at:at + 1] if at >= 0 else self.score.new_zeros(self.score.shape[0], 1)
        return TreeProposal(DraftTree(parents), torch.cat([self.tokens, chain[:, m:].to(self.tokens.device)], dim=1),
                            None, torch.cat([self.score, above.expand(-1, C)], dim=1))

    def graft_at(self, chain: torch.Tensor) -> "TreeProposal":
        """`graft` inside a captured round, with no host read: the tree a `TensorTree`, chain [B, C] (-1: no token)
        on the device. It always adds C nodes (a graph keeps its shapes): below the node where row 0's chain leaves
        the tree, the chain's remaining tokens, then -1s (never accepted) for the ones the tree already held. The
        depth bound grows by C, the child bound by one."""
        tree, tokens = self.tree, self.tokens
        N, (B, C) = tree.N, chain.shape
        at = torch.full((), -1, dtype=torch.int64, device=tokens.device)
        m = torch.zeros((), dtype=torch.int64, device=tokens.device)  # chain tokens the tree holds, from the root
        for j in range(C):
            hit = (tree.parents == at) & (tokens[0] == chain[0, j]) & (m == j)  # [N]: at's child with token j
            at = torch.where(hit.any(), hit.to(torch.int8).argmax(), at)
            m = m + hit.any()
        take = m + torch.arange(C, device=tokens.device)  # [C] the chain's positions the new nodes carry
        new = torch.where(take < C, chain.gather(1, take.clamp_max(C - 1).expand(B, -1)), -1)
        parents = torch.cat([tree.parents, at.view(1), torch.arange(N, N + C - 1, device=tokens.device)])
        above = torch.where(at >= 0, self.score.index_select(1, at.clamp_min(0).view(1)), 0.0)  # [B, 1]
        return TreeProposal(TensorTree(parents, tree.max_depth + C, tree.width + 1), torch.cat([tokens, new], 1),
                            None, torch.cat([self.score, above.expand(-1, C)], dim=1))


class Drafter:
    name = "drafter"
    model_free = True  # proposals are a pure function of the context
    aux_layers: tuple[int, ...] = ()  # target layers whose input hidden states this drafter reads
    sets_length = False  # True: propose(rows, k) picks its own length <= k, so gamma "auto" hands it the largest k
    step_s = 0.0  # such a drafter's measured seconds a draft token (the policy hands it over; 0 until measured)
    remembers = False  # True: keeps what it observed beyond a stream (model-free only: replayed from row 0's ids)
    guess: torch.Tensor | None = None  # [B] a hidden-state reader's first draft token at the current context

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def start(self, rows: list[list[int]], sampling: SamplingConfig, generator: torch.Generator | None,
              hidden: torch.Tensor | None = None) -> None:
        pass

    def propose_ids(self, row: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose(self, rows: list[list[int]], k: int) -> Proposal:
        ids = [self.propose_ids(row, k) for row in rows]
        n = min(len(x) for x in ids)  # rows advance together, so they share K
        tokens = torch.tensor([x[:n] for x in ids], dtype=torch.int64).reshape(len(rows), n)
        return Proposal(tokens.to(self.device, non_blocking=True), None)

    def observe(self, rows: list[list[int]], kept: int, hidden: torch.Tensor | None = None) -> None:
        pass

    def reset_session(self) -> None:
        """Forget what was learnt across generations (the copy drafters' record of their acceptance, and the n-gram
        cache's text)."""

    session: tuple[str, ...] = ()  # the attributes that hold what `reset_session` forgets

    def memory(self) -> dict:
        """A copy of what this drafter learnt across generations, for `recall` (the engine's calibration streams
        leave no trace in it)."""
        return copy.deepcopy({name: getattr(self, name) for name in self.session})

    def recall(self, memory: dict) -> None:
        self.__dict__.update(memory)


class NoDraft(Drafter):
    """K = 0: the round is one plain decoding step, so the bandit can always fall back to plain decoding."""

    name = "no_draft"
    _none: torch.Tensor | None = None  # the empty [B, 0] proposal, made once (a plain round's only tensor work here)

    def propose_ids(self, row, k):
        return []

    def propose(self, rows, k):
        if self._none is None or self._none.shape[0] != len(rows):
            self._none = torch.empty((len(rows), 0), dtype=torch.int64, device=self.device)
        return Proposal(self._none, None)


SEP = -1  # a document boundary in a SuffixIndex's stream: no match crosses it and no copy runs past it


class SuffixIndex:
    """Every substring of up to `depth` tokens of a growing token stream, in a trie updated as tokens arrive.

    `extend` costs O(depth) per token and never rescans the stream; `match` returns the longest suffix of the stream
    (up to `depth` tokens) that also occurred earlier, with where it most recently ended; `continuation` reads what
    followed there. A depth-limited suffix trie, as in SuffixDecoding (Oliaro et al. 2024), keyed by token.
    """

    def __init__(self, depth: int = 16):
        self.depth = depth
        self.stream: list[int] = []
        self.kids: list[dict[int, int]] = [{}]  # node 0 is the root (the empty string); kids[node][token] = child
        self.last: list[int] = [-1]  # where each node's string most recently ended in the stream
        self.prev: list[int] = [-1]  # where it ended before that (-1: nowhere)
        self.active: list[int] = []  # nodes of the stream's suffixes of length 1, 2, ... (at most depth)
        self.before: list[int] = []  # `active` as it was before the last token

    def extend(self, tokens) -> None:
        kids, last, prev, stream = self.kids, self.last, self.prev, self.stream
        for t in tokens:
            i = len(stream)
            stream.append(t)
            grown, self.before = [], self.active
            known = True  # the suffixes grow shortest first: once one is new, every longer one is new too
            for node in (0, *self.active[:self.depth - 1]):  # each suffix, the empty one included, grows by t
                child = kids[node].get(t) if known else None
                if child is None:
                    known = False
                    child = kids[node][t] = len(kids)
                    kids.append({})
                    last.append(i)
                    prev.append(-1)
                else:
                    prev[child] = last[child]
                    last[child] = i
                grown.append(child)
            self.active = grown

    def new_document(self) -> None:
        """End the current document: later suffixes start after the boundary, and copies stop at it."""
        if self.stream and self.stream[-1] != SEP:
            self.stream.append(SEP)
        for node in self.active:  # an occurrence at a document's end has no continuation: forget it
            self.last[node], self.prev[node] = self.prev[node], -1
        self.active = self.before = []

    def match(self) -> tuple[int, int, int]:
        """(length, end, node) of the longest suffix of the stream that also ended earlier, at `end` most recently,
        with a token after it; (0, -1, 0) when there is none."""
        stream = self.stream
        for length in range(len(self.active), 0, -1):
            node = self.active[length - 1]
            end = self.prev[node]
            if end >= 0 and stream[end + 1] != SEP:  # end + 1 < len(stream): the occurrence is an earlier one
                return length, end, node
        return 0, -1, 0

    def find(self, tokens: list[int]) -> tuple[int, int, int]:
        """`match` for a context that is not the stream: the longest suffix of `tokens` found in the index, with where
        it most recently ended and a token after it. O(depth^2); for contexts off the indexed path."""
        stream = self.stream
        for s in range(max(0, len(tokens) - self.depth), len(tokens)):
            node = 0
            for t in tokens[s:]:
                node = self.kids[node].get(t, -1)
                if node < 0:
                    break
            for end in (self.last[node], self.prev[node]) if node > 0 else ():
                if 0 <= end < len(stream) - 1 and stream[end + 1] != SEP:
                    return len(tokens) - s, end, node
        return 0, -1, 0

    def before_last(self) -> tuple[int, int]:
        """(length, end) of the longest suffix (2..depth tokens) of the stream without its last token that ended
        earlier, at `end` most recently, with two tokens after it; (0, -1) when there is none. Where the last token
        broke a copy (`match` finds it nowhere after its predecessor), the copy's source sits at `end`: the last token
        replaced the one after it, or came in before it (`CopyDrafter`'s aligned copies). O(depth)."""
        stream, n = self.stream, len(self.stream)
        for length in range(len(self.before), 1, -1):
            node = self.before[length - 1]
            for end in (self.last[node], self.prev[node]):
                if 0 <= end < n - 2 and SEP not in (stream[end + 1], stream[end + 2]):
                    return length, end
        return 0, -1

    def continuation(self, end: int, n: int) -> list[int]:
        """Up to n tokens that followed position `end`; a copy that reaches the end of the stream goes on copying
        itself (a repeat with period len(stream) - 1 - end), and one that reaches a document boundary stops."""
        stream, out = self.stream, []
        for pos in range(end + 1, end + 1 + n):
            t = stream[pos] if pos < len(stream) else out[pos - len(stream)]
            if t == SEP:
                break
            out.append(t)
        return out


BRANCH_FLOOR = 0.3  # a copied branch of a greedy tree keeps tokens while all so far are accepted with this chance
MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 13, 19, 27)  # match lengths that start a bucket of the draft-length statistics
_BUCKET_OF = [sum(n >= b for b in MATCH_BUCKETS) for n in range(MATCH_BUCKETS[-1] + 1)]


ALIGNED = (len(MATCH_BUCKETS) + 1, False)  # the bucket of an aligned copy's first token (`CopyDrafter._aligned`)
ALIGNED_PRIOR = 0.25  # its prior chance: 23% of such first tokens were the target's on the embedded model's greedy
#                       answers to the app's examples (the stream's record choosing the alignment), 65% of those went on
ALIGN_DECAY = 0.8  # the memory of a stream's record of which alignment (substitution or insertion) copies on
ALIGNED_RUN = 6  # an aligned copy may replace a one-token match only after a copied run this long: a short run says
#                  little, and the last token found elsewhere may mean the text moved on to another part of its source


def match_bucket(length: int, split: bool) -> tuple[int, bool]:
    """Statistics are kept per (match-length bucket, whether earlier occurrences went on in more than one way)."""
    return _BUCKET_OF[min(length, MATCH_BUCKETS[-1])], split


class Copy(NamedTuple):
    """A copy drafter's draft at one context: the copied tokens, the match they follow (length, split), whether they
    are an aligned copy, and where the last token broke a copy, both aligned copies (`CopyDrafter._aligned`)."""
    tokens: list[int]
    length: int
    split: bool
    aligned: bool = False
    sub: list[int] = []  # the copy had the last token replaced the source's next one
    ins: list[int] = []  # the copy had the last token come in before it
    pick: list[int] = []  # the one of the two the stream's record chose (drafted where `aligned`)

    def bucket(self, j: int) -> tuple[int, bool]:
        """The odds' bucket of copied token j."""
        return ALIGNED if self.aligned and j == 0 else match_bucket(self.length + j, self.split and j == 0)


class CopyDrafter(Drafter):
    """Drafts by copying what followed the most recent earlier occurrence of the context's longest repeated suffix.

    The draft length comes from the match. `odds` (CopyOdds) holds the chance that the next copied token is
    accepted, per match-length bucket and whether the earlier occurrences went on in one way or several, learnt
    from every round: the draft at each pre-round context is scored against the tokens the target emitted, whether
    or not this drafter was pulled. A copied token that is accepted lengthens the match by one for the next. The
    draft is cut to the K <= k with the most expected tokens per second given those chances and `costs`, the
    target's forward times (the engine hands over the ones it measures; until then a step plus 6% a token). K = 0,
    a plain step, when no length pays: a weak match proposes nothing.

    The index is kept in step with row 0 by `start` and `observe` (O(depth) per new token); the draft at each
    context length is computed once and kept, so the engine's counterfactual call on the pre-round context is free.
    Subclasses say what is indexed: `_begin(row)` returns (row position, stream position) of the first indexed token.
    """

    model_free = True
    sets_length = True
    aligns = True  # where the last token broke a copy, draft an aligned one (`_aligned`): on an H100 prompt lookup
    # alone 3.66x -> 3.89x own plain on the summary example, 1.66x -> 1.76x on the long repetitive one, the others
    # within 1%, rounds no longer (`benchmarks.run --aligned-copies on|off`, `engine_embedded_cuda_lin_*_s57.json`)
    session = ("odds", "_memo")

    def __init__(self, device="cpu", depth: int = 16, max_draft: int = MAX_GAMMA):
        super().__init__(device)
        self.depth, self.max_draft = depth, max_draft
        self.costs = CostModel()  # the target's forward seconds by tokens fed; the Engine hands over its own
        self.costs.observe(1, 1.0)
        self.index = SuffixIndex(depth)
        self.odds = CopyOdds()  # the chance that a copied token is accepted, learnt from every scored round
        self._row0, self._stream0 = 0, 0  # row position and stream position of the current document's first token
        self._memo: dict[int, Copy] = {}  # stream length -> the longest draft there
        self._offers: dict[tuple[int, int], tuple[Copy, tuple[list[int], float]]] = {}  # (length, k) -> `offer`
        self.alignment = {"sub": 0.0, "ins": 0.0}  # this stream's decayed record of the aligned copies' first tokens

    # -- the drafter interface -------------------------------------------------------------------------
    def start(self, rows, sampling, generator, hidden=None):
        self._row0, self._stream0 = self._begin(rows[0])
        self._memo = {}
        self.alignment = {"sub": 0.0, "ins": 0.0}

    def propose(self, rows, k):
        first = self.propose_ids(rows[0], k)
        ids = [first] + [first if row == rows[0] else self._draft_off_path(row, k) for row in rows[1:]]
        n = min(len(x) for x in ids)  # rows advance together, so they share K
        tokens = torch.tensor([x[:n] for x in ids], dtype=torch.int64).reshape(len(rows), n)
        return Proposal(tokens.to(self.device, non_blocking=True), None)

    def propose_ids(self, row, k):
        return self.offer(row, k)[0]

    def copy_rate(self, row, k: int) -> float:
        """The expected tokens per second of this drafter's best copy of at most k tokens at row's context (by this
        session's odds and the measured costs; 0 without a copy)."""
        return self.offer(row, k)[1]

    def offer(self, row, k: int) -> tuple[list[int], float]:
        """(the tokens proposed at row's context, at most k: the length with the most expected tokens per second;
        that rate of the best copy, 0 without one), by the odds and the measured costs. Where row is on the indexed
        path it is worked out once per context and k, with the odds of the first call: the bandit's check before a
        round (`copy_rate`) and the counterfactual score after it (`propose_ids` at the pre-round context) read one
        offer (on the CPU the second reading cost ~30 us a round)."""
        found, pos = self._located(row, k)
        kept = self._offers.get((pos, k)) if pos is not None else None
        if kept is not None and kept[0] is self._memo.get(pos):  # made from this memo entry (not one recalled)
            return kept[1]
        n, rate = length_choice(self._survival(found), self.costs)
        made = (found.tokens[:n], rate)
        if pos is not None:
            self._offers = {key: v for key, v in self._offers.items() if key[0] in self._memo}
            self._offers[(pos, k)] = (self._memo[pos], made)
        return made

    def branch(self, rows, k: int, floor: float = BRANCH_FLOOR) -> torch.Tensor | None:
        """Copied chains to join a greedy draft tree as one more branch (`TreeProposal.graft`): [B, C] int64, -1
        past a row's own, C the length of row 0's, whose tokens are kept while the chance that all of them so far
        are accepted stays >= floor (a tree's extra nodes cost less than a chain's: no length is chosen by cost
        here); None when row 0 copies nothing."""
        chains = []
        for row in rows:
            found = self._match(row, k)
            chains.append(found.tokens[:sum(p >= floor for p in self._survival(found))])
        C = len(chains[0])
        if not C:
            return None
        padded = [c[:C] + [-1] * (C - len(c[:C])) for c in chains]
        return torch.tensor(padded, dtype=torch.int64).to(self.device, non_blocking=True)

    def observe(self, rows, kept, hidden=None):
        row, at = rows[0], len(self.index.stream)
        if self._position(row) != at:  # not the engine's use (a row off the indexed path): index it afresh
            self.start(rows, None, None)
            return
        new = row[self._row0 + at - self._stream0:]
        found = self._draft_at(at)
        for j in range(min(len(found.tokens), len(new))):  # score the draft against what the target emitted
            hit = found.tokens[j] == new[j]
            self.odds.observe(found.bucket(j), hit)
            if not hit:
                break
        if found.pick and new:  # the last token broke a copy: which alignment went on
            for way in ("sub", "ins"):
                self.alignment[way] = ALIGN_DECAY * self.alignment[way] + (getattr(found, way)[:1] == new[:1])
            if not found.aligned:  # not drafted: its first token still tells the aligned bucket's record
                self.odds.observe(ALIGNED, found.pick[0] == new[0])
        self.index.extend(new)

    def reset_session(self):
        self.odds = CopyOdds()
        self._memo = {}

    # -- internals -----------------------------------------------------------------------------------
    def _begin(self, row) -> tuple[int, int]:
        raise NotImplementedError

    def _position(self, row) -> int | None:
        """The stream length that `row` corresponds to, if row agrees with the indexed document (checked on the last
        `depth` indexed tokens) and is not behind the memo; None for a row off the indexed path."""
        stream = self.index.stream
        pos = self._stream0 + len(row) - self._row0
        if pos < self._stream0:
            return None
        if pos >= len(stream):
            lo = max(self._stream0, len(stream) - self.depth)
            return len(stream) if row[self._row0 + lo - self._stream0:self._row0 + len(stream) - self._stream0] == stream[lo:] else None
        if pos in self._memo:  # the pre-round context of the engine's counterfactual
            lo = max(self._stream0, pos - self.depth)
            return pos if row[self._row0 + lo - self._stream0:] == stream[lo:pos] else None
        return None

    def _draft_at(self, pos: int) -> Copy:
        """The longest draft the index supports at stream length `pos` (the current end, or one of the last two the
        memo keeps: the next round may draft before the engine scores this one's counterfactuals)."""
        if pos not in self._memo:
            length, end, node = self.index.match()
            found = Copy(self.index.continuation(end, self.max_draft) if length else [], length,
                        len(self.index.kids[node]) > 1)
            last = max(self._memo, default=None)
            self._memo = {} if last is None else {last: self._memo[last]}
            self._memo[pos] = self._aligned(found) if self.aligns and length < 2 else found
        return self._memo[pos]

    def _aligned(self, found: Copy) -> Copy:
        """Where the last token broke a copy (it follows its predecessor nowhere earlier), the copies aligned with the
        source of the tokens before it (`SuffixIndex.before_last`): the last token replaced the source's next token
        (a renamed word, a changed number: copy on after that token) or came in before it (an inserted word: copy
        on from it). The stream's record of which went on picks one; it is drafted where the last token follows
        nothing, or after a run of ALIGNED_RUN tokens where its first token's chance beats the plain match's (each
        learnt in `observe`)."""
        length, end = self.index.before_last()
        if not length:
            return found
        sub, ins = self.index.continuation(end + 1, self.max_draft), self.index.continuation(end, self.max_draft)
        pick = ins if self.alignment["ins"] > self.alignment["sub"] else sub
        drafted = not found.tokens or \
            (length >= ALIGNED_RUN and self.odds.chance(ALIGNED) > self.odds.chance(found.bucket(0)))
        if drafted:
            return Copy(pick, length, False, True, sub, ins, pick)
        return found._replace(sub=sub, ins=ins, pick=pick)

    def _match(self, row, k) -> Copy:
        """The draft for row: at most k tokens, from the index where row is on its path."""
        return self._located(row, k)[0]

    def _located(self, row, k) -> tuple[Copy, int | None]:
        """`_match`'s draft, and the stream length it was drafted at (its memo key) where row is on the indexed path,
        else None."""
        at = self._position(row)
        if at is None:
            return self._off_path(row, k), None
        if at == len(self.index.stream) and at < self._stream0 + len(row) - self._row0:  # row runs ahead: catch up
            self.index.extend(row[self._row0 + at - self._stream0:])
        pos = self._stream0 + len(row) - self._row0
        found = self._draft_at(pos)
        return found._replace(tokens=found.tokens[:k]), pos

    def _off_path(self, row, k) -> Copy:
        length, end, node, index = self._find(row)
        tokens = index.continuation(end, min(k, self.max_draft)) if length else []
        return Copy(tokens, length, len(index.kids[node]) > 1)

    def _draft_off_path(self, row, k) -> list[int]:
        found = self._off_path(row, k)
        return found.tokens[:self._length(found)]

    def _find(self, row):
        raise NotImplementedError

    def _length(self, found: Copy) -> int:
        """How many of the copied tokens to propose: the K in 0..len(found.tokens) with the most expected tokens per
        second, each accepted token lengthening the match for the next."""
        return best_length(self._survival(found), self.costs)

    def _survival(self, found: Copy) -> list[float]:
        """The chance that the first 1, 2, ... of the copied tokens are all accepted (stops below 1e-3)."""
        survival, p = [], 1.0
        for j in range(len(found.tokens) if found.length else 0):
            p *= self.odds.chance(found.bucket(j))
            if p < 1e-3:  # later tokens add nothing that could pay for verifying them
                break
            survival.append(p)
        return survival


def copy_prior(bucket: int, split: bool) -> float:
    """Prior chance that the next copied token is accepted, before this session has scored any: longer matches and
    matches whose earlier occurrences all went on the same way copy better. Fitted to the embedded model, greedy,
    on the benchmark prompts (every position of their plain decodes): 0.46 / 0.21 after a one-token match (one /
    several continuations seen), 0.60 / 0.32 after two, 0.67-0.90 after three to eight, 0.87-0.96 after nine or more."""
    return (0.95 - 0.5 / MATCH_BUCKETS[max(0, bucket - 1)]) * (0.55 if split else 1.0)


_PRIOR = {(b, split): copy_prior(b, split) for b in range(len(MATCH_BUCKETS) + 1) for split in (False, True)}
_PRIOR[ALIGNED] = ALIGNED_PRIOR


class CopyOdds:
    """The chance that a copied token is accepted, per match bucket: that bucket's decayed record of scored tokens,
    starting from copy_prior times how all of this session's copies have fared against the prior (accepted tokens
    over the prior's expected count, decayed). The shared factor moves every bucket at once, so a few rounds tell
    free text (copies fail) from an edit; a bucket's own record then refines it."""

    def __init__(self, decay: float = 0.95, strength: float = 8.0, bucket_decay: float = 0.9, bucket_strength: float = 2.0):
        self.decay, self.strength = decay, strength  # shared factor: memory ~1 / (1 - decay) tokens, prior weight
        self.bucket_decay, self.bucket_strength = bucket_decay, bucket_strength
        self.hits = self.expected = 0.0
        self.buckets: dict[tuple[int, bool], list[float]] = {}  # bucket -> [accepted, scored], decayed

    @property
    def factor(self) -> float:
        return (self.hits + self.strength) / (self.expected + self.strength)

    def chance(self, bucket: tuple[int, bool]) -> float:
        hits, n = self.buckets.get(bucket, (0.0, 0.0))
        prior = min(0.98, _PRIOR[bucket] * self.factor)
        return (hits + self.bucket_strength * prior) / (n + self.bucket_strength)

    def observe(self, bucket: tuple[int, bool], hit: bool) -> None:
        self.hits = self.decay * self.hits + hit
        self.expected = self.decay * self.expected + _PRIOR[bucket]
        record = self.buckets.setdefault(bucket, [0.0, 0.0])
        record[0] = self.bucket_decay * record[0] + hit
        record[1] = self.bucket_decay * record[1] + 1


class PromptLookup(CopyDrafter):
    """Copies from the current context (prompt and output so far): the longest earlier occurrence of its suffix.
    It learns its odds afresh in every stream, so a stream's draws depend on its prompt and seed alone."""

    name = "prompt_lookup"

    def _begin(self, row):
        self.index = SuffixIndex(self.depth)
        self.index.extend(row)
        self.odds = CopyOdds()
        return 0, 0

    def _find(self, row):
        index = SuffixIndex(self.depth)  # a context off the indexed path: index it from scratch
        index.extend(row)
        return (*index.match(), index)


class NgramCache(CopyDrafter):
    """Copies from everything generated in this session (recurring answers, code, JSON), earlier generations
    included; `reset_session` forgets them. Each generation is a document of its output, after the last
    `prompt_context` prompt tokens (so that an answer's first tokens can be matched after the chat template)."""

    name = "ngram_cache"
    remembers = True
    session = ("odds", "_memo", "index", "_row0", "_stream0")

    def __init__(self, device="cpu", depth: int = 16, max_draft: int = MAX_GAMMA, prompt_context: int = 8):
        super().__init__(device, depth, max_draft)
        self.prompt_context = prompt_context

    def reset_session(self):
        super().reset_session()
        self.index = SuffixIndex(self.depth)
        self._row0 = self._stream0 = 0

    def _begin(self, row):
        self.index.new_document()
        row0, stream0 = max(0, len(row) - self.prompt_context), len(self.index.stream)
        self.index.extend(row[row0:])
        return row0, stream0

    def _find(self, row):
        return (*self.index.find(row), self.index)


class DraftModel(Drafter):
    """A small causal LM with its own KV cache; samples k tokens from q and rolls back after each round."""

    model_free = False

    def __init__(self, lm: CausalLM, name: str = "draft_model"):
        super().__init__(lm.device)
        self.lm, self.name = lm, name
        self.sampling = SamplingConfig()
        self.generator = None

    def start(self, rows, sampling, generator, hidden=None):
        self.sampling, self.generator = sampling, generator
        self.lm.reset()
        if len(rows[0]) > 1:  # the last prompt token is fed by the first propose
            self.lm.forward(torch.tensor([r[:-1] for r in rows], device=self.device), logits_to_keep=1)

    def propose(self, rows, k):
        B = len(rows)
        if k == 0:
            return Proposal(torch.empty((B, 0), dtype=torch.int64, device=self.device), None)
        new = torch.tensor([r[self.lm.length:] for r in rows], device=self.device)  # [B, 1 or 2]
        tokens, qs = [], []
        for i in range(k):
            logits = self.lm.forward(new, logits_to_keep=1)[:, -1]  # [B, V]
            token, q = draw(logits, self.sampling, self.generator)
            tokens.append(token)
            qs.append(q)
            new = token[:, None]
        return Proposal(torch.stack(tokens, dim=1), None if self.sampling.greedy else torch.stack(qs, dim=1))

    def observe(self, rows, kept, hidden=None):
        self.lm.crop(min(self.lm.length, kept))


# A sampled draft token x is accepted with chance ~ c0 + c1 q(x) (least squares over draws from q: the shipped head on
# 30 of its generator's held-out prompts, `python -m benchmarks.head --sets heldout --heldout 30 --online-k ''`:
# 0.383 + 0.523 q(x) at temperature 1, 0.324 + 0.543 q(x) at 0.7; q(x) alone reads 0.23 where 0.51 are accepted).
# One line for every head: the heads trained since fit 0.352-0.377 + 0.472-0.548 q(x) on the 66 hand-written prompts
# at temperature 1 (the shipped one 0.375 + 0.496 q(x); `head_embedded_cpu_{slots,s46,s49,s51,s52}.json`).
SAMPLED_ACCEPTANCE = (0.35, 0.55)
CATCH_UP = 16  # verified slots that wait before the draft head's first pass runs over them (DraftHeadDrafter)


class DraftHeadDrafter(Drafter):
    """An EAGLE-3 style head (`flashspec_core.draft_head`) over the target's hidden states, with its own KV cache.

    The features of verified positions arrive through `start` and every round's `observe` (whatever arm was
    pulled); the head's first pass runs over them once `catch_up` slots are waiting, and always before it drafts,
    as one batched pass (`catch_up`). Its cache keeps those slots, and the pass's last output gives the next
    draft's first token (`guess`: its top token, None while slots wait). `propose` draws that token, feeds its own
    output back for the remaining K - 1 tokens and rolls those K - 1 slots back. It samples from exactly the q
    it reports: the head's distribution over its draft vocabulary, placed at the target ids (zero elsewhere).

    catch_up=1 runs the first pass every round (always current: a guess to score each round). On the CPU a pass
    costs about as much over 8 slots as over 1 (the weights are read once), so the default waits for CATCH_UP
    slots: rounds of other arms then pay ~0.2 ms a slot instead of ~1.5 ms a round (the native 4-bit path, a
    7 ms plain round). On a GPU a pass costs about as much as over 1 slot too: a captured round runs it inside its
    graph where the head drafts (`observe_at`), and another arm's round stores its slots in the head's backlog, which
    it takes in pieces as this drafter would (`CapturedRound.catch_up`); catch_up=1 runs it inside every round.

    On the CPU the head sets its own chain length (`sets_length`): once the policy has handed it the measured costs
    (`costs`, and `step_s`, its seconds a draft step) a chain ends after the token past which one more is not worth
    its step and verify (`gamma.worth_another`, from the head's probabilities of the tokens it drew). The decision
    after token i reads tokens 1..i only, so every drafted token is still a draw from q: exact. Not on a GPU, where
    reading a probability each step would wait for the device.
    """

    name = "draft_head"
    model_free = False

    def __init__(self, head: DraftHead, vocab_size: int, vocab_limit: int | None = None, catch_up: int = CATCH_UP):
        """vocab_limit: draft from the first (most frequent) ids of the head's vocabulary only: a cheaper step.
        catch_up: run the first pass once this many verified slots wait (1: every round)."""
        if not isinstance(catch_up, int) or catch_up < 1:
            raise ValueError(f"catch_up must be a positive int, got {catch_up!r}")
        head.check_one_layer()
        super().__init__(head.d2t.device)
        self.head, self.vocab_size = head, vocab_size
        head.columns = self.device.type == "cpu"  # matrix products for its few rows there (fast_path.linear)
        self.aux_layers = head.cfg.aux_layers
        self.dtype = next(head.parameters()).dtype
        self.sampling, self.generator = SamplingConfig(), None
        self.cache = None
        self.h: torch.Tensor | None = None  # [B, 1, H] the first pass's output at the last verified slot
        self.logits: torch.Tensor | None = None  # [B, draft V] float32: the next draft token's logits
        self.fixed: _Fixed | None = None  # a captured round's buffers (`bind`), kept across streams
        self.plans: dict = {}  # captured sampled trees' index tensors (`_SampledPlan`), by TreeSize
        self.catch_up_slots = catch_up
        self.waiting: list[torch.Tensor] = []  # features [B, n, F] of verified slots not yet through the first pass
        self.sets_length = self.device.type == "cpu"
        self.costs: CostModel | None = None  # the target's measured forward costs, handed over by the policy
        self.set_vocab_limit(vocab_limit)

    def set_vocab_limit(self, vocab_limit: int | None) -> None:
        """Draft from the first `vocab_limit` (most frequent) ids of the head's vocabulary; None = all of them.
        Before the first round (a captured round's buffers are sized by it)."""
        if self.fixed is not None:
            raise RuntimeError("set the draft vocabulary before the head's first captured round")
        if vocab_limit is not None and not 0 < vocab_limit:
            raise ValueError(f"vocab_limit must be positive, got {vocab_limit}")
        ids = self.head.draft_ids[:vocab_limit]
        if int(ids.max()) >= self.vocab_size:
            raise ValueError(f"the draft head names target ids up to {int(ids.max())}; "
                             f"the vocabulary has {self.vocab_size}")
        self.ids, self.limit = ids, vocab_limit

    def bind(self, batch: int, capacity: int) -> "_Fixed":
        """Fixed buffers for a captured round (`flashspec_core.captured`): a cache of `capacity` slots that never
        grows and the state the next draft starts from, at addresses its graphs keep; every stream of `batch` rows
        reuses them (`start` empties the cache)."""
        f = self.fixed
        if f is None or f.h.shape[0] != batch or f.cache.k.shape[2] != capacity:
            H, V = self.head.cfg.hidden_size, self.ids.numel()
            self.fixed = f = _Fixed(HeadCache(self.head.cfg, batch, capacity, self.device, self.dtype),
                                    torch.zeros((batch, 1, H), dtype=self.dtype, device=self.device),
                                    torch.zeros((batch, V), device=self.device),
                                    torch.zeros(batch, dtype=torch.int64, device=self.device))
        return f

    def start(self, rows, sampling, generator, hidden=None):
        self.sampling, self.generator = draft_sampling(sampling, self.head.cfg.draft_temperature), generator
        if self.fixed is not None and self.fixed.h.shape[0] == len(rows):
            self.cache = self.fixed.cache
            self.cache.length = 0
        else:
            self.cache = HeadCache(self.head.cfg, len(rows), max(64, 2 * len(rows[0])), self.device, self.dtype)
        self.h = self.logits = self.guess = None
        self.waiting = []
        self.observe(rows, len(rows[0]), hidden)
        self.catch_up(rows)  # the prompt's slots at once: a first draft never waits for them

    @torch.inference_mode()
    def observe(self, rows, kept, hidden=None):
        """Newly verified slots (hidden [B, n, F]: slot t pairs the features of position t with token t + 1) join
        those waiting for the first pass, which runs once `catch_up_slots` wait."""
        if hidden is None or hidden.shape[1] == 0:
            return
        self.waiting.append(hidden.clone())  # the target may reuse its output buffer
        self.guess = None  # the last pass's guess is for an earlier context now
        if sum(w.shape[1] for w in self.waiting) >= self.catch_up_slots:
            self.catch_up(rows)

    @torch.inference_mode()
    def catch_up(self, rows) -> None:
        """The first pass over every waiting slot, in one head step: the head is then current (h, logits, guess)."""
        if not self.waiting:
            return
        hidden = torch.cat(self.waiting, dim=1) if len(self.waiting) > 1 else self.waiting[0]
        self.waiting = []
        s, n = self.cache.length, hidden.shape[1]
        following = torch.tensor([r[s + 1:s + 1 + n] for r in rows], device=self.device)  # token t + 1 of each slot
        h = self.head.step(self.cache, following, self.head.fuse(hidden.to(self.dtype)))[:, -1:]  # [B, 1, H]
        self._keep(h, fixed=self.fixed is not None and self.cache is self.fixed.cache)

    def _keep(self, h: torch.Tensor, fixed: bool) -> None:
        """The next draft's state from the first pass's last output h [B, 1, H]; fixed: into the fixed buffers (a
        captured round reads them, whatever this drafter's own cache was when it was captured)."""
        logits = self.head.logits(h[:, -1], self.limit)  # draft vocabulary
        if fixed:  # written in place: the widening copy and the id lookup land in the buffers
            f = self.fixed
            h, logits = f.h.copy_(h), f.logits.copy_(logits)
            guess = torch.index_select(self.ids, 0, argmax(logits), out=f.guess)  # [B]
        else:
            logits = logits.float()
            guess = self.ids[argmax(logits)]  # [B]
        self.h, self.logits, self.guess = h, logits, guess

    # -- a captured round (fixed shapes, device positions, no host reads) ---------------------------
    def observe_at(self, hidden: torch.Tensor, emitted: torch.Tensor, kept: torch.Tensor, pos: torch.Tensor,
                   S: int) -> None:
        """`observe` inside a captured round: the first pass over all K + 1 verified slots pos [K+1] (hidden [B, K+1,
        F], emitted [B, K+1] the round's emitted ids: token t + 1 of slot t), of which the first kept + 1 (kept [1],
        the accepted count) are real; the rest are written past the new length and overwritten next round."""
        following = emitted.clamp_min(0)
        h = self.head.step_at(self.fixed.cache, following, self.head.fuse(hidden.to(self.dtype)), pos, S)
        self._keep(h.index_select(1, kept), fixed=True)

    def prompt_at(self, following: torch.Tensor, features: torch.Tensor, pos: torch.Tensor, S: int) -> None:
        """`catch_up` over prompt slots pos [T] (a device tensor, a chain) inside a captured graph: following [B, T]
        token t + 1 of each slot, features [B, T, F] the target's; the fixed state is the last slot's."""
        h = self.head.step_at(self.fixed.cache, following, self.head.fuse(features), pos, S)
        self._keep(h[:, -1:], fixed=True)

    def caught_up(self, n: int) -> None:
        """The first pass ran over the stream's first n slots in captured graphs (`prompt_at`): the cache holds them
        and the fixed buffers the next draft's state."""
        f = self.fixed
        self.cache = f.cache
        self.cache.length = n
        self.h, self.logits, self.guess = f.h, f.logits, f.guess

    def propose_at(self, k: int, length: torch.Tensor, S: int, params: torch.Tensor | None, generator,
                   truncates: bool = True) -> Proposal:
        """`propose` inside a captured round from the fixed state: draft step i writes head slot length + i (device
        length [1]); params None = greedy, else `sampling_params` (truncates: `logits_to_probs_at`'s). Its slots
        are overwritten by `observe_at`."""
        h, logits = self.fixed.h, self.fixed.logits
        tokens, qs = [], []
        for i in range(k):
            if params is None:
                index, q = argmax(logits), None
            else:
                q = logits_to_probs_at(logits, params, truncates)
                index = sample(q, generator)
            tokens.append(self.ids[index])
            qs.append(q)
            if i + 1 < k:
                h = self.head.step_at(self.fixed.cache, tokens[-1][:, None], h, length + i, S)
                logits = self.head.logits(h[:, -1], self.limit).float()
        return Proposal(torch.stack(tokens, dim=1), None if params is None else self._widen(torch.stack(qs, dim=1)))

    def propose_tree_at(self, shape, length: torch.Tensor, S: int) -> TreeProposal:
        """`propose_tree` (greedy) inside a captured round, from the fixed state: every level of fixed width (the
        root's top_k children, then each level's w (`TreeSize.width`) best candidates expanded, top_k children
        each), the tree the `size` best candidates by row 0's scores, all on the device: a `TensorTree` (depth and
        child bounds: the shape's). Level l's nodes sit at head slots length + (l - 1) * w..., which `observe_at`
        overwrites."""
        depth, k, size = shape.depth, shape.top_k, shape.size
        w, cache = shape.width, self.fixed.cache  # the frontier's width below the root
        slots = length + torch.arange((depth - 1) * w, device=self.device)  # level l's nodes: slots[(l - 1) * w:]
        rope = length + torch.arange(depth, device=self.device)  # level l's rotary position: rope[l - 1]
        own = cache.slots[:S][None, :] == slots[:, None]  # [(depth - 1) * w, S]: each tree slot's own column
        visible = (cache.slots[:S] < length)[None, :]  # [1, S]: what the root sees, the verified slots
        h, logits = self.fixed.h, self.fixed.logits[:, None]  # [B, W, H], [B, W, V] (the root: W = 1)
        frontier_score = logits.new_zeros(logits.shape[:2], dtype=torch.float32)
        scores, index, chosen = [], [], []
        backend = os.environ.get("FLASHSPEC_TREE_LEVEL") or ("triton" if self.head.uses_kernels(h) else "torch")
        for level in range(1, depth + 1):
            first = sum(x.shape[1] for x in scores)  # the level's first candidate id
            last = level == depth
            lv = tree_level(logits, frontier_score, k, 0 if last else w, first, backend)
            scores.append(lv.score)
            index.append(lv.child)
            if last:
                break
            chosen.append(lv.chosen)
            here = slice((level - 1) * w, level * w)
            tokens, h, visible = next_frontier(lv, self.ids, h, visible, own[here], backend)  # visible [w, S]
            h = self.head.step_tree_at(cache, tokens, h, slots[here], rope[level - 1].expand(w), visible)
            logits = self.head.logits(h, self.limit)  # float32 in the tree level's log-softmax
            frontier_score = lv.picked_score
        return _ranked(torch.cat(scores, 1), self._tree_parents(chosen, k), self.ids[torch.cat(index, 1)], size,
                       depth, k, backend)

    def propose_sampled_tree_at(self, shape, length: torch.Tensor, S: int, params: torch.Tensor,
                                generator, truncates: bool = True) -> TreeProposal:
        """`_sampled_tree` inside a captured round, from the fixed state: the static shape's levels, each level's
        children drawn without replacement from the head's q at their parents (one draw over the level), then one
        head step over the level's nodes at head slots length + (the nodes of the levels above), each seeing the
        verified slots, its ancestors and itself (`observe_at` overwrites them). The tree is the shape as a
        `TensorTree` whose depth bound is `shape.depth` (the record's layout, as a greedy tree's); q [B, N, V] the law
        each node was drawn from, as `kernels.tree_verify` reads it. shape: a `TreeSize`, drafted as `shape.sampled`;
        truncates: `logits_to_probs_at`'s."""
        plan, cache = self._sampled_plan(shape), self.fixed.cache
        h, logits = self.fixed.h, self.fixed.logits[:, None]  # the level above's [B, W, H], [B, W, draft V]
        score = logits.new_zeros(logits.shape[:2], dtype=torch.float32)
        verified = (cache.slots[:S] < length)[None, :]  # [1, S]
        tokens, qs, scores = [], [], []
        for d, lv in enumerate(plan.levels, start=1):
            law = logits_to_probs_at(logits.index_select(1, lv.parents), params, truncates)  # [B, P, draft V]
            drawn, laws = _without_replacement(law, lv.draws, generator)  # [B, P, c], [B, P, c, draft V]
            index = drawn.flatten(1).index_select(1, lv.pick)  # [B, W] the level's nodes
            q = laws.flatten(1, 2).index_select(1, lv.pick)  # [B, W, draft V]
            score = score.index_select(1, lv.up) + q.gather(-1, index[..., None]).squeeze(-1).clamp_min(1e-30).log()
            tokens.append(self.ids[index])
            qs.append(q)
            scores.append(score)
            if lv.slots is None:  # the last level: drafted, not run
                break
            visible = verified | (cache.slots[:S] == (length + lv.seen)[..., None]).any(dim=1)  # [W, S]
            rope = (length + d - 1).expand(lv.slots.numel())
            h = self.head.step_tree_at(cache, tokens[-1], h.index_select(1, lv.up), length + lv.slots, rope, visible)
            logits = self.head.logits(h, self.limit).float()
        pick = lambda xs: torch.cat(xs, dim=1).index_select(1, plan.order)  # noqa: E731  (level order -> node order)
        return TreeProposal(plan.tree, pick(tokens), self._widen(pick(qs)), pick(scores))

    def _sampled_plan(self, shape) -> "_SampledPlan":
        """`sampled_plan` of a `TreeSize`'s static shape on this drafter's device, made once per shape (before a graph
        is captured: its first call is the capture's warm-up) and kept."""
        if shape not in self.plans:
            self.plans[shape] = sampled_plan(shape.sampled, shape.depth, self.device)
        return self.plans[shape]

    def _tree_parents(self, chosen: list[torch.Tensor], k: int) -> torch.Tensor:
        """Each candidate's parent candidate id [M] (-1 the root): the root's k children, then k children of each
        level's chosen nodes (chosen: one [w] a level but the last)."""
        roots = torch.full((k,), -1, dtype=torch.int64, device=self.device)
        if not chosen:
            return roots
        return torch.cat([roots, torch.stack(chosen)[..., None].expand(-1, -1, k).flatten()])

    @torch.inference_mode()
    def propose(self, rows, k):
        B = len(rows)
        if k > 0:
            self.catch_up(rows)
        if k == 0 or self.h is None:  # no verified features yet (a one-token prompt): a plain round
            return Proposal(torch.empty((B, 0), dtype=torch.int64, device=self.device), None)
        verified, h, logits = self.cache.length, self.h, self.logits
        tokens, qs, survival = [], [], []
        for i in range(k):
            index, q = draw(logits, self.sampling, self.generator)
            tokens.append(self.ids[index])
            qs.append(q)
            if i + 1 == k or self._ends(index, q, logits, survival):
                break
            h = self.head.step(self.cache, tokens[-1][:, None], h)
            logits = self.head.logits(h[:, -1], self.limit).float()
        self.cache.crop(verified)  # the draft slots go; the verified ones stay
        q = None if self.sampling.greedy else self._widen(torch.stack(qs, dim=1))
        return Proposal(torch.stack(tokens, dim=1), q)

    def _ends(self, index: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, survival: list[float]) -> bool:
        """Whether the chain ends with the token just drawn (index [B]): its probability under the head (q, or the
        softmax of the greedy step's logits; the rows' mean) extends `survival`, and one more token must be worth its
        price (`gamma.worth_another`). Never before the costs are measured."""
        if not self.sets_length or self.costs is None or self.step_s <= 0:
            return False
        probs = q if q is not None else logits.softmax(dim=-1)
        p = float(probs.gather(-1, index[:, None]).mean())
        if q is not None:  # a draw x is accepted with min(1, p(x) / q(x)): far more often than q(x) when q is flat
            p = min(1.0, SAMPLED_ACCEPTANCE[0] + SAMPLED_ACCEPTANCE[1] * p)
        survival.append(p * (survival[-1] if survival else 1.0))
        return not worth_another(survival, p, self.costs, self.step_s)

    def _widen(self, q: torch.Tensor) -> torch.Tensor:
        """q over the draft vocabulary [B, K, draft V] -> over the target's [B, K, V] (zero outside it)."""
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.ids, q)

    # -- trees (EAGLE-2's dynamic tree, Li et al. 2024) ----------------------------------------------
    @torch.inference_mode()
    def propose_tree(self, rows, depth: int, top_k: int, size: int) -> TreeProposal:
        """A tree of at most `size` nodes and `depth` levels below the pending token, grown from the current state.

        Level by level, every frontier node gets its top_k tokens under the head as children, scored by cumulative
        draft log-probability (the parent's plus the child's log q); the top_k best children of the level form the
        next frontier, which the head runs over in one step with a tree mask in its own cache (a node sees the
        verified slots, its ancestors and itself). The tree is then the `size` best nodes of all levels (EAGLE-2's
        rerank; a child never scores above its parent, ties go to the earlier node, so they form a tree), numbered
        best first: parents come before children and siblings are tried most probable first. The head's cache is
        cropped back to the verified slots.

        The shape is shared by a batch: row 0's scores choose it (which frontier node and which of its ranked
        children), and every row carries its own tokens at those places (its own r-th best child). Greedy, the
        children are a function of the pre-round state (q = None, one-hot at each node's token). At temperature
        > 0 the head samples instead (`_sampled_tree`): a shape fixed in advance, children drawn from q.
        """
        self._check_tree(depth, top_k, size)
        B = len(rows)
        self.catch_up(rows)
        if self.h is None:  # no verified features yet (a one-token prompt): an empty tree, a plain round
            none = torch.empty((B, 0), device=self.device)
            return TreeProposal(DraftTree(()), none.long(), None, none)
        if not self.sampling.greedy:
            return self._sampled_tree(DraftTree.static(depth, top_k, size))
        verified = self.cache.length
        frontier = _Frontier(h=self.h, logits=self.logits[:, None], score=self.logits.new_zeros(B, 1),
                             ids=torch.full((1,), -1, dtype=torch.int64, device=self.device),
                             seen=torch.zeros((1, 0), dtype=torch.bool, device=self.device))
        scores, parents, index, count = [], [], [], 0
        for level in range(1, depth + 1):
            k = min(top_k, frontier.logits.shape[-1])
            w = 0 if level == depth else min(top_k, size, frontier.logits.shape[1] * k)
            lv = tree_level(frontier.logits, frontier.score, k, w, count)  # [B, W * k] each, the w best of them
            scores.append(lv.score)
            parents.append(frontier.ids.repeat_interleave(k))
            index.append(lv.child)
            if level < depth:
                frontier = self._grow(frontier, lv, verified + level - 1)
            count += lv.score.shape[1]
        self.cache.crop(verified)  # the tree's slots go; the verified ones stay
        return self._rerank(torch.cat(scores, 1), torch.cat(parents), torch.cat(index, 1), size)

    def _sampled_tree(self, tree: DraftTree) -> TreeProposal:
        """A tree of a shape fixed before any draw, each node's children drawn from the head's q at that node without
        replacement (Gumbel top-k): the j-th sibling's law is q with the earlier siblings' tokens removed,
        renormalised (one-hot where q has no other token left), which is the law the tree verifier's sampled test
        needs for every node given the path to it (`kernels.tree_verify`). One head step a level over its nodes,
        each seeing the verified slots, its ancestors and itself; the cache is cropped back to the verified slots."""
        B, N, verified = self.h.shape[0], tree.N, self.cache.length
        index = torch.zeros((B, N), dtype=torch.int64, device=self.device)  # draft-vocabulary index per node
        q = self.logits.new_zeros(B, N, self.ids.numel())
        score = self.logits.new_zeros(B, N)
        h, logits = {0: self.h[:, -1]}, {0: self.logits}  # by slot (0 = the root): head output, children's logits
        cached: list[int] = []  # tree nodes in the head's cache, in the order appended
        for d in range(1, tree.max_depth + 1):
            level = [i for i in range(N) if tree.depth[i] == d]
            for slot in sorted({tree.parents[i] + 1 for i in level}):
                kids = list(tree.children[slot])
                law = logits_to_probs(logits[slot], self.sampling)  # [B, draft V]
                drawn, laws = _without_replacement(law, len(kids), self.generator)
                index[:, kids], q[:, kids] = drawn, laws
                base = score[:, slot - 1:slot] if slot else 0.0
                score[:, kids] = base + laws.gather(-1, drawn[..., None]).squeeze(-1).clamp_min(1e-30).log()
            if d < tree.max_depth:
                mask = self._level_mask(tree, level, cached, verified)
                positions = torch.full((len(level),), verified + d - 1, dtype=torch.int64, device=self.device)
                parents_h = torch.stack([h[tree.parents[i] + 1] for i in level], dim=1)  # [B, W, H]
                out = self.head.step(self.cache, self.ids[index[:, level]], parents_h, positions, mask)
                out_logits = self.head.logits(out, self.limit).float()
                for j, i in enumerate(level):
                    h[i + 1], logits[i + 1] = out[:, j], out_logits[:, j]
                cached += level
        self.cache.crop(verified)
        return TreeProposal(tree, self.ids[index], self._widen(q), score)

    def _level_mask(self, tree: DraftTree, level: list[int], cached: list[int], verified: int) -> torch.Tensor:
        """[W, cache length + W] bool: each node of `level` sees the verified slots, its ancestors among the cached
        tree nodes and itself."""
        rows = []
        for i in level:
            ancestors = set(tree.path_to(tree.parents[i]))
            rows.append([True] * verified + [n in ancestors for n in cached] + [n == i for n in level])
        return torch.tensor(rows, dtype=torch.bool, device=self.device)

    def _check_tree(self, depth, top_k, size) -> None:
        for name, value in (("depth", depth), ("top_k", top_k), ("size", size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def _grow(self, frontier: "_Frontier", level: Level, position: int) -> "_Frontier":
        """The next frontier: the level's chosen candidates (`tree_level`), run through the head in one step at
        `position`, each seeing the verified slots, its ancestors and itself."""
        w = level.up.numel()
        eye = torch.eye(w, dtype=torch.bool, device=self.device)
        seen = torch.cat([frontier.seen[level.up], eye], dim=1)  # [w, S + w] over the tree's slots in the cache
        verified = self.cache.length - frontier.seen.shape[1]
        mask = torch.cat([seen.new_ones(w, verified), seen], dim=1)  # [w, cache length + w]
        positions = torch.full((w,), position, dtype=torch.int64, device=self.device)
        h = self.head.step(self.cache, self.ids[level.picked_child], frontier.h[:, level.up], positions, mask)
        return _Frontier(h=h, logits=self.head.logits(h, self.limit).float(), score=level.picked_score,
                         ids=level.chosen, seen=seen)

    def _rerank(self, scores, parents, index, size: int) -> TreeProposal:
        """The `size` best candidates by row 0's scores (scores [B, M], parents by candidate id [M], draft-vocabulary
        index [B, M]) as a tree, numbered best first (ties: the earlier candidate, so a parent precedes its children)."""
        order, node_parents = _best_nodes(scores, parents, size)
        tree = DraftTree(tuple(node_parents.tolist()))  # the shape on the host (one sync)
        return TreeProposal(tree, self.ids[index[:, order]], None, scores[:, order])


def _best_nodes(scores: torch.Tensor, parents: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` best candidates by row 0's scores [B, M] (candidate parents [M], -1 the root), numbered best
    first, on the device: their candidate ids [N] and each one's parent node [N] (-1 the root). A child never scores
    above its parent and ties go to the earlier candidate, so every parent is kept and comes first."""
    order = scores[0].sort(descending=True, stable=True).indices[:size]  # [N] candidate ids
    node = torch.full_like(parents, -1).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    up = parents[order]
    return order, torch.where(up >= 0, node[up.clamp_min(0)], up)


def _ranked(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, size: int, depth: int,
            width: int, backend: str = "torch") -> TreeProposal:
    """`_best_nodes` as a TreeProposal of a `TensorTree` (depth and child bounds given), tokens [B, M] by candidate;
    "triton": the ranking and the tree's views in one kernel (`kernels.tree_level.rank_tree_triton`)."""
    if backend == "triton":
        r = rank_tree_triton(scores, parents, tokens, size, depth, width)
        return TreeProposal(TensorTree(r.parents, depth, width, views=r), r.tokens, None, r.scores)
    order, node_parents = _best_nodes(scores, parents, size)
    return TreeProposal(TensorTree(node_parents, depth, width), tokens[:, order], None, scores[:, order])


@dataclass(frozen=True)
class _SampledLevel:
    """One level of a static tree, as index tensors (`sampled_plan`). Positions index the level above's nodes (the
    root alone above level 1) or this level's, in node order within the level."""
    parents: torch.Tensor  # [P] the nodes above that have children here
    draws: int  # c: the most children one of them has (each draws c without replacement)
    pick: torch.Tensor  # [W] each node's draw among the [P * c]: its parent's p * c + its rank among siblings
    up: torch.Tensor  # [W] each node's parent among the nodes above
    slots: torch.Tensor | None  # [W] its head cache slot past the verified ones; None on the last level (not run)
    seen: torch.Tensor | None  # [W, d] the slots past the verified ones of its path, itself included


@dataclass(frozen=True)
class _SampledPlan:
    tree: TensorTree  # the shape on the device
    levels: list[_SampledLevel]
    order: torch.Tensor  # [N] node i's place among the levels' nodes laid end to end


def sampled_plan(tree: DraftTree, depth: int, device) -> _SampledPlan:
    """A static tree (`DraftTree.static`) as the index tensors a captured sampled tree drafts it with, level by
    level (`DraftHeadDrafter.propose_sampled_tree_at`); depth >= its levels bounds its `TensorTree`."""
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    levels, above, slot_of = [], [-1], {}
    for d in range(1, tree.max_depth + 1):
        nodes = [i for i in range(tree.N) if tree.depth[i] == d]
        parents = [a for a in above if tree.children[a + 1]]
        draws = max(len(tree.children[a + 1]) for a in parents)
        pick = [parents.index(tree.parents[i]) * draws + tree.children[tree.parents[i] + 1].index(i) for i in nodes]
        slots = seen = None
        if d < tree.max_depth:
            slot_of.update((i, len(slot_of)) for i in nodes)
            seen = as_tensor([[slot_of[a] for a in tree.path_to(i)] for i in nodes])  # [W, d]: a level-d path
            slots = as_tensor([slot_of[i] for i in nodes])
        levels.append(_SampledLevel(as_tensor([above.index(a) for a in parents]), draws, as_tensor(pick),
                                    as_tensor([above.index(tree.parents[i]) for i in nodes]), slots, seen))
        above = nodes
    laid = [i for d in range(1, tree.max_depth + 1) for i in range(tree.N) if tree.depth[i] == d]
    width = max(len(k) for k in tree.children)
    return _SampledPlan(TensorTree(as_tensor(list(tree.parents)), depth, width), levels,
                        as_tensor([laid.index(i) for i in range(tree.N)]))


@dataclass(frozen=True)
class _Fixed:
    """A draft head's buffers for captured rounds (`DraftHeadDrafter.bind`)."""
    cache: HeadCache  # never grows
    h: torch.Tensor  # [B, 1, H] the first pass's output at the last verified slot
    logits: torch.Tensor  # [B, draft V] float32: the next draft token's logits
    guess: torch.Tensor  # [B] int64: their top token, as a target id


@dataclass(frozen=True)
class _Frontier:
    """The nodes of one tree level that the head has run over (the shape shared by the rows, values per row)."""
    h: torch.Tensor  # [B, W, H] their head outputs (the root: the first pass's output at the last verified slot)
    logits: torch.Tensor  # [B, W, draft V] float32: their children's logits
    score: torch.Tensor  # [B, W] float32 cumulative draft log-probability (0 for the root)
    ids: torch.Tensor  # [W] int64 candidate ids (-1 for the root)
    seen: torch.Tensor  # [W, S] bool over the tree's S slots in the cache: ancestors and itself


def _without_replacement(law: torch.Tensor, c: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """c draws per row from law [..., V] without replacement (the exponential race's c best: Gumbel top-k), and the
    law each was drawn from given the earlier ones: [..., c] indices, [..., c, V] laws. Where the law has no token
    left, the draw is the next index in the race and its law one-hot there (a deterministic sibling)."""
    noise = torch.empty_like(law).exponential_(generator=generator)
    drawn = (law / noise).topk(c, dim=-1).indices  # [..., c] distinct
    index = drawn[..., None, :].expand(*drawn.shape, c)  # [..., c (law j), c (draw i)]
    earlier = torch.ones(c, c, device=law.device).tril(-1).expand(index.shape)  # [j, i] 1 where draw i came before j
    removed = law.new_zeros(*index.shape[:-1], law.shape[-1]).scatter_(-1, index, earlier)  # [..., c, V]
    left = law[..., None, :] * (1 - removed)  # law j: the law without the draws before it
    mass = left.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(left).scatter_(-1, drawn[..., None], 1.0)
    return drawn, torch.where(mass > 0, left / mass.clamp_min(1e-30), one_hot)


def draw(logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row from logits [B, V]: the argmax when greedy (q None), else a sample from q [B, V]."""
    if sampling.greedy:
        return argmax(logits), None
    q = logits_to_probs(logits, sampling)
    return sample(q, generator), q


MODEL_FREE = {"prompt_lookup": PromptLookup, "ngram_cache": NgramCache, "no_draft": NoDraft}
