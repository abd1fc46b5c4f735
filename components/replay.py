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
from typing import Iterator

import gradio as gr

from flashspec_core import MODES, ArmState, RoundEvent, TokenSpan
from flashspec_core.checks import check_text, shown
from flashspec_core.gamma import MAX_GAMMA
from flashspec_core.stream import DraftedTree

from components.arms import arms_figure
from components.compact import CompactRun
from components.runs import COLUMNS, FORMAT, VERSION
from components.tokens import EMPTY, KINDS

MAX_RUNS, MAX_ROUNDS, MAX_SPANS = 64, 30_000, 400_000  # what a loaded file may hold (all runs together)
MAX_TEXT, MAX_FIELD = 200, 2_000  # characters of a token's text, of a runs-table value
MAX_SECONDS = 86_400.0  # a round's times and a run's length, at most a day
MIN_SECONDS = 1e-6  # a round's wall time and a run's elapsed time, at least a microsecond
MAX_ROUND_WAIT_S = 2.0  # a replay waits at most this long for any one round, whatever the file says
NAME = re.compile(r"[\w.:+\-/]{1,100}")  # drafter and arm names: no markup
SPEEDS = (0.1, 1.0)  # the pace slider's range, times real time


class BadRunFile(ValueError):
    """A run file that is not a FlashSpec export, or holds values an export never has."""


# ----------------------------------------------------------------------------------------------------
# From JSON (every value checked: the file comes from whoever uploads it)


def _get(d: dict, key: str, kind, where: str, optional: bool = False, lo=None, hi=None):
    """d[key] as an int or float in lo..hi (finite), or a str that is valid Unicode; None when optional and absent."""
    value = d.get(key)
    if value is None and optional:
        return None
    if kind is str:
        return _text(value, f"{where}: {key!r}", MAX_FIELD * 50)
    ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    ok = ok and (kind is not float or math.isfinite(value)) and (lo is None or lo <= value <= hi)
    if not ok:
        span = "" if lo is None else f" in {lo:g}..{hi:g}"
        raise BadRunFile(f"{where}: {key!r} should be {'a number' if kind is float else 'an integer'}{span}, "
                         f"got {shown(value, 24)}")
    return float(value) if kind is float else value


def _text(value, what: str, limit: int) -> str:
    """A str of at most `limit` characters that is valid Unicode (no lone surrogate)."""
    if not isinstance(value, str) or len(value) > limit:
        raise BadRunFile(f"{what} should be text of at most {limit:,} characters")
    try:
        check_text(value, what)
    except ValueError as e:
        raise BadRunFile(str(e).split(";")[0]) from None
    return value


def _ids(d: dict, key: str, where: str) -> tuple[int, ...]:
    ids = d.get(key)
    if not isinstance(ids, list) or len(ids) > 64 or not all(_is_id(t) for t in ids):
        raise BadRunFile(f"{where}: {key!r} should be a short list of token ids")
    return tuple(ids)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 24


