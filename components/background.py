"""Runs an engine stream in a thread of its own, so that the engine never waits while gradio serialises and
sends an update (a generator handler is otherwise suspended for that time, and the engine's clock with it):
the UI takes whatever rounds have arrived, at its own pace.
"""
from __future__ import annotations

import threading
from typing import Iterator, TypeVar

T = TypeVar("T")


def in_background(items: Iterator[T], interval: float) -> Iterator[tuple[list[T], bool]]:
    """Yield (items so far, done): every `interval` seconds while new items arrive, and once at the end.

    The iterator runs in a worker thread; an exception there is raised here. Closing this generator stops the
    worker after its current item and waits for it, so the caller may then hand the engine to someone else.
    """
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
            getattr(items, "close", lambda: None)()  # in this thread, where the generator ran
            with cond:
                outcome["done"] = True
                cond.notify_all()

    worker = threading.Thread(target=work, name="flashspec-stream", daemon=True)
    worker.start()
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
        worker.join()
