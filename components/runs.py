"""The session's runs: one `Run` per finished run or race leg (its runs-table row, its prompt and its round
events), shown as a pandas frame and exported to CSV (the rows) and JSON (rows, prompts and events: what
replay needs, loaded back by components.replay).

The JSON export: {"format": "flashspec-runs", "version": 1, "runs": [{<runs-table row>, "prompt": str,
"events": [<round>, ...]}]}, where a round is RoundEvent's fields with spans as [kind, id, text, p, q] and arms
as [name, pulls, observations, mean, score] (score null = untried, +inf in the engine), and "tree": null, or for a
tree round its draft tree as {"tokens": [id, ...], "parents": [node or -1, ...], "accepted": [node, ...],
"texts": [str, ...]} (RoundEvent.drafted_tree; its node count is tree_nodes).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from components.compact import NamedByRecord
from flashspec_core import RoundEvent

COLUMNS = ("run", "leg", "when", "mode", "example", "pair", "models", "drafters", "bandit", "gamma", "draft_shape",
           "temperature", "top_p", "max_new_tokens", "seed", "backend", "new_tokens", "tok_per_s", "decode_tok_per_s",
           "acceptance", "tokens_per_forward", "target_forwards", "elapsed_s", "prefill_s", "speedup", "pulls",
           "finished")
ROUNDED = {"tok_per_s": 2, "decode_tok_per_s": 2, "acceptance": 3, "tokens_per_forward": 3, "elapsed_s": 3,
           "prefill_s": 3, "speedup": 3}
FORMAT, VERSION = "flashspec-runs", 1  # the JSON export's header
DOWNLOADS = ("Download CSV", "Download JSON (replayable)")  # the download buttons' labels
FIELDS = ("index", "mode", "drafter", "gamma", "accepted", "rejected", "resampled", "bonus", "spans", "text",
          "draft_s", "verify_s", "round_s", "elapsed_s", "new_tokens", "arms", "finished", "prefill_s")  # a round's, in JSON


@dataclass(frozen=True)
class Run(NamedByRecord):
    """A finished run (or race leg): its runs-table row, and what replay needs."""
    record: dict  # run_record(): flat, the runs table's columns
    prompt: str = ""
    events: tuple[RoundEvent, ...] = ()  # dropped (empty) for old runs, to bound a session's memory


def run_record(run: str, mode: str, settings: dict, stats: dict, example: str = "", speedup: float | None = None,
               leg: str = "") -> dict:
    """A flat row: the run id, its settings (RunSettings.record()) and its stats (the engine's summarize())."""
    row = {"run": run, "leg": leg, "when": time.strftime("%H:%M:%S"), "mode": mode, "example": example, **settings,
           **{k: stats.get(k) for k in COLUMNS if k in stats}, "speedup": speedup}
    row["pulls"] = " ".join(f"{k}:{v}" for k, v in (stats.get("pulls") or {}).items())
    return {k: row.get(k) for k in COLUMNS}


def runs_frame(records: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(records, columns=list(COLUMNS))
    for col, digits in ROUNDED.items():
        frame[col] = pd.to_numeric(frame[col], errors="coerce").round(digits)
    return frame


def finite(x):
    """A number for JSON: NaN and infinities become null (JSON has neither), so one odd value cannot break an export."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def event_to_dict(e: RoundEvent) -> dict:
    d = {f: finite(getattr(e, f)) for f in FIELDS}
    d["accepted"], d["rejected"] = list(e.accepted), list(e.rejected)
    d["spans"] = [[s.kind, s.id, s.text, finite(s.p), finite(s.q)] for s in e.spans]
    d["arms"] = [[a.name, a.pulls, a.observations, finite(a.mean), finite(a.score)] for a in e.arms]
    tree = e.drafted_tree
    d["tree"] = None if tree is None else {"tokens": list(tree.tokens), "parents": list(tree.parents),
                                           "accepted": list(tree.accepted), "texts": list(tree.texts)}
    return d


def export_document(runs: list[Run]) -> dict:
    return {"format": FORMAT, "version": VERSION,
            "runs": [{**{k: finite(v) for k, v in r.record.items()}, "prompt": r.prompt,
                      "events": [event_to_dict(e) for e in r.events]} for r in runs]}


def export_runs(runs: list[Run], folder: Path, tag: str = "") -> tuple[Path, Path]:
    """Write flashspec_runs{tag}.csv (the rows) and .json (rows, prompts, round events) into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    csv, js = folder / f"flashspec_runs{tag}.csv", folder / f"flashspec_runs{tag}.json"
    pd.DataFrame([r.record for r in runs], columns=list(COLUMNS)).to_csv(csv, index=False)
    js.write_text(json.dumps(export_document(runs), allow_nan=False))
    return csv, js


def build_runs() -> dict[str, gr.components.Component]:
    c = {}
    c["runs_table"] = gr.Dataframe(runs_frame([]), label="Runs in this session", elem_id="runs-table",
                                   interactive=False, max_height=360)
    with gr.Row():
        c["download_csv"] = gr.DownloadButton(DOWNLOADS[0], value=None, interactive=False, elem_id="download-csv")
        c["download_json"] = gr.DownloadButton(DOWNLOADS[1], value=None, interactive=False, elem_id="download-json")
        c["clear_runs"] = gr.Button("Clear runs", elem_id="clear-runs", variant="secondary")
    return c
