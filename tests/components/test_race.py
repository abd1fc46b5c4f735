import pytest
from fake_events import make_event

from components.race import race_summary, same_tokens, speedup, tokens_over_time_figure, why_different
from components.settings import parse_settings

PLAIN = dict(tok_per_s=10.0, tokens_per_forward=1.0, new_tokens=20, acceptance=0.0)
SPEC = dict(tok_per_s=25.0, tokens_per_forward=3.5, new_tokens=20, acceptance=0.8)
GOOD = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False, gamma=4,
            temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0, bandit="ucb1", backend="auto")


def test_speedup_is_the_ratio_of_tok_per_s():
    assert speedup(PLAIN, SPEC) == 2.5
    assert speedup({}, SPEC) is None and speedup(PLAIN, {}) is None


def test_summary_states_the_ratio_and_whether_texts_match():
    assert "×2.50" in race_summary(PLAIN, SPEC, True)
    assert "acceptance 80% vs 0%" in race_summary(PLAIN, SPEC, True)
    assert "**Same tokens**" in race_summary(PLAIN, SPEC, True)
    assert "**Different tokens**: because" in race_summary(PLAIN, SPEC, False, "because")
    assert "A runs first" in race_summary({}, {}, None)


def test_why_the_tokens_differ():
    greedy = parse_settings(**GOOD)
    assert "should match" in why_different(parse_settings(**GOOD, mode="plain"), greedy)
    hot = parse_settings(**{**GOOD, "temperature": 0.8})
    other = parse_settings(**{**GOOD, "temperature": 0.8, "roles": ["prompt_lookup"], "gamma_auto": True})
    assert why_different(hot, other).startswith("sampling with different drafters, gamma is still exact but not identical")
    assert "the two configurations are the same" in why_different(hot, hot)
    big = parse_settings(**{**GOOD, "pair": "smollm2-1.7b"})
    assert "target models differ" in why_different(greedy, big)


def test_same_tokens_compares_emitted_ids(events):
    assert same_tokens(events, list(events))
    assert not same_tokens(events, events[:2])


def test_tokens_over_time_starts_at_zero_and_follows_elapsed(events):
    plain = [make_event(i, "no_draft", accepted=(), last=("plain", "x"), mode="plain", arms=(),
                        elapsed=0.1 * (i + 1), new_tokens=i + 1) for i in range(4)]
    fig = tokens_over_time_figure({"a": plain, "b": events}, {"a": "A · plain"})
    assert [t.name for t in fig.data] == ["A · plain", "B"]
    assert list(fig.data[0].x) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert list(fig.data[0].y) == [0, 1, 2, 3, 4]
    assert list(fig.data[1].x)[1:] == [e.elapsed_s for e in events]
    assert tokens_over_time_figure({}).data == ()
