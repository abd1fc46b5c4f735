"""A decode attention for grouped-query models that reads each cached key and value once, for Hugging Face models.

Transformers' SDPA path copies every key/value head `num_key_value_groups` times (`repeat_kv`) whenever an
attention mask is given, and a static cache always gives one: at a large batch a decode step then moves about
three times the whole cache per layer (the embedded model has 9 query heads over 3 key/value heads). Here the
query heads of a group attend to their shared keys as one matrix product, [B, H_kv, G, D] @ [B, H_kv, D, T]
(one new token per row); prompts (more than one token per row) keep the SDPA path. Registered under the name
"grouped_sdpa": `use_grouped_attention(model)` switches a loaded model to it.
"""
from __future__ import annotations

import torch

NAME = "grouped_sdpa"


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [B, H, Tq, D], key/value [B, H_kv, T, D], attention_mask [B, 1, Tq, T] (bool: True = attend, or
    additive float); returns [B, Tq, H, D] as transformers' attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, Tq, D = query.shape
    Hkv = key.shape[1]
    if Tq != 1 or Hkv == H or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = D ** -0.5 if scaling is None else scaling
    q = query.reshape(B, Hkv, H // Hkv, D)  # the G query heads of a group share one key/value head
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, H_kv, G, T]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, :]  # [B, 1, 1, T]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)  # [B, H_kv, G, D]
    return out.reshape(B, H, 1, D).transpose(1, 2), None


def use_grouped_attention(model) -> None:
    """Register the function (once) and switch `model` to it, masks made as for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
