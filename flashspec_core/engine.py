"""The speculative decoding engine: exact (output distribution = the target's), streaming, bandit-driven.

`Engine.stream` yields one `RoundEvent` per round; `Engine.generate` drains it. Each round the host policy
(`policy.HostPolicy`: bandit, K) chooses, the device round (`round.DeviceRound`) drafts, verifies, accepts,
rolls back and updates, the policy learns from the round's host numbers and the event builder
(`events.EventBuilder`) yields its event; `stream.py` holds the nouns they share. Plain decoding is the same
round with the no-draft arm (K = 0), through the same caches, so comparisons are fair. This module builds
engines (presets, Hub ids, built models) and checks what comes in.
"""
from __future__ import annotations

import functools
import gc
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from flashspec_core import native
from flashspec_core.bandit import Bandit
from flashspec_core.checks import SEED_RANGE, check_text, is_int, shown
from flashspec_core.draft_head import DraftHead, HeadMismatchError, load_head
from flashspec_core.drafters import MODEL_FREE, DraftHeadDrafter, DraftModel, Drafter, NoDraft
from flashspec_core.events import EventBuilder, summarize
from flashspec_core.fast_path import MODES as FAST_PATH_MODES
from flashspec_core.fast_path import fast_or_eager
from flashspec_core.gamma import MAX_AUTO_GAMMA
from flashspec_core.gguf_weights import GGUFFile
from flashspec_core.models import CausalLM, embedded_gguf, load_model, pick_device, pick_dtype, pick_precision
from flashspec_core.policy import HostPolicy
from flashspec_core.request import MODES, Request, arms_for
from flashspec_core.round import DeviceRound, Launched
from flashspec_core.sampling import SamplingConfig
from flashspec_core.stream import GenerationResult, Played, RoundEvent, RoundOutput, StreamState, TokenSpan
from flashspec_core.tree_round import COPY_SOURCES
from kernels import resolve_backend

# the names other modules import from here (the event types and `summarize` live in stream.py and events.py)
__all__ = ["DRAFT_HEAD", "HEADS", "MODES", "NAMED_DRAFTERS", "PRESETS", "Engine", "EngineBusyError", "GenerationResult",
           "RoundEvent", "RoundOutput", "TokenSpan", "check_same_vocabulary", "head_for", "paths", "summarize"]

DRAFT_HEAD = "draft_head"  # a drafter entry: the trained head shipped for the target (see HEADS)
NAMED_DRAFTERS = (*MODEL_FREE, DRAFT_HEAD)  # drafter entries that are names, not model ids
ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class ShippedHead:
    folder: Path  # an EAGLE-3 folder written by flashspec_core.train_head
    vocab_limit: int | None = None  # draft from this many of its most frequent ids (a cheaper step); None = all


# One sampling of each kind a captured round's graphs tell apart: greedy, temperature alone, top-k or top-p on
LAWS = (SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_p=0.9))
HEADS = {"embedded": ShippedHead(ASSETS / "draft_head", vocab_limit=12288)}  # target -> its trained head

# Model pairs are data. Drafter entries: a Hub id or folder (a draft model), or a model-free drafter name.
PRESETS = {
    "embedded": dict(target="embedded", drafters=["draft_head", "prompt_lookup", "ngram_cache"]),
    "smollm2-1.7b": dict(target="HuggingFaceTB/SmolLM2-1.7B-Instruct",
                         drafters=["HuggingFaceTB/SmolLM2-135M-Instruct", "prompt_lookup", "ngram_cache"]),
    "qwen2.5-1.5b": dict(target="Qwen/Qwen2.5-1.5B-Instruct",
                         drafters=["Qwen/Qwen2.5-0.5B-Instruct", "prompt_lookup", "ngram_cache"]),
    "tinyllama-1.1b": dict(target="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
                           drafters=["Felladrin/Llama-160M-Chat-v1", "prompt_lookup", "ngram_cache"]),
}


