"""Bandit: UCB1 regret under its bound, sliding-window recovery, and the no-draft arm winning when drafts are useless."""
import math
import random
import time

import pytest

from flashspec_core import Engine, SamplingConfig
from flashspec_core.bandit import Bandit, speed_reward
from flashspec_core.drafters import Drafter
from tests.conftest import tiny_llama


def run(bandit, means, steps, rng, switch_at=None, switched=None):
    regret, picks = 0.0, []
    for t in range(steps):
        m = switched if switch_at is not None and t >= switch_at else means
        arm = bandit.select()
        i = bandit.arms.index(arm)
        bandit.update(arm, 1.0 if rng.random() < m[i] else 0.0)
        regret += max(m) - m[i]
        picks.append(i)
    return regret, picks


@pytest.mark.parametrize("tuned", [False, True], ids=["classic", "tuned"])
def test_ucb1_regret_under_bound(tuned):
    means, steps = [0.9, 0.8, 0.5], 20_000
    gaps = [max(means) - m for m in means if m < max(means)]
    bound = sum(8 * math.log(steps) / g for g in gaps) + (1 + math.pi ** 2 / 3) * sum(gaps)  # Auer et al. 2002
    regrets = [run(Bandit(["a", "b", "c"], "ucb1", tuned=tuned), means, steps, random.Random(s))[0] for s in range(3)]
    assert sum(regrets) / 3 < bound, (regrets, bound)
    uniform_regret = steps * sum(max(means) - m for m in means) / 3
    assert sum(regrets) / 3 < uniform_regret / 3  # far from choosing at random


@pytest.mark.parametrize("strategy", ["ucb1", "thompson", "window"])
def test_best_arm_found(strategy):
    _, picks = run(Bandit(["a", "b", "c"], strategy, window=200, seed=1), [0.3, 0.7, 0.5], 3000, random.Random(0))
    assert picks[-500:].count(1) > 400


def test_sliding_window_recovers_after_switch():
    rng = random.Random(0)
    bandit = Bandit(["a", "b", "c"], "window", window=150)
    _, picks = run(bandit, [0.9, 0.2, 0.4], 4000, rng, switch_at=2000, switched=[0.2, 0.9, 0.4])
    assert picks[1500:2000].count(0) > 400  # it found the first best arm
    assert picks[2500:4000].count(1) > 1200  # and the new one within a few hundred rounds of the switch


def test_counterfactual_updates_do_not_count_as_pulls():
    b = Bandit(["a", "b"], "ucb1")
    b.update("a", 0.7, pulled=False)
    state = {s.name: s for s in b.state()}
    assert state["a"].pulls == 0 and state["a"].observations == 1 and state["a"].mean == pytest.approx(0.7)


@pytest.mark.parametrize("strategy", ["ucb1", "thompson", "window"])
def test_a_choice_among_some_arms_picks_the_best_of_them(strategy):
    bandit = Bandit(["a", "b", "c"], strategy, seed=2)
    for _ in range(300):
        for arm, reward in (("a", 0.9), ("b", 0.2), ("c", 0.5)):
            bandit.update(arm, reward)
    assert bandit.select() == "a" and bandit.select(["b", "c"]) == "c" and bandit.select(["b"]) == "b"


def test_speed_reward_is_monotone_and_bounded():
    values = [speed_reward(r, 10.0) for r in (0.0, 5.0, 10.0, 20.0, 1e9)]
    assert values == sorted(values) and values[2] == pytest.approx(0.5) and 0 <= values[0] and values[-1] <= 1


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown bandit strategy 'greedy'"):
        Bandit(["a"], "greedy")


class UselessDrafter(Drafter):
    """Always-wrong proposals that also cost time: every round emits one token, slower than plain."""
    model_free = False  # scored only when pulled

    def __init__(self, device, name, vocab):
        super().__init__(device)
        self.name, self.vocab = name, vocab

    def propose_ids(self, row, k):
        time.sleep(0.01)
        return [(row[-1] * 7 + 3) % self.vocab] * k


@pytest.mark.parametrize("strategy", ["ucb1", "thompson", "window"])
@pytest.mark.parametrize("model_free", [True, False], ids=["scored_free", "pulled_only"])
def test_no_draft_arm_wins_when_drafts_are_useless(strategy, model_free):
    target = tiny_llama(vocab=50, seed=7, layers=2)
    engine = Engine.from_models(target, [], bandit=strategy)
    for name in ("useless_a", "useless_b"):
        engine.drafters[name] = UselessDrafter(engine.target.device, name, 50)
        engine.drafters[name].model_free = model_free  # model-free arms are also scored counterfactually
    result = engine.generate(list(range(1, 9)), max_new_tokens=200, sampling=SamplingConfig(temperature=1.0), gamma=8,
                             drafters=["useless_a", "useless_b", "no_draft"], seed=0)
    pulls = result.stats["pulls"]
    wasted = pulls.get("useless_a", 0) + pulls.get("useless_b", 0)
    assert pulls.get("no_draft", 0) > 2 * wasted, pulls  # plain rounds cost ~1 ms here, a useless one > 10 ms
    if model_free:  # free counterfactual scores keep exploration cheap
        assert wasted <= 10, pulls


