"""The prompt bank: breadth, every template fills, topic parsing, a stable held-out split, and the hand-written
evaluation set kept out of the data."""
import json
import random
from pathlib import Path

import pytest

from flashspec_core.head_data import excluded
from flashspec_core.prompt_bank import (DOMAINS, HELDOUT_KINDS, KINDS, MATERIAL, clean_material, fill, is_heldout,
                                        make_prompts, parse_topics)
from flashspec_core.train_head import banned_texts

ROOT = Path(__file__).resolve().parents[2]


def test_breadth():
    assert len(KINDS) >= 40 and len(DOMAINS) >= 90
    assert set(HELDOUT_KINDS) < set(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_template_fills(kind):
    rng = random.Random(0)
    for template in KINDS[kind]:
        text = fill(template, "tide pools", rng, ["maps", "owls"], "alpha, beta, gamma")
        assert "{" not in text.replace("{name}", "") and len(text) > 8, text


def test_prompts_cover_the_kinds_and_skip_missing_material():
    rng = random.Random(1)
    prompts = make_prompts(3000, ["owls", "maps", "tide pools"], {"passage": [("owls", "Owls hunt at night. " * 6)]}, rng)
    kinds = {p.kind for p in prompts}
    assert len(kinds) >= 40
    assert not kinds & {"code_explain", "code_fix", "code_convert", "code_test"}  # their templates all need code
    assert any(p.kind == "summary" and "Owls hunt" in p.text for p in prompts)
    assert all(p.topic in ("owls", "maps", "tide pools") for p in prompts)


def test_parse_topics():
    text = "Here are some topics:\n1. **Black holes**: regions of space\n2) Neutron stars - dense remnants\n- the Big Bang\n\n* x"
    assert parse_topics(text) == ["black holes", "neutron stars", "the Big Bang"]


def test_heldout_split_is_stable_and_keeps_whole_kinds():
    assert all(is_heldout(k, "anything") for k in HELDOUT_KINDS)
    topics = [f"topic {i}" for i in range(4000)]
    share = sum(is_heldout("story", t) for t in topics) / len(topics)
    assert 0.03 < share < 0.07
    assert [is_heldout("story", t) for t in topics[:50]] == [is_heldout("poem", t) for t in topics[:50]]


def test_material_cleaning():
    assert clean_material("code", "Sure:\n```python\ndef f(x):\n    return x + 1\n```\nDone.") == "def f(x):\n    return x + 1"
    assert clean_material("items", "apples, pears, plums\nmore text") == "apples, pears, plums"
    assert clean_material("items", "just one thing") is None
    assert clean_material("passage", "too short") is None
    assert set(MATERIAL) == {"passage", "code", "items"}


def test_hand_written_prompts_are_banned_from_the_data():
    open_prompts = json.loads((ROOT / "benchmarks" / "open_prompts.json").read_text())
    assert len(open_prompts) >= 60 and len({p["kind"] for p in open_prompts}) >= 25
    banned = banned_texts()
    assert all(excluded(p["prompt"], banned) for p in open_prompts)
    assert not excluded("Write a short story about a dragon who bakes bread.", banned)


def test_row_temperature_samples_each_row_at_its_own_temperature():
    """Gumbel-max: a T > 0 row follows softmax(logits / T) (chi-squared), a T = 0 row keeps its argmax exactly."""
    import torch

    from flashspec_core.head_data import RowTemperature

    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    N = 40000
    t = torch.tensor([1.0, 0.7] * (N // 2) + [0.0] * 16)
    picks = RowTemperature(t)(None, logits.expand(len(t), -1).clone()).argmax(-1)
    assert (picks[N:] == 0).all()
    for temp in (1.0, 0.7):
        got = torch.bincount(picks[:N][t[:N] == temp], minlength=5).float()
        expected = (logits[0] / temp).softmax(-1) * got.sum()
        chi2 = float(((got - expected) ** 2 / expected).sum())
        assert chi2 < 18.5, (temp, chi2)  # 4 degrees of freedom, p = 0.001
