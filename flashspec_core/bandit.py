"""Multi-armed bandits over drafters: choose an arm, consume rewards in [0, 1]. Knows nothing of models.

Strategies: "ucb1" (Auer et al. 2002), "thompson" (Beta posteriors with fractional rewards, Agrawal & Goyal
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
    def __init__(self, arms: list[str], strategy: str = "ucb1", window: int = 200, seed: int = 0):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown bandit strategy {strategy!r}; expected one of {sorted(STRATEGIES)}")
        if not arms:
            raise ValueError("a bandit needs at least one arm")
        if len(set(arms)) != len(arms):
            raise ValueError(f"arm names must be unique, got {arms}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.arms, self.strategy = list(arms), strategy
        self.rng = random.Random(seed)
        self.pulls = {a: 0 for a in arms}
        self.count = {a: 0 for a in arms}  # all-time observations
        self.total = {a: 0.0 for a in arms}  # all-time reward sum
        self.recent = deque(maxlen=window)  # (arm, reward), for "window"
        self.draws = {a: 0.0 for a in arms}  # last Thompson sample

    # -- the two calls the engine makes ------------------------------------------------------------
    def select(self) -> str:
        scores = self._scores(sample=True)
        return max(self.arms, key=lambda a: (scores[a], -self.arms.index(a)))

    def update(self, arm: str, reward: float, pulled: bool = True) -> None:
        if arm not in self.count:
            raise ValueError(f"unknown arm {arm!r}; expected one of {self.arms}")
        reward = min(1.0, max(0.0, float(reward)))
        self.pulls[arm] += int(pulled)
        self.count[arm] += 1
        self.total[arm] += reward
        self.recent.append((arm, reward))

    # -- display -----------------------------------------------------------------------------------
    def state(self) -> tuple[ArmState, ...]:
        counts, sums = self._stats()
        scores = self._scores(sample=False)
        return tuple(ArmState(a, self.pulls[a], counts[a], sums[a] / counts[a] if counts[a] else 0.0, scores[a])
                     for a in self.arms)

    # -- internals ---------------------------------------------------------------------------------
    def _stats(self):
        if self.strategy != "window":
            return self.count, self.total
        counts = {a: 0 for a in self.arms}
        sums = {a: 0.0 for a in self.arms}
        for a, r in self.recent:
            counts[a] += 1
            sums[a] += r
        return counts, sums

    def _scores(self, sample: bool) -> dict[str, float]:
        counts, sums = self._stats()
        if self.strategy == "thompson":
            if sample:  # Beta(1 + successes, 1 + failures) with fractional rewards
                self.draws = {a: self.rng.betavariate(1 + sums[a], 1 + counts[a] - sums[a]) for a in self.arms}
            return dict(self.draws)
        t = max(1, sum(counts.values()))
        return {a: (sums[a] / counts[a] + math.sqrt(2 * math.log(t) / counts[a])) if counts[a] else math.inf
                for a in self.arms}


def speed_reward(tokens_per_s: float, reference_tokens_per_s: float) -> float:
    """Map a round's speed to [0, 1]: s / (1 + s), where s is the speedup over the reference (plain) speed.

    Plain decoding scores 0.5, twice as fast 0.67, five times 0.83; a round slower than plain scores < 0.5.
    """
    if reference_tokens_per_s <= 0:
        return 0.5
    s = tokens_per_s / reference_tokens_per_s
    return s / (1 + s)
