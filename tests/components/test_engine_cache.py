"""The app's engine cache: one engine per model pair however its models are spelled, bounded by count and by
memory (least recently used first, the pinned default and engines in use never evicted), loads under the
server's policy."""
import os

import psutil
import pytest

from components import engine_cache
from components.engine_cache import CacheConfig, EngineCache, LoadProgress, Slot, cache_key, get_engine, weight_bytes
from components.settings import CUSTOM, PairSpec, resolve_pair
from flashspec_core import Engine, ModelUnavailableError
from flashspec_core.models import LoadPolicy, cache_dir, embedded_model_dir
from tests.conftest import tiny_llama


def test_key_resolves_the_backend_and_normalises_names():
    spec = resolve_pair("embedded")
    assert cache_key(spec, "auto") == cache_key(spec, "torch") == ("embedded", ("draft_head", "prompt_lookup", "ngram_cache"), "torch")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        cache_key(spec, "fast")
    a = PairSpec(CUSTOM, "Org/Model", ("Org/Draft", "prompt_lookup"))
    b = PairSpec(CUSTOM, "org/model ", ("ORG/draft", "prompt_lookup"))
    assert cache_key(a, "auto") == cache_key(b, "auto") == ("org/model", ("org/draft", "prompt_lookup"), "torch")
    with pytest.raises(ValueError, match="local model folders are off"):
        cache_key(PairSpec(CUSTOM, "/etc", ()), "auto")


def test_engines_are_loaded_once_and_shared(embedded_slot):
    again = get_engine(resolve_pair("embedded"), "torch")
    assert again is embedded_slot
    assert list(embedded_slot.engine.drafters) == ["draft_head", "prompt_lookup", "ngram_cache", "no_draft"]
    assert not embedded_slot.lock.locked()
    # float32: the target's 135M parameters (538 MB, its tied output layer counted once) and the draft head's 5.1M
    # plus its 49,152 output rows (133 MB); the tied layer counted twice would add 113 MB
    assert 640e6 < weight_bytes(embedded_slot.engine) < 700e6


def test_unreachable_model_is_a_clear_error_and_caches_nothing(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = engine_cache.ENGINES.keys()
    messages = []
    with pytest.raises(ModelUnavailableError, match="nobody/no-such-model"):
        get_engine(resolve_pair(CUSTOM, "nobody/no-such-model"), "auto", lambda f, m: messages.append(m))
    assert engine_cache.ENGINES.keys() == before


def test_load_progress_counts_models():
    reports = []
    progress = LoadProgress(resolve_pair(CUSTOM, "org/t", "org/d"), lambda f, m: reports.append((f, m)))
    for message in ("downloading org/t from the Hub", "loading org/t", "loading org/d"):
        progress(message)
    assert reports == [(0.0, "downloading org/t from the Hub"), (1 / 3, "loading org/t"), (2 / 3, "loading org/d")]


class TinyLoader:
    """Builds a tiny random engine per call and counts the calls."""

    def __init__(self):
        self.loaded = []

    def __call__(self, spec, backend, progress):
        self.loaded.append(spec.target)
        return Engine.from_models(tiny_llama(vocab=6, seed=len(self.loaded)), ["prompt_lookup"])


def pair(i: int) -> PairSpec:
    return PairSpec(CUSTOM, f"org/model-{i}", ("prompt_lookup",))


def test_least_recently_used_engines_go_first_and_pinned_or_busy_ones_stay():
    loader = TinyLoader()
    cache = EngineCache(CacheConfig(max_engines=3), loader)
    slots = [cache.get(pair(i)) for i in range(3)]
    cache.pin(cache.key(pair(0), "auto"))
    cache.get(pair(1))  # now 2 is the least recently used unpinned engine
    cache.get(pair(3))
    assert [k[0] for k in cache.keys()] == ["org/model-0", "org/model-1", "org/model-3"]
    with slots[1].lock:  # in use by a run: kept, so the next load evicts 3 instead
        cache.get(pair(4))
    assert [k[0] for k in cache.keys()] == ["org/model-0", "org/model-1", "org/model-4"]
    assert loader.loaded == [f"org/model-{i}" for i in (0, 1, 2, 3, 4)]
    assert cache.get(pair(0)) is slots[0]  # no reload


def test_memory_limit_evicts_until_the_rest_fits():
    loader = TinyLoader()
    one = weight_bytes(loader(pair(9), "auto", None))
    cache = EngineCache(CacheConfig(max_engines=10, max_gib=2.5 * one / engine_cache.GIB), loader)
    for i in range(4):
        cache.get(pair(i))
    assert [k[0] for k in cache.keys()] == ["org/model-2", "org/model-3"]
    assert cache.nbytes() == 2 * one
    alone = EngineCache(CacheConfig(max_gib=0.5 * one / engine_cache.GIB), loader)
    alone.get(pair(5))
    assert len(alone.keys()) == 1  # the engine just loaded stays even when it alone is over the limit


def rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def test_three_spellings_of_one_folder_load_it_once(embedded_slot):
    """Memory check: a folder spelled /path, /path/ and //path is one engine, loaded once (~540 MB, not 3x)."""
    folder = embedded_model_dir()
    policy = LoadPolicy(local_roots=(str(cache_dir()),), allow_pickle=False)
    loads = []

    def counted(spec, backend, progress):
        loads.append(spec.target)
        return cache._load(spec, backend, progress)

    cache = EngineCache(CacheConfig(policy=policy), counted)
    spellings = [str(folder), str(folder) + "/", "/" + str(folder)]
    first = cache.get(PairSpec(CUSTOM, spellings[0], ("prompt_lookup",)))
    after_first = rss()
    again = [cache.get(PairSpec(CUSTOM, s, ("prompt_lookup",))) for s in spellings[1:]]
    assert all(slot is first for slot in again) and len(loads) == 1 and len(cache.keys()) == 1
    assert rss() - after_first < 50e6  # the other spellings added no model
    assert isinstance(first, Slot) and first.nbytes > 500e6
