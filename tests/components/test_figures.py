import json

import plotly.graph_objects as go
from fake_events import make_event

from components.arms import arms_figure
from components.figures import figure
from components.race import tokens_over_time_figure


def validated(fig: go.Figure) -> dict:
    """The figure rebuilt through plotly's validation (which raises on any invalid property), as JSON."""
    return json.loads(go.Figure(fig.to_plotly_json()).to_json())


def test_fast_figures_equal_validated_ones(events):
    plain = [make_event(i, "no_draft", accepted=(), last=("plain", "x"), mode="plain", arms=()) for i in range(3)]
    for fig in (arms_figure(events, "ucb1"), arms_figure([]), arms_figure(plain),
                tokens_over_time_figure({"plain": plain, "speculative": events}), tokens_over_time_figure({})):
        assert json.loads(fig.to_json()) == validated(fig)


def test_the_template_is_resolved():
    layout = json.loads(figure([], {}).to_json())["layout"]
    assert isinstance(layout["template"], dict) and "layout" in layout["template"]
