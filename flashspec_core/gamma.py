"""Measured costs and per-drafter acceptance, and the K ("gamma") that maximises expected tokens per second.

With per-token acceptance a, a round that proposes K tokens emits (1 - a^(K+1)) / (1 - a) tokens on average
(Leviathan et al. 2023) and costs the drafter's K tokens (`DraftCost`: a fixed part per round, such as the draft
head catching up on the slots verified since it last ran, plus K steps) and one target forward over K + 1 tokens.
Both costs are
measured once per engine (`Engine.calibrate`, when it warms up), so the choice adapts to the machine (on a CPU a
17-token forward costs ~2x one token, on a GPU with graphs nearly the same as one) while a run stays a function
of its prompt, settings and seed.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_GAMMA = 32
MAX_AUTO_GAMMA = 16  # the largest K that gamma "auto" chooses (and that a stream captures graphs for)


@dataclass(frozen=True)
class DraftCost:
    """A drafter's seconds to propose K tokens in a round: per_round + K * per_token (nothing at K = 0)."""
    per_token: float = 0.0
    per_round: float = 0.0

    def seconds(self, K: int) -> float:
        return self.per_round + K * self.per_token if K else 0.0


class CostModel:
    """Exponential moving averages of the target's forward time, keyed by the number of tokens fed."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.seconds: dict[int, float] = {}
        self.known: list[int] = []  # sorted keys of `seconds`
        self._curve: list[float] = []  # forward(1..n), cached until the next observe

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        if old is None:
            self.known = sorted([*self.known, tokens])
        self.seconds[tokens] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self._curve = []

    def curve(self, n: int) -> list[float]:
        """[forward(1), ..., forward(m)] for some m >= n, computed once per observation (choosing K asks for all of
        them each round)."""
        if len(self._curve) < n:
            self._curve = [self.forward(t) for t in range(1, n + 1)]
        return self._curve

    def forward(self, tokens: int) -> float:
        """Estimated seconds for a forward over `tokens` tokens (interpolated; 0 when nothing is measured)."""
        if not self.seconds:
            return 0.0
        if tokens in self.seconds:
            return self.seconds[tokens]
        known = self.known
        lo = max((t for t in known if t < tokens), default=None)
        hi = min((t for t in known if t > tokens), default=None)
        if lo is not None and hi is not None:
            w = (tokens - lo) / (hi - lo)
            return (1 - w) * self.seconds[lo] + w * self.seconds[hi]
        base = self.seconds[known[0]] if lo is None else self.seconds[lo]
        anchor = known[0] if lo is None else lo
        slope = 0.06 * base  # prior: each extra token ~6% of a step (CPU, fp32)
        if lo is not None and len(known) >= 2:  # past the largest measured count: the last two points' slope (this
            prev = known[-2]  # CPU measured ~3% a token past 5 tokens, a GPU ~1%), or where that falls (forwards
            measured = (self.seconds[lo] - self.seconds[prev]) / (lo - prev)  # over 2-4 tokens cost more than 5
            if measured < 0:  # here) the slope from the smallest count; never above the prior
                measured = (self.seconds[lo] - self.seconds[known[0]]) / (lo - known[0])
            slope = min(slope, max(0.0, measured))
        return base + slope * (tokens - anchor)

    def plain_step(self) -> float:
        return self.forward(1)


class Acceptance:
    """Per-token acceptance rate of one drafter, as a decayed Beta estimate from geometric trials."""

    def __init__(self, decay: float = 0.9, prior: float = 0.5):
        self.decay, self.accepted, self.rejected = decay, 2 * prior, 2 * (1 - prior)

    def observe(self, accepted: int, proposed: int) -> None:
        if proposed <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < proposed else 0)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by a round of K proposals with per-token acceptance a."""
    if a >= 1.0:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)


def best_gamma(a: float, draft: DraftCost, costs: CostModel, max_gamma: int) -> int:
    """The K in 1..max_gamma that maximises expected tokens per second of a round."""
    if costs.plain_step() <= 0:
        return min(4, max_gamma)
    return best_chain(a, draft, costs, max_gamma)[0]


