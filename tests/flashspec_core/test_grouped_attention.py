"""The grouped decode attention equals transformers' SDPA path (which repeats key/value heads)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flashspec_core import grouped_attention as ga


class _Module:
    num_key_value_groups = 3
    is_causal = True


def test_one_token_attention_equals_sdpa_with_a_padding_mask():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 5, 9, 3, 37, 16
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(2, B, Hkv, T, D, generator=g)
    mask = torch.rand(B, 1, 1, T, generator=g) > 0.3
    mask[..., -1] = True  # the new token always sees itself
    want, _ = sdpa_attention_forward(_Module(), q, k, v, mask, scaling=0.25)
    got, _ = ga.grouped_attention(_Module(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (B, 1, H, D)
    assert (got - want).abs().max().item() < 1e-5


def test_static_cache_generation_is_unchanged_and_uses_the_grouped_step(monkeypatch):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 300, (4, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[2, :2] = 0  # left padding, as the data's batches have
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2, cache_implementation="static")
    want = model.generate(ids, **kw)
    calls = []
    inner = ga.grouped_attention
    monkeypatch.setattr(ga, "grouped_attention", lambda m, q, *a, **k: calls.append(q.shape[2]) or inner(m, q, *a, **k))
    ga.use_grouped_attention(model)
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert calls.count(1) == 11 * cfg.num_hidden_layers  # every decode step of every layer took the grouped path
