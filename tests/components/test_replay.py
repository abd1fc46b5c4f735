"""Replay: the JSON export loads back exactly, hostile files are refused value by value with a short reason, and
the pace follows the run's own timing with every wait capped."""
import dataclasses
import json

import pytest
from fake_events import TREE, make_event, make_tree_event

from components.compact import compact
from components.replay import MAX_ROUND_WAIT_S, BadRunFile, load_document, play_times, position
from components.runs import Run, export_document, run_record
from components.tokens import round_group

SETTINGS = {"pair": "embedded", "models": "embedded", "drafters": "prompt_lookup", "gamma": "4", "temperature": 0.0,
            "top_p": 1.0, "max_new_tokens": 16, "seed": 0, "bandit": "ucb1", "backend": "auto"}
STATS = {"new_tokens": 6, "tok_per_s": 12.0, "acceptance": 0.5, "tokens_per_forward": 2.0, "pulls": {"a": 1}}


def consistent(events):
    """The events with new_tokens counted as the engine counts them (the running sum of emitted tokens)."""
    out, total = [], 0
    for e in events:
        total += len(e.emitted)
        out.append(dataclasses.replace(e, new_tokens=total))
    return out


def exported(events, record=None) -> str:
    record = record or run_record("run 1", "speculative", SETTINGS, STATS)
    return json.dumps(export_document([Run(record, "hi", tuple(consistent(events)))]))


def test_an_export_loads_back_with_the_same_events(events):
    (run,) = load_document(exported(events), "my_file")
    assert run.events(range(len(run))) == consistent(events)  # every field, +inf scores included
    assert run.record["run"] == "my_file: run 1" and run.prompt == "hi" and run.name == "my_file: run 1"
    assert run.nbytes < 4_000


def test_stats_of_a_prefix_are_the_engines(events):
    from flashspec_core.engine import summarize

    (run,) = load_document(exported(events))
    for shown in (1, 2, 3):
        expected = summarize(consistent(events)[:shown])
        assert run.stats(shown) == {k: v for k, v in expected.items() if k != "pulls"}
    assert run.pulls(3) == {"prompt_lookup": 2, "ngram_cache": 1}


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: "not json", "not a JSON file"),
    (lambda d: [{"run": "run 1"}], r"no round events \(exported before replay existed\)"),
    (lambda d: {**d, "format": "other"}, "not a FlashSpec run file"),
    (lambda d: {**d, "runs": []}, "1 to 64 runs"),
    (lambda d: {**d, "runs": [{**d["runs"][0], "events": []}]}, "should be an object with a list of rounds"),
    (lambda d: {**d, "runs": [{**d["runs"][0], "events": d["runs"][0]["events"] * 234}] * 50},
     "holds 35,100 rounds"),
    (lambda d: set_event(d, "drafter", "<img src=x onerror=alert(1)>"), "a drafter name should be"),
    (lambda d: set_event(d, "spans", [["evil", 1, "x", 0.5, None]]), "a span should be"),
    (lambda d: set_event(d, "spans", [["accepted", 10, "x" * 5000, 0.5, None]]), "at most 200 characters"),
    (lambda d: set_event(d, "spans", [["accepted", -1, "x", 0.5, None]]), "a span should be"),
    (lambda d: set_span(d, 2, "\ud800"), r"lone surrogate \(U\+D800\)"),
    (lambda d: set_span(d, 3, 1.5), r"'p' should be a number in 0..1, got 1.5"),
    (lambda d: set_span(d, 4, float("nan")), "'q' should be a number in 0..1"),
    (lambda d: set_event(d, "elapsed_s", "soon"), "'elapsed_s' should be a number in 0..86400"),
    (lambda d: set_event(d, "elapsed_s", 1e308), r"'elapsed_s' should be a number in 0..86400, got 1e\+308"),
    (lambda d: set_event(d, "elapsed_s", 5e-324), "'round_s' and 'elapsed_s' should be at least 1e-06"),
    (lambda d: set_event(d, "index", True), "'index' should be an integer"),
    (lambda d: set_event(d, "index", 2**70), "'index' should be an integer in 0..30000"),
    (lambda d: set_event(d, "index", 1), "'index' should be 0"),
    (lambda d: set_event(d, "gamma", -5), "'gamma' should be an integer in 0..32, got -5"),
    (lambda d: set_event(d, "gamma", 1), "do not agree"),
    (lambda d: set_event(d, "accepted", [11, 10]), "do not agree"),
    (lambda d: set_event(d, "accepted", list(range(100))), "a short list of token ids"),
    (lambda d: set_event(d, "new_tokens", 7), "the token count, the time, the arms or the finish do not follow"),
    (lambda d: set_event(d, "finished", "eos"), "do not follow"),
    (lambda d: set_event(d, "arms", [["a", 1, 1, 0.5]]), "an arm should be"),
    (lambda d: set_event(d, "arms", [["a", 1, 1, 7.0, None]]), "'mean' should be a number in 0..1"),
    (lambda d: set_event(d, "mode", "fast"), "unknown mode"),
    (lambda d: set_record(d, "bandit", "ucb\udfff"), r"'bandit' contains a lone surrogate"),
    (lambda d: set_record(d, "run", "r\ud800"), r"'run' contains a lone surrogate"),
])
def test_hostile_files_are_refused_with_a_short_reason(events, mutate, reason):
    doc = json.loads(exported(events))
    text = mutate(doc)
    with pytest.raises(BadRunFile, match=reason) as info:
        load_document(text if isinstance(text, str) else json.dumps(text))
    assert len(str(info.value)) < 200 and "\n" not in str(info.value)


