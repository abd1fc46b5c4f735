"""Event handlers of the Replay tab: pick a run (of the session, or loaded from an exported file), then play it
at a fraction of its real pace, pause, step one round per click, or restart. Same update dicts as the other
handlers (components.handlers); no torch work, so replays never wait for the engine.

Playing is paced here, on the server, and bounded: a round waits at most MAX_ROUND_WAIT_S, a Play lasts at most
MAX_PLAY_S, at most 4 updates a second go out and each only appends to the text (see components.tokens.
replay_page), the bandit figure is redrawn every PLOT_INTERVAL_S over at most PLOT_ROUNDS rounds, and a stream
whose client stops reading is dropped.
"""
from __future__ import annotations

import bisect
import logging
import os
import re
import time
from pathlib import Path
from typing import Iterator

from components.arms import arms_figure
from components.compact import CompactRun, RunsTooLarge
from components.handlers import replay_choices
from components.replay import SPEEDS, BadRunFile, load_document, play_times, position
from components.session import Session
from components.settings import number
from components.tokens import EMPTY, replay_page, round_group, stats_markdown

log = logging.getLogger(__name__)

FRAME_INTERVAL_S = 0.25  # at most this often a new frame while playing
PLOT_INTERVAL_S = 2.0  # the bandit figure, less often (always on the last frame)
PLOT_ROUNDS = 300  # the replay's bandit figure shows at most this many rounds (every n-th, the last included)
PAGE_SPANS = 2_000  # tokens on the replay pane at once; a longer run shows the page of its latest round
MAX_PLAY_S = 300.0  # one Play lasts at most this long; Play again goes on
MAX_UNREAD = 20  # updates a client left unread: beyond this, it is gone and its replay stops
POLL_S = 0.25  # how often a waiting replay looks at the Pause button
KEEPALIVE_S = 1.0  # while a round is not due, an update this often anyway (so an unread stream shows)
MAX_FILE_BYTES = 10 << 20  # as app.py's max_file_size


class Pane:
    """The replay text of one run, built a round at a time: a page of round groups that only grows while playing."""

    def __init__(self, run: CompactRun):
        self.run, self.first, self.upto, self.body = run, -1, 0, ""

    def page_start(self, shown: int) -> int:
        """The first round of the page that holds round shown - 1 (pages of PAGE_SPANS tokens)."""
        start, _ = self.run.round_spans(shown - 1)
        boundary = start // PAGE_SPANS * PAGE_SPANS
        return bisect.bisect_left(self.run.span_end, boundary) + 1 if boundary else 0

    def html(self, shown: int) -> str:
        if not shown:
            return EMPTY
        first = self.page_start(shown)
        if first != self.first or shown < self.upto:
            self.first, self.upto, self.body = first, first, ""
        self.body += "".join(round_group(e) for e in self.run.events(range(self.upto, shown)))
        self.upto = shown
        skipped_tokens = self.run.new_tokens[first - 1] if first else 0
        return replay_page(self.body, first, skipped_tokens, done=shown == len(self.run))


