"""Event handlers of the runs. Each takes the session's `Session` (its gr.State) and named picker values, and
yields (or returns) dicts of updates keyed by component name; `components.wiring.bind` maps names to
components.

Picker values arrive raw (the run events skip gradio's preprocessing) and are checked by
components.settings and the engine. Every failure becomes a short message on the status line and the
handler ends normally, so the app stays up and the next run works. Runs hold their engine's lock for their
whole length (see components.engine_cache).
"""
from __future__ import annotations

import html
import logging
import time
from contextlib import closing
from typing import Iterator

import gradio as gr

from flashspec_core import ModelUnavailableError, RoundEvent
from flashspec_core.engine import summarize

from components import engine_cache
from components.arms import arms_figure
from components.background import in_background
from components.prompt import READY, example_by_name, load_examples
from components.race import WAITING, race_summary, same_tokens, speedup, tokens_over_time_figure, why_different
from components.runs import DOWNLOADS, Run, run_record, runs_frame
from components.session import ExportRefused, Session
from components.settings import (CUSTOM, LEGS, RunSettings, arm_names, default_shape, parse_leg, parse_prompt,
                                 parse_settings, resolve_pair, role_choices)
from components.tokens import EMPTY, stats_markdown, tokens_html

log = logging.getLogger(__name__)

TEXT_INTERVAL_S = 0.2  # how often the text and stats are re-sent while a stream runs
PLOT_INTERVAL_S = 1.0  # the bandit figure costs more to build, send and draw: less often
EXAMPLES = load_examples()


# ----------------------------------------------------------------------------------------------------
# Small pure helpers


def error_message(e: BaseException) -> str:
    """What the status line says about an exception: what went wrong and what to do. Bad input and unavailable
    models say why (their messages quote no server paths); anything else says only its kind, since its text
    may (the server log has it)."""
    text = html.escape(str(e)[:600], quote=False)
    if isinstance(e, ModelUnavailableError):
        return f"**Model unavailable.** {text}"
    if isinstance(e, ValueError):
        return f"**Cannot run:** {text}"
    return (f"**Error ({type(e).__name__}).** The app is still up: change the settings or try again "
            "(the server log has the details).")


def failure(e: BaseException) -> dict:
    """The updates that end a failed run; unexpected errors (not ValueError) are also logged with a traceback."""
    if not isinstance(e, ValueError):
        log.error("run failed", exc_info=e)
    return {"status": error_message(e)}


def table_updates(state: Session) -> dict:
    """The runs table, its two downloads and the replay picker, after the session's runs changed."""
    off = {"value": None, "interactive": False}
    files = {"download_csv": gr.update(**off, label=DOWNLOADS[0]), "download_json": gr.update(**off, label=DOWNLOADS[1])}
    if state.runs:
        try:
            csv, js = state.exports()
            files = {"download_csv": gr.update(value=str(csv), interactive=True, label=DOWNLOADS[0]),
                     "download_json": gr.update(value=str(js), interactive=True, label=DOWNLOADS[1])}
        except ExportRefused as e:  # the downloads stay off and say why
            files = {name: gr.update(**off, label=f"{label} (not saved: {e})")
                     for name, label in zip(("download_csv", "download_json"), DOWNLOADS)}
    return {"runs_table": runs_frame([r.record for r in state.runs]), **files, "state": state,
            "replay_pick": replay_choices(state)}


def replay_choices(state: Session, value: str | None = None):
    choices = state.choices()
    value = value if value is not None else (choices[0][1] if choices else None)
    return gr.update(choices=choices, value=value)


def example_name(prompt: str, example) -> str:
    """The example's name while the prompt is still that example's, else the prompt's first words."""
    ex = example_by_name(EXAMPLES, example if isinstance(example, str) else None)
    if ex is not None and ex["prompt"] == prompt:
        return ex["name"]
    words = " ".join((prompt or "").split())
    return words[:40] + ("…" if len(words) > 40 else "")


# ----------------------------------------------------------------------------------------------------
# Shared steps of the run handlers (generators: they yield status updates and return their result)


def load(settings: RunSettings, progress):
    """Load the engine (once); yields a status line, returns its slot."""
    yield {"status": f"Loading {html.escape(settings.pair.label[:160])} …"}
    report = (lambda fraction, message: progress(fraction, desc=message)) if progress is not None else None
    return engine_cache.get_engine(settings.pair, settings.backend, report)


