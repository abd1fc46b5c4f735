"""Plotly figures from plain dicts, built without plotly's per-property validation: about ten times faster,
which matters for the bandit figure rebuilt while a stream runs. The template is resolved here, as validation
would have done; tests/components/test_figures.py checks that validation gives the same JSON.
"""
from __future__ import annotations

import html

import plotly.graph_objects as go
import plotly.io as pio

TEMPLATE = pio.templates["plotly_white"].to_plotly_json()


def plot_text(text) -> str:
    """Text for a title, label, legend or hover: plotly draws some HTML there (links, bold), so tags are escaped."""
    return html.escape(str(text), quote=False)


def figure(data: list[dict], layout: dict) -> go.Figure:
    return go.Figure(data=data, layout={"template": TEMPLATE, **layout}, _validate=False)
