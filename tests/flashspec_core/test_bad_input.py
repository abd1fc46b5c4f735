"""Bad input gets a clear ValueError (or ModelUnavailableError, a ValueError) and leaves the engine usable."""
import math
import time

import pytest
import torch

from flashspec_core import Engine, EngineBusyError, ModelUnavailableError, SamplingConfig
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
    (dict(prompt=b"abc"), "must be a str or a list of token ids"),
    (dict(prompt=bytearray(b"ab")), "must be a str or a list of token ids"),
    (dict(prompt=[1.7]), r"token ids must be ints, got 1.7 \(float\)"),
    (dict(prompt=[1, True]), r"token ids must be ints, got True \(bool\)"),
    (dict(prompt="\ud800 hi"), r"lone surrogate \(U\+D800\) at character 0"),
    (dict(prompt=12), "must be a str or a list of token ids"),
    (dict(seed=2**70), "seed must be a 64-bit integer"),
    (dict(seed=-(2**63) - 1), "seed must be a 64-bit integer"),
    (dict(seed="abc"), "seed must be a 64-bit integer .* got 'abc'"),
    (dict(seed=1.5), "seed must be a 64-bit integer"),
    (dict(seed=True), "seed must be a 64-bit integer"),
    (dict(seed=float("nan")), "seed must be a 64-bit integer"),
    (dict(max_new_tokens=True), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=4.0), "max_new_tokens must be a positive integer"),
    (dict(chat="yes"), "chat must be True or False"),
    (dict(drafters="prompt_lookup"), "drafters must be a list of drafter names"),
    (dict(drafters=[["x"]]), "drafters must be a list of drafter names"),
    (dict(mode=["plain"]), "unknown mode"),
    (dict(bandit=["ucb1"]), "unknown bandit strategy"),
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
    (dict(temperature=float("nan")), "temperature must be >= 0 .* finite, got nan"),
    (dict(temperature=float("inf")), "temperature must be >= 0 .* finite, got inf"),
    (dict(temperature="0.5"), "temperature must be >= 0"),
    (dict(temperature=True), "temperature must be >= 0"),
    (dict(temperature=1e-30), r"temperature must be 0 \(greedy\) or at least 1e-06"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\], got nan"),
    (dict(top_k=2.0), "top_k must be an integer >= 0"),
    (dict(top_k=False), "top_k must be an integer >= 0"),
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


def test_large_start_of_range_values_are_accepted(tiny_engine):
    """The edges of the seed range, numpy-style integers and tuples of ids are all fine."""
    import numpy as np

    base = tiny_engine.generate([1, 2, 3], max_new_tokens=4, seed=(1 << 64) - 1).token_ids
    assert tiny_engine.generate((np.int64(1), 2, 3), max_new_tokens=np.int64(4), seed=(1 << 64) - 1).token_ids == base
    assert len(tiny_engine.generate([1, 2, 3], max_new_tokens=4, seed=-(1 << 63)).token_ids) == 4


def test_error_messages_quote_only_a_short_prefix(tiny_engine):
    huge = "x" * 100_000
    for kwargs in (dict(gamma=huge), dict(mode=huge), dict(bandit=huge), dict(drafters=[huge]), dict(seed=huge)):
        with pytest.raises(ValueError) as info:
            tiny_engine.generate([1, 2, 3], max_new_tokens=4, **kwargs)
        assert len(str(info.value)) < 300, (list(kwargs), len(str(info.value)))
        assert "characters)" in str(info.value)  # says how long the value was
    with pytest.raises(ValueError) as info:
        SamplingConfig(temperature=huge)
    assert len(str(info.value)) < 200


def test_a_second_open_stream_is_refused_and_the_first_is_unharmed(tiny_engine):
    # greedy: the tokens are fixed whatever draft lengths the measured costs pick, so any corruption of the
    # shared caches by the refused stream would show as different tokens
    args = dict(max_new_tokens=12, sampling=SamplingConfig(temperature=0.0), gamma=3, seed=5, drafters=["prompt_lookup"])
    tokens = lambda events: [t for e in events for t in e.emitted]  # noqa: E731
    expected = tokens(tiny_engine.stream([1, 2, 3], **args))
    first = tiny_engine.stream([1, 2, 3], **args)
    got = [next(first)]
    second = tiny_engine.stream([4, 5], **args)  # validation is eager and fine; the refusal comes when it starts
    with pytest.raises(EngineBusyError, match="another stream of this engine is still open"):
        next(second)
    got += list(first)
    assert tokens(got) == expected
    third = tiny_engine.stream([1, 2, 3], **args)
    next(third)
    third.close()  # closing releases the engine as draining does
    assert tokens(tiny_engine.stream([1, 2, 3], **args)) == expected


def test_nan_temperature_never_reaches_the_round(tiny_engine):
    with pytest.raises(ValueError, match="finite"):
        tiny_engine.generate([1, 2, 3], max_new_tokens=4, sampling=SamplingConfig(temperature=math.nan))
