"""The Replay tab's handlers, stepped as gradio would: pick, step, restart, play at a pace, pause, load a file; the
loaded runs stay within their per-session and server-wide bounds."""
import json
import threading
import time

from fake_events import make_event

from components import replay_handlers
from components.compact import LOADED, LoadedRuns, compact
from components.replay_handlers import (Pane, replay_load, replay_pause, replay_pick, replay_play, replay_restart,
                                        replay_step)
from components.runs import Run, export_document, run_record
from components.session import MAX_REPLAYABLE, Session


def session_with_a_run(rounds: int = 5, gap: float = 0.05) -> Session:
    state = Session()
    events = tuple(make_event(i, elapsed=0.01 + gap * i, rejected=("x",) if i % 2 else (),
                              last=("resampled", "y") if i % 2 else ("bonus", "!"), new_tokens=2 * (i + 1))
                   for i in range(rounds))
    state.add(Run(run_record("run 1", "speculative", {"bandit": "<a href='x'>ucb1</a>"}, {"new_tokens": 10}), "hi",
                  events))
    return state


def test_step_and_restart_show_one_round_more_or_none():
    state = session_with_a_run()
    first = replay_step(state, "run 1")
    assert first["replay_position"] == "Round 1 of 5 · 2 tokens"
    assert first["replay_tokens"].count("tok-") >= 2
    assert first["replay_arms"].data  # the same bandit figure as live
    second = replay_step(state, "run 1")
    assert second["replay_tokens"].startswith(first["replay_tokens"])  # the text only grows
    assert second["replay_tokens"].count('class="fs-round"') == 2 and "tok-rejected" in second["replay_tokens"]
    assert "&lt;a href" in second["replay_arms"].layout.annotations[1].text  # a file's text never becomes markup
    assert replay_restart(state, "run 1")["replay_position"] == "Round 0 of 5 · 0 tokens"
    assert replay_step(state, "missing")["replay_position"].startswith("Pick a run")
    assert replay_pick(state, ["not", "a", "name"])["replay_position"].startswith("Pick a run")
    end = [replay_step(state, "run 1") for _ in range(6)][-1]
    assert end["replay_position"].endswith("(end)") and "fs-done" in end["replay_tokens"]


def test_a_long_run_shows_pages_and_a_thinned_figure(monkeypatch):
    monkeypatch.setattr(replay_handlers, "PAGE_SPANS", 10)
    events = [make_event(i, new_tokens=2 * (i + 1)) for i in range(400)]  # 2 spans a round
    run = compact(run_record("run 1", "plain", {}, {}), "", events)
    pane = Pane(run)
    assert pane.html(5).count("fs-round") == 5 and "not shown" not in pane.html(5)
    assert pane.html(6).count("fs-round") == 1 and "5 earlier rounds (10 tokens) are not shown" in pane.html(6)
    figure = replay_handlers.replay_figure(run, 400)
    lines = [t for t in figure.data if t.type == "scatter"]
    assert max(len(t.x) for t in lines) <= replay_handlers.PLOT_ROUNDS + 1 and any(399 in t.x for t in lines)


def test_play_follows_the_chosen_speed_and_pause_stops_it():
    state = session_with_a_run(rounds=5, gap=0.05)  # 0.21 s of real time
    t0 = time.perf_counter()
    frames = list(replay_play(state, "run 1", 0.5))
    assert time.perf_counter() - t0 >= 0.21 / 0.5 - 0.05
    assert frames[-1]["replay_position"].endswith("(end)") and state.replay_shown == 5
    assert [f["replay_position"] for f in frames[:-1]] == sorted({f["replay_position"] for f in frames[:-1]})
    texts = [f["replay_tokens"] for f in frames if not f["replay_position"].endswith("(end)")]
    assert len(texts) > 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each update only appends
    slow = session_with_a_run(rounds=5, gap=1.0)
    threading.Timer(0.3, replay_pause, args=(slow,)).start()
    frames = list(replay_play(slow, "run 1", 1.0))
    assert slow.replay_shown == 1 and frames[-1]["replay_position"].startswith("Round 1 of 5")
    assert "Cannot play:** speed must be a number in 0.1..1.0, got nan" in next(replay_play(slow, "run 1", float("nan")))["replay_position"]
    assert "got None" in next(replay_play(slow, None, None))["replay_position"]


