"""Sampling configuration and logits -> probabilities; the same transform is applied to p and q.

`p` is the target's distribution, `q` the draft's. Temperature 0 means greedy: the engine then compares
argmaxes and never samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from flashspec_core.checks import is_int, is_real, shown
from kernels.verify import argmax

MIN_TEMPERATURE = 1e-6  # below this (but above 0) logits / temperature overflow float32 into NaN probabilities


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy; > 0 divides the logits
    top_k: int = 0  # 0 = off; else keep the k most likely tokens
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off

    def __post_init__(self):
        t = self.temperature
        if not is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy) and finite, got {shown(t)}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {shown(self.top_k)}")
        if not is_real(self.top_p) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {shown(self.top_p)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p may drop tokens when sampling (a captured round then sorts the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def draft_sampling(cfg: SamplingConfig, draft_temperature: float) -> SamplingConfig:
    """The settings a drafter draws from when it drafts at `draft_temperature` times the target's temperature
    (greedy stays greedy). Any q keeps the output exact, since the accept test reads the q drafted from; a q
    sharper than the target's law can be accepted more often."""
    if cfg.greedy or draft_temperature == 1.0:
        return cfg
    return replace(cfg, temperature=max(MIN_TEMPERATURE, cfg.temperature * draft_temperature))


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float()
    if cfg.greedy:  # a one-hot at the argmax: what greedy decoding samples from
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # keep a token while the mass before it < top_p
        drop_sorted = mass_before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from [B, V] probabilities (exponential race; no device->host sync)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax(probs / noise)


def sampling_params(cfg: SamplingConfig, device) -> torch.Tensor:
    """The settings of a sampling `cfg` as a device tensor [3] (temperature, top_k, top_p) for `logits_to_probs_at`:
    top_k 0 and top_p 1 (off) become the vocabulary and infinity, which keep every token exactly."""
    top_p = cfg.top_p if cfg.top_p < 1.0 else math.inf
    return torch.tensor([cfg.temperature or 1.0, cfg.top_k, top_p], dtype=torch.float32, device=device)


def logits_to_probs_at(logits: torch.Tensor, params: torch.Tensor, truncates: bool = True) -> torch.Tensor:
    """`logits_to_probs` for sampling, with its settings in a device tensor params [3] (`sampling_params`): one
    sequence of ops for every setting of top-k and top-p, so one captured graph serves them all. [..., V] -> [..., V]
    float32. truncates False (the settings' `SamplingConfig.truncates`): temperature alone, without the sort that
    top-k and top-p need; the same bits as the full sequence gives for settings that keep every token."""
    logits = logits.float() / params[0]
    if not truncates:
        return logits.softmax(dim=-1)
    V = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    k = params[1].long()
    k = torch.where((k > 0) & (k < V), k, V)  # 0 = off
    kth = sorted_logits.gather(-1, (k - 1).expand(*logits.shape[:-1], 1))  # the k-th largest (ties kept, as topk)
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # keep a token while the mass before it < top_p
    drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter_(-1, order, mass_before >= params[2])
    return logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
