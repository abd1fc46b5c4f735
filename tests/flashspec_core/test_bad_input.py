"""Bad input gets a clear ValueError (or ModelUnavailableError, a ValueError) and leaves the engine usable."""
import time

import pytest
import torch

from flashspec_core import Engine, ModelUnavailableError, SamplingConfig
from flashspec_core.engine import check_same_vocabulary
from tests.conftest import tiny_llama


@pytest.fixture(scope="module")
def tiny_engine():
    return Engine.from_models(tiny_llama(vocab=6, seed=0), [tiny_llama(vocab=6, seed=1), "prompt_lookup"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt="hello"), "no tokenizer"),
    (dict(prompt=[1, 9]), "outside the vocabulary"),
    (dict(gamma=33), "gamma must be an integer in 0..32"),
    (dict(gamma=-1), "gamma must be an integer in 0..32"),
    (dict(gamma="many"), "gamma must be an integer in 0..32"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=10_000), "exceeds the model's context window of 256"),
    (dict(mode="fast"), "unknown mode 'fast'"),
    (dict(drafters=["nope"]), "unknown drafters"),
    (dict(bandit="greedy"), "unknown bandit strategy"),
])
def test_bad_request_raises_and_engine_still_works(tiny_engine, kwargs, message):
    args = dict(prompt=[1, 2, 3], max_new_tokens=8)
    before = tiny_engine.generate(**args).token_ids
    with pytest.raises(ValueError, match=message):
        tiny_engine.generate(**{**args, **kwargs})
    assert tiny_engine.generate(**args).token_ids == before  # nothing left half-initialised


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
])
def test_bad_sampling(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_empty_string_prompt(embedded_engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        embedded_engine.generate("   ", max_new_tokens=4)


def test_mismatched_pair_without_tokenizer():
    with pytest.raises(ValueError, match=r"vocabularies differ \(\[6, 7\]\)"):
        Engine.from_models(tiny_llama(vocab=6), [tiny_llama(vocab=7)])


def test_mismatched_tokenizers_compare_token_maps(embedded_engine):
    """Same vocab_size, different token-to-id maps: refused."""
    tok = embedded_engine.tokenizer
    other = type("Tok", (), {"get_vocab": lambda self: {**tok.get_vocab(), "hello": -1}})()
    check_same_vocabulary(tok, tok, "t", "d")  # the same map passes
    with pytest.raises(ValueError, match="different vocabularies"):
        check_same_vocabulary(tok, other, "t", "d")


def test_unknown_backend_and_preset():
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'; expected one of \['auto', 'torch', 'triton'\]"):
        Engine.from_models(tiny_llama(), [], kernel_backend="cuda")
    with pytest.raises(ValueError, match="unknown preset"):
        Engine.from_preset("gpt-5")


def test_unknown_model_offline_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(ModelUnavailableError, match=r"'nobody/no-such-model' is not in the local Hugging Face cache.*hf download nobody/no-such-model"):
        Engine.from_pretrained("nobody/no-such-model", ["prompt_lookup"])
    assert time.perf_counter() - t0 < 10


def test_unknown_model_without_offline_flag_fails_fast_and_clearly():
    """With no network (as on this CI) the reachability probe answers at once instead of retrying for 25 s."""
    from flashspec_core.models import hub_reachable

    if hub_reachable():
        pytest.skip("the Hub is reachable from this machine; the offline path is covered by the HF_HUB_OFFLINE test")
    with pytest.raises(ModelUnavailableError, match="cannot be reached"):
        Engine.from_pretrained("HuggingFaceTB/SmolLM2-1.7B-Instruct", ["prompt_lookup"])


def test_unknown_model_free_drafter():
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        Engine.from_models(tiny_llama(), ["medusa"])