def acquire(slot):
    """Take the engine's lock, saying so when another run holds it. The caller releases slot.lock."""
    if not slot.lock.acquire(blocking=False):
        yield {"status": "Waiting for the model: another run (or the start-up warm-up) is using it …"}
        slot.lock.acquire()


def open_stream(slot, prompt, settings: RunSettings):
    """The engine's stream for one run (or one race leg), after clearing the drafters' memory of earlier
    generations: another session's text must never come back as this one's drafts, and leg B of a race must
    not draft from leg A's output."""
    slot.engine.reset_session()
    speculative = settings.mode == "speculative"
    drafters = arm_names(settings.pair, list(slot.engine.drafters), settings.roles) if speculative else None
    return slot.engine.stream(prompt, max_new_tokens=settings.max_new_tokens, sampling=settings.sampling,
                              gamma=settings.gamma if speculative else 0, mode=settings.mode, seed=settings.seed,
                              drafters=drafters, bandit=settings.bandit,
                              tree=settings.tree if speculative else None)


def policy():
    return engine_cache.ENGINES.config.policy


# ----------------------------------------------------------------------------------------------------
# Handlers


def run_stream(state: Session, prompt, example="", keep_rejected=False, progress=None, **values) -> Iterator[dict]:
    """Speculative decoding of one prompt: the text round by round, the bandit figure, then a runs-table row."""
    state.stop_requested = False
    keep_rejected = keep_rejected is True
    yield {"status": "Starting …", "tabs": gr.update(selected="stream")}
    try:
        prompt = parse_prompt(prompt)
        settings = parse_settings(**values, policy=policy())
        slot = yield from load(settings, progress)
        yield from acquire(slot)
    except Exception as e:  # noqa: BLE001 - every failure goes to the status line
        yield failure(e)
        return
    try:
        stream = open_stream(slot, prompt, settings)
        yield {"tokens": EMPTY, "stream_stats": "&nbsp;", "arms_plot": arms_figure([]),
               "status": f"Generating … {precision_line(slot.engine)}".rstrip()}
        plotted = time.perf_counter()
        with closing(in_background(stream, TEXT_INTERVAL_S)) as updates:  # closed (worker joined) before unlocking
            for events, done in updates:
                if done or state.stop_requested:
                    break
                update = {"tokens": tokens_html(events, live=True, keep_rejected=keep_rejected),
                          "stream_stats": stats_markdown(summarize(events), live=True),
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
    yield from finish_run(state, prompt, example, keep_rejected, settings, events, done, precision_line(slot.engine))


def precision_line(engine) -> str:
    """Which weights the target runs on, for the status line ("" for an engine that does not say)."""
    precision = getattr(engine, "precision", "")
    if precision == "gguf":
        return "target on its GGUF file's 4-bit weights"
    return f"target in {precision}" if precision else ""


def finish_run(state: Session, prompt: str, example, keep_rejected: bool, settings: RunSettings, events, done,
               precision: str = ""):
    """The last updates of a Run: the final text and figure, and (when it finished) its runs-table row."""
    stats = summarize(events)
    state.last_events = events
    final = {"tokens": tokens_html(events, live=False, keep_rejected=keep_rejected),
             "arms_plot": arms_figure(events, settings.bandit)}
    if not done:
        yield {**final, "stream_stats": stats_markdown(stats, live=True), "state": state,
               "status": f"Stopped after {stats['new_tokens']} tokens (not added to the runs table)."}
        return
    run = state.next_id("run")
    record = run_record(run, "speculative", settings.record(), stats, example_name(prompt, example))
    state.add(Run(record, prompt, tuple(events)))
    yield {**final, "stream_stats": stats_markdown(stats),
           "status": f"Done ({run}): {stats['new_tokens']} tokens at {stats['tok_per_s']:.1f} tok/s"
                     + (f", {precision}." if precision else "."),
           **table_updates(state)}


def run_race(state: Session, prompt, example="", keep_rejected=False, progress=None, **values) -> Iterator[dict]:
    """Configuration A, then configuration B, on the same prompt and seed; their ratio, whether the tokens are
    the same (and why not), and tokens over time. Both legs become rows of the runs table."""
    state.stop_requested = False
    keep_rejected = keep_rejected is True
    yield {"status": "Starting the race …", "tabs": gr.update(selected="race")}
    try:
        prompt = parse_prompt(prompt)
        legs = {leg: parse_leg(leg, values, policy()) for leg in LEGS}  # both checked before either runs
        slots = {}
        for leg in LEGS:
            slots[leg] = yield from load(legs[leg], progress)
    except Exception as e:  # noqa: BLE001 - every failure goes to the status line
        yield failure(e)
        return
    yield {**{f"{leg}_tokens": EMPTY for leg in LEGS}, **{f"{leg}_stats": "&nbsp;" for leg in LEGS},
           **{f"{leg}_title": f"#### {leg.upper()} · {html.escape(legs[leg].describe())}" for leg in LEGS},
           "race_summary": WAITING, "race_plot": tokens_over_time_figure({})}
    events = {}
    for leg in LEGS:
        try:
            events[leg] = yield from race_leg(state, prompt, leg, legs[leg], slots[leg], keep_rejected)
        except Exception as e:  # noqa: BLE001 - every failure goes to the status line
            yield failure(e)
            return
        if events[leg] is None:
            yield {"status": "Race stopped (not added to the runs table)."}
            return
    yield from finish_race(state, prompt, example, legs, events)


def race_leg(state: Session, prompt: str, leg: str, settings: RunSettings, slot, keep_rejected: bool):
    """One leg, streamed into its pane; returns its events, or None when Stop was pressed."""
    yield from acquire(slot)
    try:
        with closing(in_background(open_stream(slot, prompt, settings), TEXT_INTERVAL_S)) as updates:
            for events, done in updates:
                yield {f"{leg}_tokens": tokens_html(events, live=not done, keep_rejected=keep_rejected),
                       f"{leg}_stats": stats_markdown(summarize(events), live=not done),
                       "status": f"Racing: {leg.upper()} ({settings.mode}), {events[-1].new_tokens} tokens"}
                if state.stop_requested:
                    return None
    finally:
        slot.lock.release()
    return events


def finish_race(state: Session, prompt: str, example, legs: dict[str, RunSettings], events: dict[str, list]):
    stats = {leg: summarize(events[leg]) for leg in LEGS}
    ratio = speedup(stats["a"], stats["b"])
    run, name = state.next_id("race"), example_name(prompt, example)
    for leg in LEGS:
        record = run_record(run, legs[leg].mode, legs[leg].record(), stats[leg], name,
                            ratio if leg == "b" else None, leg=leg.upper())
        state.add(Run(record, prompt, tuple(events[leg])))
    identical = same_tokens(events["a"], events["b"])
    names = {leg: f"{leg.upper()} · {legs[leg].mode}" for leg in LEGS}
    yield {"race_summary": race_summary(stats["a"], stats["b"], identical, why_different(legs["a"], legs["b"])),
           "race_plot": tokens_over_time_figure(events, names),
           "status": f"Done ({run}): B / A ×{ratio:.2f}." if ratio else f"Done ({run}).", **table_updates(state)}


def stop(state: Session) -> dict:
    """Ask this session's running Run or Race to stop after its current update (it ends itself and frees the
    engine: no cancelled generator is left for gradio to clean up)."""
    state.stop_requested = True
    return {"status": "Stopping …"}


def show_rejected(state: Session, keep_rejected) -> dict:
    """Re-render the last run's text with or without every round's rejected drafts."""
    if not state.last_events:
        return {}
    return {"tokens": tokens_html(state.last_events, live=False, keep_rejected=keep_rejected is True)}


def clear_runs(state: Session) -> dict:
    """Forget the session's runs and delete its exported files."""
    state.clear()
    return {**table_updates(state), "status": READY}


def pick_example(example) -> dict:
    ex = example_by_name(EXAMPLES, example if isinstance(example, str) else None)
    if ex is None:
        return {}
    return {"prompt": ex["prompt"], "max_new_tokens": ex["max_new_tokens"]}


def pair_updates(pair, prefix: str = "") -> dict:
    """Show the free-text ids for a custom pair; offer the drafters the pair has, all ticked, and its starting draft
    shape (`default_shape`). An unknown pair (only an API caller can send one) gets a short error."""
    try:
        spec = None if pair == CUSTOM else resolve_pair(pair)
    except ValueError as e:
        raise gr.Error(str(e)[:300], print_exception=False) from None
    choices = role_choices(spec)
    return {prefix + "custom_row": gr.update(visible=spec is None),
            prefix + "roles": gr.update(choices=choices, value=[value for _, value in choices]),
            prefix + "shape": gr.update(value=default_shape(spec))}


def pick_pair(pair) -> dict:
    return pair_updates(pair)


def pick_pair_a(a_pair) -> dict:
    return pair_updates(a_pair, "a_")


def pick_pair_b(b_pair) -> dict:
    return pair_updates(b_pair, "b_")
