"""Event handlers of the Replay tab: pick a run (of the session, or loaded from an exported file), then play it
at a fraction of its real pace, pause, step one round per click, or restart. Same update dicts as the other
handlers (components.handlers); no torch work, so replays never wait for the engine.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Iterator

from flashspec_core.engine import summarize

from components.arms import arms_figure
from components.handlers import replay_choices
from components.replay import BadRunFile, due, load_document, position, wait_for
from components.runs import Run
from components.session import Session
from components.settings import number
from components.tokens import EMPTY, stats_markdown, tokens_html

FRAME_INTERVAL_S = 0.05  # at most this often a new frame while playing
PLOT_INTERVAL_S = 0.5  # the bandit figure, less often (always on the last frame)
POLL_S = 0.25  # how often a sleeping replay looks at the Pause button
MAX_FILE_BYTES = 10 << 20  # as app.py's max_file_size


def frame(run: Run, shown: int, plot: bool = True) -> dict:
    """The replay pane after `shown` rounds of `run`: the latest round's rejected drafts struck through, as live."""
    events = list(run.events[:shown])
    live = shown < len(run.events)
    out = {"replay_tokens": tokens_html(events, live=live) if events else EMPTY,
           "replay_stats": stats_markdown(summarize(events), live=live) if events else "&nbsp;",
           "replay_position": position(list(run.events), shown)}
    if plot:
        out["replay_arms"] = arms_figure(events, run.record.get("bandit") or "")
    return out


def current(state: Session, name) -> Run | None:
    """The picked run; picking another one starts it from round 0."""
    run = state.find(name) if isinstance(name, str) else None
    if run is not None and run.name != state.replay_name:
        state.replay_name, state.replay_shown = run.name, 0
    return run


def replay_pick(state: Session, replay_pick) -> dict:
    run = current(state, replay_pick)
    if run is None:
        return {"replay_position": position([], 0)}
    state.replay_paused = True
    return {**frame(run, state.replay_shown), "state": state}


def replay_step(state: Session, replay_pick) -> dict:
    """One more round (the Next round button)."""
    run = current(state, replay_pick)
    if run is None:
        return {"replay_position": position([], 0)}
    state.replay_paused = True
    state.replay_shown = min(state.replay_shown + 1, len(run.events))
    return {**frame(run, state.replay_shown), "state": state}


def replay_restart(state: Session, replay_pick) -> dict:
    run = current(state, replay_pick)
    if run is None:
        return {"replay_position": position([], 0)}
    state.replay_paused, state.replay_shown = True, 0
    return {**frame(run, 0), "state": state}


def replay_pause(state: Session) -> dict:
    state.replay_paused = True
    return {}


def replay_play(state: Session, replay_pick, replay_speed) -> Iterator[dict]:
    """Play from the current round at `replay_speed` times the run's real pace (from the start when at its end)."""
    run = current(state, replay_pick)
    try:
        speed = number("speed", replay_speed, 0.1, 1.0)
    except ValueError as e:
        yield {"replay_position": f"**Cannot play:** {e}"}
        return
    if run is None:
        yield {"replay_position": position([], 0)}
        return
    events = list(run.events)
    if state.replay_shown >= len(events):
        state.replay_shown = 0
    state.replay_paused = False
    start, t0, plotted = state.replay_shown, time.perf_counter(), 0.0
    while state.replay_shown < len(events) and not state.replay_paused:
        elapsed = time.perf_counter() - t0
        time.sleep(min(max(wait_for(events, start, state.replay_shown, speed, elapsed), FRAME_INTERVAL_S), POLL_S))
        shown = due(events, start, speed, time.perf_counter() - t0)
        if shown > state.replay_shown and not state.replay_paused:
            state.replay_shown = shown
            plot = time.perf_counter() - plotted >= PLOT_INTERVAL_S or shown == len(events)
            plotted = time.perf_counter() if plot else plotted
            yield frame(run, shown, plot)
    yield {**frame(run, state.replay_shown), "state": state}


def replay_load(state: Session, replay_upload) -> dict:
    """Load the runs of an exported JSON file for replay; the uploaded copy is deleted once read."""
    if not isinstance(replay_upload, str) or not replay_upload:
        return {}
    path = Path(replay_upload)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise BadRunFile(f"the file is over {MAX_FILE_BYTES >> 20} MB")
        text = path.read_text(encoding="utf-8", errors="replace")
        source = re.sub(r"[^\w.\-]", "_", path.stem)[:40] or "file"
        runs = load_document(text, source)
    except (BadRunFile, OSError) as e:
        message = str(e) if isinstance(e, BadRunFile) else "the file could not be read"
        return {"replay_position": f"**Cannot load this file:** {message}"}
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    state.load(runs)
    state.replay_name, state.replay_shown, state.replay_paused = runs[0].name, 0, True
    return {**frame(runs[0], 0), "replay_pick": replay_choices(state, runs[0].name), "state": state}