class EngineBusyError(RuntimeError):
    """A second stream was resumed while another stream of the same engine was still open."""


class Engine:
    """A target model, its drafters, a kernel backend and a bandit strategy. Not thread-safe: one stream at a time."""

    def __init__(self, target: CausalLM, drafters: list[Drafter], tokenizer=None, *, kernel_backend: str = "auto",
                 bandit: str = "ucb1", window: int = 200, eos_ids: set[int] | None = None, name: str = "custom",
                 captured: str = "auto"):
        resolve_backend(kernel_backend, target.device)  # fail early on unknown names
        Bandit(["x"], bandit, window)  # likewise for the strategy
        self.target, self.tokenizer, self.name = target, tokenizer, name
        self.kernel_backend, self.bandit_strategy, self.window = kernel_backend, bandit, window
        if len({d.aux_layers for d in drafters if d.aux_layers}) > 1:
            raise ValueError("drafters read hidden states from different target layers; the engine feeds one set")
        self.drafters: dict[str, Drafter] = {}
        for d in [*drafters, NoDraft(target.device)]:
            if d.name in self.drafters:
                if isinstance(d, NoDraft):
                    continue
                raise ValueError(f"two drafters are named {d.name!r}")
            self.drafters[d.name] = d
        self.eos_ids = set(eos_ids or ())
        self.round = DeviceRound(target, self.drafters, kernel_backend, captured)  # draft, verify, accept, roll back
        self.policy = HostPolicy(self.drafters)  # arm and K choices, rewards, the machine's measured costs
        self.events = EventBuilder(tokenizer, self.eos_ids)  # stop checks, events, text pieces
        self.rechosen = 0  # rounds whose arm was chosen again once the round before them landed (`_play`)
        self.launch_ahead = True  # captured rounds: launch the next on-device round before this one lands (`_play`)

    # ------------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_preset(cls, name: str = "embedded", **kwargs) -> "Engine":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_pretrained(**{**PRESETS[name], **kwargs}, name=name)

    @classmethod
    def from_pretrained(cls, target: str = "embedded", drafters: list[str] = ("prompt_lookup", "ngram_cache"), *,
                        device: str = "auto", dtype: str = "auto", kernel_backend: str = "auto",
                        bandit: str = "ucb1", fast_path: str = "auto", precision: str = "auto", progress=None,
                        name: str | None = None, captured: str = "auto") -> "Engine":
        """Load a target and its drafters by Hub id, local folder, 'embedded', or model-free drafter name.

        precision: "gguf" runs the target on its GGUF file's own 4-bit weights (the embedded model on the CPU;
        `fast_path.StaticCausalLM`), "float32" on the dequantised weights in `dtype`, "auto" = gguf where it can.
        """
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        resolve_backend(kernel_backend, dev)
        Bandit(["x"], bandit)
        precision = pick_precision(precision, target, dev)
        model, tokenizer = load_model(target, dev, dt, progress)
        gguf = embedded_gguf(model.config) if precision == "gguf" else None
        draft_models = {}
        for d in drafters:
            if d == DRAFT_HEAD:
                draft_models[d] = (head_for(target, model, packed=gguf is not None), tokenizer)  # a built DraftHeadDrafter
            elif d not in MODEL_FREE:
                draft_models[d] = load_model(d, dev, dt, progress)
                check_same_vocabulary(tokenizer, draft_models[d][1], target, d)
        engine = cls.from_models(model, [draft_models[d][0] if d in draft_models else d for d in drafters],
                                 tokenizer=tokenizer, kernel_backend=kernel_backend, bandit=bandit, fast_path=fast_path,
                                 draft_names=[_short(d) for d in drafters], name=name or target, gguf=gguf,
                                 captured=captured)
        settle_heap()
        return engine

    @classmethod
    def from_models(cls, target_model, drafters: list = ("prompt_lookup", "ngram_cache"), tokenizer=None, *,
                    kernel_backend: str = "auto", bandit: str = "ucb1", fast_path: str = "auto",
                    draft_names: list[str] | None = None, name: str = "custom", gguf: GGUFFile | None = None,
                    captured: str = "auto") -> "Engine":
        """Wrap already-built Hugging Face models. Drafters: draft models or model-free drafter names.

        fast_path: "auto" = static KV cache + CUDA graphs on CUDA for Llama-family models, else eager;
        "on" = the static path (raises for unsupported models); "off" = eager Hugging Face with DynamicCache.
        gguf: the target's GGUF file: its linear layers run on the file's own 4-bit weights (CPU, static path).
        captured: "auto" = whole rounds as CUDA graphs where they replay (`flashspec_core.captured`), "eager" = that
        code without graphs, "off" = eager rounds (the target's forwards still replay their own graphs on CUDA).
        """
        if fast_path not in FAST_PATH_MODES:
            raise ValueError(f"unknown fast_path {fast_path!r}; expected one of {list(FAST_PATH_MODES)}")
        device = next(target_model.parameters()).device
        models = [d for d in drafters if not isinstance(d, (str, DraftHead, Drafter))]
        widths = [target_model.config.vocab_size] + [m.config.vocab_size for m in models]
        if tokenizer is None and len(set(widths)) > 1:
            raise ValueError(f"target and draft vocabularies differ ({widths}) and there is no tokenizer to reconcile them")
        vocab = min(widths)
        if tokenizer is not None and vocab < len(tokenizer):
            raise ValueError(f"a model's output width {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
        built = []
        for i, d in enumerate(drafters):
            if isinstance(d, str):
                if d not in MODEL_FREE:
                    raise ValueError(f"unknown drafter {d!r}; expected a model or one of {sorted(MODEL_FREE)}")
                built.append(MODEL_FREE[d](device))
            elif isinstance(d, DraftHead):
                built.append(DraftHeadDrafter(d, vocab))
            elif isinstance(d, Drafter):
                built.append(d)
            else:
                label = draft_names[i] if draft_names else f"draft_model{'' if len(models) == 1 else i}"
                built.append(DraftModel(fast_or_eager(d.eval(), vocab, mode=fast_path), name=label))
        eos = _eos_ids(target_model, tokenizer)
        return cls(fast_or_eager(target_model.eval(), vocab, mode=fast_path, gguf=gguf), built, tokenizer,
                   kernel_backend=kernel_backend, bandit=bandit, eos_ids=eos, name=name, captured=captured)

    # ------------------------------------------------------------------------------------------------
    # Public API

    @property
    def precision(self) -> str:
        """What the target computes with: "gguf" (its file's 4-bit weights) or its weights' dtype, e.g. "float32"."""
        if getattr(self.target, "gguf", False):
            return "gguf"
        return str(next(self.target.model.parameters()).dtype).removeprefix("torch.")

    def encode(self, prompt, chat: bool = True) -> list[int]:
        """A str (through the chat template when chat=True and the tokenizer has one) or a list of token ids."""
        if isinstance(prompt, str):
            check_text(prompt)
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as a list of token ids")
            if chat and getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            else:
                ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            bad = [t for t in prompt if not is_int(t)]
            if bad:
                raise ValueError(f"token ids must be ints, got {shown(bad[0])} ({type(bad[0]).__name__})")
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"the prompt must be a str or a list of token ids (ints), got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token ids {shown(bad[:5])} are outside the vocabulary [0, {self.target.vocab_size})")
        return list(ids)

    def stream(self, prompt, max_new_tokens: int = 64, sampling: SamplingConfig | None = None, gamma="auto",
               mode: str = "speculative", seed: int = 0, chat: bool = True, drafters: list[str] | None = None,
               bandit: str | None = None, tree=None) -> Iterator[RoundEvent]:
        """Generate up to max_new_tokens, yielding one RoundEvent per round.

        gamma: K in 0..32, or "auto" (per drafter, from its acceptance and the costs measured by `calibrate`).
        drafters: names of the arms to use (default: all); one name = that drafter every round, several =
        a bandit over them and the no-draft arm. mode="plain" decodes one token a round through the same code.
        tree: a `TreeSize(depth, top_k, size)`: the draft head drafts a tree of that shape each time it is pulled
        (`tree_round`: trees run on the captured round where one applies, one graph a round, an auto-sized one at
        its bound, `TreeSize.fixed`, a sampled one in its static shape, `TreeSize.sampled`; without a captured round
        they run eager rounds, auto-sized ones sized per round). None: chains of K.
        """
        sampling = SamplingConfig() if sampling is None else sampling
        if not isinstance(chat, bool):
            raise ValueError(f"chat must be True or False, got {shown(chat)}")
        if not is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got {shown(seed)}")
        ids = self.encode(prompt, chat)
        arms = arms_for(Request(len(ids), max_new_tokens, sampling, gamma, mode, drafters, bandit, tree),
                        list(self.drafters), self.target.context_window)
        state = StreamState(rows=[ids], sampling=sampling, gamma=gamma, mode=mode, arms=arms, max_new_tokens=max_new_tokens,
                            generator=torch.Generator(device=self.target.device).manual_seed(int(seed)),
                            bandit=Bandit(arms, bandit or self.bandit_strategy, self.window, int(seed)) if len(arms) > 1 else None,
                            tree=tree.taken(sampling.greedy) if tree is not None else None)
        return self._one_stream_at_a_time(self._stream(state))

    @functools.cached_property
    def _streaming(self) -> threading.Lock:
        """Held while a stream of this engine is open (see `_one_stream_at_a_time`)."""
        return threading.Lock()

    def _one_stream_at_a_time(self, events: Iterator[RoundEvent]) -> Iterator[RoundEvent]:
        """Yield from `events` while holding the engine's stream lock. Every stream resets the shared KV caches,
        so a second stream resumed while another is open raises EngineBusyError instead of corrupting the first."""
        if not self._streaming.acquire(blocking=False):
            raise EngineBusyError("another stream of this engine is still open (one at a time): "
                                  "drain it or call its close() first")
        try:
            yield from events
        finally:
            self._streaming.release()

    def calibrate(self, context: int = 64, reps: int = 3) -> None:
        """Measure this machine's costs once: the target's forward over 1..MAX_AUTO_GAMMA + 1 tokens and each
        drafter's propose time per round and per token (`DeviceRound.draft_cost`; a drafter added later is measured
        when it first streams). Every decision that weighs costs (copy drafters' draft lengths, auto gamma, the
        bandit's rewards) uses these fixed numbers and the round's tokens, never the round's own timings, so a
        stream is a function of its prompt, settings and seed. Each stream calls it; it measures what is missing, and
        its streams leave no trace in what drafters remember (`Drafter.memory`)."""
        rows = [[1 + i % (self.target.vocab_size - 1) for i in range(context)]]
        if self.policy.calibrated and all(name in self.policy.draft_costs for name in self.drafters):
            return
        self.round.feed(rows, None)  # the streams a drafter that remembers missed are replayed into it first
        memories = {name: d.memory() for name, d in self.drafters.items()}  # calibration streams leave no trace
        if not self.policy.calibrated:
            self.policy.set_costs(self.round.forward_costs(rows, (1, 2, 3, 4, 5, 6, 8, 9, 12, MAX_AUTO_GAMMA + 1), reps))
        for name, d in self.drafters.items():
            if name not in self.policy.draft_costs:
                self.policy.set_draft_cost(name, self.round.draft_cost(rows, d, reps))
        for name, d in self.drafters.items():
            d.recall(memories[name])

    def warm_up(self, max_context: int = 2048, tree_tokens: int = 0, trees=()) -> float:
        """Measure the machine's costs (`calibrate`) and, where rounds replay as CUDA graphs, capture every graph a
        stream of up to `max_context` tokens can choose (each of `LAWS`, every K of gamma "auto", every context
        bucket; with tree_tokens, the target's tree verifies of 2..tree_tokens slots too, for eager trees; with
        trees, `TreeSize`s, the captured tree rounds of each one's fixed shape, greedy and sampled), so that
        streams capture nothing; then settles the heap (what the captures left alive, out of the collector's full
        passes, which otherwise stall a stream's round now and then); returns the seconds it took."""
        t0 = time.perf_counter()
        self.calibrate()
        for sampling in LAWS:
            # a sampled "auto" takes chains; a sampled tree drops its copied branch
            fixed = [t.taken(sampling.greedy).fixed for t in trees if sampling.greedy or not t.auto]
            self.round.warm_up(sampling, max_context, trees=list(dict.fromkeys(fixed)))
        if tree_tokens:
            self.round.warm_up_trees(max_context, tree_tokens)
        settle_heap()
        return time.perf_counter() - t0

    def reset_session(self) -> None:
        """Forget cross-generation memory (the n-gram cache), e.g. between benchmark rows."""
        for d in self.drafters.values():
            d.reset_session()
        self.round.reset_session()

    def generate(self, prompt, max_new_tokens: int = 64, sampling: SamplingConfig | None = None, **kwargs) -> GenerationResult:
        events = list(self.stream(prompt, max_new_tokens, sampling, **kwargs))
        ids = [t for e in events for t in e.emitted]
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
        stats = {**summarize(events), "paths": paths(self), "precision": self.precision,
                 "kernel_backend": resolve_backend(self.kernel_backend, self.target.device)}
        return GenerationResult(ids, text, stats, events)

    # ------------------------------------------------------------------------------------------------
    # The loop

    def _stream(self, s: StreamState) -> Iterator[RoundEvent]:
        """Choose an arm and K, run a round, learn from it, yield its event."""
        self.calibrate()
        s.t_start = time.perf_counter()  # generation is lazy: the clock starts with the first round's prefill
        copies = [n for n in COPY_SOURCES if s.tree and s.tree.copy and n in self.drafters and n not in s.arms]
        s.prefill_s = self.round.start(s.rows, s.sampling, s.generator,  # (a tree's copied branch: its drafters fed)
                                       len(s.rows[0]) + s.max_new_tokens + s.max_gamma + 1, s.max_gamma,
                                       s.arms + copies, tree_tokens=s.tree.verify_tokens if s.tree else 0,
                                       tree=_captured_shape(s))  # one graph a tree round (auto: its bound)
        ahead = None  # the next round, chosen (and maybe launched) before this one landed
        while s.produced < s.max_new_tokens:
            played, ahead = self._play(s, ahead)
            self.policy.learn(s, played)
            finished, emitted = self.events.finish(played.emitted, s.produced, s.max_new_tokens)
            s.produced += len(emitted)
            if finished == "eos":
                del s.rows[0][len(played.before) + len(emitted):]
            yield self.events.event(s, replace(played, emitted=emitted), finished)
            s.index += 1
            if finished:
                return

    def _play(self, s: StreamState, ahead: "Turn | None") -> tuple[Played, "Turn | None"]:
        """One round of the stream: the policy's arm and K, then the device round. On captured rounds the next
        round's arm is chosen before this one lands (the bandit and gamma "auto" read one round late) and, when it
        drafts on the device (`DeviceRound.on_device`) and the stream's end cannot cut its K, launched at once:
        the host's work on this round overlaps the device's on the next. A round that drafts from the host's rows
        (the copy drafters) launches as soon as this one has landed and its drafter has learnt it, before the other
        drafters learn it, the policy learns from it and its event is built; it plays only if still sure of the
        landed rows (`HostPolicy.still_sure`), else the round is chosen again (`_choose_again`)."""
        if self.round.captured is None or not self.launch_ahead:
            return self._play_now(s), None
        turn = self._launch(s, ahead or Turn(self.policy.choose(s)))
        ahead = Turn(self.policy.choose(s))
        if self.round.on_device(self.drafters[ahead.arm]):
            self._launch(s, ahead, in_flight=turn.launched.most)
        before = s.rows[0][:]
        out = self.round.land(s.rows, turn.launched, first=self.drafters[ahead.arm])
        emitted = s.rows[0][len(before):]
        if not self.events.finish(emitted, s.produced, s.max_new_tokens)[0]:
            if ahead.launched is None and not self.policy.still_sure(s, ahead.arm):
                ahead = Turn(self._choose_again(s))  # a copy arm chosen on the rows before this round, unsure of these
                self.rechosen += 1
            self._launch(s, ahead, uncounted=len(emitted))
        self.round.settle()
        return Played(turn.arm, turn.limit, before, emitted, out), ahead

    def _choose_again(self, s: StreamState) -> str:
        """The arm of a round whose copy arm, chosen one round late, is unsure of the landed rows: the bandit's among
        the arms that do not copy, at once; where all arms copy, chosen anew once every drafter has learnt the round."""
        arm = self.policy.choose_uncopied(s)
        if arm is None:
            self.round.settle()
            arm = self.policy.choose(s)
        return arm

    def _launch(self, s: StreamState, turn: "Turn", uncounted: int = 0, in_flight: int = 0) -> "Turn":
        """Launch `turn` (if it is not yet) with K cut to fit the stream (`_limit`). A round launched ahead of one in
        flight waits (unlaunched) where the stream's end could cut its K."""
        if turn.launched is None:
            turn.limit = self._limit(s, uncounted, in_flight)
            if in_flight == 0 or turn.limit >= max(s.max_gamma, getattr(s.tree, "longest", 0)):
                drafter = self.drafters[turn.arm]
                tree = self._captured_tree(s, drafter, turn.limit)
                k = 0 if tree else self.policy.gamma(s, turn.arm, turn.limit)
                turn.launched = self.round.launch(s.rows, drafter, k, s.sampling, s.generator, tree=tree)
        return turn

    def _captured_tree(self, s: StreamState, drafter: Drafter, limit: int):
        """The tree a captured round verifies for this arm (the head, one graph: its fixed shape, tree auto at its
        bound; sampled, the static shape), or None for a chain: other arms, or where the stream's end would cut its
        depth."""
        tree = _captured_shape(s)
        head = isinstance(drafter, DraftHeadDrafter) and self.round.captured is not None
        return tree if tree is not None and head and limit >= tree.longest else None

    def _limit(self, s: StreamState, uncounted: int = 0, in_flight: int = 0) -> int:
        """The most tokens a round may draft: K + 1 fit the tokens left and the context window. `uncounted`: tokens
        a landed round added to the rows that the stream has not counted yet; `in_flight`: the most that the round
        in flight may still add."""
        left = s.max_new_tokens - s.produced - uncounted - in_flight
        return min(left, self.target.context_window - len(s.rows[0]) - in_flight) - 1

    def _play_now(self, s: StreamState) -> Played:
        """One round chosen, run and landed at once (eager rounds, or captured ones without launching ahead)."""
        arm, limit = self.policy.choose(s), self._limit(s)
        before, drafter = s.rows[0][:], self.drafters[arm]
        captured_tree = self._captured_tree(s, drafter, limit)
        if captured_tree is not None:  # one graph: the fixed shape (tree auto: its bound)
            out = self.round.run_tree(s.rows, drafter, captured_tree, s.sampling, s.generator)
        elif s.tree is not None and isinstance(drafter, DraftHeadDrafter) and limit > 0 and self.round.captured is None:
            shape, nodes = self.policy.tree_plan(s, arm, s.tree.within(limit))
            out = self.round.run_tree(s.rows, drafter, shape, s.sampling, s.generator, nodes)
        else:  # a chain (on a captured round also where the stream's end would cut a tree's depth: it has no graph)
            out = self.round.run(s.rows, drafter, self.policy.gamma(s, arm, limit), s.sampling, s.generator)
        return Played(arm, limit, before, s.rows[0][len(before):], out)

    # The device round under the names the engine's tests have used (tests/flashspec_core: rollback and chi-squared
    # tests drive single rounds over hand-made rows).
    def _start(self, rows, sampling, generator, max_context=None, max_gamma=MAX_AUTO_GAMMA, arms=None) -> float:
        return self.round.start(rows, sampling, generator, max_context, max_gamma, arms)

    def _round(self, rows, drafter: Drafter, k: int, sampling: SamplingConfig, generator) -> RoundOutput:
        return self.round.run(rows, drafter, k, sampling, generator)


