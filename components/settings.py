"""The pickers: model pair, drafters, gamma, sampling, bandit strategy and kernel backend, and the pure
functions that turn their raw values into a `RunSettings` the engine understands (or a clear ValueError).

Model pairs are data: every entry of `flashspec_core.PRESETS` (the embedded offline default first), plus
"custom" for free-text Hub ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from flashspec_core import PRESETS, STRATEGIES, SamplingConfig
from flashspec_core.drafters import MODEL_FREE
from flashspec_core.engine import DRAFT_HEAD
from flashspec_core.models import pick_device
from kernels import BACKENDS, resolve_backend, triton_available

DEFAULT_PAIR = "embedded"
CUSTOM = "custom"
DRAFT_MODEL = "draft_model"  # the role of a draft-model entry in a pair, whatever its Hub id
DRAFTER_ROLES = (DRAFT_MODEL, DRAFT_HEAD, "prompt_lookup", "ngram_cache")
NAMED = (*MODEL_FREE, DRAFT_HEAD)  # drafter entries that are roles by name (others are draft-model ids)
TARGET_NAMES = {"embedded": "SmolLM2-135M-Instruct"}
MAX_UI_GAMMA = 16
MAX_UI_TOKENS = 1024


@dataclass(frozen=True)
class PairSpec:
    """A target and the drafters loaded beside it (Hub ids or folders for draft models, else model-free names)."""
    name: str  # preset name, or "custom"
    target: str  # Hub id, folder or "embedded"
    drafters: tuple[str, ...]  # in engine order

    def roles(self) -> list[str]:
        return [d if d in NAMED else DRAFT_MODEL for d in self.drafters]

    @property
    def label(self) -> str:
        models = [d for d in self.drafters if d not in NAMED] + (["draft head"] if DRAFT_HEAD in self.drafters else [])
        return TARGET_NAMES.get(self.target, self.target) + (f" + {', '.join(models)}" if models else "")


@dataclass(frozen=True)
class RunSettings:
    """Everything one run needs besides the prompt, validated."""
    pair: PairSpec
    roles: tuple[str, ...]  # drafter roles the bandit may use (subset of pair.roles())
    gamma: int | str  # K in 1..16, or "auto"
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int
    bandit: str  # one of STRATEGIES
    backend: str  # as picked: "torch" | "triton" | "auto"

    def record(self) -> dict:
        """The settings as flat columns of the runs table."""
        return {"pair": self.pair.label, "drafters": "+".join(self.roles), "gamma": str(self.gamma),
                "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                "max_new_tokens": self.max_new_tokens, "seed": self.seed, "bandit": self.bandit,
                "backend": self.backend}


# ----------------------------------------------------------------------------------------------------
# Pure functions


def pair_choices() -> list[tuple[str, str]]:
    """(label, value) pairs for the model-pair dropdown: embedded first, then the Hub presets, then custom."""
    names = [DEFAULT_PAIR] + sorted(n for n in PRESETS if n != DEFAULT_PAIR)
    out = []
    for n in names:
        spec = resolve_pair(n)
        suffix = f" (offline: {spec.label})" if n == DEFAULT_PAIR else f": {spec.label}"
        out.append((n + suffix, n))
    return out + [("custom Hub ids (type them below)", CUSTOM)]


def resolve_pair(choice: str, target: str = "", draft: str = "") -> PairSpec:
    """A preset name, or CUSTOM with free-text ids -> PairSpec. Raises ValueError on an unknown or empty choice."""
    if choice == CUSTOM:
        target, draft = (target or "").strip(), (draft or "").strip()
        if not target:
            raise ValueError("custom pair: type a target model (a Hub id such as 'Qwen/Qwen2.5-1.5B-Instruct', "
                             "a local folder, or 'embedded')")
        return PairSpec(CUSTOM, target, tuple(([draft] if draft else []) + ["prompt_lookup", "ngram_cache"]))
    if choice not in PRESETS:
        raise ValueError(f"unknown model pair {choice!r}; expected one of {sorted(PRESETS) + [CUSTOM]}")
    return PairSpec(choice, PRESETS[choice]["target"], tuple(PRESETS[choice]["drafters"]))


def role_choices(spec: PairSpec | None) -> list[tuple[str, str]]:
    """(label, value) pairs for the drafter checkboxes; a pair without a draft model offers no draft-model box."""
    roles = spec.roles() if spec is not None else [r for r in DRAFTER_ROLES if r != DRAFT_HEAD]  # none ships for custom
    labels = {DRAFT_MODEL: "draft model", DRAFT_HEAD: "draft head", "prompt_lookup": "prompt lookup",
              "ngram_cache": "n-gram cache"}
    return [(labels[r], r) for r in DRAFTER_ROLES if r in roles]


def arm_names(spec: PairSpec, engine_arms: list[str], roles) -> list[str]:
    """Engine arm names for the chosen roles. engine_arms lists the engine's drafters in construction order
    (the pair's drafters, then no_draft). Roles the pair lacks are ignored; none left is an error."""
    chosen = [arm for role, arm in zip(spec.roles(), engine_arms) if role in set(roles or ())]
    if not chosen:
        raise ValueError(f"choose at least one drafter this pair has: {[label for label, _ in role_choices(spec)]}")
    return chosen


def parse_gamma(auto: bool, value) -> int | str:
    if auto:
        return "auto"
    if value is None or float(value) != int(value) or not 1 <= int(value) <= MAX_UI_GAMMA:
        raise ValueError(f"gamma must be an integer in 1..{MAX_UI_GAMMA} or auto, got {value!r}")
    return int(value)


def parse_settings(pair: str, target: str, draft: str, roles, gamma_auto: bool, gamma, temperature, top_p,
                   max_new_tokens, seed, bandit: str, backend: str) -> RunSettings:
    """Raw picker values -> RunSettings. Raises ValueError naming the bad value and the allowed ones."""
    spec = resolve_pair(pair, target, draft)
    if not roles:
        raise ValueError("choose at least one drafter for the bandit")
    if bandit not in STRATEGIES:
        raise ValueError(f"unknown bandit strategy {bandit!r}; expected one of {list(STRATEGIES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {list(BACKENDS)}")
    if max_new_tokens is None or int(max_new_tokens) != max_new_tokens or not 1 <= max_new_tokens <= MAX_UI_TOKENS:
        raise ValueError(f"max new tokens must be an integer in 1..{MAX_UI_TOKENS}, got {max_new_tokens!r}")
    if seed is None or int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    sampling = SamplingConfig(temperature=float(temperature or 0.0), top_p=float(top_p if top_p is not None else 1.0))
    return RunSettings(spec, tuple(r for r in DRAFTER_ROLES if r in set(roles)), parse_gamma(gamma_auto, gamma),
                       sampling, int(max_new_tokens), int(seed), bandit, backend)


def backend_choices(device=None) -> list[tuple[str, str]]:
    """Radio choices for the kernel backend, each saying what it means on this machine."""
    device = device if device is not None else pick_device("auto")
    auto = resolve_backend("auto", device)
    triton_ok = triton_available(device)
    return [("auto (here: " + auto + ")", "auto"), ("torch (reference)", "torch"),
            ("triton" + ("" if triton_ok else " (unavailable here: needs CUDA)"), "triton")]


# ----------------------------------------------------------------------------------------------------
# The panel


def build_settings() -> dict[str, gr.components.Component]:
    """The pickers, in a column; returns them by name."""
    spec = resolve_pair(DEFAULT_PAIR)
    c = {}
    with gr.Group():
        c["pair"] = gr.Dropdown(pair_choices(), value=DEFAULT_PAIR, label="Model pair", elem_id="pair")
        with gr.Row(visible=False) as c["custom_row"]:
            c["target"] = gr.Textbox(label="Target model (Hub id or folder)", elem_id="target",
                                     placeholder="Qwen/Qwen2.5-1.5B-Instruct")
            c["draft"] = gr.Textbox(label="Draft model (Hub id, optional)", elem_id="draft",
                                    placeholder="Qwen/Qwen2.5-0.5B-Instruct")
    c["roles"] = gr.CheckboxGroup(role_choices(spec), value=spec.roles(), label="Drafters the bandit may use",
                                  info="With two or more, the bandit also keeps a no-draft arm.", elem_id="roles")
    with gr.Row():
        c["gamma"] = gr.Slider(1, MAX_UI_GAMMA, value=4, step=1, label="Gamma (draft tokens per round)",
                               elem_id="gamma")
        c["gamma_auto"] = gr.Checkbox(value=False, label="Auto gamma", elem_id="gamma-auto",
                                      info="Per drafter, from its acceptance and measured costs.")
    with gr.Row():
        c["temperature"] = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                     elem_id="temperature")
        c["top_p"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p", elem_id="top-p")
    with gr.Row():
        c["max_new_tokens"] = gr.Slider(1, MAX_UI_TOKENS, value=128, step=1, label="Max new tokens",
                                        elem_id="max-new-tokens")
        c["seed"] = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed")
    with gr.Row():
        c["bandit"] = gr.Radio(list(STRATEGIES), value="ucb1", label="Bandit strategy", elem_id="bandit")
        c["backend"] = gr.Radio(backend_choices(), value="auto", label="Kernel backend", elem_id="backend")
    return c


SETTING_NAMES = ("pair", "target", "draft", "roles", "gamma_auto", "gamma", "temperature", "top_p",
                 "max_new_tokens", "seed", "bandit", "backend")  # parse_settings' arguments, in order