class OracleDrafter(Drafter):
    """Proposes the next `k` tokens of a known greedy continuation: every proposal is accepted in full."""

    def __init__(self, device, continuation, prompt_len):
        super().__init__(device)
        self.name, self.continuation, self.prompt_len = "oracle", continuation, prompt_len

    def propose_ids(self, row, k):
        done = len(row) - self.prompt_len
        return self.continuation[done:done + k]


def test_counterfactual_scores_wait_for_the_tokens_that_decide_them():
    """A model-free arm that was not pulled is scored once later rounds show how far its proposal would have been
    accepted, never on a guess: after a one-token plain round a 6-token proposal is still open; when the next round
    has emitted enough, it scores as the 7 tokens a pulled round would have emitted."""
    target = tiny_llama(vocab=50, seed=7, layers=2)
    engine = Engine.from_models(target, [])
    prompt, greedy = list(range(1, 9)), SamplingConfig(temperature=0.0)
    plain = engine.generate(prompt, max_new_tokens=20, sampling=greedy, mode="plain").token_ids
    engine.drafters["oracle"] = OracleDrafter(engine.target.device, plain, len(prompt))
    events = list(engine.stream(prompt, max_new_tokens=20, sampling=greedy, gamma=6, drafters=["no_draft", "oracle"]))
    assert [e.drafter for e in events[:2]] == ["no_draft", "oracle"]  # untried arms first, in order
    oracle = [{a.name: a for a in e.arms}["oracle"] for e in events[:2]]
    assert oracle[0].observations == 0  # round 0 emitted 1 token: the counterfactual is still open
    assert events[1].accepted == tuple(plain[1:7]) and oracle[1].observations == 2 and oracle[1].pulls == 1
    assert oracle[1].mean > 0.5  # the resolved counterfactual scored as 7 tokens for one verify of 7


def test_a_tested_copy_arm_plays_its_strong_match_over_the_bandits_choice():
    """The bandit's means do not see the context: prompt lookup scoring poorly overall still plays a long match that
    its odds (once tested in the session) rate well above the other arms, and only then; without a match, or with
    odds never scored, the bandit's choice stands."""
    from flashspec_core.drafters import match_bucket
    from flashspec_core.gamma import CostModel
    from flashspec_core.stream import StreamState

    engine = Engine.from_models(tiny_llama(vocab=50, seed=7, layers=2), ["prompt_lookup"])
    costs = CostModel()
    for tokens in (1, 2, 4, 8, 17):
        costs.observe(tokens, 0.01 * (1 + 0.05 * (tokens - 1)))
    engine.policy.set_costs(costs)
    lookup = engine.drafters["prompt_lookup"]
    text = [3, 17, 4, 9, 22, 8, 30, 11, 5, 41, 12, 6, 7, 2]
    greedy = SamplingConfig(temperature=0.0)

    def choice(rows, tested):
        s = StreamState(rows=[rows], sampling=greedy, gamma="auto", mode="speculative", arms=["prompt_lookup", "no_draft"],
                        max_new_tokens=64, generator=None, bandit=Bandit(["prompt_lookup", "no_draft"]))
        for _ in range(20):  # the bandit's means: no_draft far ahead
            s.bandit.update("no_draft", 0.5)
            s.bandit.update("prompt_lookup", 0.2)
        lookup.start(s.rows, greedy, None)  # indexes the context; prompt lookup's odds start afresh in a stream
        for _ in range(tested):  # copies scored in this stream, all accepted
            lookup.odds.observe(match_bucket(9, False), True)
        return engine.policy.choose(s)

    assert choice(text + [50 - t for t in range(1, 9)], tested=8) == "no_draft"  # no match: nothing to copy
    assert choice(text + text[:9], tested=0) == "no_draft"  # a 9-token match, odds never scored
    assert choice(text + text[:9], tested=8) == "prompt_lookup"  # a 9-token match, odds tested


def test_a_copy_must_beat_what_the_drafting_arm_made_when_that_beats_its_acceptances_chain():
    """A tree round emits more than its arm's per-token acceptance says a chain would: the rival rate that a copy
    must beat is the better of the two (and plain decoding's rate at least)."""
    from flashspec_core.gamma import CostModel
    from flashspec_core.stream import StreamState

    engine = Engine.from_models(tiny_llama(vocab=50, seed=7, layers=2), [])
    engine.drafters["useless"] = UselessDrafter(engine.target.device, "useless", 50)  # a drafter that is not a copy
    costs = CostModel()
    for tokens in (1, 17):
        costs.observe(tokens, 0.01 * (1 + 0.05 * (tokens - 1)))
    engine.policy.set_costs(costs)
    s = StreamState(rows=[[1, 2, 3]], sampling=SamplingConfig(temperature=0.0), gamma="auto", mode="speculative",
                    arms=["useless", "no_draft"], max_new_tokens=8, generator=None, bandit=Bandit(["useless", "no_draft"]))
    chain = engine.policy.rival_rate(s)
    assert chain > 100.0  # acceptance 0.5 (the prior) at its best K beats plain decoding's 100 tokens a second
    s.made["useless"] = 3 * chain  # what its rounds made
    assert engine.policy.rival_rate(s) == pytest.approx(3 * chain)
    s.made["useless"], s.acceptance["useless"].rejected = 1.0, 1e6  # a drafter that never pays
    assert engine.policy.rival_rate(s) == pytest.approx(100.0)
