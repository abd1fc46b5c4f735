"""A/B recording: one record per finished run of the session, as a pandas frame, exported to CSV and JSON."""
from __future__ import annotations

import json
import time
from pathlib import Path

import gradio as gr
import pandas as pd

COLUMNS = ("run", "when", "mode", "example", "pair", "drafters", "bandit", "gamma", "temperature", "top_p",
           "max_new_tokens", "seed", "backend", "new_tokens", "tok_per_s", "decode_tok_per_s", "acceptance",
           "tokens_per_forward", "target_forwards", "elapsed_s", "prefill_s", "speedup", "pulls", "finished")
ROUNDED = {"tok_per_s": 2, "decode_tok_per_s": 2, "acceptance": 3, "tokens_per_forward": 3, "elapsed_s": 3,
           "prefill_s": 3, "speedup": 3}


def run_record(run: str, mode: str, settings: dict, stats: dict, example: str = "", speedup: float | None = None) -> dict:
    """A flat row: the run id, its settings (RunSettings.record()) and its stats (the engine's summarize())."""
    row = {"run": run, "when": time.strftime("%H:%M:%S"), "mode": mode, "example": example, **settings,
           **{k: stats.get(k) for k in COLUMNS if k in stats}, "speedup": speedup}
    row["pulls"] = " ".join(f"{k}:{v}" for k, v in (stats.get("pulls") or {}).items())
    return {k: row.get(k) for k in COLUMNS}


def runs_frame(records: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(records, columns=list(COLUMNS))
    for col, digits in ROUNDED.items():
        frame[col] = pd.to_numeric(frame[col], errors="coerce").round(digits)
    return frame


def export_runs(records: list[dict], folder: Path) -> tuple[Path, Path]:
    """Write runs.csv and runs.json (full precision) into folder; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(records, columns=list(COLUMNS))
    csv, js = folder / "flashspec_runs.csv", folder / "flashspec_runs.json"
    frame.to_csv(csv, index=False)
    js.write_text(json.dumps(records, indent=1))
    return csv, js


def build_runs() -> dict[str, gr.components.Component]:
    c = {}
    c["runs_table"] = gr.Dataframe(runs_frame([]), label="Runs in this session", elem_id="runs-table",
                                   interactive=False, max_height=360)
    with gr.Row():
        c["download_csv"] = gr.DownloadButton("Download CSV", value=None, interactive=False, elem_id="download-csv")
        c["download_json"] = gr.DownloadButton("Download JSON", value=None, interactive=False, elem_id="download-json")
        c["clear_runs"] = gr.Button("Clear runs", elem_id="clear-runs", variant="secondary")
    return c
