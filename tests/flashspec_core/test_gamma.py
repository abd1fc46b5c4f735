"""Gamma selection from acceptance and measured costs."""
import random

import pytest

from flashspec_core.gamma import (Acceptance, CostModel, DraftCost, best_gamma, best_length, expected_tokens,
                                  worth_another)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_cost_model_interpolates_and_extrapolates():
    c = CostModel()
    c.observe(1, 0.050)
    c.observe(5, 0.090)
    assert c.forward(3) == pytest.approx(0.070)
    assert c.forward(9) > c.forward(5)
    assert c.known == [1, 5]


def test_best_gamma_grows_with_acceptance_and_shrinks_with_draft_cost():
    c = CostModel()
    for t, s in ((1, 0.05), (5, 0.08), (17, 0.11)):
        c.observe(t, s)
    free = DraftCost()
    low, high = best_gamma(0.2, free, c, 16), best_gamma(0.95, free, c, 16)
    assert low < high and high >= 10
    assert best_gamma(0.95, DraftCost(per_token=0.05), c, 16) < high  # a step as costly as a target step: fewer


def test_a_draft_cost_per_round_favours_longer_drafts():
    """A fixed cost each round the drafter runs (the head's first pass over waiting slots) is spread over K."""
    c = CostModel()
    for t, s in ((1, 0.05), (5, 0.08), (17, 0.11)):
        c.observe(t, s)
    step = DraftCost(per_token=0.01)
    assert best_gamma(0.6, DraftCost(per_token=0.01, per_round=0.05), c, 16) > best_gamma(0.6, step, c, 16)
    assert step.seconds(0) == 0.0 and DraftCost(0.01, 0.05).seconds(3) == pytest.approx(0.08)


@pytest.mark.parametrize("seed", range(4))
def test_best_gamma_picks_the_k_of_the_most_tokens_per_second_as_costs_move(seed):
    """best_gamma reads the target's costs from CostModel.curve (kept between observations): the pick is the argmax
    of the rates from CostModel.forward, before and after a new observation changes the curve."""
    rng = random.Random(seed)
    c = CostModel(decay=0.5)
    for t in sorted(rng.sample(range(1, 18), 4)):
        c.observe(t, rng.uniform(0.01, 0.05) * (1 + 0.05 * t))
    for step in range(30):
        a, draft = rng.random(), DraftCost(per_token=rng.uniform(0, 0.01), per_round=rng.uniform(0, 0.02))
        rates = [expected_tokens(a, k) / (draft.seconds(k) + c.forward(k + 1)) for k in range(1, 17)]
        assert best_gamma(a, draft, c, 16) == 1 + rates.index(max(rates))
        if step % 5 == 4:
            c.observe(rng.randint(1, 17), rng.uniform(0.005, 0.08))


def test_acceptance_estimate_tracks_geometric_trials():
    a = Acceptance()
    for _ in range(30):
        a.observe(9, 10)  # nine accepted, then a rejection
    assert a.rate == pytest.approx(0.9, abs=0.02)


def test_best_length_weighs_each_token_against_its_cost():
    c = CostModel()
    for t, s in ((1, 1.0), (2, 1.6), (5, 1.3)):  # a CPU whose 2-4 token forwards cost more than 5 (see benchmarks/drafters.py)
        c.observe(t, s)
    assert best_length([], c) == 0
    assert best_length([0.05] * 8, c) == 0  # nothing pays: a plain step
    assert best_length([0.9 ** j for j in range(1, 17)], c) >= 8  # a sure copy goes long
    assert best_length([0.3, 0.1], c) == 0  # K = 1: 1.3 tokens for 1.6 steps; K = 2: 1.4 for 1.5 (interpolated)
    assert best_length([0.5, 0.25, 0.125, 0.06], c) == 4  # K = 4 costs 1.3 steps for ~1.94 tokens
    survival = [0.8 ** j for j in range(1, 9)]
    rates = [(1 + sum(survival[:k])) / c.forward(k + 1) for k in range(0, 9)]
    assert best_length(survival, c) == rates.index(max(rates))
    assert c.curve(4)[:4] == [c.forward(t) for t in (1, 2, 3, 4)]
    c.observe(3, 9.0)
    assert c.curve(4)[2] == 9.0  # a new observation refreshes the cached curve


