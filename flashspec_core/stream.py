"""The nouns every part of a stream shares: its per-stream state, what one round did (as host numbers), and the
events a stream yields. The device round (`round.py`), the host policy (`policy.py`), the event builder
(`events.py`) and the engine all import these; this module imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashspec_core.bandit import ArmState, Bandit
from flashspec_core.gamma import MAX_AUTO_GAMMA, Acceptance, Calibration
from flashspec_core.sampling import SamplingConfig


@dataclass(frozen=True)
class TokenSpan:
    kind: str  # "accepted" | "rejected" | "resampled" | "bonus" | "plain"
    id: int
    text: str  # decoded piece ("" without a tokenizer)
    p: float  # target probability of this token at its position
    q: float | None  # draft probability (1.0 for a deterministic drafter; None for resampled/bonus/plain)


@dataclass(frozen=True)
class DraftedTree:
    """Row 0's draft tree of a tree round, for display: nodes in the order verification tried them (a parent before
    its children), with the path it accepted."""
    tokens: tuple[int, ...]  # [N] each node's drafted token id
    parents: tuple[int, ...]  # [N] each node's parent node, -1 for the pending token (the root)
    accepted: tuple[int, ...]  # the accepted path's nodes, the root's child first (cut where the stream stopped)
    texts: tuple[str, ...] = ()  # [N] each node's decoded piece after its ancestors (events.py; empty before)


@dataclass(frozen=True)
class RoundEvent:
    index: int  # round number, from 0
    mode: str  # "speculative" | "plain"
    drafter: str  # the arm that drafted this round
    gamma: int  # K: tokens proposed this round
    accepted: tuple[int, ...]  # accepted draft ids (emitted)
    rejected: tuple[int, ...]  # draft ids from the first rejection on (dropped)
    resampled: int | None  # drawn from norm(max(0, p - q)) at the first rejection
    bonus: int | None  # drawn from p after a full accept (in plain mode: the plain token)
    spans: tuple[TokenSpan, ...]  # accepted, rejected, then the resampled/bonus token, for display
    text: str  # new text this round
    draft_s: float
    verify_s: float
    round_s: float
    elapsed_s: float  # since the stream started, prefill included
    new_tokens: int  # tokens generated so far
    arms: tuple[ArmState, ...]  # bandit state after this round (empty without a bandit)
    finished: str | None  # "eos" | "length" | None
    prefill_s: float = 0.0  # the stream's prefill (the same on every event), included in elapsed_s
    device_s: float | None = None  # CUDA: GPU time of the round's launched work after drafting (RoundOutput's)
    tree_nodes: int = 0  # a tree round: the draft tree's nodes verified in its one target forward (0: a chain)
    drafted_tree: DraftedTree | None = None  # a tree round: row 0's draft tree with texts (the spans show its
    # accepted path and the children tried where the walk stopped; the tree has every branch); None for a chain

    @property
    def emitted(self) -> tuple[int, ...]:
        last = self.resampled if self.resampled is not None else self.bonus
        return self.accepted + (() if last is None else (last,))


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: dict
    events: list[RoundEvent] = field(repr=False, default_factory=list)


@dataclass
class RoundOutput:
    """What one vectorised round did, per row, before rows were advanced together: host numbers, read from the
    round's one device-to-host copy."""
    num_accepted: list[int]  # [B]
    tokens: list[list[int]]  # [B][K+1]: accepted drafts, the resampled/bonus token, -1s
    draft: list[int]  # row 0's proposal (K ids)
    p: list[float]  # row 0: p of each proposed token, then p of its emitted token at num_accepted
    q: list[float]  # row 0: q of each proposed token
    draft_s: float
    verify_s: float
    guesses: dict[str, int] = field(default_factory=dict)  # row 0: each hidden-state reader's first-pass top
    # token at the pre-round context (what it would have drafted first), for its counterfactual score
    device_s: float | None = None  # CUDA: the GPU's time from the end of drafting to the end of the round's launch
    tree: tuple[int, int] | None = None  # a tree round's (nodes verified, depth); None for a chain
    drafted_tree: DraftedTree | None = None  # a tree round: row 0's draft tree and accepted path; None for a chain


@dataclass(frozen=True)
class Played:
    """One round as the host sees it once it has run: the arm and its K limit, the context before it, the ids it
    emitted (row 0) and the round's output."""
    arm: str
    limit: int  # the most tokens K could have been (what the arm's counterfactual proposals are cut to)
    before: list[int]  # row 0 before the round
    emitted: list[int]  # row 0's new ids (accepted drafts, then the resampled/bonus id)
    out: RoundOutput


@dataclass
class Counterfactual:
    """What an arm that was not pulled would have proposed, waiting for the tokens that decide it."""
    arm: str
    proposal: list[int]
    seen: list[int]  # the tokens emitted since it was made


@dataclass
class StreamState:
    """What one stream carries from round to round; made by `Engine.stream` once the request is valid."""
    rows: list[list[int]]  # [1][T]: the context so far, prompt first
    sampling: SamplingConfig
    gamma: int | str  # a fixed K, or "auto"
    mode: str  # "speculative" | "plain"
    arms: list[str]  # the drafters this stream may use
    max_new_tokens: int
    generator: torch.Generator  # every random draw of the stream (seeded)
    bandit: Bandit | None  # None with a single arm
    acceptance: dict[str, Acceptance] = field(default_factory=dict)  # per arm
    t_start: float = 0.0  # set when the loop starts
    prefill_s: float = 0.0
    produced: int = 0  # tokens emitted so far
    index: int = 0  # rounds so far
    open: list[Counterfactual] = field(default_factory=list)  # counterfactual proposals not yet decided
    tree: object = None  # a tree_round.TreeSize: the draft head drafts trees of it (None: chains)
    tree_fit: Calibration = field(default_factory=Calibration)  # tree "auto": accepted over expected nodes so far
    tree_expected: float = 0.0  # the last auto-sized tree's expected accepted nodes, by the head's probabilities
    made: dict[str, float] = field(default_factory=dict)  # each arm's tokens per second in its recent rounds

    def __post_init__(self):
        self.acceptance = {a: Acceptance() for a in self.arms}

    @property
    def max_gamma(self) -> int:
        """The most tokens a round of this stream may draft."""
        return MAX_AUTO_GAMMA if self.gamma == "auto" else self.gamma