def _name(value, where: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise BadRunFile(f"{where}: a drafter name should be letters, digits and . : + - / _")
    return value


def _span(s, where: str) -> TokenSpan:
    if not isinstance(s, list) or len(s) != 5 or s[0] not in KINDS or not _is_id(s[1]):
        raise BadRunFile(f"{where}: a span should be [kind, id, text, p, q]")
    d = dict(zip(("kind", "id", "text", "p", "q"), s))
    return TokenSpan(d["kind"], d["id"], _text(d["text"], f"{where}: a span's text", MAX_TEXT),
                     _get(d, "p", float, where, lo=0.0, hi=1.0), _get(d, "q", float, where, True, 0.0, 1.0))


def _arm(a, where: str) -> ArmState:
    if not isinstance(a, list) or len(a) != 5:
        raise BadRunFile(f"{where}: an arm should be [name, pulls, observations, mean, score]")
    d = dict(zip(("name", "pulls", "observations", "mean", "score"), a))
    score = _get(d, "score", float, where, True, -100.0, 100.0)
    return ArmState(_name(d["name"], where), _get(d, "pulls", int, where, lo=0, hi=MAX_ROUNDS),
                    _get(d, "observations", int, where, lo=0, hi=16 * MAX_ROUNDS),
                    _get(d, "mean", float, where, lo=0.0, hi=1.0), math.inf if score is None else score)


def _tree(t, accepted: tuple[int, ...], where: str) -> DraftedTree | None:
    """A tree round's draft tree: at most MAX_GAMMA nodes, each parent an earlier node (or -1, the root), texts as
    span texts, and the accepted nodes a path from the root whose tokens are the round's accepted ids."""
    if t is None:
        return None
    keys = ("tokens", "parents", "accepted", "texts")
    if not isinstance(t, dict) or set(t) != set(keys) or not all(isinstance(t[k], list) for k in keys):
        raise BadRunFile(f"{where}: 'tree' should be null or an object of lists {list(keys)}")
    tokens, parents, path, texts = (t[k] for k in keys)
    n = len(tokens)
    ok = 0 < n <= MAX_GAMMA and len(parents) == len(texts) == n and all(_is_id(x) for x in tokens)
    ok = ok and all(_is_int(p) and -1 <= p < i for i, p in enumerate(parents))
    ok = ok and all(_is_int(a) and 0 <= a < n for a in path) and len(path) <= n
    ok = ok and [parents[a] for a in path] == [-1, *path][:len(path)] and tuple(tokens[a] for a in path) == accepted
    if not ok:
        raise BadRunFile(f"{where}: the 'tree' is not a draft tree whose accepted path gives the accepted ids")
    texts = tuple(_text(x, f"{where}: a tree node's text", MAX_TEXT) for x in texts)
    return DraftedTree(tuple(tokens), tuple(parents), tuple(path), texts)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _agree(spans: tuple[TokenSpan, ...], accepted, rejected, resampled, bonus) -> bool:
    """Spans as the engine makes them: the accepted drafts, the rejected ones, then the resampled or bonus token."""
    last = [t for t in (resampled, bonus) if t is not None]
    kinds = ["accepted"] * len(accepted) + ["rejected"] * len(rejected) + \
        ["resampled" if resampled is not None else "bonus"] * len(last)
    shown_kinds = [s.kind if s.kind != "plain" else "bonus" for s in spans]
    # (at an end of text inside the accepted drafts, the engine labels the drafts after it "accepted" too)
    return len(last) <= 1 and [s.id for s in spans] == [*accepted, *rejected, *last] and \
        all(k == seen or (k == "rejected" and seen == "accepted") for k, seen in zip(kinds, shown_kinds))


def event_from_dict(d, where: str, index: int = 0) -> RoundEvent:
    """One round, every value checked on its own and against the others (the spans against the ids, the ids
    against gamma)."""
    if not isinstance(d, dict):
        raise BadRunFile(f"{where}: a round should be an object")
    spans, arms = d.get("spans"), d.get("arms")
    if not isinstance(spans, list) or not isinstance(arms, list) or len(spans) > 2 * MAX_GAMMA + 1 or len(arms) > 16:
        raise BadRunFile(f"{where}: 'spans' and 'arms' should be short lists")
    mode, finished = d.get("mode"), d.get("finished")
    if mode not in MODES or finished not in (None, "eos", "length"):
        raise BadRunFile(f"{where}: unknown mode or finish")
    if _get(d, "index", int, where, lo=0, hi=MAX_ROUNDS) != index:
        raise BadRunFile(f"{where}: 'index' should be {index} (rounds are numbered from 0, in order)")
    gamma = _get(d, "gamma", int, where, lo=0, hi=MAX_GAMMA)
    accepted, rejected = _ids(d, "accepted", where), _ids(d, "rejected", where)
    resampled, bonus = _get(d, "resampled", int, where, True, 0, 1 << 24), _get(d, "bonus", int, where, True, 0, 1 << 24)
    spans = tuple(_span(s, where) for s in spans)
    if not _agree(spans, accepted, rejected, resampled, bonus) or len(accepted) + len(rejected) > gamma:
        raise BadRunFile(f"{where}: the spans, accepted and rejected ids and gamma do not agree")
    seconds = {k: _get(d, k, float, where, lo=0.0, hi=MAX_SECONDS) for k in ("draft_s", "verify_s", "round_s",
                                                                              "elapsed_s")}
    if seconds["round_s"] < MIN_SECONDS or seconds["elapsed_s"] < MIN_SECONDS:
        raise BadRunFile(f"{where}: 'round_s' and 'elapsed_s' should be at least {MIN_SECONDS:g} s")
    _get(d, "text", str, where)  # checked, then rebuilt from the spans
    tree = _tree(d.get("tree"), accepted, where)
    return RoundEvent(
        index=index, mode=mode, drafter=_name(d.get("drafter"), where), gamma=gamma, accepted=accepted,
        rejected=rejected, resampled=resampled, bonus=bonus, spans=spans,
        text="".join(s.text for s in spans if s.kind != "rejected"), **seconds,
        new_tokens=_get(d, "new_tokens", int, where, lo=0, hi=MAX_SPANS), arms=tuple(_arm(a, where) for a in arms),
        finished=finished, prefill_s=_get(d, "prefill_s", float, where, True, 0.0, MAX_SECONDS) or 0.0,
        tree_nodes=len(tree.tokens) if tree else 0, drafted_tree=tree)


def _record(d: dict, where: str) -> dict:
    """The runs-table row of a loaded run: known columns with finite numbers and short valid text only."""
    row = {}
    for k in COLUMNS:
        v = d.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        if not isinstance(v, (int, float, type(None))) or isinstance(v, bool) or (isinstance(v, int) and abs(v) > 2**64):
            v = _text(str(v)[:MAX_FIELD], f"{where}: {k!r}", MAX_FIELD)
        row[k] = v
    if not row["run"]:
        raise BadRunFile(f"{where}: the run has no name")
    return row


def run_from_dict(r, where: str, source: str) -> CompactRun:
    """One run of a file, its rounds checked one by one and kept compactly (never all as objects at once)."""
    if not isinstance(r, dict) or not isinstance(r.get("events"), list) or not r["events"]:
        raise BadRunFile(f"{where}: should be an object with a list of rounds")
    record = _record(r, where)
    record["run"] = f"{source}: {record['run']}"[:120]
    prompt = r.get("prompt") if isinstance(r.get("prompt"), str) else ""
    run = CompactRun(record, _text(prompt, f"{where}: the prompt", 100_000))
    tokens, elapsed, arms = 0, 0.0, None
    for j, d in enumerate(r["events"]):
        e = event_from_dict(d, f"{where}, round {j}", j)
        tokens += len(e.emitted)
        names = [a.name for a in e.arms]
        arms = names if arms is None else arms
        if e.new_tokens != tokens or e.elapsed_s < elapsed or names != arms or (e.finished and j + 1 < len(r["events"])):
            raise BadRunFile(f"{where}, round {j}: the token count, the time, the arms or the finish do not follow "
                             "from the earlier rounds")
        elapsed = e.elapsed_s
        run.add(e)
    return run


def load_document(text: str, source: str = "file") -> list[CompactRun]:
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
    rounds = sum(len(r["events"]) for r in runs if isinstance(r, dict) and isinstance(r.get("events"), list))
    spans = sum(len(e["spans"]) + _tree_size(e)
                for r in runs if isinstance(r, dict) and isinstance(r.get("events"), list)
                for e in r["events"] if isinstance(e, dict) and isinstance(e.get("spans"), list))
    if rounds > MAX_ROUNDS or spans > MAX_SPANS:
        raise BadRunFile(f"the file holds {rounds:,} rounds and {spans:,} tokens; at most {MAX_ROUNDS:,} and "
                         f"{MAX_SPANS:,} are replayed")
    out = [run_from_dict(r, f"run {i + 1}", source) for i, r in enumerate(runs)]
    if len({r.name for r in out}) != len(out):
        raise BadRunFile("two runs of the file have the same name")
    return out


def _tree_size(e: dict) -> int:
    """A round's tree nodes as the file gives them (counted with the spans against MAX_SPANS; checked later)."""
    tree = e.get("tree")
    return len(tree["tokens"]) if isinstance(tree, dict) and isinstance(tree.get("tokens"), list) else 0


# ----------------------------------------------------------------------------------------------------
# The pace


def play_times(run: CompactRun, start: int, speed: float) -> Iterator[float]:
    """Seconds after Play at which rounds start, start + 1, ... appear at `speed` times the run's real pace; no round
    waits more than MAX_ROUND_WAIT_S after the one before it (whatever a file says)."""
    t, before = 0.0, run.elapsed(start - 1) if start else 0.0
    for i in range(start, len(run)):
        t += min(max(0.0, run.elapsed(i) - before) / speed, MAX_ROUND_WAIT_S)
        before = run.elapsed(i)
        yield t


def position(rounds: int, shown: int, tokens: int = 0) -> str:
    if not rounds:
        return "Pick a run, then **Play** or **Next round**."
    end = " (end)" if shown == rounds else ""
    return f"Round {shown} of {rounds} · {tokens} tokens{end}"


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
    c["replay_position"] = gr.Markdown(position(0, 0), elem_id="replay-position")
    c["replay_tokens"] = gr.HTML(EMPTY, label="Replayed text", elem_id="replay-tokens")
    c["replay_stats"] = gr.Markdown("&nbsp;", elem_id="replay-stats")
    c["replay_arms"] = gr.Plot(arms_figure([]), label="Bandit (replay)", elem_id="replay-arms")
    return c
