"""Side by side: configuration A, then configuration B, on the same prompt and seed (never at once: two runs
sharing the cores would distort both timings). By default A is plain decoding and B speculative decoding of
the same pair. Pure formatters (the ratio, why the texts differ, tokens over time) and the panel.
"""
from __future__ import annotations

import gradio as gr
import plotly.graph_objects as go

from flashspec_core import RoundEvent

from components.figures import figure, plot_text
from components.settings import LEGS, RunSettings, build_leg
from components.tokens import EMPTY

COLORS = {"a": "#64748b", "b": "#2563eb"}
WAITING = "Configuration A runs first, then B, on the same prompt and seed."


def speedup(a: dict, b: dict) -> float | None:
    """B's tok/s over A's (prefill included in both), or None before both have run."""
    if not a or not b or not a.get("tok_per_s") or not b.get("new_tokens"):
        return None
    return b["tok_per_s"] / a["tok_per_s"]


def same_tokens(a_events: list[RoundEvent], b_events: list[RoundEvent]) -> bool:
    return [t for e in a_events for t in e.emitted] == [t for e in b_events for t in e.emitted]


def why_different(a: RunSettings, b: RunSettings) -> str:
    """Why two legs on the same prompt and seed may emit different tokens."""
    if a.pair.target != b.pair.target:
        return "the target models differ, and each leg follows its own target's distribution."
    if a.sampling.greedy:
        return ("under greedy decoding they should match; a near-tie between two tokens can flip with the shape "
                "of the target's forward pass (one token, or K + 1 at once).")
    changed = [name for name, x, y in (("mode", a.mode, b.mode), ("drafters", a.roles, b.roles),
                                       ("gamma", a.gamma, b.gamma), ("draft shape", a.shape, b.shape),
                                       ("bandit", a.bandit, b.bandit),
                                       ("model pair", a.pair, b.pair), ("backend", a.backend, b.backend)) if x != y]
    if not changed:
        return ("the two configurations are the same, so the tokens should be too (costs are measured once per "
                "engine, not per run); the server's log may say more.")
    return (f"sampling with different {', '.join(changed)} is still exact but not identical: each leg is an exact "
            "sample of the target's distribution, and the seed's random numbers are used in a different order.")


def race_summary(a: dict, b: dict, identical: bool | None, reason: str = "") -> str:
    """The ratio and the same/different line under the two panes."""
    ratio = speedup(a, b)
    if ratio is None:
        return WAITING
    line = (f"### B / A: ×{ratio:.2f}\n{b['tok_per_s']:.1f} vs {a['tok_per_s']:.1f} tok/s; acceptance "
            f"{b['acceptance']:.0%} vs {a['acceptance']:.0%}; {b['tokens_per_forward']:.2f} vs "
            f"{a['tokens_per_forward']:.2f} tokens per target forward.")
    if identical is not None:
        line += "\n\n**Same tokens** in both panes." if identical else f"\n\n**Different tokens**: {reason}"
    return line


def tokens_over_time_figure(legs: dict[str, list[RoundEvent]], names: dict[str, str] | None = None) -> go.Figure:
    """Tokens generated against seconds since the stream started (prefill included), one line per leg."""
    data = []
    for leg in LEGS:
        events = legs.get(leg) or []
        if events:
            data.append(dict(type="scatter", mode="lines+markers", name=plot_text((names or {}).get(leg, leg.upper())),
                             line=dict(color=COLORS[leg]), marker=dict(size=4),
                             x=[0.0] + [e.elapsed_s for e in events], y=[0] + [e.new_tokens for e in events]))
    layout = dict(height=320, margin=dict(l=50, r=12, t=44, b=40),
                  xaxis=dict(title=dict(text="seconds since the stream started (prefill included)"), rangemode="tozero"),
                  yaxis=dict(title=dict(text="tokens"), rangemode="tozero"),
                  legend=dict(orientation="h", x=1, xanchor="right", y=1.02, yanchor="bottom"))
    return figure(data, layout)


def build_race() -> dict[str, gr.components.Component]:
    c = {}
    with gr.Accordion("Configurations A and B", open=False, elem_id="ab-configs"):
        with gr.Row():
            for leg in LEGS:
                with gr.Column(elem_id=f"config-{leg}"):
                    gr.Markdown(f"**{leg.upper()}**")
                    c |= build_leg(leg)
    with gr.Row(equal_height=True):
        for leg in LEGS:
            with gr.Column():
                c[f"{leg}_title"] = gr.Markdown(f"#### {leg.upper()}", elem_id=f"{leg}-title")
                c[f"{leg}_tokens"] = gr.HTML(EMPTY, label=f"{leg.upper()} text", elem_id=f"{leg}-tokens")
                c[f"{leg}_stats"] = gr.Markdown("&nbsp;", elem_id=f"{leg}-stats")
    c["race_summary"] = gr.Markdown(WAITING, elem_id="race-summary")
    c["race_plot"] = gr.Plot(tokens_over_time_figure({}), label="Tokens over time", elem_id="race-plot")
    return c
