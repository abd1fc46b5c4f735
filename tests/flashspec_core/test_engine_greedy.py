"""Greedy speculative output must equal greedy plain output, token for token, on the real embedded model."""
import pytest
import torch

from flashspec_core import Engine, SamplingConfig
from tests.conftest import fixed_costs

PROMPTS = [
    "Rename the function `area` to `rect_area` in this code and return the code:\n\n"
    "def area(w, h):\n    return w * h\n\nprint(area(2, 3))\nprint(area(4, 5))\n",
    "Summarise in two sentences: The Amazon rainforest covers much of the Amazon basin of South America. "
    "It is home to millions of species of insects, plants, birds and other forms of life.",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def engine_with_draft_model(embedded_engine):
    """The embedded target plus a real draft model: its own first 24 of 30 layers (early exit), sharing weights."""
    from transformers import AutoModelForCausalLM

    from flashspec_core.models import embedded_gguf

    target = embedded_engine.target.model
    cfg = target.config.__class__.from_dict({**target.config.to_dict(), "num_hidden_layers": 24})
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(list(target.model.layers[:24]))
    draft.model.norm, draft.lm_head = target.model.norm, target.lm_head
    gguf = embedded_gguf(target.config) if embedded_engine.precision == "gguf" else None  # the target's own path
    return Engine.from_models(target, [draft, "prompt_lookup", "ngram_cache"], tokenizer=embedded_engine.tokenizer,
                              draft_names=["draft:early-exit-24"], gguf=gguf)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code", "summary", "chat"])
def test_greedy_speculative_equals_plain(embedded_engine, prompt):
    engine = embedded_engine
    greedy = SamplingConfig(temperature=0.0)
    plain = engine.generate(prompt, max_new_tokens=64, sampling=greedy, mode="plain").token_ids
    assert len(plain) == 64 or plain[-1] in engine.eos_ids
    for drafters, gamma in ((["prompt_lookup"], 4), (["ngram_cache"], 4), (["no_draft"], 4), (["draft_head"], 4),
                            (["draft_head"], "auto"), (None, "auto")):
        result = engine.generate(prompt, max_new_tokens=64, sampling=greedy, gamma=gamma, drafters=drafters)
        assert result.token_ids == plain, f"drafters={drafters} gamma={gamma} diverged"


def test_greedy_speculative_equals_plain_on_float32(embedded_engine):
    """The float32 path (the dequantised weights) stays exact too; `embedded_engine` runs the GGUF weights on the CPU."""
    from flashspec_core.engine import head_for

    target = embedded_engine.target.model
    engine = Engine.from_models(target, [head_for("embedded", target), "prompt_lookup"],
                                tokenizer=embedded_engine.tokenizer)
    assert engine.precision == str(target.dtype).removeprefix("torch.")
    greedy = SamplingConfig(temperature=0.0)
    plain = engine.generate(PROMPTS[0], max_new_tokens=48, sampling=greedy, mode="plain").token_ids
    for drafters in (["draft_head"], None):
        result = engine.generate(PROMPTS[0], max_new_tokens=48, sampling=greedy, gamma="auto", drafters=drafters)
        assert result.token_ids == plain, f"drafters={drafters} diverged"


def test_greedy_with_draft_model_equals_plain(engine_with_draft_model):
    engine, greedy = engine_with_draft_model, SamplingConfig(temperature=0.0)
    plain = engine.generate(PROMPTS[0], max_new_tokens=64, sampling=greedy, mode="plain").token_ids
    stats = []
    for drafters in (["draft:early-exit-24"], None):
        result = engine.generate(PROMPTS[0], max_new_tokens=64, sampling=greedy, gamma=3, drafters=drafters)
        assert result.token_ids == plain, f"drafters={drafters} diverged"
        stats.append(result.stats)
    assert 0 < stats[0]["accepted"] < stats[0]["proposed"], stats[0]  # the draft model's drafts: accepts and rejects


def test_bandit_run_accepts_drafts_and_saves_forwards(embedded_engine):
    result = embedded_engine.generate(PROMPTS[0], max_new_tokens=64, gamma="auto")
    assert result.stats["target_forwards"] < len(result.token_ids), result.stats
    assert result.stats["acceptance"] > 0


def test_shipped_head_drafts_open_text(embedded_engine):
    """The trained head guesses open text (no prompt to copy): most rounds emit more than one token. On the CPU the
    head ends its chains by the measured costs, so they are fixed here near an idle 2-core machine's (a forward 8 ms,
    8% more a token; a head step 0.75 ms): measured on a loaded machine they once cut its chains to 1.68 tokens a
    forward, where these give 2.29 (and measured ones 2.21-2.29 on an idle one)."""
    with fixed_costs(embedded_engine, step_ms=8.0, slope=0.08, head_ms=(0.35, 0.75), copy_ms=0.01):
        result = embedded_engine.generate(PROMPTS[2], max_new_tokens=64, drafters=["draft_head"], gamma=4)
    assert result.stats["tokens_per_forward"] > 1.8, result.stats


def test_ngram_cache_drafts_a_recurring_answer(embedded_engine):
    """Asked the same question again in a session, the n-gram cache copies its first answer: still exactly plain
    decoding's tokens, in far fewer target forwards; after reset_session it has nothing to copy from."""
    engine, greedy = embedded_engine, SamplingConfig(temperature=0.0)
    engine.reset_session()
    plain = engine.generate(PROMPTS[2], max_new_tokens=48, sampling=greedy, mode="plain").token_ids  # observed too
    again = engine.generate(PROMPTS[2], max_new_tokens=48, sampling=greedy, gamma="auto", drafters=["ngram_cache"])
    engine.reset_session()
    cold = engine.generate(PROMPTS[2], max_new_tokens=48, sampling=greedy, gamma="auto", drafters=["ngram_cache"])
    engine.reset_session()
    assert again.token_ids == plain and cold.token_ids == plain
    assert again.stats["target_forwards"] <= len(plain) / 4 < cold.stats["target_forwards"], (again.stats, cold.stats)
