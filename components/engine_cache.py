"""Loaded engines, shared by all browser sessions: one per (target, pair drafters, resolved backend).

Concurrency model (the engine is not thread-safe):
- all torch work (loading, warm-up, runs) happens on one engine thread (components.background);
- each cached engine comes with a `threading.Lock`; a run holds it from its first token to its last, so two
  runs never interleave on one engine, whoever calls (the app, a test, the benchmark);
- loading takes one process-wide lock, so two sessions asking for the same model load it once;
- the app also puts its run events in one gradio concurrency group with concurrency_limit=1, so runs queue
  one after the other: on a small machine, two runs at once would distort both timings.
Per-session data (the runs table) lives in each session's gr.State, never here.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from flashspec_core import Engine
from flashspec_core.models import pick_device
from kernels import resolve_backend

from components.background import on_engine_thread
from components.settings import NAMED, PairSpec


@dataclass
class Slot:
    """A loaded engine and the lock a run holds for its whole length."""
    engine: Engine
    lock: threading.Lock = field(default_factory=threading.Lock)


log = logging.getLogger(__name__)
_ENGINES: dict[tuple, Slot] = {}
_LOAD_LOCK = threading.Lock()


def cache_key(spec: PairSpec, backend: str) -> tuple:
    """(target, drafters, backend) with the backend resolved on this machine, so 'auto' and 'torch' share."""
    return spec.target, tuple(spec.drafters), resolve_backend(backend, pick_device("auto"))


class LoadProgress:
    """Turns the engine's progress messages into (fraction, message): one step per model to load."""

    def __init__(self, spec: PairSpec, report):
        self.total = 1 + sum(d not in NAMED for d in spec.drafters)
        self.done = 0
        self.report = report

    def __call__(self, message: str) -> None:
        if message.startswith("loading "):
            self.done += 1
        self.report(min(self.done, self.total) / (self.total + 1), message)


def get_engine(spec: PairSpec, backend: str = "auto", progress=None) -> Slot:
    """The cached engine for this pair and backend, loading it once. progress(fraction, message) is called
    while loading. Raises ModelUnavailableError (offline, unknown id) or ValueError (bad backend, vocabularies)."""
    key = cache_key(spec, backend)
    slot = _ENGINES.get(key)
    if slot is not None:
        return slot
    with _LOAD_LOCK:
        if key not in _ENGINES:
            report = LoadProgress(spec, progress) if progress else None
            engine = on_engine_thread(Engine.from_pretrained, target=spec.target, drafters=list(spec.drafters),
                                      kernel_backend=key[2], progress=report, name=spec.name)
            _ENGINES[key] = Slot(engine)
        return _ENGINES[key]


def preload(spec: PairSpec, backend: str = "auto") -> Slot | None:
    """Load an engine and run two tokens through it, so that the first timed run does not pay the warm-up.
    A failure is logged, not raised: the first run will then show it on the status line."""
    try:
        slot = get_engine(spec, backend)
        with slot.lock:
            on_engine_thread(slot.engine.generate, "Hello", max_new_tokens=2)
        return slot
    except Exception as e:  # noqa: BLE001
        log.warning("could not preload %s: %s", spec.label, e)
        return None
