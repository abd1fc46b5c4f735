"""Replay: a finished run shown again round by round, at a fraction of its real pace or one round per click,
with the same colours, hover values and bandit figure as live. Runs come from the session or from a JSON
file the app exported before. Pure functions (the JSON format, checked strictly on the way in; the pace)
and the panel.

The JSON format is components.runs.export_document's.
"""
from __future__ import annotations

import json
import math
import re

import gradio as gr

from flashspec_core import ArmState, RoundEvent, TokenSpan

from components.arms import arms_figure
from components.runs import COLUMNS, FIELDS, FORMAT, VERSION, Run
from components.tokens import EMPTY, KINDS

MAX_RUNS, MAX_ROUNDS, MAX_TEXT = 64, 30_000, 2_000  # what a loaded file may hold (rounds: all runs together)
NAME = re.compile(r"[\w.:+\-/]{1,100}")  # drafter and arm names: no markup
SPEEDS = (0.1, 1.0)  # the pace slider's range, times real time


class BadRunFile(ValueError):
    """A run file that is not a FlashSpec export, or holds values an export never has."""


# ----------------------------------------------------------------------------------------------------
# From JSON (every value checked: the file comes from whoever uploads it)


def _get(d: dict, key: str, kind, where: str, optional: bool = False):
    value = d.get(key)
    if value is None and optional:
        return None
    ok = isinstance(value, kind) and not isinstance(value, bool) if kind is not bool else isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise BadRunFile(f"{where}: {key!r} should be {getattr(kind, '__name__', kind)}")
    return float(value) if kind is float else value


def _ids(d: dict, key: str, where: str) -> tuple[int, ...]:
    ids = _get(d, key, list, where)
    if len(ids) > 64 or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 24 for t in ids):
        raise BadRunFile(f"{where}: {key!r} should be a short list of token ids")
    return tuple(ids)


