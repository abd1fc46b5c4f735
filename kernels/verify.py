"""Speculative verification: the exact accept/reject test of Leviathan et al. / Chen et al. (2023).

Given K draft tokens with their draft distribution q and the target distribution p at K + 1 positions,
accept draft token x_i with probability min(1, p_i(x) / q_i(x)); at the first rejection emit one token
from norm(max(0, p_i - q_i)); after a full accept emit a bonus token from p_K. The emitted tokens then
follow p exactly. `p` = target, `q` = draft, everywhere in this file.

Layout follows the Triton tutorials: the pure-PyTorch reference first (it is the specification), then
the Triton kernel, then its launcher with the same signature, then the backend switch.

Randomness is explicit so that backends can be compared bit for bit:
  uniform [B, K]  float32 in [0, 1): acceptance draws.
  noise   [B, V]  float32 Exp(1) draws: the residual or bonus token is argmax(w / noise) over the vocabulary,
                  where w is the unnormalised residual max(0, p - q) (or p for the bonus). This is the
                  exponential-race form of sampling from norm(w): no normalise-and-cumsum pass is needed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BACKENDS = ("torch", "triton", "auto")


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per row
    tokens: torch.Tensor  # [B, K+1] int64: accepted drafts, then the resampled/bonus token, then -1


def _check_inputs(draft_tokens, draft_probs, target_probs, uniform, noise):
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[0] != B or target_probs.shape[1] != K + 1:
        raise ValueError(f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K, V):
        raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, {V}], got {tuple(draft_probs.shape)}")
    if uniform is not None and tuple(uniform.shape) != (B, K):
        raise ValueError(f"uniform must be [B, K] = [{B}, {K}], got {tuple(uniform.shape)}")
    if noise is not None and tuple(noise.shape) != (B, V):
        raise ValueError(f"noise must be [B, V] = [{B}, {V}], got {tuple(noise.shape)}")
    return B, K, V


def draw_randoms(B: int, K: int, V: int, device, generator: torch.Generator | None = None):
    """The uniform [B, K] and Exp(1) noise [B, V] draws that one verification consumes."""
    uniform = torch.rand((B, K), device=device, generator=generator, dtype=torch.float32)
    noise = torch.empty((B, V), device=device, dtype=torch.float32).exponential_(generator=generator)
    return uniform, noise


# ----------------------------------------------------------------------------------------------------
# Reference (the specification)


def verify_torch(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, None when the drafter is deterministic (q one-hot)
    target_probs: torch.Tensor,  # [B, K+1, V] float32, already temperature/top-k/top-p processed
    *,
    uniform: torch.Tensor | None = None,  # [B, K]
    noise: torch.Tensor | None = None,  # [B, V]
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> VerifyResult:
    B, K, V = _check_inputs(draft_tokens, draft_probs, target_probs, uniform, noise)
    rows = torch.arange(B, device=draft_tokens.device)
    if greedy:
        best = target_probs.argmax(dim=-1)  # [B, K+1]
        accept = draft_tokens == best[:, :K]
    else:
        if uniform is None or noise is None:
            u, e = draw_randoms(B, K, V, target_probs.device, generator)
            uniform = u if uniform is None else uniform
            noise = e if noise is None else noise
        p_x = target_probs[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        accept = uniform * q_x < p_x  # u < p/q without dividing; q = 0 accepts whenever p > 0
    num_accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]

    if greedy:
        final = best[rows, num_accepted]
    else:
        p_n = target_probs[rows, num_accepted]  # [B, V]; position K is the bonus position
        if draft_probs is None:
            q_n = torch.zeros_like(p_n)
            has_draft = num_accepted < K
            q_n[rows[has_draft], draft_tokens[has_draft, num_accepted[has_draft]]] = 1.0
        else:
            q_pad = torch.cat([draft_probs, draft_probs.new_zeros((B, 1, V))], dim=1)  # [B, K+1, V]
            q_n = q_pad[rows, num_accepted]
        residual = (p_n - q_n).clamp_min(0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q: the residual is empty; fall back to p
        w = torch.where(empty, p_n, residual)
        final = (w / noise).argmax(dim=-1)

    positions = torch.arange(K + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)  # [B, K+1]
    tokens = torch.where(positions < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens[rows, num_accepted] = final
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


# ----------------------------------------------------------------------------------------------------
# Triton kernel and launcher (same signature as the reference)

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend still works without triton
    triton = None

verify_triton = None  # defined below when triton is importable


# ----------------------------------------------------------------------------------------------------
# Backend switch


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when the Triton backend can run on `device` (CUDA, or any device under TRITON_INTERPRET=1)."""
    if verify_triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    dev = torch.device(device) if device is not None else None
    return torch.cuda.is_available() and (dev is None or dev.type == "cuda")


def resolve_backend(name: str, device: torch.device | str | None = None) -> str:
    """Map "torch" | "triton" | "auto" to the backend that will run; raise on unknown names."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(BACKENDS)}")
    if name == "auto":
        dev = torch.device(device) if device is not None else None
        on_cuda = dev is not None and dev.type == "cuda"
        return "triton" if on_cuda and triton_available(dev) else "torch"
    if name == "triton" and not triton_available(device):
        raise ValueError("backend 'triton' needs CUDA (or TRITON_INTERPRET=1) and the triton package; use 'torch' or 'auto'")
    return name


def verify(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (deterministic drafter)
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    *,
    uniform: torch.Tensor | None = None,  # [B, K]
    noise: torch.Tensor | None = None,  # [B, V]
    generator: torch.Generator | None = None,
    greedy: bool = False,
    backend: str = "auto",
) -> VerifyResult:
    """Run the exact speculative test with the chosen backend ("torch" | "triton" | "auto")."""
    chosen = resolve_backend(backend, target_probs.device)
    if chosen == "triton":
        return verify_triton(draft_tokens, draft_probs, target_probs, uniform=uniform, noise=noise,
                             generator=generator, greedy=greedy)
    return verify_torch(draft_tokens, draft_probs, target_probs, uniform=uniform, noise=noise,
                        generator=generator, greedy=greedy)
