"""The handlers stepped directly, as gradio would, with the real embedded engine on short prompts."""
import html
import re
import threading

import gradio as gr
import pytest

import app
from components import handlers
from components.handlers import (error_message, pick_example, pick_pair, pick_pair_b, run_race, run_stream,
                                 show_rejected)
from components.session import Session
from components.settings import DRAFT_SHAPES, default_shape, parse_settings, resolve_pair
from flashspec_core import ModelUnavailableError

SETTINGS = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False,
                gamma=4, temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0, bandit="ucb1", backend="auto",
                shape="chain")
LEG = {k: v for k, v in SETTINGS.items() if k not in ("temperature", "top_p", "max_new_tokens", "seed")}
RACE = dict(temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0, **{f"a_{k}": v for k, v in LEG.items()},
            **{f"b_{k}": v for k, v in LEG.items()}, a_mode="plain", b_mode="speculative")
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
    assert len(state.runs) == 1 and 1 <= state.runs[0].record["new_tokens"] <= 16
    assert state.runs[0].record["drafters"] == "prompt_lookup+ngram_cache"
    assert state.runs[0].events and state.runs[0].prompt == PROMPT  # what replay needs
    assert len(last["runs_table"]) == 1
    assert last["download_csv"]["value"].endswith(".csv") and last["download_json"]["interactive"]
    assert last["replay_pick"]["value"] == "run 1"
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
             (PROMPT, {"roles": []}, "choose at least one drafter"),
             (PROMPT, {"shape": "tree 99"}, "unknown draft shape 'tree 99'; expected one of ['chain', 'tree 8'"),
             (PROMPT, {"shape": {"depth": 40}}, "unknown draft shape {'depth': 40}"),
             (PROMPT, {"shape": "tree 8"}, "draft shape 'tree 8' needs the draft head among the drafters"),
             (PROMPT, {"temperature": float("nan")}, "temperature must be a number in 0.0..2.0, got nan"),
             (PROMPT, {"temperature": float("inf")}, "temperature must be a number in 0.0..2.0, got inf"),
             (PROMPT, {"seed": 2**70}, "seed must be an integer in 0..18446744073709551615"),
             (PROMPT, {"seed": "abc"}, "seed must be an integer in 0..18446744073709551615, got 'abc'"),
             (PROMPT, {"max_new_tokens": True}, "max new tokens must be an integer"),
             (PROMPT, {"roles": "prompt_lookup"}, "drafters must be a list of names"),
             (PROMPT, {"pair": ["embedded"]}, "unknown model pair ['embedded']"),
             (PROMPT, {"pair": "custom", "target": "/etc"}, "local model folders are off on this server"),
             (PROMPT, {"pair": "custom", "target": "~"}, "model name '~' is not a Hub id"),
             (PROMPT, {"pair": "custom", "target": "x" * 100_000}, "is 100,000 characters long; at most 10,000"),
             (PROMPT, {"pair": "custom", "target": "x" * 5000}, "(5,002 characters) is not a Hub id"),
             ("\ud800 hi", {}, "lone surrogate (U+D800)"),
             ([1, 2, 3], {}, "the prompt must be text, got list"),
             ("x" * 200_000, {}, "the prompt is 200,000 characters long; at most 100,000")]
    for prompt, change, message in cases:
        updates, last = drain(run_stream(state, prompt, **{**SETTINGS, **change}))
        assert message in last["status"], (change, last["status"])
        assert len(last["status"]) < 400 and "/root" not in last["status"], last["status"]
    assert state.runs == [] and not embedded_slot.lock.locked()
    _, last = drain(run_stream(state, PROMPT, **SETTINGS))
    assert last["status"].startswith("Done") and len(state.runs) == 1