@dataclass
class Turn:
    """A round the policy chose: its arm, and once launched its K limit and the device round's record."""
    arm: str
    limit: int = 0
    launched: Launched | None = None


# ----------------------------------------------------------------------------------------------------
# Helpers


def paths(engine: "Engine") -> dict:
    """Which decoding path each model runs (e.g. "static+graphs", "eager (not on CUDA)")."""
    out = {"target": getattr(engine.target, "path", "eager")}
    for name, d in engine.drafters.items():
        if isinstance(d, DraftModel):
            out[name] = getattr(d.lm, "path", "eager")
    return out


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """Refuse a pair whose token-to-id maps differ (vocab_size alone hides padding and reordering)."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        t, d = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        diff = sorted(set(t.items()) ^ set(d.items()))[:3]
        raise ValueError(f"draft {draft_name!r} and target {target_name!r} use different vocabularies "
                         f"({len(d)} vs {len(t)} tokens; e.g. {diff}); speculative decoding needs a shared tokenizer")


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        ids |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and not ids:
        ids.add(tokenizer.eos_token_id)
    return ids


def settle_heap() -> None:
    """Move what a load or a warm-up left alive (the libraries' and models' ~10^6 Python objects, the captured
    graphs') out of the cyclic garbage collector's sight: its full passes over them cost a decode step 8-10% on a
    2-core CPU, and a round 4-5 ms now and then on a GPU's host. Unfrozen first, so what an earlier load left for
    garbage (an evicted engine) is collected now rather than kept for good."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _short(name: str) -> str:
    return name if name in MODEL_FREE or name == DRAFT_HEAD else "draft:" + name.rstrip("/").split("/")[-1]


def head_for(target: str, model, packed: bool = False, folder: Path | None = None) -> DraftHeadDrafter:
    """The drafter of the trained head shipped for `target` (HEADS), on the model's device and in its dtype, or
    with packed=True with packed products (`DraftHead.pack`: the native kernel's Q8_0 blocks in float32 where it
    loads with its fast path, else int8 rows in bfloat16; beside the GGUF target on the CPU). folder: another head
    trained for the same target, drafted the same way (benchmarks compare heads).
    Raises HeadMismatchError (a ValueError) when none ships, the file is missing, or it fits another target."""
    if target not in HEADS:
        raise HeadMismatchError(f"no draft head ships for target {target!r} (heads: {sorted(HEADS)}); train one with "
                                f"`python -m flashspec_core.train_head`")
    embed = model.get_input_embeddings().weight
    fast = packed and native.load() and torch.ops.flashspec.vnni()  # the native kernel takes float32 activations
    dtype = torch.float32 if fast else torch.bfloat16 if packed else embed.dtype
    head = load_head(folder or HEADS[target].folder, model.config, embed, dtype=dtype)
    if packed:
        head.pack(native=fast)
    return DraftHeadDrafter(head, model.config.vocab_size, HEADS[target].vocab_limit)


def _captured_shape(s: StreamState):
    """The tree a stream's captured tree rounds take: the fixed shape (tree auto: its bound), or None (chains). A
    sampled tree "auto" takes chains there: on an H200 a sampled tree round of the static shape measured 3.1-3.4 ms
    against 1.9 for a chain of 4, for 2.34 tokens a forward against 1.93 (`tree_round_cuda_bfloat16_t1_s36b.json`)."""
    if s.tree is None or (s.tree.auto and not s.sampling.greedy):
        return None
    return s.tree.fixed
