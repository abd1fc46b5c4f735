"""The app's one engine thread: every torch call of the app (loading, warm-up, each run) happens there, and a
run's rounds reach the UI from it at the UI's own pace, so the engine never waits while gradio sends an update.

Why one thread: libgomp throttles (stops spinning between parallel regions) once it manages more threads than
there are cores, and each thread that calls into torch gets its own OpenMP team. On a 2-core machine, decoding
on a second thread after the first had used torch ran about 20% slower; on one thread it runs as fast as a
plain script.

In a forked child (Hugging Face ZeroGPU runs each `spaces.GPU` call in a forked worker process) the engine
thread does not exist, so both functions then run the work on the calling thread, which is that worker's.
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import os
import threading
import time
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")
THREAD_NAME = "flashspec-engine"
ENGINE_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
OWNER_PID = os.getpid()  # the process whose engine thread ENGINE_THREAD runs; a fork of it has none


def inline() -> bool:
    """True where the work must run on the calling thread: on the engine thread itself, or in a forked child."""
    return threading.current_thread().name.startswith(THREAD_NAME) or os.getpid() != OWNER_PID


def on_engine_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the engine thread (with the caller's context variables, which gradio's progress
    tracking needs); blocks for its result or raises its exception."""
    if inline():
        return fn(*args, **kwargs)
    return ENGINE_THREAD.submit(contextvars.copy_context().run, fn, *args, **kwargs).result()


def in_background(items: Iterator[T], interval: float) -> Iterator[tuple[list[T], bool]]:
    """Yield (items so far, done): every `interval` seconds while new items arrive, and once at the end.

    The iterator is drained on the engine thread; an exception there is raised here. Closing this generator
    stops the draining after its current item and waits for it, so the caller may then hand the engine on.
    """
    if threading.current_thread().name.startswith(THREAD_NAME):
        raise RuntimeError("in_background waits for the engine thread, so it cannot run on it")
    if os.getpid() != OWNER_PID:
        yield from on_this_thread(items, interval)
        return
    seen: list[T] = []
    cond = threading.Condition()
    stop = threading.Event()
    outcome: dict = {"done": False, "error": None}

    def work():
        try:
            for item in items:
                with cond:
                    seen.append(item)
                if stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            outcome["error"] = e
        finally:
            getattr(items, "close", lambda: None)()  # on this thread, where the generator ran
            with cond:
                outcome["done"] = True
                cond.notify_all()

    future = ENGINE_THREAD.submit(work)
    shown = 0
    try:
        while True:
            with cond:
                cond.wait_for(lambda: outcome["done"], timeout=interval)
                done, snapshot = outcome["done"], list(seen)
            if outcome["error"] is not None:
                raise outcome["error"]
            if done:
                yield snapshot, True
                return
            if len(snapshot) > shown:
                shown = len(snapshot)
                yield snapshot, False
    finally:
        stop.set()
        if not future.cancel():  # already running: let it finish its current item
            concurrent.futures.wait([future])


def on_this_thread(items: Iterator[T], interval: float) -> Iterator[tuple[list[T], bool]]:
    """in_background's updates, with the iterator drained on the calling thread (between updates)."""
    seen: list[T] = []
    last = time.perf_counter()
    try:
        for item in items:
            seen.append(item)
            if time.perf_counter() - last >= interval:
                last = time.perf_counter()
                yield list(seen), False
        yield list(seen), True
    finally:
        getattr(items, "close", lambda: None)()
