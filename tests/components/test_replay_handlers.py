"""The Replay tab's handlers, stepped as gradio would: pick, step, restart, play at a pace, pause, load a file."""
import json
import threading
import time

from fake_events import make_event

from components.replay_handlers import replay_load, replay_pause, replay_pick, replay_play, replay_restart, replay_step
from components.runs import Run, export_document, run_record
from components.session import MAX_REPLAYABLE, Session


def session_with_a_run(rounds: int = 5, gap: float = 0.05) -> Session:
    state = Session()
    events = tuple(make_event(i, elapsed=0.01 + gap * i, rejected=("x",) if i % 2 else (),
                              last=("resampled", "y") if i % 2 else ("bonus", "!")) for i in range(rounds))
    state.add(Run(run_record("run 1", "speculative", {"bandit": "ucb1"}, {"new_tokens": 10}), "hi", events))
    return state


def test_step_and_restart_show_one_round_more_or_none():
    state = session_with_a_run()
    first = replay_step(state, "run 1")
    assert first["replay_position"] == "Round 1 of 5 · 2 tokens"
    assert first["replay_tokens"].count("tok-") >= 2 and "tok-rejected" not in first["replay_tokens"]
    assert first["replay_arms"].data  # the same bandit figure as live
    second = replay_step(state, "run 1")
    assert "tok-rejected" in second["replay_tokens"]  # round 1 rejects: struck through while it is the latest
    assert replay_restart(state, "run 1")["replay_position"] == "Round 0 of 5 · 0 tokens"
    assert replay_step(state, "missing")["replay_position"].startswith("Pick a run")
    assert replay_pick(state, ["not", "a", "name"])["replay_position"].startswith("Pick a run")


def test_play_follows_the_chosen_speed_and_pause_stops_it():
    state = session_with_a_run(rounds=5, gap=0.05)  # 0.21 s of real time
    t0 = time.perf_counter()
    frames = list(replay_play(state, "run 1", 0.5))
    assert time.perf_counter() - t0 >= 0.21 / 0.5 - 0.05
    assert frames[-1]["replay_position"].endswith("(end)") and state.replay_shown == 5
    assert [f["replay_position"] for f in frames[:-1]] == sorted({f["replay_position"] for f in frames[:-1]})
    slow = session_with_a_run(rounds=5, gap=1.0)
    threading.Timer(0.3, replay_pause, args=(slow,)).start()
    frames = list(replay_play(slow, "run 1", 1.0))
    assert slow.replay_shown == 1 and frames[-1]["replay_position"].startswith("Round 1 of 5")
    assert "Cannot play:** speed must be a number in 0.1..1.0, got nan" in next(replay_play(slow, "run 1", float("nan")))["replay_position"]


def test_only_the_last_runs_keep_their_events():
    state = session_with_a_run()
    for i in range(MAX_REPLAYABLE + 2):
        state.add(Run(run_record(f"run {i + 2}", "plain", {}, {}), "", (make_event(0),)))
    assert len(state.runs) == MAX_REPLAYABLE + 3 and len(state.replayable()) == MAX_REPLAYABLE
    big = Run(run_record("file: run 1", "plain", {}, {}), "", (make_event(0),) * 20_000)
    state.load([big, big])
    state.load([Run(run_record("file: run 2", "plain", {}, {}), "", (make_event(0),))])
    assert [len(r.events) for r in state.loaded] == [20_000, 1]  # the oldest loaded run went


def test_a_loaded_file_joins_the_picker_and_its_upload_is_deleted(tmp_path):
    source = session_with_a_run()
    path = tmp_path / "my talk.json"
    path.write_text(json.dumps(export_document(source.runs)))
    state = Session()
    out = replay_load(state, str(path))
    assert not path.exists()
    assert out["replay_pick"]["value"] == "my_talk: run 1" and out["replay_position"] == "Round 0 of 5 · 0 tokens"
    assert [r.name for r in state.replayable()] == ["my_talk: run 1"]
    assert replay_step(state, "my_talk: run 1")["replay_position"] == "Round 1 of 5 · 2 tokens"
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert "Cannot load this file:** this file has rows but no round events" in replay_load(state, str(bad))["replay_position"]
    assert replay_load(state, None) == {}
