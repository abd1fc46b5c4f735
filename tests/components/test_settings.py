import pytest
import torch

from components.settings import (CUSTOM, DRAFT_MODEL, DRAFT_SHAPES, GPU_SHAPE, MAX_UI_GAMMA, PairSpec, arm_names,
                                 backend_choices, default_shape, pair_choices, parse_gamma, parse_leg, parse_settings,
                                 resolve_pair, role_choices)
from flashspec_core import PRESETS
from flashspec_core.models import LoadPolicy
from kernels import triton_available

GOOD = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False, gamma=4,
            temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0, bandit="ucb1", backend="auto", shape="chain")


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
    assert s.max_new_tokens == 16 and s.seed == 3 and s.roles == ("ngram_cache",)  # the embedded pair has no draft model
    assert s.sampling.greedy and s.record()["gamma"] == "4"
    big = parse_settings(**{**GOOD, "pair": "smollm2-1.7b", "roles": ["ngram_cache", DRAFT_MODEL]})
    assert big.roles == (DRAFT_MODEL, "ngram_cache")  # in the pair's order
    assert big.record()["pair"] == "smollm2-1.7b" and "SmolLM2-1.7B-Instruct" in big.record()["models"]


def test_roles_come_from_the_preset_so_new_drafters_need_no_code(monkeypatch):
    monkeypatch.setitem(PRESETS, "embedded", dict(target="embedded", drafters=["prompt_lookup", "ngram_cache", "draft_head"]))
    spec = resolve_pair("embedded")
    assert role_choices(spec) == [("prompt lookup", "prompt_lookup"), ("n-gram cache", "ngram_cache"),
                                  ("draft head", "draft_head")]
    s = parse_settings(**{**GOOD, "roles": ["draft_head"]})
    assert s.roles == ("draft_head",) and "draft head" in s.describe()
    assert arm_names(spec, ["prompt_lookup", "ngram_cache", "draft_head", "no_draft"], ["draft_head"]) == ["draft_head"]


@pytest.mark.parametrize("change, message", [
    (dict(bandit="greedy"), "unknown bandit strategy 'greedy'"),
    (dict(backend="cuda"), "unknown backend 'cuda'"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(temperature=-1.0), "temperature must be a number in 0.0..2.0"),
    (dict(temperature=float("nan")), "temperature must be a number in 0.0..2.0, got nan"),
    (dict(temperature="0.5"), "temperature must be a number in 0.0..2.0, got '0.5'"),
    (dict(temperature=None), "temperature must be a number in 0.0..2.0, got None"),
    (dict(top_p=float("nan")), "top_p must be a number in 0.0..1.0, got nan"),
    (dict(max_new_tokens=0), "max new tokens must be"),
    (dict(max_new_tokens=2.5), "max new tokens must be an integer"),
    (dict(seed=-1), "seed must be"),
    (dict(seed=1e300), "seed must be an integer in 0..18446744073709551615"),
    (dict(seed=True), "seed must be an integer"),
    (dict(roles=[]), "choose at least one drafter"),
    (dict(roles=[["x"]]), "drafters must be a list of names"),
    (dict(gamma_auto="yes"), "auto gamma must be true or false, got 'yes'"),
    (dict(gamma=float("inf")), "gamma must be an integer in 1..16, got inf"),
    (dict(bandit=None), "unknown bandit strategy None"),
    (dict(pair={"a": 1}), "unknown model pair"),
    (dict(pair="custom", target=12), "the target model must be text, got int"),
    (dict(pair="custom", target="a/b/c"), "model name 'a/b/c' is not a Hub id"),
    (dict(pair="custom", target="org/t", draft="/etc/passwd"), "local model folders are off on this server"),
    (dict(mode="fast"), "unknown mode 'fast'"),
])
def test_parse_settings_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        parse_settings(**{**GOOD, **change})


def test_backend_choices_say_what_runs_here():
    labels = dict((v, label) for label, v in backend_choices(torch.device("cpu")))
    assert labels["auto"] == "auto (here: torch)"
    assert ("unavailable" in labels["triton"]) == (not triton_available(torch.device("cpu")))


