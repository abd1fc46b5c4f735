"""The host policy: which arm drafts each round and how many tokens (K), and what each round teaches: the arms'
acceptance and the bandit's rewards, for the arm that was pulled and, counterfactually, for the others. Python
only: it reads the host numbers a round returns (`stream.Played`) and the costs `Engine.calibrate` measured
once, never a tensor, so a stream is a function of its prompt, settings and seed.
"""
from __future__ import annotations

import math
from dataclasses import replace

from flashspec_core.bandit import speed_reward
from flashspec_core.drafters import CopyDrafter, Drafter, NoDraft
from flashspec_core.gamma import MAX_AUTO_GAMMA, CostModel, DraftCost, best_chain, best_gamma, best_tree_nodes
from flashspec_core.stream import Counterfactual, Played, StreamState
from flashspec_core.tree import DraftTree


SURE_COPY = 1.3  # a copy plays over the bandit's choice where it promises this many times the rival arm's rate
SCORED_COPIES = 3.0  # once its odds were scored on this many copied tokens in the session (decayed, by their prior)
RATE_DECAY = 0.8  # an arm's tokens per second over its recent rounds: a decayed mean (~5 rounds)


class HostPolicy:
    """Arm and K choices and rewards over an engine's drafters, from the machine's measured costs."""

    def __init__(self, drafters: dict[str, Drafter]):
        self.drafters = drafters
        self.costs = CostModel()  # the target's forward seconds by tokens fed, measured once (`set_costs`)
        self.draft_costs = {NoDraft.name: DraftCost()}  # each drafter's seconds to draft, measured likewise
        for d in drafters.values():
            if d.sets_length:
                d.costs = self.costs  # such a drafter sizes its drafts from this machine's measured costs

    def draft_cost(self, arm: str) -> DraftCost:
        """An arm's measured drafting seconds (none measured yet: free)."""
        return self.draft_costs.get(arm, DraftCost())

    @property
    def calibrated(self) -> bool:
        return bool(self.costs.seconds)

    def set_draft_cost(self, arm: str, cost: DraftCost) -> None:
        """An arm's measured drafting seconds; a drafter that sets its own length weighs its steps by them."""
        self.draft_costs[arm] = cost
        if self.drafters[arm].sets_length:
            self.drafters[arm].step_s = cost.per_token

    def set_costs(self, costs: CostModel) -> None:
        self.costs = costs
        for d in self.drafters.values():
            if d.sets_length:
                d.costs = costs

    # -- before a round ------------------------------------------------------------------------------
    def choose(self, s: StreamState) -> str:
        """The stream's arm for the next round: the bandit's, unless a copy arm is sure of a long copy here
        (`sure_copy`)."""
        if not s.bandit:
            return s.arms[0]
        return self.sure_copy(s) or s.bandit.select()

    def sure_copy(self, s: StreamState) -> str | None:
        """The copy arm whose copy at the current context promises the most tokens per second, where that is at least
        SURE_COPY times the rival's (`rival_rate`) and its odds have been tested in this session (SCORED_COPIES):
        the bandit's means do not see the context, so a copy arm that can rarely copy still plays a strong match."""
        tested = [a for a in s.arms if isinstance(self.drafters[a], CopyDrafter) and
                  self.drafters[a].odds.expected >= SCORED_COPIES]
        if not self.calibrated or not tested:
            return None
        rates = {a: self._copy_rate(s, a) for a in tested}
        best = max(rates, key=rates.get)
        return best if self._beats_rival(s, rates[best]) else None

    def still_sure(self, s: StreamState, arm: str) -> bool:
        """Whether an arm chosen one round late (on the rows before the round in flight, `Engine._play`) plays on the
        rows that round left: a copy arm if it is sure there (`sure_copy`) by its own offer (it has learnt that
        round; the others have not); an arm that does not copy, or any arm without measured costs to weigh, plays."""
        if not isinstance(self.drafters[arm], CopyDrafter) or not self.calibrated:
            return True
        return self._beats_rival(s, self._copy_rate(s, arm))

    def choose_uncopied(self, s: StreamState) -> str | None:
        """The bandit's choice among the arms that do not copy (None: no such arm), for a round whose late copy
        choice was unsure at the landed rows (`still_sure`): none of them reads what the copy drafters learn from
        the landed round, so it launches before they learn it (`Engine._play`)."""
        uncopied = [a for a in s.arms if not isinstance(self.drafters[a], CopyDrafter)]
        return s.bandit.select(uncopied) if s.bandit and uncopied else None

    def _copy_rate(self, s: StreamState, arm: str) -> float:
        """A copy arm's expected tokens per second at the stream's rows, at most the K gamma gives it."""
        return self.drafters[arm].copy_rate(s.rows[0], self.gamma(s, arm, s.max_gamma))

    def _beats_rival(self, s: StreamState, rate: float) -> bool:
        """Whether a copy's rate is sure: at least SURE_COPY times the rival's (no copy: no rival to weigh)."""
        return rate > 0 and rate > SURE_COPY * self.rival_rate(s)

    def rival_rate(self, s: StreamState) -> float:
        """Tokens per second the stream's best arm that does not copy can be expected to make: at its best K by its
        acceptance and the measured costs, or as its recent rounds made (a tree's rounds beat its acceptance's
        chain), plain decoding's rate at least."""
        best = 1.0 / self.costs.plain_step()
        for arm in s.arms:
            if self.drafters[arm].model_free:
                continue
            chain = best_chain(s.acceptance[arm].rate, self.draft_cost(arm), self.costs, MAX_AUTO_GAMMA)[1]
            best = max(best, chain, s.made.get(arm, 0.0))
        return best

    def gamma(self, s: StreamState, arm: str, limit: int) -> int:
        """K for this round: a fixed gamma, or for "auto" the K that maximises expected tokens per second from the
        arm's acceptance; a drafter that sets its own draft length (<= K, from the measured costs) gets the
        largest K under "auto"."""
        gamma = s.gamma
        if gamma == "auto":
            drafter = self.drafters[arm]
            gamma = MAX_AUTO_GAMMA if drafter.sets_length else best_gamma(s.acceptance[arm].rate, self.draft_cost(arm),
                                                                         self.costs, MAX_AUTO_GAMMA)
        return max(0, min(gamma, limit))

    def tree_plan(self, s: StreamState, arm: str, shape):
        """(shape, nodes) for a tree round (`tree_round.run_tree`). A fixed size as asked. Tree "auto": the depth is
        the chain's K under gamma "auto" (a deep tree's drafting can cost more than it saves: each level is a head
        step); greedy, the round drafts `shape.size` nodes and `nodes` cuts them to the best first n by their draft
        scores; sampled, the cut must not depend on the draws (a law chosen by its own draws would no longer be q),
        so the size is chosen before drafting from the static shape's prior (`DraftTree.static_prior`)."""
        if not shape.auto:
            return shape, None
        if self.calibrated:
            depth = best_gamma(s.acceptance[arm].rate, self.draft_cost(arm), self.costs, shape.depth)
            shape = replace(shape, depth=min(shape.depth, depth))
        if s.sampling.greedy:
            return shape, lambda scores, extra=0: self.tree_nodes(s, arm, shape.depth, scores, extra)
        prior = DraftTree.static_prior(shape.depth, shape.top_k, shape.size)
        return replace(shape, size=max(1, self.tree_nodes(s, arm, shape.depth, prior))), None

    def tree_nodes(self, s: StreamState, arm: str, depth: int, scores: list[float], extra: int = 0) -> int:
        """Tree "auto": how many of a drafted tree's nodes (best first) to verify for the most expected tokens per
        second, each node's chance of acceptance taken as its draft probability (EAGLE-2's observation) scaled by
        this stream's calibration of the head (`StreamState.tree_fit`); `extra` copied tokens join the verify
        whatever the cut (a tree's copied branch)."""
        chances = [math.exp(x) for x in scores]
        n = best_tree_nodes([min(1.0, s.tree_fit.ratio * c) for c in chances], self.costs,
                            self.draft_cost(arm).seconds(depth), extra)
        s.tree_expected = sum(chances[:n])
        return n

    # -- after a round -------------------------------------------------------------------------------
    def learn(self, s: StreamState, played: Played) -> None:
        """The pulled arm's acceptance, the bandit's reward (tokens emitted over the round's cost as calibrated,
        not as timed: the same tokens always earn the same reward), the other arms' counterfactual scores."""
        K = len(played.out.draft)
        self.learn_acceptance(s, played.arm, played.out)
        if s.bandit:
            ref = 1.0 / max(self.costs.plain_step(), 1e-9)
            seconds = self.cost(played.arm, K) if played.out.tree is None else self.tree_cost(played.arm, *played.out.tree)
            rate = len(played.emitted) / max(seconds, 1e-9)
            s.bandit.update(played.arm, speed_reward(rate, ref))
            s.made[played.arm] = RATE_DECAY * s.made.get(played.arm, rate) + (1 - RATE_DECAY) * rate
            self._score_counterfactuals(s, played, ref)

    def learn_acceptance(self, s: StreamState, arm: str, out) -> None:
        """The pulled arm's acceptance; after an auto-sized tree round, also the nodes accepted against those the
        head's probabilities expected."""
        s.acceptance[arm].observe(out.num_accepted[0], len(out.draft))
        if out.tree is not None and s.tree is not None and s.tree.auto:
            s.tree_fit.observe(out.num_accepted[0], s.tree_expected)

    def _score_counterfactuals(self, s: StreamState, played: Played, ref: float) -> None:
        """Score the arms that were not pulled against the tokens the target actually emitted.

        What each would have proposed at the pre-round context (`_proposal`) is kept until later rounds show how
        far the target would have accepted it (its first mismatch, or all of it); it then scores as (matching
        prefix + 1) tokens at the calibrated cost of a round that drafts len(proposal) tokens. Free: no target
        forward, and no guess for the part of a long proposal that a short round does not reveal (a proposal the
        stream ends before resolving is dropped). The open proposals live in the stream's state.
        """
        for c in s.open:
            c.seen.extend(played.emitted)  # the tokens emitted since each open proposal was made
        for arm in s.arms:
            proposal = None if arm == played.arm else self._proposal(s, arm, played)
            if proposal is not None:
                s.open.append(Counterfactual(arm, proposal, list(played.emitted)))
        still_open = []
        for c in s.open:
            m, known = 0, min(len(c.proposal), len(c.seen))
            while m < known and c.proposal[m] == c.seen[m]:
                m += 1
            if m == known < len(c.proposal):  # everything seen so far matched; the rest is not known yet
                still_open.append(c)
                continue
            s.acceptance[c.arm].observe(m, len(c.proposal))
            seconds = self.cost(c.arm, len(c.proposal))
            s.bandit.update(c.arm, speed_reward((m + 1) / max(seconds, 1e-9), ref), pulled=False)
        s.open = still_open

    def _proposal(self, s: StreamState, arm: str, played: Played) -> list[int] | None:
        """What an arm that was not pulled would have proposed at the pre-round context: a model-free arm's draft
        (cut to the K it would have had), a hidden-state reader's first-pass guess (one token: its next ones would
        cost head steps), or None (a draft model: scoring it would cost its forwards)."""
        drafter = self.drafters[arm]
        if drafter.model_free:
            return drafter.propose_ids(played.before, self.gamma(s, arm, played.limit))
        if arm in played.out.guesses:
            return [played.out.guesses[arm]][:played.limit]
        return None

    def tree_cost(self, arm: str, nodes: int, depth: int) -> float:
        """A tree round's seconds as calibrated: a draft step per level (each level's step runs over several nodes
        at once, which this counts as one) and a target forward over the tree's nodes + 1."""
        return self.draft_cost(arm).seconds(depth) + self.costs.forward(nodes + 1)

    def cost(self, arm: str, K: int) -> float:
        """A round's seconds as calibrated: the arm drafting K tokens and a target forward over K + 1 tokens."""
        return self.draft_cost(arm).seconds(K) + self.costs.forward(K + 1)