def best_chain(a: float, draft: DraftCost, costs: CostModel, max_gamma: int) -> tuple[int, float]:
    """(K, expected tokens per second) of the best chain round for acceptance a, K in 1..max_gamma (costs measured)."""
    forward = costs.curve(max_gamma + 1)  # forward[k] = costs.forward(k + 1), computed once per observation
    rates = [expected_tokens(a, k) / (draft.seconds(k) + forward[k]) for k in range(1, max_gamma + 1)]
    best = max(rates)
    return 1 + rates.index(best), best


def best_tree_nodes(chances: list[float], costs: CostModel, draft_s: float = 0.0, extra: int = 0) -> int:
    """How many nodes of a drafted tree to verify, numbered best first so that any first n form a tree (EAGLE-2's
    rerank): the n in 0..len(chances) that maximises expected tokens per second, where chances[i] is node i's
    chance of acceptance and the round costs draft_s (spent already) and a target forward over n + 1 tokens and
    `extra` more (a copied branch that joins the tree whatever its size)."""
    if costs.plain_step() <= 0:
        return len(chances)
    forward = costs.curve(len(chances) + 1 + extra)
    best, best_rate, tokens = 0, 1.0 / (draft_s + forward[extra]), 1.0
    for n, chance in enumerate(chances, start=1):
        tokens += chance
        rate = tokens / (draft_s + forward[n + extra])
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def worth_another(survival: list[float], p: float, costs: CostModel, step_s: float) -> bool:
    """Whether a chain of k = len(survival) drafted tokens (survival[j]: the chance its first j + 1 are all accepted)
    should grow by one: yes while one more token raises the expected tokens per second of the round, the next
    token's survival taken as survival[-1] * p, p the drafter's probability of its last token (confidence runs in
    streaks), its price a draft step of step_s seconds and the target's forward over one token more."""
    if costs.plain_step() <= 0 or not survival:
        return True
    k = len(survival)
    forward = costs.curve(k + 2)  # forward[j]: a verify of j drafts (j + 1 tokens)
    tokens, seconds = 1.0 + sum(survival), k * step_s + forward[k]
    more = (tokens + survival[-1] * p) / (seconds + step_s + forward[k + 1] - forward[k])
    return more > tokens / seconds


class Calibration:
    """How far a drafter's own probabilities over- or under-state acceptance in one stream: the decayed ratio of the
    tokens accepted to those its probabilities expected, clipped to [0.2, 1.5] (1 before any round)."""

    def __init__(self, decay: float = 0.9):
        self.decay, self.accepted, self.expected = decay, 1.0, 1.0

    def observe(self, accepted: int, expected: float) -> None:
        if expected > 0:
            self.accepted = self.decay * self.accepted + accepted
            self.expected = self.decay * self.expected + expected

    @property
    def ratio(self) -> float:
        return min(1.5, max(0.2, self.accepted / self.expected))


def best_length(survival: list[float], costs: CostModel, draft_step_s: float = 0.0) -> int:
    """The K in 0..len(survival) that maximises expected tokens per second, where survival[j - 1] is the chance that
    the first j drafted tokens are all accepted (K = 0: a plain step). best_gamma is the case survival[j - 1] = a^j."""
    return length_choice(survival, costs, draft_step_s)[0]


def length_choice(survival: list[float], costs: CostModel, draft_step_s: float = 0.0) -> tuple[int, float]:
    """(`best_length`'s K, the most expected tokens per second of a round drafting at least one of the tokens: 0
    without any, or before the costs are measured, when K is at most 4)."""
    if costs.plain_step() <= 0:
        return min(4, len(survival)), 0.0
    rates = length_rates(survival, costs, draft_step_s)
    return rates.index(max(rates)), max(rates[1:], default=0.0)


def length_rates(survival: list[float], costs: CostModel, draft_step_s: float = 0.0) -> list[float]:
    """Expected tokens per second of a round drafting K = 0..len(survival) of the tokens (`best_length`'s survival)."""
    forward = costs.curve(len(survival) + 1)
    rates, tokens = [1.0 / forward[0]], 1.0
    for k, p in enumerate(survival, start=1):
        tokens += p
        rates.append(tokens / (k * draft_step_s + forward[k]))
    return rates
