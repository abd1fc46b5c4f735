import json

import pandas as pd

from fake_events import make_event

from components.runs import COLUMNS, FORMAT, Run, export_runs, run_record, runs_frame

SETTINGS = {"pair": "embedded", "drafters": "prompt_lookup+ngram_cache", "gamma": "4", "temperature": 0.0,
            "top_p": 1.0, "max_new_tokens": 16, "seed": 0, "bandit": "ucb1", "backend": "auto"}
STATS = {"new_tokens": 16, "tok_per_s": 12.34567, "decode_tok_per_s": 20.0, "acceptance": 0.5, "tokens_per_forward": 2.0,
         "target_forwards": 8, "elapsed_s": 1.3, "prefill_s": 0.1, "pulls": {"prompt_lookup": 5, "no_draft": 3},
         "finished": "length", "rounds": 8}


def test_record_is_flat_and_complete():
    row = run_record("run 1", "speculative", SETTINGS, STATS, "Open chat", 2.5)
    assert list(row) == list(COLUMNS)
    assert row["pulls"] == "prompt_lookup:5 no_draft:3"
    assert row["speedup"] == 2.5 and row["tok_per_s"] == 12.34567 and row["bandit"] == "ucb1"


def test_frame_rounds_for_display():
    frame = runs_frame([run_record("run 1", "speculative", SETTINGS, STATS)])
    assert list(frame.columns) == list(COLUMNS)
    assert frame.loc[0, "tok_per_s"] == 12.35
    assert runs_frame([]).empty


def test_exports_round_trip(tmp_path, events):
    records = [run_record("race 1", "plain", SETTINGS, STATS, leg="A"),
               run_record("race 1", "speculative", SETTINGS, STATS, "", 2.0, leg="B")]
    runs = [Run(records[0], "hi", tuple(events)), Run(records[1], "hi", ())]
    csv, js = export_runs(runs, tmp_path / "out", tag="_1")
    assert csv.name == "flashspec_runs_1.csv"
    back = pd.read_csv(csv)
    assert list(back["mode"]) == ["plain", "speculative"] and back.loc[1, "speedup"] == 2.0
    assert list(back["leg"]) == ["A", "B"]
    doc = json.loads(js.read_text())  # standard JSON: no NaN or Infinity (an untried arm's +inf is null)
    assert doc["format"] == FORMAT and [r["run"] for r in doc["runs"]] == ["race 1", "race 1"]
    assert {k: doc["runs"][0][k] for k in COLUMNS} == records[0] and doc["runs"][0]["prompt"] == "hi"
    first = doc["runs"][0]["events"][0]
    assert first["spans"][0] == ["accepted", 10, "def", 0.9, 1.0] and first["arms"][2] == ["no_draft", 0, 1, 0.5, None]
    assert len(doc["runs"][0]["events"]) == 3 and doc["runs"][1]["events"] == []
    assert Run(records[1]).name == "race 1 · B" and make_event(0).text