def test_plain_mode_ignores_the_drafter_pickers():
    s = parse_settings(**{**GOOD, "roles": None, "gamma": None}, mode="plain")
    assert s.mode == "plain" and s.gamma == 0
    assert s.record()["drafters"] == "" and s.describe().startswith("plain decoding · embedded")


def test_a_leg_reads_its_own_pickers_and_the_shared_sampling():
    values = {"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 8, "seed": 2}
    for leg, mode in (("a", "plain"), ("b", "speculative")):
        values |= {f"{leg}_{k}": v for k, v in GOOD.items() if k not in values} | {f"{leg}_mode": mode}
    values["b_gamma"] = 6
    a, b = parse_leg("a", values), parse_leg("b", values)
    assert (a.mode, b.mode, b.gamma, a.sampling, a.seed) == ("plain", "speculative", 6, b.sampling, 2)
    values["b_bandit"] = "best"
    with pytest.raises(ValueError, match="configuration B: unknown bandit strategy 'best'"):
        parse_leg("b", values)


def test_folders_are_checked_against_the_policy(tmp_path):
    (tmp_path / "m").mkdir()
    allowed = LoadPolicy(local_roots=(str(tmp_path),))
    assert resolve_pair(CUSTOM, str(tmp_path / "m"), policy=allowed).target == str(tmp_path / "m")
    with pytest.raises(ValueError, match="local model folders are off"):
        resolve_pair(CUSTOM, str(tmp_path / "m"))


def test_draft_shape_chain_or_a_tree_for_the_draft_head():
    chain = parse_settings(**GOOD)
    assert chain.tree is None and chain.record()["draft_shape"] == "chain" and "tree" not in chain.describe()
    tree = parse_settings(**{**GOOD, "roles": ["draft_head", "prompt_lookup"], "shape": "tree 16"})
    assert tree.tree == DRAFT_SHAPES["tree 16"] and tree.tree.size == 16
    assert tree.record()["draft_shape"] == "tree 16 (depth 6, top-k 4)"
    assert "· tree 16 (depth 6, top-k 4) ·" in tree.describe()
    plain = parse_settings(**{**GOOD, "shape": "tree 8"}, mode="plain")  # plain mode drafts nothing: no shape
    assert plain.tree is None and plain.record()["draft_shape"] == ""


@pytest.mark.parametrize("shape, message", [
    ("tree 9", "unknown draft shape 'tree 9'; expected one of "
               "\\['chain', 'tree 8', 'tree 16', 'tree 32', 'tree auto', 'tree \\+ copy'\\]"),
    (None, "unknown draft shape None"), (16, "unknown draft shape 16"), (["tree 8"], "unknown draft shape"),
    ("x" * 10_000, "unknown draft shape 'xxx"),
])
def test_bad_draft_shapes_are_refused(shape, message):
    with pytest.raises(ValueError, match=message):
        parse_settings(**{**GOOD, "roles": ["draft_head"], "shape": shape})


def test_a_pair_with_the_head_starts_with_a_tree_on_a_gpu_and_chains_on_a_cpu():
    embedded, custom = resolve_pair("embedded"), None
    assert default_shape(embedded, "cuda") == GPU_SHAPE and DRAFT_SHAPES[GPU_SHAPE] is not None
    assert default_shape(embedded, torch.device("cuda", 0)) == GPU_SHAPE
    assert default_shape(embedded, "cpu") == "chain"
    assert default_shape(resolve_pair("smollm2-1.7b"), "cuda") == "chain"  # a draft model's pair: no head, no tree
    assert default_shape(custom, "cuda") == "chain"
    parse_settings(**{**GOOD, "roles": ["draft_head"], "shape": default_shape(embedded, "cuda")})  # a valid choice


def test_a_tree_needs_the_draft_head():
    with pytest.raises(ValueError, match="draft shape 'tree 8' needs the draft head among the drafters"):
        parse_settings(**{**GOOD, "shape": "tree 8"})  # prompt lookup and the n-gram cache draft chains only
