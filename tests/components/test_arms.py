import json
import math

from fake_events import make_event

from components.arms import arm_order, arms_figure, finite


def traces(fig, kind, axis):
    return [t for t in fig.data if t.type == kind and t.xaxis == axis]


def test_pulls_and_scores_follow_the_last_round(events):
    fig = arms_figure(events, "ucb1")
    (bars,) = traces(fig, "bar", "x")
    assert list(bars.y) == ["prompt_lookup", "ngram_cache", "no_draft"]
    assert list(bars.x) == [a.pulls for a in events[-1].arms]
    lines = traces(fig, "scatter", "x2")
    assert [t.name for t in lines] == ["prompt_lookup", "ngram_cache", "no_draft"]
    assert list(lines[0].y) == [1.2, 1.2, 1.2]


def test_infinite_scores_are_gaps_and_named_untried(events):
    fig = arms_figure(events, "ucb1")
    no_draft = [t for t in traces(fig, "scatter", "x2") if t.name == "no_draft"][0]
    assert list(no_draft.y) == [None, None, None]
    assert any("untried: no_draft" in a.text for a in fig.layout.annotations)
    text = fig.to_json()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text)
    assert finite(math.inf) is None and finite(math.nan) is None and finite(0.25) == 0.25


def test_each_round_is_marked_on_its_arm(events):
    fig = arms_figure(events)
    rounds = {t.y[0]: list(t.x) for t in traces(fig, "scatter", "x3") if len(t.y)}
    assert rounds == {"prompt_lookup": [0, 2], "ngram_cache": [1]}


def test_without_a_bandit_pulls_count_rounds():
    evs = [make_event(i, "prompt_lookup", arms=()) for i in range(3)]
    fig = arms_figure(evs)
    assert arm_order(evs) == ["prompt_lookup"]
    (bars,) = traces(fig, "bar", "x")
    assert list(bars.x) == [3]
    assert traces(fig, "scatter", "x2") == []


def test_empty_figure_invites_a_run():
    fig = arms_figure([])
    assert any("run a prompt" in a.text for a in fig.layout.annotations)
