"""The bandit panel: round events -> one plotly figure (pure), and its panel.

Top left: pulls per arm (bars). Top right: each arm's score over the rounds (the UCB index, or the last Thompson
draw); an untried UCB arm scores +inf, drawn as a gap and marked "untried". Bottom: which arm each round
used, the marker's size growing with the tokens that round emitted.
"""
from __future__ import annotations

import math

import gradio as gr
import plotly.graph_objects as go

from flashspec_core import RoundEvent

from components.figures import figure, plot_text

PALETTE = ("#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#64748b")
HEIGHT = 430


def arm_order(events: list[RoundEvent]) -> list[str]:
    """The bandit's arms in its own order; without a bandit, the drafters used, in order of first use (escaped for
    plotly, like every name shown in the figure)."""
    for e in events:
        if e.arms:
            return [plot_text(a.name) for a in e.arms]
    return list(dict.fromkeys(plot_text(e.drafter) for e in events))


def arm_colors(names: list[str]) -> dict[str, str]:
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def finite(x: float) -> float | None:
    """A score fit for plotting: None (a gap) for +-inf and NaN."""
    return x if math.isfinite(x) else None


def arms_figure(events: list[RoundEvent], strategy: str = "", pulls: dict[str, int] | None = None) -> go.Figure:
    """The figure after `events` (a replay of a long run passes every n-th round, its last included, and the
    rounds per drafter as `pulls`)."""
    names = arm_order(events)
    colors = arm_colors(names)
    last = events[-1].arms if events else ()
    if last:
        pulls = {plot_text(a.name): a.pulls for a in last}
        hover = {plot_text(a.name): f"mean reward {a.mean:.3f} over {a.observations} observations<br>score "
                         f"{'untried (+inf)' if not math.isfinite(a.score) else f'{a.score:.3f}'}" for a in last}
    else:
        pulls = {plot_text(k): v for k, v in pulls.items()} if pulls is not None else \
            {n: sum(plot_text(e.drafter) == n for e in events) for n in names}
        hover = {n: "single drafter: no bandit" for n in names}
    data = [dict(type="bar", orientation="h", y=names, x=[pulls[n] for n in names],
                 marker=dict(color=[colors[n] for n in names]), text=[str(pulls[n]) for n in names], textposition="auto",
                 hovertext=[hover[n] for n in names], hoverinfo="y+text", showlegend=False, xaxis="x", yaxis="y")]
    rounds = [e.index for e in events]
    for i, n in enumerate(names):
        if not last:
            break
        scores = [finite(e.arms[i].score) if e.arms else None for e in events]
        data.append(dict(type="scatter", mode="lines", x=rounds, y=scores, name=n, line=dict(color=colors[n]),
                         legendgroup=n, xaxis="x2", yaxis="y2"))
    for n in names:
        mine = [e for e in events if plot_text(e.drafter) == n]
        data.append(dict(type="scatter", mode="markers", x=[e.index for e in mine], y=[n] * len(mine),
                         marker=dict(color=colors[n], size=[6 + 2 * len(e.emitted) for e in mine], opacity=0.8),
                         text=[f"K={e.gamma}, accepted {len(e.accepted)}, emitted {len(e.emitted)}" for e in mine],
                         hoverinfo="x+y+text", showlegend=False, legendgroup=n, xaxis="x3", yaxis="y3"))
    untried = [plot_text(a.name) for a in last if not math.isfinite(a.score)]
    title = "score" + (f" ({plot_text(strategy)})" if strategy else "") + (f"; untried: {', '.join(untried)}" if untried else "")
    heading = dict(xref="paper", yref="paper", showarrow=False, font=dict(size=12), xanchor="left")
    categories = dict(type="category", categoryorder="array", categoryarray=names[::-1])
    layout = dict(
        height=HEIGHT, margin=dict(l=100, r=12, t=76, b=40),
        legend=dict(orientation="h", x=1, xanchor="right", y=1.09, yanchor="bottom", font=dict(size=11)),
        xaxis=dict(domain=[0, 0.3], anchor="y", rangemode="tozero"), yaxis=dict(domain=[0.6, 1], anchor="x", **categories),
        xaxis2=dict(domain=[0.42, 1], anchor="y2"), yaxis2=dict(domain=[0.6, 1], anchor="x2"),
        xaxis3=dict(domain=[0, 1], anchor="y3", title=dict(text="round", standoff=2)),
        yaxis3=dict(domain=[0, 0.38], anchor="x3", **categories),
        annotations=[dict(heading, x=0, y=1.0, yanchor="bottom", text="pulls"),
                     dict(heading, x=0.42, y=1.0, yanchor="bottom", text=title),
                     dict(heading, x=0, y=0.42, yanchor="bottom", text="arm used in each round (size: tokens emitted)")],
    )
    if not events:
        layout["annotations"].append(dict(xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                                          text="run a prompt to see the bandit"))
    return figure(data, layout)


def build_arms() -> dict[str, gr.components.Component]:
    return {"arms_plot": gr.Plot(arms_figure([]), label="Bandit: arms, scores and rounds", elem_id="arms-plot")}