def test_a_step_restart_or_pick_stops_a_play_before_its_next_frame():
    """gradio's cancel of a running Play lands late: the Play itself must send nothing after another handler took
    the replay over, or its last frame (say "(end)") would overwrite the restart's "Round 0"."""
    for takeover in (replay_restart, replay_step, replay_pick):
        state = session_with_a_run(rounds=5, gap=0.2)
        play = replay_play(state, "run 1", 1.0)
        first = next(play)
        assert first["replay_position"].startswith("Round ")
        shown = takeover(state, "run 1")["replay_position"]
        assert list(play) == [], takeover.__name__
        assert shown.startswith("Round ") and state.replay_paused
    state = session_with_a_run(rounds=3, gap=0.01)
    frames = list(replay_play(state, "run 1", 1.0))
    assert sum(f["replay_position"].endswith("(end)") for f in frames) == 1  # the closing frame alone shows the end


def test_a_play_is_bounded_in_time_and_stops_when_nobody_reads(monkeypatch):
    monkeypatch.setattr(replay_handlers, "MAX_PLAY_S", 0.3)
    state = session_with_a_run(rounds=5, gap=1.0)
    frames = list(replay_play(state, "run 1", 0.1))
    assert "paused after" in frames[-1]["replay_position"] and state.replay_paused
    monkeypatch.setattr(replay_handlers, "unread", lambda request: 1000)
    assert list(replay_play(session_with_a_run(), "run 1", 1.0)) == []


def test_only_the_last_runs_keep_their_events():
    state = session_with_a_run()
    for i in range(MAX_REPLAYABLE + 2):
        state.add(Run(run_record(f"run {i + 2}", "plain", {}, {}), "", (make_event(0),)))
    assert len(state.runs) == MAX_REPLAYABLE + 3 and len(state.choices()) == MAX_REPLAYABLE


def test_loaded_runs_are_bounded_per_session_and_for_the_server():
    run = compact(run_record("a", "plain", {}, {}), "", [make_event(i, new_tokens=2 * (i + 1)) for i in range(50)])
    size = run.nbytes
    store = LoadedRuns(session_bytes=3 * size, total_bytes=5 * size)
    for s in ("s1", "s2"):
        for i in range(4):  # the fourth pushes the session's first out
            store.add(s, [compact({**run.record, "run": f"{s} {i}"}, "", run.events(range(len(run))))])
    assert store.names("s1") == {"s1 2", "s1 3"}  # its first went for the session's bound, "s1 1" for the server's
    assert store.names("s2") == {"s2 1", "s2 2", "s2 3"} and store.nbytes() <= 5 * size
    assert store.get("s2", "s2 3") is not None and store.get("s2", "s2 0") is None
    store.drop("s2")
    assert store.names("s2") == set()


def test_a_loaded_file_joins_the_picker_and_its_upload_is_deleted(tmp_path):
    source = session_with_a_run()
    path = tmp_path / "my talk.json"
    path.write_text(json.dumps(export_document(source.runs)))
    state = Session()
    out = replay_load(state, str(path))
    assert not path.exists()
    assert out["replay_pick"]["value"] == "my_talk: run 1" and out["replay_position"] == "Round 0 of 5 · 0 tokens"
    assert [name for _, name in state.choices()] == ["my_talk: run 1"]
    assert replay_step(state, "my_talk: run 1")["replay_position"] == "Round 1 of 5 · 2 tokens"
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert "Cannot load this file:** this file has rows but no round events" in replay_load(state, str(bad))["replay_position"]
    assert "no file was sent" in replay_load(state, None)["replay_position"]
    state.clear()
    assert LOADED.names(state.id) == set() and state.choices() == []
