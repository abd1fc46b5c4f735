"""Loaded engines, shared by all browser sessions: at most a few, one per (model pair, backend) however the
models were spelled, the least recently used evicted first, the embedded default pinned.

Concurrency model (the engine is not thread-safe):
- all torch work (loading, warm-up, runs) happens on one engine thread (components.background);
- each cached engine comes with a `threading.Lock`; a run holds it from its first token to its last, so two
  runs never interleave on one engine, whoever calls (the app, a test, the benchmark); an engine whose lock
  is held is never evicted;
- loading takes one process-wide lock, so two sessions asking for the same model load it once;
- the app also puts its run events in one gradio concurrency group with concurrency_limit=1, so runs queue
  one after the other: on a small machine, two runs at once would distort both timings.
Models load under the cache's `LoadPolicy` (flashspec_core.models): by default Hub ids and the embedded model
only. Per-session data (the runs table) lives in each session's gr.State, never here.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flashspec_core import Engine
from flashspec_core.engine import NAMED_DRAFTERS
from flashspec_core.models import PRECISIONS, PUBLIC, LoadPolicy, load_policy, parse_model_name, pick_device
from kernels import resolve_backend

from components.background import on_engine_thread
from components.settings import DRAFT_SHAPES, PairSpec

GIB = 1 << 30
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    """What remote users may load, and how much of it the server keeps."""
    policy: LoadPolicy = PUBLIC  # where models may come from (see flashspec_core.models)
    max_engines: int = 3  # engines kept loaded, the pinned default included
    max_gib: float = 8.0  # weights and buffers kept loaded; the engine loaded last always stays
    precision: str = "auto"  # the targets' weights (flashspec_core.models.PRECISIONS): auto = the GGUF file's where it can

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; expected one of {list(PRECISIONS)}")
        if not isinstance(self.max_engines, int) or self.max_engines < 1:
            raise ValueError(f"max_engines must be an integer >= 1, got {self.max_engines!r}")
        if not self.max_gib > 0:
            raise ValueError(f"max_gib must be > 0, got {self.max_gib!r}")


@dataclass
class Slot:
    """A loaded engine, the lock a run holds for its whole length, and the bytes its models hold."""
    engine: Engine
    lock: threading.Lock = field(default_factory=threading.Lock)
    nbytes: int = 0


def weight_bytes(engine: Engine) -> int:
    """Bytes held by the parameters and buffers of the engine's models (each storage counted once)."""
    seen, total = set(), 0
    for module in _modules(engine):
        for t in (*module.parameters(), *module.buffers()):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _modules(engine: Engine) -> list[torch.nn.Module]:
    """The torch modules behind the engine's target and drafters (found through their public attributes)."""
    found, todo = {}, [engine.target, *engine.drafters.values()]
    for _ in range(3):  # e.g. drafter -> lm -> model
        nxt = []
        for obj in todo:
            if isinstance(obj, torch.nn.Module):
                found[id(obj)] = obj
            elif hasattr(obj, "__dict__"):
                nxt += [v for k, v in vars(obj).items() if not k.startswith("_")]
        todo = nxt
    return list(found.values())


class LoadProgress:
    """Turns the engine's progress messages into (fraction, message): one step per model to load."""

    def __init__(self, spec: PairSpec, report):
        self.total = 1 + sum(d not in NAMED_DRAFTERS for d in spec.drafters)
        self.done = 0
        self.report = report

    def __call__(self, message: str) -> None:
        if message.startswith("loading "):
            self.done += 1
        self.report(min(self.done, self.total) / (self.total + 1), message)


