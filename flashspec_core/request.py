"""A stream's request and its checks, made before any state changes ("validate eagerly, generate lazily"), and
the arms it resolves to. Errors name the bad value (short) and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashspec_core.bandit import STRATEGIES
from flashspec_core.checks import is_int, shown
from flashspec_core.drafters import NoDraft
from flashspec_core.gamma import MAX_GAMMA
from flashspec_core.sampling import SamplingConfig
from flashspec_core.tree_round import TreeSize

MODES = ("speculative", "plain")


@dataclass(frozen=True)
class Request:
    """What `Engine.stream` was asked for, as given (unchecked until `arms_for`)."""
    prompt_len: int  # tokens of the encoded prompt
    max_new_tokens: object  # a positive int
    sampling: object  # a SamplingConfig
    gamma: object  # an int in 0..MAX_GAMMA or "auto"
    mode: object  # one of MODES
    drafters: object  # None (all) or a list of drafter names
    bandit: object  # None (the engine's strategy) or one of STRATEGIES
    tree: object = None  # None (chains) or a tree_round.TreeSize for the draft head's rounds


def arms_for(r: Request, drafters: list[str], window: int) -> list[str]:
    """Check `r` against an engine with these drafter names and context window; return the stream's arms: the
    no-draft arm alone in plain mode, else the named drafters (default: all) plus the no-draft arm when there are
    several, so the bandit can always fall back to plain decoding."""
    _check_settings(r, window)
    if r.drafters is not None and (not isinstance(r.drafters, (list, tuple))
                                   or not all(isinstance(n, str) for n in r.drafters)):
        raise ValueError(f"drafters must be a list of drafter names, got {shown(r.drafters)}")
    names = list(r.drafters) if r.drafters else [n for n in drafters if n != NoDraft.name]
    unknown = [n for n in names if n not in drafters]
    if unknown:
        raise ValueError(f"unknown drafters {shown(unknown)}; this engine has {sorted(drafters)}")
    if r.mode == "plain":
        return [NoDraft.name]
    if len(names) > 1 and NoDraft.name not in names:
        names.append(NoDraft.name)
    return names or [NoDraft.name]


def _check_settings(r: Request, window: int) -> None:
    if not isinstance(r.mode, str) or r.mode not in MODES:
        raise ValueError(f"unknown mode {shown(r.mode)}; expected one of {list(MODES)}")
    if not isinstance(r.sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(r.sampling).__name__}")
    if not is_int(r.max_new_tokens) or r.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {shown(r.max_new_tokens)}")
    if r.prompt_len + r.max_new_tokens > window:
        raise ValueError(f"prompt ({r.prompt_len} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds the "
                         f"model's context window of {window} tokens")
    if r.gamma != "auto" and (not isinstance(r.gamma, int) or isinstance(r.gamma, bool) or not 0 <= r.gamma <= MAX_GAMMA):
        raise ValueError(f"gamma must be an integer in 0..{MAX_GAMMA} or 'auto', got {shown(r.gamma)}")
    if r.tree is not None and not isinstance(r.tree, TreeSize):
        raise ValueError(f"tree must be None or a TreeSize(depth, top_k, size), got {shown(r.tree)}")
    if r.bandit is not None and (not isinstance(r.bandit, str) or r.bandit not in STRATEGIES):
        raise ValueError(f"unknown bandit strategy {shown(r.bandit)}; expected one of {sorted(STRATEGIES)}")
