"""Multi-armed bandits over drafters: choose an arm, consume rewards in [0, 1]. Knows nothing of models.

Strategies: "ucb1" (Auer et al. 2002; by default its variance-aware "UCB1-Tuned" index from the same paper,
which explores far less when rewards are steady, as tok/s rewards are), "thompson" (Beta posteriors with fractional rewards, Agrawal & Goyal
2012) and "window" (sliding-window UCB, Garivier & Moulines 2011: only the last `window` observations
count, so the bandit follows content that drifts). Observations may be counterfactual (an arm scored
without being pulled); they update the estimates but not the pull counts.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

STRATEGIES = ("ucb1", "thompson", "window")


@dataclass(frozen=True)
class ArmState:
    name: str
    pulls: int  # rounds in which this arm was chosen
    observations: int  # rewards counted (pulls plus counterfactual scores; within the window for "window")
    mean: float  # mean reward of the counted observations
    score: float  # what the strategy ranks by: UCB index, last Thompson draw


class Bandit:
    def __init__(self, arms: list[str], strategy: str = "ucb1", window: int = 200, seed: int = 0, tuned: bool = True):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown bandit strategy {strategy!r}; expected one of {sorted(STRATEGIES)}")
        if not arms:
            raise ValueError("a bandit needs at least one arm")
        if len(set(arms)) != len(arms):
            raise ValueError(f"arm names must be unique, got {arms}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.arms, self.strategy, self.tuned = list(arms), strategy, tuned
        self.rng = random.Random(seed)
        self.pulls = {a: 0 for a in arms}
        self.count = {a: 0 for a in arms}  # all-time observations
        self.total = {a: 0.0 for a in arms}  # all-time reward sum
        self.squares = {a: 0.0 for a in arms}  # all-time sum of squared rewards (for UCB1-Tuned)
        self.recent = deque(maxlen=window)  # (arm, reward), for "window"
        self.draws = {a: 0.0 for a in arms}  # last Thompson sample

    # -- the two calls the engine makes ------------------------------------------------------------
    def select(self, among: list[str] | None = None) -> str:
        """The arm to pull next (of `among` only, where given)."""
        scores = self._scores(sample=True)
        return max(among or self.arms, key=lambda a: (scores[a], -self.arms.index(a)))

    def update(self, arm: str, reward: float, pulled: bool = True) -> None:
        if arm not in self.count:
            raise ValueError(f"unknown arm {arm!r}; expected one of {self.arms}")
        reward = min(1.0, max(0.0, float(reward)))
        self.pulls[arm] += int(pulled)
        self.count[arm] += 1
        self.total[arm] += reward
        self.squares[arm] += reward * reward
        self.recent.append((arm, reward))

    # -- display -----------------------------------------------------------------------------------
    def state(self) -> tuple[ArmState, ...]:
        counts, sums, _ = self._stats()
        scores = self._scores(sample=False)
        return tuple(ArmState(a, self.pulls[a], counts[a], sums[a] / counts[a] if counts[a] else 0.0, scores[a])
                     for a in self.arms)

    # -- internals ---------------------------------------------------------------------------------
    def _stats(self):
        if self.strategy != "window":
            return self.count, self.total, self.squares
        counts = {a: 0 for a in self.arms}
        sums = {a: 0.0 for a in self.arms}
        squares = {a: 0.0 for a in self.arms}
        for a, r in self.recent:
            counts[a] += 1
            sums[a] += r
            squares[a] += r * r
        return counts, sums, squares

    def _scores(self, sample: bool) -> dict[str, float]:
        counts, sums, squares = self._stats()
        if self.strategy == "thompson":
            if sample:  # Beta(1 + successes, 1 + failures) with fractional rewards
                self.draws = {a: self.rng.betavariate(1 + sums[a], 1 + counts[a] - sums[a]) for a in self.arms}
            return dict(self.draws)
        t = max(1, sum(counts.values()))
        scores = {}
        for a in self.arms:
            n = counts[a]
            if not n:
                scores[a] = math.inf
                continue
            mean = sums[a] / n
            if self.tuned:  # UCB1-Tuned: the variance bound replaces the worst case 1/4 * 8
                var = max(0.0, squares[a] / n - mean * mean) + math.sqrt(2 * math.log(t) / n)
                scores[a] = mean + math.sqrt(math.log(t) / n * min(0.25, var))
            else:
                scores[a] = mean + math.sqrt(2 * math.log(t) / n)
        return scores


def speed_reward(tokens_per_s: float, reference_tokens_per_s: float) -> float:
    """Map a round's speed to [0, 1]: s / (1 + s), where s is the speedup over the reference (plain) speed.

    Plain decoding scores 0.5, twice as fast 0.67, five times 0.83; a round slower than plain scores < 0.5.
    """
    if reference_tokens_per_s <= 0:
        return 0.5
    s = tokens_per_s / reference_tokens_per_s
    return s / (1 + s)
