"""Gamma selection from acceptance and measured costs."""
import pytest

from flashspec_core.gamma import Acceptance, CostModel, best_gamma, expected_tokens


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
    low, high = best_gamma(0.2, 0.0, c, 16), best_gamma(0.95, 0.0, c, 16)
    assert low < high and high >= 10
    assert best_gamma(0.95, 0.05, c, 16) < high  # a draft step as costly as a target step: propose fewer


def test_acceptance_estimate_tracks_geometric_trials():
    a = Acceptance()
    for _ in range(30):
        a.observe(9, 10)  # nine accepted, then a rejection
    assert a.rate == pytest.approx(0.9, abs=0.02)
