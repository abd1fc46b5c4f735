import pytest
from fake_events import make_event

from components.race import race_summary, same_tokens, speedup, tokens_over_time_figure

PLAIN = dict(tok_per_s=10.0, tokens_per_forward=1.0, new_tokens=20)
SPEC = dict(tok_per_s=25.0, tokens_per_forward=3.5, new_tokens=20)


def test_speedup_is_the_ratio_of_tok_per_s():
    assert speedup(PLAIN, SPEC) == 2.5
    assert speedup({}, SPEC) is None and speedup(PLAIN, {}) is None


def test_summary_states_speedup_and_whether_texts_match():
    assert "×2.50" in race_summary(PLAIN, SPEC, True, True)
    assert "Same tokens" in race_summary(PLAIN, SPEC, True, True)
    assert "should match" in race_summary(PLAIN, SPEC, False, True)
    assert "not the same sample" in race_summary(PLAIN, SPEC, False, False)
    assert "Plain decoding runs first" in race_summary({}, {}, None, True)


def test_same_tokens_compares_emitted_ids(events):
    assert same_tokens(events, list(events))
    assert not same_tokens(events, events[:2])


def test_tokens_over_time_starts_at_zero_and_follows_elapsed(events):
    plain = [make_event(i, "no_draft", accepted=(), last=("plain", "x"), mode="plain", arms=(),
                        elapsed=0.1 * (i + 1), new_tokens=i + 1) for i in range(4)]
    fig = tokens_over_time_figure({"plain": plain, "speculative": events})
    assert [t.name for t in fig.data] == ["plain", "speculative"]
    assert list(fig.data[0].x) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert list(fig.data[0].y) == [0, 1, 2, 3, 4]
    assert list(fig.data[1].x)[1:] == [e.elapsed_s for e in events]
    assert tokens_over_time_figure({}).data == ()