def _name(value, where: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise BadRunFile(f"{where}: a drafter name should be letters, digits and . : + - / _")
    return value


def _span(s, where: str) -> TokenSpan:
    if not isinstance(s, list) or len(s) != 5 or s[0] not in KINDS:
        raise BadRunFile(f"{where}: a span should be [kind, id, text, p, q]")
    d = dict(zip(("kind", "id", "text", "p", "q"), s))
    if not isinstance(d["text"], str) or len(d["text"]) > MAX_TEXT:
        raise BadRunFile(f"{where}: a span's text should be a short string")
    return TokenSpan(d["kind"], _ids({"x": [d["id"]]}, "x", where)[0], d["text"], _get(d, "p", float, where),
                     _get(d, "q", float, where, optional=True))


def _arm(a, where: str) -> ArmState:
    if not isinstance(a, list) or len(a) != 5:
        raise BadRunFile(f"{where}: an arm should be [name, pulls, observations, mean, score]")
    d = dict(zip(("name", "pulls", "observations", "mean", "score"), a))
    score = _get(d, "score", float, where, optional=True)
    return ArmState(_name(d["name"], where), _get(d, "pulls", int, where), _get(d, "observations", int, where),
                    _get(d, "mean", float, where), math.inf if score is None else score)


def event_from_dict(d, where: str) -> RoundEvent:
    if not isinstance(d, dict):
        raise BadRunFile(f"{where}: a round should be an object")
    spans, arms = _get(d, "spans", list, where), _get(d, "arms", list, where)
    if len(spans) > 64 or len(arms) > 16:
        raise BadRunFile(f"{where}: too many spans or arms")
    mode = d.get("mode")
    finished = d.get("finished")
    if mode not in ("speculative", "plain") or finished not in (None, "eos", "length"):
        raise BadRunFile(f"{where}: unknown mode or finish")
    return RoundEvent(
        index=_get(d, "index", int, where), mode=mode, drafter=_name(d.get("drafter"), where),
        gamma=_get(d, "gamma", int, where), accepted=_ids(d, "accepted", where), rejected=_ids(d, "rejected", where),
        resampled=_get(d, "resampled", int, where, optional=True), bonus=_get(d, "bonus", int, where, optional=True),
        spans=tuple(_span(s, where) for s in spans), text=_get(d, "text", str, where)[:MAX_TEXT * 64],
        draft_s=_get(d, "draft_s", float, where), verify_s=_get(d, "verify_s", float, where),
        round_s=_get(d, "round_s", float, where), elapsed_s=_get(d, "elapsed_s", float, where),
        new_tokens=_get(d, "new_tokens", int, where), arms=tuple(_arm(a, where) for a in arms), finished=finished,
        prefill_s=_get(d, "prefill_s", float, where, optional=True) or 0.0)  # absent in files of earlier versions


def _record(d: dict, where: str) -> dict:
    """The runs-table row of a loaded run: known columns with plain values only."""
    row = {}
    for k in COLUMNS:
        v = d.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        row[k] = v if isinstance(v, (int, float, type(None))) and not isinstance(v, bool) else str(v)[:200]
    if not row["run"]:
        raise BadRunFile(f"{where}: the run has no name")
    return row


def load_document(text: str, source: str = "file") -> list[Run]:
    """The replayable runs of an exported JSON file. Raises BadRunFile with a short reason."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise BadRunFile("this is not a JSON file") from None
    if isinstance(doc, list):
        raise BadRunFile("this file has rows but no round events (exported before replay existed)")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise BadRunFile(f"this is not a FlashSpec run file (expected format {FORMAT!r}, version {VERSION})")
    runs = doc.get("runs")
    if not isinstance(runs, list) or not 0 < len(runs) <= MAX_RUNS:
        raise BadRunFile(f"the file should hold 1 to {MAX_RUNS} runs")
    out, rounds = [], 0
    for i, r in enumerate(runs):
        where = f"run {i + 1}"
        if not isinstance(r, dict):
            raise BadRunFile(f"{where}: should be an object")
        events = _get(r, "events", list, where)
        rounds += len(events)
        if not events or rounds > MAX_ROUNDS:
            raise BadRunFile(f"{where}: every run should have rounds, at most {MAX_ROUNDS} in the file")
        record = _record(r, where)
        record["run"] = f"{source}: {record['run']}"[:120]
        prompt = r.get("prompt") if isinstance(r.get("prompt"), str) else ""
        out.append(Run(record, prompt[:100_000], tuple(event_from_dict(e, f"{where}, round {j}")
                                                       for j, e in enumerate(events))))
    return out


# ----------------------------------------------------------------------------------------------------
# The pace


def due(events: list[RoundEvent], start: int, speed: float, seconds: float) -> int:
    """How many rounds are on screen `seconds` after playing from round `start` at `speed` times real time
    (round i appears when the original stream had reached elapsed_s[i], prefill included)."""
    t0 = events[start - 1].elapsed_s if start else 0.0
    n = start
    while n < len(events) and (events[n].elapsed_s - t0) / speed <= seconds:
        n += 1
    return n


def wait_for(events: list[RoundEvent], start: int, shown: int, speed: float, seconds: float) -> float:
    """Seconds until round `shown` (the next one) is due; 0 when it already is, or when none is left."""
    if shown >= len(events):
        return 0.0
    t0 = events[start - 1].elapsed_s if start else 0.0
    return max(0.0, (events[shown].elapsed_s - t0) / speed - seconds)


def position(events: list[RoundEvent], shown: int) -> str:
    if not events:
        return "Pick a run, then **Play** or **Next round**."
    tokens = events[shown - 1].new_tokens if shown else 0
    end = " (end)" if shown == len(events) else ""
    return f"Round {shown} of {len(events)} · {tokens} tokens{end}"


# ----------------------------------------------------------------------------------------------------
# The panel


def build_replay() -> dict[str, gr.components.Component]:
    c = {}
    with gr.Row(equal_height=True):
        c["replay_pick"] = gr.Dropdown([], value=None, label="Run to replay", elem_id="replay-pick", scale=3)
        c["replay_upload"] = gr.UploadButton("Load a run file (JSON)", file_types=[".json"], file_count="single",
                                             elem_id="replay-upload", scale=1)
    with gr.Row(equal_height=True):
        c["replay_speed"] = gr.Slider(SPEEDS[0], SPEEDS[1], value=0.25, step=0.05, label="Speed (× real time)",
                                      elem_id="replay-speed", scale=3)
        c["replay_play"] = gr.Button("Play", variant="primary", elem_id="replay-play", scale=1, min_width=70)
        c["replay_pause"] = gr.Button("Pause", elem_id="replay-pause", scale=1, min_width=70)
        c["replay_step"] = gr.Button("Next round", elem_id="replay-step", scale=1, min_width=70)
        c["replay_restart"] = gr.Button("Restart", elem_id="replay-restart", scale=1, min_width=70)
    c["replay_position"] = gr.Markdown(position([], 0), elem_id="replay-position")
    c["replay_tokens"] = gr.HTML(EMPTY, label="Replayed text", elem_id="replay-tokens")
    c["replay_stats"] = gr.Markdown("&nbsp;", elem_id="replay-stats")
    c["replay_arms"] = gr.Plot(arms_figure([]), label="Bandit (replay)", elem_id="replay-arms")
    return c