class EngineCache:
    """Engines by normalised key, least recently used first; `get` loads what is missing.

    loader(spec, backend, progress) -> Engine builds an engine (default: Engine.from_pretrained under the
    policy, on the engine thread); tests pass small ones."""

    def __init__(self, config: CacheConfig = CacheConfig(), loader=None):
        self.config = config
        self.loader = loader or self._load
        self._slots: OrderedDict[tuple, Slot] = OrderedDict()
        self._pinned: set[tuple] = set()
        self._lock = threading.Lock()  # guards _slots and _pinned (held briefly)
        self._load_lock = threading.Lock()  # one load at a time, so two sessions asking for a model load it once

    def configure(self, config: CacheConfig) -> None:
        self.config = config

    def key(self, spec: PairSpec, backend: str) -> tuple:
        """(target, drafters, backend): models by their normalised names (a folder by its real path, a Hub id
        in lower case), the backend resolved on this machine, so 'auto' and 'torch' share. Checks every name."""
        policy = self.config.policy
        drafters = tuple(d if d in NAMED_DRAFTERS else parse_model_name(d, policy).key for d in spec.drafters)
        return parse_model_name(spec.target, policy).key, drafters, resolve_backend(backend, pick_device("auto"))

    def get(self, spec: PairSpec, backend: str = "auto", progress=None) -> Slot:
        """The cached engine for this pair and backend, loading it once. progress(fraction, message) is called
        while loading. Raises ModelUnavailableError (offline, unknown id) or ValueError (a name, a backend)."""
        key = self.key(spec, backend)
        slot = self._hit(key)
        if slot is not None:
            return slot
        with self._load_lock:
            slot = self._hit(key)  # loaded by another session while this one waited
            if slot is not None:
                return slot
            with self._lock:
                self._evict(self.config.max_engines - 1, float("inf"))  # room for one more before loading
            engine = on_engine_thread(self.loader, spec, key[2], LoadProgress(spec, progress) if progress else None)
            with self._lock:
                self._slots[key] = slot = Slot(engine, nbytes=weight_bytes(engine))
                self._evict(self.config.max_engines, self.config.max_gib * GIB, keep=key)
            return slot

    def _hit(self, key: tuple) -> Slot | None:
        with self._lock:
            if key not in self._slots:
                return None
            self._slots.move_to_end(key)
            return self._slots[key]

    def _load(self, spec: PairSpec, backend: str, report) -> Engine:
        """Engine.from_pretrained under the cache's policy, with each model by its checked name."""
        with load_policy(self.config.policy):
            drafters = [d if d in NAMED_DRAFTERS else parse_model_name(d).name for d in spec.drafters]
            return Engine.from_pretrained(target=parse_model_name(spec.target).name, drafters=drafters,
                                          kernel_backend=backend, precision=self.config.precision, progress=report,
                                          name=spec.name)

    def _evict(self, max_engines: int, max_bytes: float, keep: tuple | None = None) -> None:
        """Drop least recently used engines over the limits; never a pinned one, one in use, or `keep`."""
        for key in list(self._slots):
            if len(self._slots) <= max_engines and self.nbytes() <= max_bytes:
                return
            slot = self._slots[key]
            if key == keep or key in self._pinned or slot.lock.locked():
                continue
            log.info("evicting engine %s (%.0f MB)", key, slot.nbytes / 2**20)
            del self._slots[key]

    def pin(self, key: tuple) -> None:
        """Never evict this engine (the embedded default)."""
        with self._lock:
            self._pinned.add(key)

    def evict(self, key: tuple) -> None:
        """Drop one engine (a run holding it finishes first: it keeps its own reference)."""
        with self._lock:
            self._slots.pop(key, None)
            self._pinned.discard(key)

    def keys(self) -> list[tuple]:
        """Cached keys, least recently used first."""
        return list(self._slots)

    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self._slots.values())


ENGINES = EngineCache()  # the app's cache; app.main configures it from the command line


def cache_key(spec: PairSpec, backend: str) -> tuple:
    return ENGINES.key(spec, backend)


def get_engine(spec: PairSpec, backend: str = "auto", progress=None) -> Slot:
    return ENGINES.get(spec, backend, progress)


TREE_TOKENS = max(t.verify_tokens for t in DRAFT_SHAPES.values() if t is not None)  # the largest tree's verify
TREES = tuple(t for t in DRAFT_SHAPES.values() if t is not None)  # greedy fixed ones run as captured rounds


def preload(spec: PairSpec, backend: str = "auto", warm: bool = True) -> Slot | None:
    """Load an engine, pin it, and (warm=True) warm it up (`Engine.warm_up`: its costs, and on a GPU every CUDA graph
    a run can choose, the tree verifies of the draft shapes on offer included) and run two tokens through it, so
    that the first timed run does not pay the warm-up. A failure is logged, not raised: the first run will then show
    it on the status line."""
    try:
        slot = get_engine(spec, backend)
        ENGINES.pin(cache_key(spec, backend))
        if warm:
            with slot.lock:
                seconds = on_engine_thread(slot.engine.warm_up, tree_tokens=TREE_TOKENS, trees=TREES)
                log.info("warmed up %s in %.1f s", spec.label, seconds)
                on_engine_thread(slot.engine.generate, "Hello", max_new_tokens=2)
        return slot
    except Exception as e:  # noqa: BLE001
        log.warning("could not preload %s: %s", spec.label, e)
        return None
