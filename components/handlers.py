"""Event handlers. Each takes the session's `Session` (its gr.State) and named picker values, and yields (or
returns) dicts of updates keyed by component name; `components.wiring.bind` maps names to components.

Every failure becomes a message on the status line and the handler ends normally, so the app stays up and
the next run works. Runs hold their engine's lock for their whole length (see components.engine_cache).
"""
from __future__ import annotations

import html
import logging
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import gradio as gr

from flashspec_core import ModelUnavailableError, RoundEvent
from flashspec_core.engine import summarize

from components import engine_cache
from components.arms import arms_figure
from components.background import in_background
from components.prompt import READY, example_by_name, load_examples
from components.race import race_summary, same_tokens, speedup, tokens_over_time_figure
from components.runs import export_runs, run_record, runs_frame
from components.settings import CUSTOM, RunSettings, arm_names, parse_settings, resolve_pair, role_choices
from components.tokens import EMPTY, stats_markdown, tokens_html

log = logging.getLogger(__name__)

TEXT_INTERVAL_S = 0.2  # how often the text and stats are re-sent while a stream runs
PLOT_INTERVAL_S = 1.0  # the bandit figure costs more to build, send and draw: less often
EXAMPLES = load_examples()


@dataclass
class Session:
    """One browser session's state: its finished runs, their exports, the last text, and a stop request."""
    runs: list[dict] = field(default_factory=list)  # run_record() rows, oldest first
    export_dir: str = ""  # a temp folder, made on the first export
    finished: int = 0  # runs and races finished, for their ids
    last_events: list = field(default_factory=list)  # the last Run's round events, to re-render its text
    stop_requested: bool = False  # set by the Stop button, read by the running handler between updates

    def next_id(self, kind: str) -> str:
        self.finished += 1
        return f"{kind} {self.finished}"

    def exports(self) -> tuple[Path, Path]:
        if not self.export_dir:
            self.export_dir = tempfile.mkdtemp(prefix="flashspec-runs-")
        return export_runs(self.runs, Path(self.export_dir))


# ----------------------------------------------------------------------------------------------------
# Small pure helpers


def error_message(e: BaseException) -> str:
    """What the status line says about an exception: what went wrong and what to do."""
    text = html.escape(str(e), quote=False)
    if isinstance(e, ModelUnavailableError):
        return f"**Model unavailable.** {text}"
    if isinstance(e, ValueError):
        return f"**Cannot run:** {text}"
    return f"**Error ({type(e).__name__}):** {text}. The app is still up: change the settings or try again."


def stream_stats(events: list[RoundEvent]) -> dict:
    """The engine's summary of a (partial) stream; prefill = time to the first round minus that round's own time."""
    prefill = events[0].elapsed_s - events[0].round_s if events else 0.0
    return summarize(events, prefill)


def failure(e: BaseException) -> dict:
    """The updates that end a failed run; unexpected errors (not ValueError) are also logged with a traceback."""
    if not isinstance(e, ValueError):
        log.error("run failed", exc_info=e)
    return {"status": error_message(e)}


def table_updates(state: Session) -> dict:
    """The runs table and its two downloads, after the session's runs changed."""
    if not state.runs:
        return {"runs_table": runs_frame([]), "download_csv": gr.update(value=None, interactive=False),
                "download_json": gr.update(value=None, interactive=False), "state": state}
    csv, js = state.exports()
    return {"runs_table": runs_frame(state.runs), "download_csv": gr.update(value=str(csv), interactive=True),
            "download_json": gr.update(value=str(js), interactive=True), "state": state}


# ----------------------------------------------------------------------------------------------------
# Shared steps of the run handlers (generators: they yield status updates and return their result)


def _prepare(values: dict, progress):
    """Parse the pickers, load the engine (once), take its lock; yields status lines, returns (settings, slot).
    The caller releases slot.lock."""
    settings = parse_settings(**values)
    yield {"status": f"Loading {html.escape(settings.pair.label)} …"}
    report = (lambda fraction, message: progress(fraction, desc=message)) if progress is not None else None
    slot = engine_cache.get_engine(settings.pair, settings.backend, report)
    if not slot.lock.acquire(blocking=False):
        yield {"status": "Waiting for the model: another run (or the start-up warm-up) is using it …"}
        slot.lock.acquire()
    return settings, slot


def open_stream(slot, prompt, settings: RunSettings, mode: str):
    """The engine's stream for one run (or one race leg), after clearing the drafters' memory of earlier
    generations: another session's text must never come back as this one's drafts, and the speculative leg
    of a race must not draft from the plain leg's output."""
    slot.engine.reset_session()
    drafters = arm_names(settings.pair, list(slot.engine.drafters), settings.roles) if mode == "speculative" else None
    return slot.engine.stream(prompt, max_new_tokens=settings.max_new_tokens, sampling=settings.sampling,
                              gamma=settings.gamma, mode=mode, seed=settings.seed, drafters=drafters,
                              bandit=settings.bandit)


# ----------------------------------------------------------------------------------------------------
# Handlers