def replay_figure(run: CompactRun, shown: int):
    step = -(-shown // PLOT_ROUNDS) if shown else 1
    rounds = sorted({*range(0, shown, step), shown - 1}) if shown else []
    return arms_figure(run.events(rounds, spans=False), run.record.get("bandit") or "", pulls=run.pulls(shown))


def frame(run: CompactRun, shown: int, plot: bool = True, pane: Pane | None = None) -> dict:
    """The replay pane after `shown` rounds of `run`: the latest round's rejected drafts struck through, as live."""
    live = shown < len(run)
    tokens = run.new_tokens[shown - 1] if shown else 0
    out = {"replay_tokens": (pane or Pane(run)).html(shown),
           "replay_stats": stats_markdown(run.stats(shown), live=live) if shown else "&nbsp;",
           "replay_position": position(len(run), shown, tokens)}
    if plot:
        out["replay_arms"] = replay_figure(run, shown)
    return out


def current(state: Session, name) -> CompactRun | None:
    """The picked run; picking another one starts it from round 0. Every caller takes the replay over: a Play
    still running (gradio's cancel lands late, a frame may be in flight) sees the new epoch and stops sending."""
    state.replay_epoch += 1
    run = state.find(name) if isinstance(name, str) else None
    if run is not None and run.name != state.replay_name:
        state.replay_name, state.replay_shown = run.name, 0
    return run


def replay_pick(state: Session, replay_pick) -> dict:
    run = current(state, replay_pick)
    if run is None:
        return {"replay_position": position(0, 0)}
    state.replay_paused = True
    return {**frame(run, state.replay_shown), "state": state}


def replay_step(state: Session, replay_pick) -> dict:
    """One more round (the Next round button)."""
    run = current(state, replay_pick)
    if run is None:
        return {"replay_position": position(0, 0)}
    state.replay_paused = True
    state.replay_shown = min(state.replay_shown + 1, len(run))
    return {**frame(run, state.replay_shown), "state": state}


def replay_restart(state: Session, replay_pick) -> dict:
    run = current(state, replay_pick)
    if run is None:
        return {"replay_position": position(0, 0)}
    state.replay_paused, state.replay_shown = True, 0
    return {**frame(run, 0), "state": state}


def replay_pause(state: Session) -> dict:
    state.replay_paused = True
    return {}


def unread(request) -> int:
    """Updates gradio holds for this session that its client has not read yet; 0 when that cannot be told (no
    request, or a gradio whose queue is laid out differently: the time limits still bound the replay)."""
    try:
        queue = request.request.app.get_blocks()._queue.pending_messages_per_session
        return queue[request.session_hash].qsize() if request.session_hash in queue else 0
    except Exception:  # noqa: BLE001 - an internal of gradio; without it only the time limits apply
        return 0


def replay_play(state: Session, replay_pick, replay_speed, request=None) -> Iterator[dict]:
    """Play from the current round at `replay_speed` times the run's real pace (from the start when at its end)."""
    run = current(state, replay_pick)
    try:
        speed = number("speed", replay_speed, *SPEEDS)
    except ValueError as e:
        yield {"replay_position": f"**Cannot play:** {e}"}
        return
    if run is None:
        yield {"replay_position": position(0, 0)}
        return
    if state.replay_shown >= len(run):
        state.replay_shown = 0
    state.replay_paused, pane, note, sent, epoch = False, Pane(run), "", 0.0, state.replay_epoch
    times, t0, plotted = play_times(run, state.replay_shown, speed), time.perf_counter(), time.perf_counter()
    due = next(times, None)
    while due is not None and not state.replay_paused and state.replay_epoch == epoch:
        now = time.perf_counter() - t0
        if now > MAX_PLAY_S:
            state.replay_paused, note = True, f" · paused after {MAX_PLAY_S / 60:.0f} minutes: **Play** goes on"
            break
        if unread(request) > MAX_UNREAD:
            log.info("replay dropped: its client stopped reading")
            state.replay_paused = True
            return
        if due > now:
            if now - sent >= KEEPALIVE_S:  # nothing new (gradio sends an empty change), but it counts as unread
                sent = now
                yield {"replay_position": position(len(run), state.replay_shown,
                                                   run.new_tokens[state.replay_shown - 1] if state.replay_shown else 0)}
            time.sleep(min(due - now, POLL_S))
            continue
        while due is not None and due <= now:
            state.replay_shown += 1
            due = next(times, None)
        if due is None:  # the last round: the closing frame below shows it
            break
        plot = time.perf_counter() - plotted >= PLOT_INTERVAL_S
        plotted = time.perf_counter() if plot else plotted
        yield frame(run, state.replay_shown, plot, pane)
        sent = time.perf_counter() - t0
        time.sleep(FRAME_INTERVAL_S)
    if state.replay_epoch != epoch:  # a step, restart or pick took over: its frame is the one to keep
        return
    last = frame(run, state.replay_shown, pane=pane)
    yield {**last, "replay_position": last["replay_position"] + note, "state": state}


def replay_load(state: Session, replay_upload) -> dict:
    """Load the runs of an exported JSON file for replay; the uploaded copy is deleted once read."""
    if not isinstance(replay_upload, str) or not replay_upload:
        return {"replay_position": "**Cannot load this file:** no file was sent."}
    path = Path(replay_upload)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise BadRunFile(f"the file is over {MAX_FILE_BYTES >> 20} MB")
        text = path.read_text(encoding="utf-8", errors="replace")
        source = re.sub(r"[^\w.\-]", "_", path.stem)[:40] or "file"
        runs = load_document(text, source)
        del text
        state.load(runs)
    except (BadRunFile, RunsTooLarge, OSError) as e:
        message = str(e) if isinstance(e, ValueError) else "the file could not be read"
        return {"replay_position": f"**Cannot load this file:** {message}"}
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    state.replay_name, state.replay_shown, state.replay_paused = runs[0].name, 0, True
    state.replay_epoch += 1  # a Play of an earlier pick stops sending
    return {**frame(runs[0], 0), "replay_pick": replay_choices(state, runs[0].name), "state": state}

