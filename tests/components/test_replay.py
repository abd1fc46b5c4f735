"""Replay: the JSON export loads back exactly, hostile files are refused with a short reason, and the pace
follows the run's own timing."""
import json

import pytest
from fake_events import make_event

from components.replay import BadRunFile, due, load_document, position, wait_for
from components.runs import Run, export_document, run_record

SETTINGS = {"pair": "embedded", "models": "embedded", "drafters": "prompt_lookup", "gamma": "4", "temperature": 0.0,
            "top_p": 1.0, "max_new_tokens": 16, "seed": 0, "bandit": "ucb1", "backend": "auto"}
STATS = {"new_tokens": 6, "tok_per_s": 12.0, "acceptance": 0.5, "tokens_per_forward": 2.0, "pulls": {"a": 1}}


def exported(events) -> str:
    return json.dumps(export_document([Run(run_record("run 1", "speculative", SETTINGS, STATS), "hi", tuple(events))]))


def test_an_export_loads_back_with_the_same_events(events):
    runs = load_document(exported(events), "my_file")
    assert len(runs) == 1 and runs[0].events == tuple(events)  # every field, +inf scores included
    assert runs[0].record["run"] == "my_file: run 1" and runs[0].prompt == "hi"
    assert runs[0].name == "my_file: run 1"


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: "not json", "not a JSON file"),
    (lambda d: [{"run": "run 1"}], r"no round events \(exported before replay existed\)"),
    (lambda d: {**d, "format": "other"}, "not a FlashSpec run file"),
    (lambda d: {**d, "runs": []}, "1 to 64 runs"),
    (lambda d: {**d, "runs": [{**d["runs"][0], "events": []}]}, "every run should have rounds, at most 30000"),
    (lambda d: {**d, "runs": [{**d["runs"][0], "events": d["runs"][0]["events"] * 234}] * 50},
     "run 43: every run should have rounds, at most 30000"),
    (lambda d: set_event(d, "drafter", "<img src=x onerror=alert(1)>"), "a drafter name should be"),
    (lambda d: set_event(d, "spans", [["evil", 1, "x", 0.5, None]]), "a span should be"),
    (lambda d: set_event(d, "spans", [["accepted", 1, "x" * 5000, 0.5, None]]), "a short string"),
    (lambda d: set_event(d, "spans", [["accepted", -1, "x", 0.5, None]]), "a short list of token ids"),
    (lambda d: set_event(d, "elapsed_s", "soon"), "'elapsed_s' should be float"),
    (lambda d: set_event(d, "elapsed_s", 1e400), "'elapsed_s' should be float"),
    (lambda d: set_event(d, "index", True), "'index' should be int"),
    (lambda d: set_event(d, "accepted", list(range(100))), "a short list of token ids"),
    (lambda d: set_event(d, "arms", [["a", 1, 1, 0.5]]), "an arm should be"),
    (lambda d: set_event(d, "mode", "fast"), "unknown mode"),
])
def test_hostile_files_are_refused_with_a_short_reason(events, mutate, reason):
    doc = json.loads(exported(events))
    text = mutate(doc)
    with pytest.raises(BadRunFile, match=reason) as info:
        load_document(text if isinstance(text, str) else json.dumps(text))
    assert len(str(info.value)) < 200


def set_event(doc, key, value):
    doc["runs"][0]["events"][0][key] = value
    return doc


def test_deep_nesting_is_a_clear_refusal():
    with pytest.raises(BadRunFile, match="not a JSON file"):
        load_document("[" * 100_000 + "]" * 100_000)


def test_the_pace_follows_elapsed_time():
    events = [make_event(i, elapsed=1.0 + i) for i in range(4)]  # rounds end at 1, 2, 3, 4 s
    assert [due(events, 0, 1.0, t) for t in (0.5, 1.0, 2.5, 9)] == [0, 1, 2, 4]
    assert [due(events, 0, 0.5, t) for t in (1.9, 2.0, 4.0)] == [0, 1, 2]  # half speed: twice the time
    assert due(events, 2, 1.0, 0.99) == 2 and due(events, 2, 1.0, 1.0) == 3  # from round 2: relative times
    assert wait_for(events, 0, 0, 0.25, 1.0) == pytest.approx(3.0)
    assert wait_for(events, 0, 4, 0.25, 1.0) == 0.0
    assert position(events, 4) == "Round 4 of 4 · 8 tokens (end)"
    assert "Pick a run" in position([], 0)
