import threading
import time

import pytest

from components.background import in_background, on_engine_thread


def slow(n, delay=0.005, log=None):
    try:
        for i in range(n):
            time.sleep(delay)
            yield i
    finally:
        if log is not None:
            log.append("closed")


def test_every_item_arrives_in_order_and_the_last_update_is_complete():
    updates = list(in_background(slow(40), 0.05))
    assert updates[-1] == (list(range(40)), True)
    assert all(not done and items == list(range(len(items))) for items, done in updates[:-1])
    lengths = [len(items) for items, _ in updates]
    assert lengths == sorted(set(lengths))  # only new rounds make an update


def test_updates_come_at_the_interval_not_per_item():
    t0 = time.perf_counter()
    updates = list(in_background(slow(60, 0.005), 0.1))
    elapsed = time.perf_counter() - t0
    assert 1 <= len(updates) <= elapsed / 0.1 + 2


def test_errors_in_the_stream_reach_the_consumer():
    def broken():
        yield 1
        raise ValueError("bad round")

    with pytest.raises(ValueError, match="bad round"):
        list(in_background(broken(), 0.01))


def test_closing_stops_the_worker_and_closes_the_stream():
    log = []
    updates = in_background(slow(10_000, 0.002, log), 0.02)
    items, done = next(updates)
    assert not done and items
    updates.close()
    assert log == ["closed"]  # the stream was closed on the engine thread before close() returned


def test_work_runs_on_the_one_engine_thread():
    names = {on_engine_thread(lambda: threading.current_thread().name) for _ in range(3)}
    assert len(names) == 1 and names.pop().startswith("flashspec-engine")
    assert on_engine_thread(on_engine_thread, lambda: 7) == 7  # nested calls run inline, no deadlock
    with pytest.raises(ZeroDivisionError):
        on_engine_thread(lambda: 1 / 0)


def test_in_a_forked_child_the_work_runs_on_the_calling_thread(monkeypatch):
    """ZeroGPU runs GPU calls in a forked worker, where the engine thread does not exist."""
    import components.background as background

    monkeypatch.setattr(background, "OWNER_PID", -1)  # as seen from a fork of the process that made the thread
    assert on_engine_thread(threading.current_thread) is threading.current_thread()
    log = []
    updates = list(in_background(slow(30, 0.005, log), 0.04))
    assert updates[-1] == (list(range(30)), True) and log == ["closed"]
    assert all(not done for _, done in updates[:-1]) and len(updates) >= 2
    early = in_background(slow(100, 0.005, log), 0.02)
    next(early)
    early.close()
    assert log == ["closed", "closed"]  # closing stops the stream at once
