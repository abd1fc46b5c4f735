import re

from fake_events import TREE, make_event, make_tree_event

from components.tokens import KINDS, legend_html, span_html, stats_markdown, tokens_html, tree_text
from flashspec_core import TokenSpan
from flashspec_core.stream import DraftedTree


def test_span_escapes_text_and_keeps_whitespace():
    out = span_html(TokenSpan("accepted", 1, '<a href="x">&\n    ', 0.5, 1.0), "prompt_lookup")
    assert '&lt;a href=&quot;x&quot;&gt;&amp;\n    </span>' in out
    assert "<a " not in out


def test_span_title_gives_drafter_p_and_q():
    out = span_html(TokenSpan("rejected", 1, "x", 0.125, 0.75), 'draft:"quoted"')
    assert 'class="tok tok-rejected"' in out
    assert "drafter: draft:&quot;quoted&quot;&#10;p = 0.125 · q = 0.750" in out


def test_bonus_title_has_no_q():
    out = span_html(TokenSpan("bonus", 1, "x", 0.5, None), "ngram_cache")
    assert "p = 0.500" in out and "q =" not in out


def test_live_view_strikes_latest_rejections_then_drops_them(events):
    live = tokens_html(events, live=True)
    assert live.count("tok-rejected") == 1  # only the last round's draft
    assert "&lt;b&gt;" in live
    two_rounds = tokens_html(events[:2], live=True)
    assert two_rounds.count("tok-rejected") == 2  # round 1 is now the latest
    final = tokens_html(events, live=False)
    assert "tok-rejected" not in final
    assert tokens_html(events, live=False, keep_rejected=True).count("tok-rejected") == 3


def test_text_order_and_classes(events):
    out = tokens_html(events, live=False)
    texts = re.findall(r"<span [^>]*>(.*?)</span>", out, flags=re.S)
    assert texts == ["def", " f", "(", "x", ")", ":\n    "]
    assert out.startswith('<div class="fs-tokens">')
    for kind in ("accepted", "bonus", "resampled"):
        assert f"tok-{kind}" in out


def test_plain_tokens_are_neutral():
    ev = make_event(0, "no_draft", accepted=(), last=("plain", "hi"), mode="plain", arms=())
    assert 'class="tok tok-plain"' in tokens_html([ev])


def test_empty_stream_shows_placeholder():
    assert "fs-empty" in tokens_html([])


def test_legend_has_every_kind():
    legend = legend_html()
    for kind in KINDS:
        assert f"tok-{kind}" in legend


def test_stats_markdown():
    stats = dict(new_tokens=48, tok_per_s=49.6, acceptance=0.881, tokens_per_forward=4.36, elapsed_s=0.97,
                 target_forwards=11, finished="length")
    line = stats_markdown(stats)
    assert "**49.6 tok/s**" in line and "88%" in line and "4.36 tokens/target forward" in line
    assert "stopped: length" in line and "stopped" not in stats_markdown(stats, live=True)
    assert stats_markdown({}) == "&nbsp;"


def test_end_of_turn_tokens_are_a_marker_not_text():
    out = span_html(TokenSpan("bonus", 2, "<|im_end|>", 0.98, None), "prompt_lookup")
    assert 'class="tok tok-bonus tok-special"' in out and 'data-marker="end"' in out
    assert out.endswith("></span>")  # no text inside: copying the answer does not copy the token
    assert "token &lt;|im_end|&gt;" in out  # the hover still names it
    for text, marker in (("<|endoftext|>", "end"), ("</s>", "end"), ("<|eot_id|>", "end"), ("<|im_start|>", "im_start")):
        assert f'data-marker="{marker}"' in span_html(TokenSpan("accepted", 1, text, 0.5, 1.0), "d")
    for text in ("<b>", "<|", "a <|im_end|>", "|>", "<s >"):
        assert "tok-special" not in span_html(TokenSpan("accepted", 1, text, 0.5, 1.0), "d"), text


def test_a_tree_rounds_tokens_show_its_branches_escaped():
    out = tokens_html([make_tree_event(0), make_event(1)], live=False)
    assert out.count("tok-tree") == 2 and "tok-rejected" not in out  # the round's two shown tokens, not round 1's
    title = re.search(r'class="tok tok-accepted tok-tree" title="([^"]*)"', out).group(1)
    assert "draft tree: 4 nodes, 1 accepted (✓), 3 dropped (✗)" in title
    assert "✓ &quot; the&quot;&#10;  ✗ &quot; cat&quot;&#10;    ✗ &quot;\\n&quot;" in title  # nested, a newline as \\n
    assert "✗ &quot;&lt;b onmouseover=\\&quot;x\\&quot;&gt;&quot;" in title  # escaped: no markup from a token
    assert "<b " not in out and 'onmouseover="' not in out


def test_tree_text_marks_the_path_depth_first():
    lines = tree_text(TREE).split("\n")
    assert lines[1:] == ['✓ " the"', '  ✗ " cat"', '    ✗ "\\n"', '✗ "<b onmouseover=\\"x\\">"']
    assert tree_text(DraftedTree((5,), (-1,), ())).endswith('✗ #5')  # no text (no tokenizer): its id


def test_chain_rounds_have_no_tree():
    assert "tok-tree" not in tokens_html([make_event(0)]) and "draft tree" not in tokens_html([make_event(0)])