def run_stream(state: Session, prompt: str, example: str = "", keep_rejected: bool = False, progress=None,
               **values) -> Iterator[dict]:
    """Speculative decoding of one prompt: the text round by round, the bandit figure, then a runs-table row."""
    state.stop_requested = False
    yield {"status": "Starting …", "tabs": gr.Tabs(selected="stream")}
    try:
        settings, slot = yield from _prepare(values, progress)
    except Exception as e:  # noqa: BLE001 - every failure goes to the status line
        yield failure(e)
        return
    try:
        stream = open_stream(slot, prompt, settings, "speculative")
        yield {"tokens": EMPTY, "stream_stats": "&nbsp;", "arms_plot": arms_figure([]), "status": "Generating …"}
        plotted = time.perf_counter()
        with closing(in_background(stream, TEXT_INTERVAL_S)) as updates:  # closed (worker joined) before unlocking
            for events, done in updates:
                if done or state.stop_requested:
                    break
                update = {"tokens": tokens_html(events, live=True, keep_rejected=keep_rejected),
                          "stream_stats": stats_markdown(stream_stats(events), live=True),
                          "status": f"Generating … round {len(events)}, {events[-1].new_tokens} tokens"}
                if time.perf_counter() - plotted >= PLOT_INTERVAL_S:
                    update["arms_plot"] = arms_figure(events, settings.bandit)
                    plotted = time.perf_counter()
                yield update
    except Exception as e:  # noqa: BLE001 - every failure goes to the status line
        yield failure(e)
        return
    finally:
        slot.lock.release()
    stats = stream_stats(events)
    state.last_events = events
    if not done:
        yield {"tokens": tokens_html(events, live=False, keep_rejected=keep_rejected),
               "stream_stats": stats_markdown(stats, live=True), "arms_plot": arms_figure(events, settings.bandit),
               "status": f"Stopped after {stats['new_tokens']} tokens (not added to the runs table)."}
        return
    run = state.next_id("run")
    state.runs.append(run_record(run, "speculative", settings.record(), stats, example_name(prompt, example)))
    yield {"tokens": tokens_html(events, live=False, keep_rejected=keep_rejected),
           "stream_stats": stats_markdown(stats), "arms_plot": arms_figure(events, settings.bandit),
           "status": f"Done ({run}): {stats['new_tokens']} tokens at {stats['tok_per_s']:.1f} tok/s.",
           **table_updates(state)}


def run_race(state: Session, prompt: str, example: str = "", keep_rejected: bool = False, progress=None,
             **values) -> Iterator[dict]:
    """Plain decoding, then speculative decoding, of the same prompt and seed; speedup and tokens over time."""
    state.stop_requested = False
    yield {"status": "Starting the race …", "tabs": gr.Tabs(selected="race")}
    try:
        settings, slot = yield from _prepare(values, progress)
    except Exception as e:  # noqa: BLE001 - every failure goes to the status line
        yield failure(e)
        return
    legs: dict[str, list[RoundEvent]] = {}
    try:
        yield {"plain_tokens": EMPTY, "spec_tokens": EMPTY, "plain_stats": "&nbsp;", "spec_stats": "&nbsp;",
               "race_summary": race_summary({}, {}, None, True), "race_plot": tokens_over_time_figure({})}
        for mode, pane in (("plain", "plain"), ("speculative", "spec")):
            with closing(in_background(open_stream(slot, prompt, settings, mode), TEXT_INTERVAL_S)) as updates:
                for events, done in updates:
                    yield {f"{pane}_tokens": tokens_html(events, live=not done, keep_rejected=keep_rejected),
                           f"{pane}_stats": stats_markdown(stream_stats(events), live=not done),
                           "status": f"Racing: {mode} decoding, {events[-1].new_tokens} tokens"}
                    if state.stop_requested:
                        yield {"status": "Race stopped (not added to the runs table)."}
                        return
            legs[mode] = events
    except Exception as e:  # noqa: BLE001 - every failure goes to the status line
        yield failure(e)
        return
    finally:
        slot.lock.release()
    plain, spec = stream_stats(legs["plain"]), stream_stats(legs["speculative"])
    ratio = speedup(plain, spec)
    run = state.next_id("race")
    name = example_name(prompt, example)
    state.runs.append(run_record(run, "plain", settings.record(), plain, name))
    state.runs.append(run_record(run, "speculative", settings.record(), spec, name, ratio))
    identical = same_tokens(legs["plain"], legs["speculative"])
    yield {"race_summary": race_summary(plain, spec, identical, settings.sampling.greedy),
           "race_plot": tokens_over_time_figure(legs),
           "status": f"Done ({run}): speedup ×{ratio:.2f}." if ratio else f"Done ({run}).",
           **table_updates(state)}


def stop(state: Session) -> dict:
    """Ask this session's running Run or Race to stop after its current update (it ends itself and frees the
    engine: no cancelled generator is left for gradio to clean up)."""
    state.stop_requested = True
    return {"status": "Stopping …"}


def show_rejected(state: Session, keep_rejected: bool) -> dict:
    """Re-render the last run's text with or without every round's rejected drafts."""
    if not state.last_events:
        return {}
    return {"tokens": tokens_html(state.last_events, live=False, keep_rejected=keep_rejected)}


def clear_runs(state: Session) -> dict:
    state.runs.clear()
    return {**table_updates(state), "status": READY}


def pick_example(example: str) -> dict:
    ex = example_by_name(EXAMPLES, example)
    if ex is None:
        return {}
    return {"prompt": ex["prompt"], "max_new_tokens": ex["max_new_tokens"]}


def pick_pair(pair: str) -> dict:
    """Show the free-text ids for a custom pair; offer the drafters the pair has, all ticked."""
    spec = None if pair == CUSTOM else resolve_pair(pair)
    choices = role_choices(spec)
    return {"custom_row": gr.update(visible=spec is None),
            "roles": gr.update(choices=choices, value=[value for _, value in choices])}


def example_name(prompt: str, example: str) -> str:
    """The example's name while the prompt is still that example's, else the prompt's first words."""
    ex = example_by_name(EXAMPLES, example)
    if ex is not None and ex["prompt"] == prompt:
        return ex["name"]
    words = " ".join((prompt or "").split())
    return words[:40] + ("…" if len(words) > 40 else "")
