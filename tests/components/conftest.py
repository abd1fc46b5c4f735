"""Shared fixtures for the component tests: hand-made round events, and the real embedded engine."""
from __future__ import annotations

import pytest
from fake_events import make_event


@pytest.fixture
def events():
    """Three rounds: a full accept with a bonus, a rejection with a resample, and a last round that rejects."""
    return [
        make_event(0, "prompt_lookup", accepted=("def", " f"), last=("bonus", "(")),
        make_event(1, "ngram_cache", accepted=("x",), rejected=(" y", "z"), last=("resampled", ")")),
        make_event(2, "prompt_lookup", accepted=(), rejected=("<b>",), last=("resampled", ":\n    "), finished="length"),
    ]


@pytest.fixture(scope="session")
def embedded_slot():
    """The real embedded engine through the app's cache (converted once, then loaded in about a second)."""
    from components import engine_cache
    from components.settings import resolve_pair

    return engine_cache.get_engine(resolve_pair("embedded"), "auto")
