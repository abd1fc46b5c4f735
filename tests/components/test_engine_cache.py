import pytest

from components import engine_cache
from components.engine_cache import LoadProgress, cache_key, get_engine
from components.settings import CUSTOM, resolve_pair
from flashspec_core import ModelUnavailableError


def test_key_resolves_the_backend_on_this_machine():
    spec = resolve_pair("embedded")
    assert cache_key(spec, "auto") == cache_key(spec, "torch") == ("embedded", ("draft_head", "prompt_lookup", "ngram_cache"), "torch")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        cache_key(spec, "fast")


def test_engines_are_loaded_once_and_shared(embedded_slot):
    again = get_engine(resolve_pair("embedded"), "torch")
    assert again is embedded_slot
    assert list(embedded_slot.engine.drafters) == ["draft_head", "prompt_lookup", "ngram_cache", "no_draft"]
    assert not embedded_slot.lock.locked()


def test_unreachable_model_is_a_clear_error_and_caches_nothing(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = dict(engine_cache._ENGINES)
    messages = []
    with pytest.raises(ModelUnavailableError, match="nobody/no-such-model"):
        get_engine(resolve_pair(CUSTOM, "nobody/no-such-model"), "auto", lambda f, m: messages.append(m))
    assert engine_cache._ENGINES == before


def test_load_progress_counts_models():
    reports = []
    progress = LoadProgress(resolve_pair(CUSTOM, "org/t", "org/d"), lambda f, m: reports.append((f, m)))
    for message in ("downloading org/t from the Hub", "loading org/t", "loading org/d"):
        progress(message)
    assert reports == [(0.0, "downloading org/t from the Hub"), (1 / 3, "loading org/t"), (2 / 3, "loading org/d")]