def test_unexpected_errors_are_reported_too(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(handlers, "open_stream", broken)
    _, last = drain(run_stream(Session(), PROMPT, **SETTINGS))
    assert "Error (RuntimeError).** The app is still up" in last["status"]
    assert "out of memory" not in last["status"]  # an unexpected error's text may name server paths: logged only
    assert "ModelUnavailable" not in error_message(ModelUnavailableError("x"))


def test_race_runs_a_then_b_plain_against_speculative_by_default(embedded_slot):
    state = Session()
    updates, last = drain(run_race(state, PROMPT, **RACE))
    assert all(set(u) <= set(app.RACE_OUTPUTS) for u in updates)
    first_b = next(i for i, u in enumerate(updates) if "tok-" in u.get("b_tokens", ""))
    assert all("b_tokens" not in u or "tok-" not in u["b_tokens"] for u in updates[:first_b])
    assert max(i for i, u in enumerate(updates) if "a_tokens" in u) < first_b  # one after the other
    assert "tok-plain" in last["a_tokens"] and "B / A: ×" in last["race_summary"]
    assert "Same tokens" in last["race_summary"]  # greedy
    assert last["a_title"].startswith("#### A · plain decoding · embedded")
    assert "speculative · embedded (SmolLM2-135M-Instruct + draft head) · prompt lookup + n-gram cache · γ 4 · ucb1" in last["b_title"]
    rows = [r.record for r in state.runs]
    assert [(r["mode"], r["leg"], r["run"]) for r in rows] == [("plain", "A", "race 1"), ("speculative", "B", "race 1")]
    assert rows[1]["speedup"] == pytest.approx(rows[1]["tok_per_s"] / rows[0]["tok_per_s"])
    assert rows[0]["drafters"] == "" and rows[1]["drafters"] == "prompt_lookup+ngram_cache"
    assert [t.name for t in last["race_plot"].data] == ["A · plain", "B · speculative"]
    assert [name for _, name in state.choices()] == ["race 1 · B", "race 1 · A"]


def test_open_stream_passes_the_draft_shape_to_the_engine():
    seen = []

    class Engine:
        drafters = {"draft_head": None, "prompt_lookup": None, "ngram_cache": None, "no_draft": None}

        def reset_session(self):
            pass

        def stream(self, prompt, **kwargs):
            seen.append(kwargs)
            return iter(())

    slot = type("Slot", (), {"engine": Engine()})()
    for shape, mode in (("tree 16", "speculative"), ("chain", "speculative"), ("tree 16", "plain")):
        settings = parse_settings(**{**SETTINGS, "roles": ["draft_head"], "shape": shape}, mode=mode)
        handlers.open_stream(slot, PROMPT, settings)
    assert [kw["tree"] for kw in seen] == [DRAFT_SHAPES["tree 16"], None, None]
    assert seen[0]["drafters"] == ["draft_head"]


def test_a_tree_run_shows_its_trees_and_names_its_shape(embedded_slot):
    state = Session()
    _, last = drain(run_stream(state, PROMPT, **{**SETTINGS, "roles": ["draft_head"], "shape": "tree 8"}))
    assert last["status"].startswith("Done (run 1)"), last["status"]
    trees = [e for e in state.runs[0].events if e.drafted_tree is not None]
    assert trees and all(0 < e.tree_nodes <= 8 for e in trees)
    assert "tok-tree" in last["tokens"] and "draft tree: " in last["tokens"]
    assert state.runs[0].record["draft_shape"] == "tree 8 (depth 4, top-k 2)"
    assert list(last["runs_table"]["draft_shape"]) == ["tree 8 (depth 4, top-k 2)"]


def test_a_tree_with_a_copied_branch_gives_plain_decodings_text_and_names_its_shape(embedded_slot, monkeypatch):
    """"tree + copy" on a prompt that repeats itself: the head's tree (sized each round) and prompt lookup's
    continuation verified together (copied chains found and grafted), plain decoding's text, and the shape named in
    the runs table."""
    from flashspec_core import tree_round

    copied, found = [], tree_round._copied
    monkeypatch.setattr(tree_round, "_copied", lambda *args: copied.append(found(*args)) or copied[-1])
    state = Session()
    plain = drain(run_stream(state, PROMPT, **{**SETTINGS, "max_new_tokens": 24}, mode="plain"))[1]
    _, last = drain(run_stream(state, PROMPT, **{**SETTINGS, "roles": ["draft_head"], "shape": "tree + copy",
                                                 "max_new_tokens": 24}))
    assert last["status"].startswith("Done (run 2)"), last["status"]
    trees = [e for e in state.runs[1].events if e.drafted_tree is not None]
    assert trees and all(0 < e.tree_nodes <= 32 + 8 for e in trees)
    assert any(chain is not None and int((chain >= 0).sum()) > 0 for chain in copied)
    assert text_of(last["tokens"]) == text_of(plain["tokens"])
    shape = "tree + copy (depth 6, top-k 4, up to 32 nodes, a copied branch of up to 8)"
    assert state.runs[1].record["draft_shape"] == shape


def test_a_race_names_the_tree_size(embedded_slot):
    state = Session()
    change = dict(a_mode="speculative", b_roles=["draft_head"], b_shape="tree 8")
    _, last = drain(run_race(state, PROMPT, **{**RACE, **change}))
    assert "· draft head · γ 4 · tree 8 (depth 4, top-k 2) · ucb1" in last["b_title"]
    assert "tree" not in last["a_title"]
    assert [r.record["draft_shape"] for r in state.runs] == ["chain", "tree 8 (depth 4, top-k 2)"]


def test_race_of_two_speculative_configurations(embedded_slot):
    """UCB1 with gamma 4 over both drafters against Thompson with auto gamma and prompt lookup alone."""
    state = Session()
    change = dict(a_mode="speculative", b_bandit="thompson", b_gamma_auto=True, b_roles=["prompt_lookup"],
                  temperature=0.7, seed=3)
    _, last = drain(run_race(state, PROMPT, **{**RACE, **change}))
    rows = [r.record for r in state.runs]
    assert [(r["bandit"], r["gamma"], r["drafters"]) for r in rows] == [
        ("ucb1", "4", "prompt_lookup+ngram_cache"), ("thompson", "auto", "prompt_lookup")]
    summary = last["race_summary"]
    assert "Same tokens" in summary or ("Different tokens" in summary and "drafters, gamma, bandit" in summary)


def test_a_bad_configuration_b_fails_before_a_runs(embedded_slot):
    state = Session()
    _, last = drain(run_race(state, PROMPT, **{**RACE, "b_gamma": 99}))
    assert "configuration B: gamma must be an integer in 1..16, got 99" in last["status"]
    assert "a_tokens" not in last and state.runs == []


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
    race = run_race(state, long_prompt, **{**RACE, "max_new_tokens": 200})
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
    b = pick_pair_b("smollm2-1.7b")
    assert set(b) == {"b_custom_row", "b_roles", "b_shape"} and b["b_shape"]["value"] == "chain"  # no head: chains
    assert embedded["shape"]["value"] == default_shape(resolve_pair("embedded"))
    assert b["b_roles"]["choices"][0] == ("draft model (SmolLM2-135M-Instruct)", "draft_model")
    assert pick_example(None) == {}
    for bad in (["not", "a", "pair"], None):  # only an API caller sends these: a short error, no traceback
        with pytest.raises(gr.Error, match="unknown model pair"):
            pick_pair(bad)


def test_example_names_in_the_runs_table():
    ex = handlers.EXAMPLES[0]
    assert handlers.example_name(ex["prompt"], ex["name"]) == ex["name"]
    assert handlers.example_name("my own   prompt", ex["name"]) == "my own prompt"
