import pytest
import torch

from components.settings import (CUSTOM, DRAFT_MODEL, MAX_UI_GAMMA, PairSpec, arm_names, backend_choices,
                                 pair_choices, parse_gamma, parse_settings, resolve_pair, role_choices)
from flashspec_core import PRESETS
from kernels import triton_available

GOOD = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False, gamma=4,
            temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0, bandit="ucb1", backend="auto")


def test_pairs_are_the_presets_embedded_first_then_custom():
    values = [v for _, v in pair_choices()]
    assert values[0] == "embedded" and values[-1] == CUSTOM
    assert sorted(values[:-1]) == sorted(PRESETS)
    assert "offline" in pair_choices()[0][0]


def test_resolve_pair():
    spec = resolve_pair("qwen2.5-1.5b")
    assert spec.target == PRESETS["qwen2.5-1.5b"]["target"] and spec.roles()[0] == DRAFT_MODEL
    custom = resolve_pair(CUSTOM, " org/target ", " org/draft ")
    assert custom == PairSpec(CUSTOM, "org/target", ("org/draft", "prompt_lookup", "ngram_cache"))
    assert resolve_pair(CUSTOM, "org/target", "").drafters == ("prompt_lookup", "ngram_cache")
    with pytest.raises(ValueError, match="type a target model"):
        resolve_pair(CUSTOM, "  ", "x")
    with pytest.raises(ValueError, match="unknown model pair 'nope'"):
        resolve_pair("nope")


def test_role_choices_follow_the_pair():
    assert [v for _, v in role_choices(resolve_pair("embedded"))] == ["draft_head", "prompt_lookup", "ngram_cache"]
    assert [v for _, v in role_choices(resolve_pair("smollm2-1.7b"))][0] == DRAFT_MODEL
    assert len(role_choices(None)) == 3  # no head ships for a custom target
    assert resolve_pair("embedded").label == "SmolLM2-135M-Instruct + draft head"


def test_arm_names_map_roles_to_engine_arms():
    spec = resolve_pair(CUSTOM, "t", "org/d")
    arms = ["draft:d", "prompt_lookup", "ngram_cache", "no_draft"]
    assert arm_names(spec, arms, [DRAFT_MODEL, "ngram_cache"]) == ["draft:d", "ngram_cache"]
    embedded = resolve_pair("embedded")
    assert arm_names(embedded, ["draft_head", "prompt_lookup", "ngram_cache", "no_draft"], [DRAFT_MODEL, "ngram_cache"]) == ["ngram_cache"]
    with pytest.raises(ValueError, match="choose at least one drafter"):
        arm_names(embedded, ["prompt_lookup", "ngram_cache", "no_draft"], [DRAFT_MODEL])


def test_gamma():
    assert parse_gamma(True, 3) == "auto"
    assert parse_gamma(False, 7.0) == 7
    for bad in (0, MAX_UI_GAMMA + 1, 2.5, None):
        with pytest.raises(ValueError, match="gamma must be"):
            parse_gamma(False, bad)


def test_parse_settings_accepts_slider_floats():
    s = parse_settings(**{**GOOD, "max_new_tokens": 16.0, "seed": 3.0, "roles": ["ngram_cache", DRAFT_MODEL]})
    assert s.max_new_tokens == 16 and s.seed == 3 and s.roles == (DRAFT_MODEL, "ngram_cache")
    assert s.sampling.greedy and s.record()["gamma"] == "4"


@pytest.mark.parametrize("change, message", [
    (dict(bandit="greedy"), "unknown bandit strategy 'greedy'"),
    (dict(backend="cuda"), "unknown backend 'cuda'"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(max_new_tokens=0), "max new tokens must be"),
    (dict(seed=-1), "seed must be"),
    (dict(roles=[]), "choose at least one drafter"),
])
def test_parse_settings_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        parse_settings(**{**GOOD, **change})


def test_backend_choices_say_what_runs_here():
    labels = dict((v, label) for label, v in backend_choices(torch.device("cpu")))
    assert labels["auto"] == "auto (here: torch)"
    assert ("unavailable" in labels["triton"]) == (not triton_available(torch.device("cpu")))
