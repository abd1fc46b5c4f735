"""The handlers stepped directly, as gradio would, with the real embedded engine on short prompts."""
import html
import re
import threading

import pytest

import app
from components import handlers
from components.handlers import (Session, error_message, pick_example, pick_pair, run_race, run_stream, show_rejected)
from flashspec_core import ModelUnavailableError

SETTINGS = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False,
                gamma=4, temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0, bandit="ucb1", backend="auto")
PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat."


def text_of(tokens_html: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", tokens_html))


def drain(gen):
    updates = list(gen)
    merged = {}
    for u in updates:
        merged.update(u)
    return updates, merged


def test_run_streams_tokens_then_records_the_run(embedded_slot):
    state = Session()
    updates, last = drain(run_stream(state, PROMPT, **SETTINGS))
    assert all(set(u) <= set(app.STREAM_OUTPUTS) for u in updates)
    assert last["status"].startswith("Done (run 1)")
    assert "tok-" in last["tokens"] and "tok/s" in last["stream_stats"]
    assert last["arms_plot"].data  # the final figure always comes
    assert len(state.runs) == 1 and 1 <= state.runs[0]["new_tokens"] <= 16
    assert state.runs[0]["drafters"] == "prompt_lookup+ngram_cache"
    assert len(last["runs_table"]) == 1
    assert last["download_csv"]["value"].endswith(".csv") and last["download_json"]["interactive"]
    assert not embedded_slot.lock.locked()
    assert show_rejected(state, True)["tokens"].count("tok-rejected") >= show_rejected(state, False)["tokens"].count(
        "tok-rejected") == 0
    assert show_rejected(Session(), True) == {}


def test_errors_reach_the_status_line_and_the_next_run_works(embedded_slot, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    state = Session()
    cases = [("   ", {}, "Cannot run:** the prompt is empty"),
             (PROMPT, {"top_p": 0.0}, "top_p must be in (0, 1]"),
             (PROMPT, {"gamma": 40}, "gamma must be an integer in 1..16"),
             (PROMPT, {"pair": "custom", "target": "nobody/no-such-model"}, "Model unavailable"),
             ("word " * 9000, {}, "exceeds the model's context window"),
             (PROMPT, {"roles": []}, "choose at least one drafter")]
    for prompt, change, message in cases:
        updates, last = drain(run_stream(state, prompt, **{**SETTINGS, **change}))
        assert message in last["status"], (change, last["status"])
    assert state.runs == [] and not embedded_slot.lock.locked()
    _, last = drain(run_stream(state, PROMPT, **SETTINGS))
    assert last["status"].startswith("Done") and len(state.runs) == 1


def test_unexpected_errors_are_reported_too(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(handlers, "open_stream", broken)
    _, last = drain(run_stream(Session(), PROMPT, **SETTINGS))
    assert "Error (RuntimeError):** out of memory" in last["status"]
    assert "ModelUnavailable" not in error_message(ModelUnavailableError("x"))


def test_race_runs_plain_then_speculative(embedded_slot):
    state = Session()
    updates, last = drain(run_race(state, PROMPT, **SETTINGS))
    assert all(set(u) <= set(app.RACE_OUTPUTS) for u in updates)
    first_spec = next(i for i, u in enumerate(updates) if "tok-" in u.get("spec_tokens", ""))
    assert all("spec_tokens" not in u or "tok-" not in u["spec_tokens"] for u in updates[:first_spec])
    assert max(i for i, u in enumerate(updates) if "plain_tokens" in u) < first_spec  # one after the other
    assert "tok-plain" in last["plain_tokens"] and "Speedup ×" in last["race_summary"]
    assert [r["mode"] for r in state.runs] == ["plain", "speculative"]
    assert state.runs[1]["speedup"] == pytest.approx(state.runs[1]["tok_per_s"] / state.runs[0]["tok_per_s"])
    assert [t.name for t in last["race_plot"].data] == ["plain", "speculative"]


def test_a_run_waits_for_the_engine_lock(embedded_slot):
    embedded_slot.lock.acquire()
    gen = run_stream(Session(), PROMPT, **SETTINGS)
    statuses = [next(gen)["status"], next(gen)["status"], next(gen)["status"]]
    assert statuses[-1].startswith("Waiting for the model")
    timer = threading.Timer(0.2, embedded_slot.lock.release)
    timer.start()
    _, last = drain(gen)
    assert last["status"].startswith("Done")


def test_closing_a_run_midway_releases_the_lock(embedded_slot):
    gen = run_stream(Session(), PROMPT, **{**SETTINGS, "max_new_tokens": 64})
    while "Generating" not in next(gen).get("status", ""):
        pass
    assert embedded_slot.lock.locked()
    gen.close()  # what gradio does on Stop or a closed tab
    assert not embedded_slot.lock.locked()
    _, last = drain(run_stream(Session(), PROMPT, **SETTINGS))
    assert last["status"].startswith("Done")


def test_stop_ends_a_run_and_a_race_cleanly(embedded_slot):
    state = Session()
    long_prompt = handlers.EXAMPLES[-1]["prompt"]  # the multiplication table: well over 200 tokens
    gen = run_stream(state, long_prompt, **{**SETTINGS, "max_new_tokens": 200})
    while "Generating … round" not in next(gen).get("status", ""):
        pass
    assert handlers.stop(state) == {"status": "Stopping …"}
    _, last = drain(gen)
    assert last["status"].startswith("Stopped after") and state.runs == []
    assert not embedded_slot.lock.locked()
    race = run_race(state, long_prompt, **{**SETTINGS, "max_new_tokens": 200})
    while "Racing" not in next(race).get("status", ""):
        pass
    handlers.stop(state)
    _, last = drain(race)
    assert last["status"].startswith("Race stopped") and state.runs == []
    _, last = drain(run_stream(state, PROMPT, **SETTINGS))  # a new run clears the request
    assert last["status"].startswith("Done") and not embedded_slot.lock.locked()


def test_concurrent_sessions_do_not_corrupt_each_other(embedded_slot):
    prompts = [PROMPT, "Count: one two three one two three one two three"]
    alone = [text_of(drain(run_stream(Session(), p, **SETTINGS))[1]["tokens"]) for p in prompts]
    results = [None, None]
    sessions = [Session(), Session()]

    def go(i):
        results[i] = text_of(drain(run_stream(sessions[i], prompts[i], **SETTINGS))[1]["tokens"])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == alone and all(alone)  # greedy: the same text; the bandit's picks may differ (timing)
    assert [len(s.runs) for s in sessions] == [1, 1]


def test_pickers():
    example = handlers.EXAMPLES[-1]
    assert pick_example(example["name"]) == {"prompt": example["prompt"], "max_new_tokens": example["max_new_tokens"]}
    assert pick_example("missing") == {}
    custom = pick_pair("custom")
    assert custom["custom_row"]["visible"] and len(custom["roles"]["choices"]) == 3
    embedded = pick_pair("embedded")
    assert not embedded["custom_row"]["visible"] and embedded["roles"]["value"] == ["draft_head", "prompt_lookup", "ngram_cache"]


def test_example_names_in_the_runs_table():
    ex = handlers.EXAMPLES[0]
    assert handlers.example_name(ex["prompt"], ex["name"]) == ex["name"]
    assert handlers.example_name("my own   prompt", ex["name"]) == "my own prompt"