def set_event(doc, key, value):
    doc["runs"][0]["events"][0][key] = value
    return doc


def set_span(doc, field, value):
    doc["runs"][0]["events"][0]["spans"][0][field] = value
    return doc


def set_record(doc, key, value):
    doc["runs"][0][key] = value
    return doc


def test_a_tree_round_exports_and_replays_with_its_tree(events):
    rounds = consistent([make_tree_event(0), events[1], make_tree_event(2, finished="length")])
    (run,) = load_document(exported(rounds))
    assert run.events(range(len(run))) == rounds  # the trees too (tokens, parents, path, texts)
    assert compact({}, "", rounds).events(range(len(rounds))) == rounds  # a session's own runs alike
    assert run.event(0).drafted_tree == TREE and run.event(1).drafted_tree is None and run.event(0).tree_nodes == 4
    assert run.event(0, spans=False).drafted_tree is None  # the bandit figure's cheap events leave it out
    group = round_group(run.event(0))
    assert "draft tree: 4 nodes" in group and "&lt;b onmouseover=" in group and "<b " not in group


def tree_doc(**change) -> dict:
    doc = json.loads(exported([make_tree_event(0)]))
    doc["runs"][0]["events"][0]["tree"].update(change)
    return doc


@pytest.mark.parametrize("doc, reason", [
    (set_event(tree_doc(), "tree", [1, 2]), "'tree' should be null or an object of lists"),
    (set_event(tree_doc(), "tree", {"tokens": [10]}), "'tree' should be null or an object of lists"),
    (set_event(tree_doc(), "tree", {**TREE.__dict__, "extra": []}), "'tree' should be null or an object of lists"),
    (tree_doc(tokens="abc"), "'tree' should be null or an object of lists"),
    (tree_doc(tokens=[]), "not a draft tree"),
    (tree_doc(tokens=[10, 20, 21, 22] * 9, parents=[-1] * 36, texts=[""] * 36), "not a draft tree"),
    (tree_doc(tokens=[10, 20, -1, 22]), "not a draft tree"),
    (tree_doc(tokens=[10, 20, 2**40, 22]), "not a draft tree"),
    (tree_doc(tokens=[10, 20, True, 22]), "not a draft tree"),
    (tree_doc(parents=[-1, 0, -1, 3]), "not a draft tree"),  # a node its own parent
    (tree_doc(parents=[-1, 2, -1, 1]), "not a draft tree"),  # a parent after its child
    (tree_doc(parents=[-2, 0, -1, 1]), "not a draft tree"),
    (tree_doc(parents=[-1, 0, -1]), "not a draft tree"),
    (tree_doc(parents=[-1, 0.0, -1, 1]), "not a draft tree"),
    (tree_doc(accepted=[2]), "not a draft tree"),  # its token is not the accepted id
    (tree_doc(accepted=[1]), "not a draft tree"),  # not a path from the root
    (tree_doc(accepted=[0, 0]), "not a draft tree"),
    (tree_doc(accepted=[4]), "not a draft tree"),
    (tree_doc(accepted=[None]), "not a draft tree"),
    (tree_doc(accepted=[]), "not a draft tree"),  # the round accepted " the"
    (tree_doc(texts=[" the", " cat", 5, "\n"]), "a tree node's text should be text of at most 200 characters"),
    (tree_doc(texts=[" the", " cat", "x" * 201, "\n"]), "at most 200 characters"),
    (tree_doc(texts=[" the", "\udc00", "", ""]), r"lone surrogate \(U\+DC00\)"),
])
def test_hostile_trees_are_refused(doc, reason):
    with pytest.raises(BadRunFile, match=reason):
        load_document(json.dumps(doc))


def test_a_file_without_trees_still_loads(events):
    doc = json.loads(exported(events))
    for e in doc["runs"][0]["events"]:
        del e["tree"]  # files exported before trees were
    (run,) = load_document(json.dumps(doc))
    assert run.events(range(len(run))) == consistent(events)


def test_deep_nesting_is_a_clear_refusal():
    with pytest.raises(BadRunFile, match="not a JSON file"):
        load_document("[" * 100_000 + "]" * 100_000)


def test_the_pace_follows_elapsed_time_and_caps_every_wait():
    (run,) = load_document(exported([make_event(i, elapsed=1.0 + i) for i in range(4)]))  # rounds end at 1..4 s
    assert list(play_times(run, 0, 1.0)) == [1.0, 2.0, 3.0, 4.0]
    assert list(play_times(run, 0, 0.5)) == [MAX_ROUND_WAIT_S] * 1 + [2 * MAX_ROUND_WAIT_S, 3 * MAX_ROUND_WAIT_S,
                                                                     4 * MAX_ROUND_WAIT_S]  # 2 s each at half speed
    assert list(play_times(run, 2, 1.0)) == [1.0, 2.0]  # from round 2: relative times
    (slow,) = load_document(exported([make_event(0, elapsed=1.0), make_event(1, elapsed=80_000.0)]))
    assert list(play_times(slow, 0, 0.1)) == [MAX_ROUND_WAIT_S, 2 * MAX_ROUND_WAIT_S]
    assert position(4, 4, 8) == "Round 4 of 4 · 8 tokens (end)"
    assert "Pick a run" in position(0, 0)