def test_cost_model_extrapolates_with_the_measured_slope_never_above_the_prior():
    c = CostModel()
    for t, s in ((1, 1.0), (5, 1.3), (9, 1.5)):
        c.observe(t, s)
    assert c.forward(17) == pytest.approx(1.5 + 8 * 0.05)  # the last two points: 5% of a step a token
    steep = CostModel()
    for t, s in ((1, 1.0), (5, 2.0), (9, 3.0)):
        steep.observe(t, s)
    assert steep.forward(17) == pytest.approx(3.0 * (1 + 0.06 * 8))  # 25% a token measured: the 6% prior caps it
    bump = CostModel()
    for t, s in ((1, 1.0), (2, 1.6), (5, 1.3)):  # 2 tokens dearer than 5, as on this CPU
        bump.observe(t, s)
    assert bump.forward(9) == pytest.approx(1.3 + 4 * 0.075)  # falling last slope: the slope from 1 token


def test_best_tree_nodes_verifies_what_pays_for_its_forward():
    from flashspec_core.gamma import best_tree_nodes

    chances = [0.9, 0.8, 0.5, 0.3, 0.1, 0.05, 0.01]
    flat = CostModel()
    for t in (1, 8):
        flat.observe(t, 0.010)  # a GPU-like forward: more tokens cost nothing
    assert best_tree_nodes(chances, flat) == len(chances)
    steep = CostModel()
    for t in (1, 2, 4, 8):
        steep.observe(t, 0.010 * t)  # each token a full step: a node pays only if it is sure to be accepted
    assert best_tree_nodes(chances, steep) == 0
    some = CostModel()
    for t in (1, 8):
        some.observe(t, 0.010 + 0.002 * (t - 1))  # +20% a token: nodes above ~1/5 of a token's worth pay
    n = best_tree_nodes(chances, some)
    assert 2 <= n < len(chances)
    assert best_tree_nodes(chances, some, draft_s=0.05) >= n  # drafting spent already: verifying more pays more
    rising = CostModel()
    for t in (1, 4, 8, 16):
        rising.observe(t, 0.010 + 0.002 * (t - 1) + 0.001 * max(0, t - 4) ** 2)  # each token dearer past 4 (a CPU)
    alone, copied = best_tree_nodes(chances, rising), best_tree_nodes(chances, rising, extra=8)
    assert copied < alone  # 8 copied tokens in the same verify: the head's nodes start where tokens cost more
    assert best_tree_nodes(chances, CostModel()) == len(chances)  # nothing measured yet: all of it


def test_calibration_scales_by_accepted_over_expected_within_bounds():
    from flashspec_core.gamma import Calibration

    c = Calibration()
    assert c.ratio == 1.0
    for _ in range(40):
        c.observe(1, 2.0)
    assert 0.5 <= c.ratio < 0.55
    for _ in range(60):
        c.observe(0, 5.0)
    assert c.ratio == 0.2
    for _ in range(60):
        c.observe(6, 1.0)
    assert c.ratio == 1.5
    c.observe(3, 0.0)  # nothing expected: nothing learnt
    assert c.ratio == 1.5


def test_worth_another_grows_a_chain_while_its_odds_pay_for_the_step_and_the_verify():
    costs = CostModel()
    assert worth_another([0.01], 0.01, costs, 0.001)  # nothing measured yet: no early end
    for n in range(1, 10):
        costs.observe(n, 0.007 + 0.0005 * (n - 1))  # a CPU's shape: 7 ms a step, 0.5 ms a token more
    assert worth_another([0.9], 0.9, costs, 0.0005)  # confident: one more token pays
    assert not worth_another([0.2], 0.2, costs, 0.0005)  # 4% for 1 ms more: it does not
    assert worth_another([0.9, 0.81, 0.73], 0.9, costs, 0.0005)  # a confident streak goes on
    # the break-even first-token probability rises with the step's price
    def break_even(step_s):
        return next(p / 100 for p in range(1, 101) if worth_another([p / 100], p / 100, costs, step_s))
    assert break_even(0.0002) < break_even(0.001) < break_even(0.004)
