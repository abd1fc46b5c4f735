"""The stream pane: round events -> coloured, HTML-escaped token spans (pure functions), and its panel.

Each token kind has its own class (`tok-accepted`, `tok-rejected`, `tok-resampled`, `tok-bonus`, `tok-plain`;
colours in assets/app.css). The latest round's rejected drafts are shown struck through; they are dropped
once the next round arrives. Whitespace is kept verbatim: the container is `white-space: pre-wrap`.
Special tokens (e.g. the end-of-turn `<|im_end|>`) are drawn as a small marker (CSS, from `data-marker`), not
as text, so copying the text does not copy them. A tree round's tokens (`tok-tree`) add its whole draft tree to
their hover text: every branch the target checked in that round's one forward, the accepted path marked.
"""
from __future__ import annotations

import html
import json
import re

import gradio as gr

from flashspec_core import RoundEvent, TokenSpan
from flashspec_core.stream import DraftedTree

KINDS = ("accepted", "rejected", "resampled", "bonus", "plain")
KIND_LABELS = {
    "accepted": "accepted draft",
    "rejected": "rejected draft (dropped)",
    "resampled": "resampled at the rejection",
    "bonus": "bonus (all drafts accepted)",
    "plain": "plain decoding",
}
EMPTY = '<div class="fs-tokens fs-empty">The generated text appears here, round by round.</div>'
SPECIAL = re.compile(r"<\|[A-Za-z0-9_\-]{1,40}\|>|</?s>|<(?:eos|bos|pad|unk|eot)>")  # one token's whole text
END_OF_TURN = re.compile(r"<\|(?:im_end|endoftext|end_of_text|eot_id|eom_id|end)\|>|</s>|<eos>|<eot>")


def special_marker(text: str) -> str | None:
    """The marker drawn for a special token ('end' for an end of turn, else its name), None for text."""
    if not SPECIAL.fullmatch(text):
        return None
    return "end" if END_OF_TURN.fullmatch(text) else text.strip("<|>/")


def span_html(span: TokenSpan, drafter: str, tree: str = "") -> str:
    """One token as a span whose title gives its drafter, p and q (and `tree`, a tree round's branches, as text);
    a special token as an empty marked span."""
    q = "" if span.q is None else f" · q = {span.q:.3f}"
    marker = special_marker(span.text)
    token = f"\ntoken {span.text}" if marker else ""
    title = f"{KIND_LABELS[span.kind]} · drafter: {drafter}\np = {span.p:.3f}{q}{token}"
    title = html.escape(title + (f"\n\n{tree}" if tree else "")).replace("\n", "&#10;")
    classes = f"tok tok-{span.kind}" + (" tok-tree" if tree else "")
    if marker:
        return f'<span class="{classes} tok-special" title="{title}" data-marker="{html.escape(marker)}"></span>'
    return f'<span class="{classes}" title="{title}">{html.escape(span.text)}</span>'


def tree_text(tree: DraftedTree) -> str:
    """A draft tree as indented lines, depth first in the order verification tried the siblings: ✓ marks the
    accepted path, ✗ a node the round dropped (a rejected branch, or one below it). Plain text (escape it)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(i)
    accepted, lines = set(tree.accepted), []

    def walk(node: int, depth: int) -> None:
        for child in children.get(node, ()):
            piece = tree.texts[child] if child < len(tree.texts) else ""
            mark = "✓" if child in accepted else "✗"
            lines.append(f"{'  ' * depth}{mark} {shown_piece(piece, tree.tokens[child])}")
            walk(child, depth + 1)

    walk(-1, 0)
    n, kept = len(tree.tokens), len(tree.accepted)
    head = f"draft tree: {n} nodes, {kept} accepted (✓), {n - kept} dropped (✗)"
    return "\n".join([head, *lines])


def shown_piece(text: str, token: int) -> str:
    """A token's text on one line, quoted so that spaces show (its id when it has no text)."""
    if not text:
        return f"#{token}"
    return json.dumps(text, ensure_ascii=False)


def round_html(event: RoundEvent, show_rejected: bool) -> str:
    """The spans of one round in display order: accepted, [rejected], then the resampled/bonus/plain token."""
    tree = tree_text(event.drafted_tree) if event.drafted_tree is not None else ""
    return "".join(span_html(s, event.drafter, tree) for s in event.spans if show_rejected or s.kind != "rejected")


def tokens_html(events: list[RoundEvent], live: bool = True, keep_rejected: bool = False) -> str:
    """The whole text so far. live: show the latest round's rejected drafts; keep_rejected: show every round's."""
    if not events:
        return EMPTY
    last = len(events) - 1
    body = "".join(round_html(e, keep_rejected or (live and i == last)) for i, e in enumerate(events))
    return f'<div class="fs-tokens">{body}</div>'


def round_group(event: RoundEvent) -> str:
    """One round of a replay: all its spans in a group (CSS shows the rejected drafts of the last group only)."""
    return f'<span class="fs-round">{round_html(event, True)}</span>'


def replay_page(groups: str, skipped_rounds: int = 0, skipped_tokens: int = 0, done: bool = False) -> str:
    """The replay pane: a page of round groups, after a note on the rounds of earlier pages. The page is left open
    (no closing tag; the browser closes it), so while a replay plays each update only appends to the last one and
    gradio sends just the new part."""
    note = (f'<span class="fs-skipped">… {skipped_rounds} earlier rounds ({skipped_tokens} tokens) are not shown …'
            '</span>\n') if skipped_rounds else ""
    return f'<div class="fs-tokens fs-replay{" fs-done" if done else ""}">{note}{groups}'


def legend_html() -> str:
    items = "".join(f'<span class="tok tok-{k}">{html.escape(KIND_LABELS[k])}</span>' for k in KINDS)
    hint = "hover a token for its drafter, p and q; a dotted one also for its round's draft tree"
    return f'<div class="fs-legend">{items}<span class="fs-hint">{html.escape(hint)}</span></div>'


def stats_markdown(stats: dict, live: bool = False) -> str:
    """One line of the headline numbers of a (running) stream."""
    if not stats or not stats.get("new_tokens"):
        return "&nbsp;"
    line = (f"**{stats['tok_per_s']:.1f} tok/s** · acceptance {stats['acceptance']:.0%} · "
            f"{stats['tokens_per_forward']:.2f} tokens/target forward · {stats['new_tokens']} tokens in "
            f"{stats['elapsed_s']:.2f} s ({stats['target_forwards']} forwards)")
    if not live and stats.get("finished"):
        line += f" · stopped: {stats['finished']}"
    return line


def build_tokens() -> dict[str, gr.components.Component]:
    c = {}
    c["legend"] = gr.HTML(legend_html(), elem_id="legend")
    c["tokens"] = gr.HTML(EMPTY, label="Generated text", elem_id="tokens")
    c["stream_stats"] = gr.Markdown("&nbsp;", elem_id="stream-stats")
    c["keep_rejected"] = gr.Checkbox(False, label="Keep rejected drafts in the text", elem_id="keep-rejected")
    return c
