import json

import pandas as pd

from components.runs import COLUMNS, export_runs, run_record, runs_frame

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


def test_exports_round_trip(tmp_path):
    records = [run_record("race 1", "plain", SETTINGS, STATS), run_record("race 1", "speculative", SETTINGS, STATS, "", 2.0)]
    csv, js = export_runs(records, tmp_path / "out")
    back = pd.read_csv(csv)
    assert list(back["mode"]) == ["plain", "speculative"] and back.loc[1, "speedup"] == 2.0
    assert json.loads(js.read_text()) == records
