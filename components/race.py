"""Side by side: the same prompt and seed through plain decoding, then speculative decoding (never at once:
two runs sharing the cores would distort both timings). Pure formatters and the panel.
"""
from __future__ import annotations

import gradio as gr
import plotly.graph_objects as go

from flashspec_core import RoundEvent

from components.figures import figure
from components.tokens import EMPTY

LEGS = ("plain", "speculative")
COLORS = {"plain": "#64748b", "speculative": "#2563eb"}


def speedup(plain: dict, spec: dict) -> float | None:
    """Speculative tok/s over plain tok/s (prefill included in both), or None before both have run."""
    if not plain or not spec or not plain.get("tok_per_s") or not spec.get("new_tokens"):
        return None
    return spec["tok_per_s"] / plain["tok_per_s"]


def same_tokens(plain_events: list[RoundEvent], spec_events: list[RoundEvent]) -> bool:
    return [t for e in plain_events for t in e.emitted] == [t for e in spec_events for t in e.emitted]


def race_summary(plain: dict, spec: dict, identical: bool | None, greedy: bool) -> str:
    """The speedup line under the two panes."""
    ratio = speedup(plain, spec)
    if ratio is None:
        return "Plain decoding runs first, then speculative decoding, on the same prompt and seed."
    line = (f"### Speedup ×{ratio:.2f}\n{spec['tok_per_s']:.1f} vs {plain['tok_per_s']:.1f} tok/s; "
            f"{spec['tokens_per_forward']:.2f} vs {plain['tokens_per_forward']:.2f} tokens per target forward.")
    if identical is not None:
        if identical:
            line += " Same tokens in both panes."
        elif greedy:
            line += (" The texts differ: under greedy decoding they should match; a near-tie between two "
                     "tokens can flip with the batch shape of the forward pass.")
        else:
            line += " With temperature > 0 both are exact samples of the target's distribution, not the same sample."
    return line


def tokens_over_time_figure(legs: dict[str, list[RoundEvent]]) -> go.Figure:
    """Tokens generated against seconds since the stream started (prefill included), one line per leg."""
    data = []
    for name in LEGS:
        events = legs.get(name) or []
        if events:
            data.append(dict(type="scatter", mode="lines+markers", name=name, line=dict(color=COLORS[name]),
                             marker=dict(size=4), x=[0.0] + [e.elapsed_s for e in events],
                             y=[0] + [e.new_tokens for e in events]))
    layout = dict(height=320, margin=dict(l=50, r=12, t=44, b=40),
                  xaxis=dict(title=dict(text="seconds since the stream started (prefill included)"), rangemode="tozero"),
                  yaxis=dict(title=dict(text="tokens"), rangemode="tozero"),
                  legend=dict(orientation="h", x=1, xanchor="right", y=1.02, yanchor="bottom"))
    return figure(data, layout)


def build_race() -> dict[str, gr.components.Component]:
    c = {}
    with gr.Row(equal_height=True):
        with gr.Column():
            gr.Markdown("#### Plain decoding")
            c["plain_tokens"] = gr.HTML(EMPTY, label="Plain decoding text", elem_id="plain-tokens")
            c["plain_stats"] = gr.Markdown("&nbsp;", elem_id="plain-stats")
        with gr.Column():
            gr.Markdown("#### Speculative decoding")
            c["spec_tokens"] = gr.HTML(EMPTY, label="Speculative decoding text", elem_id="spec-tokens")
            c["spec_stats"] = gr.Markdown("&nbsp;", elem_id="spec-stats")
    c["race_summary"] = gr.Markdown(race_summary({}, {}, None, True), elem_id="race-summary")
    c["race_plot"] = gr.Plot(tokens_over_time_figure({}), label="Tokens over time", elem_id="race-plot")
    return c
