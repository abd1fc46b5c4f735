"""The speculative decoding engine: exact (output distribution = the target's), streaming, bandit-driven.

`Engine.stream` yields one `RoundEvent` per round; `Engine.generate` drains it. A round reads top to
bottom in `_round`: draft, verify, accept, roll back, update. Plain decoding is the same round with the
no-draft arm (K = 0), through the same caches, so comparisons are fair. Batch 1 is the product; the round
itself is vectorised over rows of equal length (used by the distribution tests): rows then advance together
by the shortest accepted prefix plus one, which keeps every row exact.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from flashspec_core.bandit import STRATEGIES, ArmState, Bandit, speed_reward
from flashspec_core.draft_head import DraftHead, HeadMismatchError, load_head
from flashspec_core.drafters import MODEL_FREE, DraftHeadDrafter, DraftModel, Drafter, NoDraft
from flashspec_core.gamma import MAX_GAMMA, Acceptance, CostModel, best_gamma
from flashspec_core.fast_path import MODES as FAST_PATH_MODES
from flashspec_core.fast_path import fast_or_eager
from flashspec_core.checks import SEED_RANGE, check_text, is_int, shown
from flashspec_core.gguf_weights import GGUFFile
from flashspec_core.models import CausalLM, embedded_gguf, load_model, pick_device, pick_dtype, pick_precision
from flashspec_core.sampling import SamplingConfig, logits_to_probs
from kernels import resolve_backend, verify

MODES = ("speculative", "plain")
MAX_AUTO_GAMMA = 16
DRAFT_HEAD = "draft_head"  # a drafter entry: the trained head shipped for the target (see HEADS)
NAMED_DRAFTERS = (*MODEL_FREE, DRAFT_HEAD)  # drafter entries that are names, not model ids
ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class ShippedHead:
    folder: Path  # an EAGLE-3 folder written by flashspec_core.train_head
    vocab_limit: int | None = None  # draft from this many of its most frequent ids (a cheaper step); None = all


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


@dataclass(frozen=True)
class TokenSpan:
    kind: str  # "accepted" | "rejected" | "resampled" | "bonus" | "plain"
    id: int
    text: str  # decoded piece ("" without a tokenizer)
    p: float  # target probability of this token at its position
    q: float | None  # draft probability (1.0 for a deterministic drafter; None for resampled/bonus/plain)


@dataclass(frozen=True)
class RoundEvent:
    index: int  # round number, from 0
    mode: str  # "speculative" | "plain"
    drafter: str  # the arm that drafted this round
    gamma: int  # K: tokens proposed this round
    accepted: tuple[int, ...]  # accepted draft ids (emitted)
    rejected: tuple[int, ...]  # draft ids from the first rejection on (dropped)
    resampled: int | None  # drawn from norm(max(0, p - q)) at the first rejection
    bonus: int | None  # drawn from p after a full accept (in plain mode: the plain token)
    spans: tuple[TokenSpan, ...]  # accepted, rejected, then the resampled/bonus token, for display
    text: str  # new text this round
    draft_s: float
    verify_s: float
    round_s: float
    elapsed_s: float  # since the stream started, prefill included
    new_tokens: int  # tokens generated so far
    arms: tuple[ArmState, ...]  # bandit state after this round (empty without a bandit)
    finished: str | None  # "eos" | "length" | None
    prefill_s: float = 0.0  # the stream's prefill (the same on every event), included in elapsed_s

    @property
    def emitted(self) -> tuple[int, ...]:
        last = self.resampled if self.resampled is not None else self.bonus
        return self.accepted + (() if last is None else (last,))


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: dict
    events: list[RoundEvent] = field(repr=False, default_factory=list)


@dataclass
class RoundOutput:
    """What one vectorised round did, per row, before rows were advanced together."""
    num_accepted: list[int]  # [B]
    tokens: list[list[int]]  # [B][K+1]: accepted drafts, the resampled/bonus token, -1s
    draft: list[int]  # row 0's proposal (K ids)
    p: list[float]  # row 0: p of each proposed token, then p of its emitted token at num_accepted
    q: list[float]  # row 0: q of each proposed token
    draft_s: float
    verify_s: float


@dataclass
class _Counterfactual:
    """What a model-free arm that was not pulled would have proposed, waiting for the tokens that decide it."""
    arm: str
    proposal: list[int]
    seen: list[int]  # the tokens emitted since it was made


@dataclass
class _Stream:
    """What one stream carries from round to round; made by `stream` once the request is valid."""
    rows: list[list[int]]  # [1][T]: the context so far, prompt first
    sampling: SamplingConfig
    gamma: int | str  # a fixed K, or "auto"
    mode: str  # "speculative" | "plain"
    arms: list[str]  # the drafters this stream may use
    max_new_tokens: int
    generator: torch.Generator  # every random draw of the stream (seeded)
    bandit: Bandit | None  # None with a single arm
    acceptance: dict[str, Acceptance] = field(default_factory=dict)  # per arm
    t_start: float = 0.0  # set when the loop starts
    prefill_s: float = 0.0
    produced: int = 0  # tokens emitted so far
    index: int = 0  # rounds so far
    open: list[_Counterfactual] = field(default_factory=list)  # counterfactual proposals not yet decided

    def __post_init__(self):
        self.acceptance = {a: Acceptance() for a in self.arms}


class Engine:
    """A target model, its drafters, a kernel backend and a bandit strategy. Not thread-safe: one stream at a time."""

    def __init__(self, target: CausalLM, drafters: list[Drafter], tokenizer=None, *, kernel_backend: str = "auto",
                 bandit: str = "ucb1", window: int = 200, eos_ids: set[int] | None = None, name: str = "custom"):
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
        self.costs = CostModel()  # the machine's forward costs, measured once by `calibrate`
        self.draft_steps = {NoDraft.name: 0.0}  # seconds per drafted token, likewise (per drafter)
        self.calibrated = False
        for d in self.drafters.values():
            if d.sets_length:
                d.costs = self.costs  # such a drafter sizes its drafts from this machine's measured costs

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
                        name: str | None = None) -> "Engine":
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
                draft_models[d] = (head_for(target, model, int8=gguf is not None), tokenizer)  # a built DraftHeadDrafter
            elif d not in MODEL_FREE:
                draft_models[d] = load_model(d, dev, dt, progress)
                check_same_vocabulary(tokenizer, draft_models[d][1], target, d)
        return cls.from_models(model, [draft_models[d][0] if d in draft_models else d for d in drafters],
                               tokenizer=tokenizer, kernel_backend=kernel_backend, bandit=bandit, fast_path=fast_path,
                               draft_names=[_short(d) for d in drafters], name=name or target, gguf=gguf)

    @classmethod
    def from_models(cls, target_model, drafters: list = ("prompt_lookup", "ngram_cache"), tokenizer=None, *,
                    kernel_backend: str = "auto", bandit: str = "ucb1", fast_path: str = "auto",
                    draft_names: list[str] | None = None, name: str = "custom", gguf: GGUFFile | None = None) -> "Engine":
        """Wrap already-built Hugging Face models. Drafters: draft models or model-free drafter names.

        fast_path: "auto" = static KV cache + CUDA graphs on CUDA for Llama-family models, else eager;
        "on" = the static path (raises for unsupported models); "off" = eager Hugging Face with DynamicCache.
        gguf: the target's GGUF file: its linear layers run on the file's own 4-bit weights (CPU, static path).
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
                   kernel_backend=kernel_backend, bandit=bandit, eos_ids=eos, name=name)

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
               bandit: str | None = None) -> Iterator[RoundEvent]:
        """Generate up to max_new_tokens, yielding one RoundEvent per round.

        gamma: K in 0..32, or "auto" (per drafter, from its acceptance and the costs measured by `calibrate`).
        drafters: names of the arms to use (default: all); one name = that drafter every round, several =
        a bandit over them and the no-draft arm. mode="plain" decodes one token a round through the same code.
        """
        sampling = SamplingConfig() if sampling is None else sampling
        if not isinstance(chat, bool):
            raise ValueError(f"chat must be True or False, got {shown(chat)}")
        if not is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got {shown(seed)}")
        ids = self.encode(prompt, chat)
        arms = self._check_request(len(ids), max_new_tokens, sampling, gamma, mode, drafters, bandit)
        state = _Stream(rows=[ids], sampling=sampling, gamma=gamma, mode=mode, arms=arms, max_new_tokens=max_new_tokens,
                        generator=torch.Generator(device=self.target.device).manual_seed(int(seed)),
                        bandit=Bandit(arms, bandit or self.bandit_strategy, self.window, int(seed)) if len(arms) > 1 else None)
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
        drafter's propose time over 4 tokens, per token (the fastest of `reps`; a drafter added later is measured
        when it first streams). Every decision that weighs costs (copy drafters' draft lengths, auto gamma, the
        bandit's rewards) uses these fixed numbers and the round's tokens, never the round's own timings, so a
        stream is a function of its prompt, settings and seed. Each stream calls it; it measures what is missing."""
        rows = [[1 + i % (self.target.vocab_size - 1) for i in range(context)]]
        greedy, generator = SamplingConfig(), torch.Generator(device=self.target.device).manual_seed(0)
        if not self.calibrated:
            self._start(rows, greedy, generator, context + 2 * (MAX_AUTO_GAMMA + 1), MAX_AUTO_GAMMA)
            sizes, L = (1, 2, 3, 4, 5, 6, 8, 9, 12, MAX_AUTO_GAMMA + 1), self.target.length
            best = dict.fromkeys(sizes, float("inf"))
            for rep in range(reps + 1):  # the first pass warms up (a fresh model's first forwards are slower)
                for T in sizes:
                    t0 = time.perf_counter()
                    self.target.forward(torch.tensor([rows[0][-1:] * T], device=self.target.device), logits_to_keep=T)
                    self._sync()
                    best[T] = min(best[T], time.perf_counter() - t0) if rep else best[T]
                    self.target.crop(L)
            self.costs = CostModel(decay=0.0)
            for T in sizes:
                self.costs.observe(T, best[T])
            for d in self.drafters.values():
                if d.sets_length:
                    d.costs = self.costs
            self.calibrated = True
        for name, d in self.drafters.items():
            if name not in self.draft_steps:
                row = [rows[0][:]]
                self._start(row, greedy, generator, context + (reps + 1) * (MAX_AUTO_GAMMA + 1), MAX_AUTO_GAMMA)
                self.draft_steps[name] = min(self._round(row, d, 4, greedy, generator).draft_s / 4 for _ in range(reps))

    def reset_session(self) -> None:
        """Forget cross-generation memory (the n-gram cache), e.g. between benchmark rows."""
        for d in self.drafters.values():
            d.reset_session()

    def generate(self, prompt, max_new_tokens: int = 64, sampling: SamplingConfig | None = None, **kwargs) -> GenerationResult:
        events = list(self.stream(prompt, max_new_tokens, sampling, **kwargs))
        ids = [t for e in events for t in e.emitted]
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
        stats = {**summarize(events), "paths": paths(self), "precision": self.precision,
                 "kernel_backend": resolve_backend(self.kernel_backend, self.target.device)}
        return GenerationResult(ids, text, stats, events)

    # ------------------------------------------------------------------------------------------------
    # Validation (before any state changes)

    def _check_request(self, prompt_len, max_new_tokens, sampling, gamma, mode, drafters, bandit) -> list[str]:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"unknown mode {shown(mode)}; expected one of {list(MODES)}")
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {shown(max_new_tokens)}")
        window = self.target.context_window
        if prompt_len + max_new_tokens > window:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context window of {window} tokens")
        if gamma != "auto" and (not isinstance(gamma, int) or isinstance(gamma, bool) or not 0 <= gamma <= MAX_GAMMA):
            raise ValueError(f"gamma must be an integer in 0..{MAX_GAMMA} or 'auto', got {shown(gamma)}")
        if bandit is not None and (not isinstance(bandit, str) or bandit not in STRATEGIES):
            raise ValueError(f"unknown bandit strategy {shown(bandit)}; expected one of {sorted(STRATEGIES)}")
        if drafters is not None and (not isinstance(drafters, (list, tuple))
                                     or not all(isinstance(n, str) for n in drafters)):
            raise ValueError(f"drafters must be a list of drafter names, got {shown(drafters)}")
        names = list(drafters) if drafters else [n for n in self.drafters if n != NoDraft.name]
        unknown = [n for n in names if n not in self.drafters]
        if unknown:
            raise ValueError(f"unknown drafters {shown(unknown)}; this engine has {sorted(self.drafters)}")
        if mode == "plain":
            return [NoDraft.name]
        if len(names) > 1 and NoDraft.name not in names:
            names.append(NoDraft.name)  # the bandit can always fall back to plain decoding
        return names or [NoDraft.name]

    # ------------------------------------------------------------------------------------------------
    # The loop

    def _start(self, rows: list[list[int]], sampling: SamplingConfig, generator: torch.Generator,
               max_context: int | None = None, max_gamma: int = MAX_AUTO_GAMMA, arms: list[str] | None = None) -> float:
        """Prefill the target (all but the last token: each round feeds the pending token) and the drafters;
        returns the seconds it took. The target reports hidden states from here on only if one of `arms`
        (default: every drafter) reads them."""
        t0 = time.perf_counter()
        readers = [self.drafters[a] for a in (arms or self.drafters)]
        self.target.aux_layers = next((d.aux_layers for d in readers if d.aux_layers), ())
        self.target.reset()
        for lm in [self.target] + [d.lm for d in self.drafters.values() if isinstance(d, DraftModel)]:
            if hasattr(lm, "capture") and max_context:  # CUDA graphs: captured once per shape, kept on the model
                lm.reset()
                lm.capture(range(1, max_gamma + 2) if lm is self.target else [1, 2], max_context=max_context)
        hidden = None
        if len(rows[0]) > 1:
            self.target.forward(torch.tensor([r[:-1] for r in rows], device=self.target.device), logits_to_keep=1)
            hidden = self.target.aux
        for d in self.drafters.values():
            d.start(rows, sampling, generator, hidden=hidden if d.aux_layers else None)
        self._sync()
        return time.perf_counter() - t0

    def _round(self, rows: list[list[int]], drafter: Drafter, k: int, sampling: SamplingConfig,
               generator: torch.Generator) -> RoundOutput:
        """One round over rows of equal length: draft, verify, accept, roll back, update."""
        L = len(rows[0])
        timer = _RoundTimer(self.target.device)
        pending = torch.tensor([r[self.target.length:] for r in rows], device=self.target.device)  # [B, 1]
        proposal = drafter.propose(rows, k)  # draft
        K = proposal.tokens.shape[1]
        timer.drafted()
        logits = self.target.forward(torch.cat([pending, proposal.tokens], dim=1), logits_to_keep=K + 1)  # [B, K+1, V]
        p = logits if sampling.greedy else logits_to_probs(logits, sampling)  # verify (greedy compares argmaxes)
        result = verify(proposal.tokens, proposal.q, p, generator=generator, greedy=sampling.greedy,
                        backend=self.kernel_backend)
        shown = logits.softmax(dim=-1) if sampling.greedy else p  # the p values shown with each token
        host = self._to_host(proposal, shown, result)  # the one device->host sync of the round
        draft_s, verify_s = timer.done()
        B = len(rows)
        num_accepted = [int(x) for x in host[:B, 0].tolist()]
        tokens = host[:B, 1:K + 2].long().tolist()
        m = min(num_accepted)  # accept: rows advance together by the shortest accepted prefix plus one
        for row, toks in zip(rows, tokens):
            row.extend(toks[:m + 1])
        self.target.crop(L + m)  # roll back: the cache keeps the context and the accepted drafts
        hidden = None if self.target.aux is None else self.target.aux[:, :m + 1]  # features of the verified tokens
        for d in self.drafters.values():  # update
            d.observe(rows, L + m, hidden=hidden if d.aux_layers else None)
        return RoundOutput(num_accepted, tokens, proposal.tokens[0].tolist() if K else [],
                           host[B, :K + 1].tolist(), host[B + 1, :K].tolist(), draft_s, verify_s)

    def _to_host(self, proposal, p, result) -> torch.Tensor:
        """Pack counts, tokens and row 0's p/q values into one float32 tensor and copy it once.

        Rows 0..B-1: [num_accepted, tokens...]; row B: p of each proposed token, then p of the emitted one;
        row B+1: q of each proposed token (1 for a deterministic drafter). Ids < 2^24 are exact in float32.
        """
        B, K = proposal.tokens.shape
        n0 = result.num_accepted[:1]  # [1]
        drafted = proposal.tokens[0]  # [K]
        p_draft = p[0, :K].gather(-1, drafted[:, None]).squeeze(-1)  # [K]
        p_last = p[0].index_select(0, n0).gather(-1, result.tokens[0].gather(0, n0)[:, None]).view(1)
        ones = torch.ones(K + 1, device=p.device)
        q_draft = ones[:K] if proposal.q is None else proposal.q[0].gather(-1, drafted[:, None]).squeeze(-1)
        pq = torch.stack([torch.cat([p_draft, p_last]), torch.cat([q_draft, ones[:1]])])  # [2, K+1]
        head = torch.cat([result.num_accepted[:, None].float(), result.tokens.float()], dim=1)  # [B, K+2]
        return torch.cat([head, torch.nn.functional.pad(pq, (0, 1))], dim=0).cpu()

    def _sync(self):
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def _stream(self, s: _Stream) -> Iterator[RoundEvent]:
        """The loop: choose an arm and K, run a round, learn from it, yield its event."""
        max_gamma = MAX_AUTO_GAMMA if s.gamma == "auto" else s.gamma
        self.calibrate()
        s.t_start = time.perf_counter()  # generation is lazy: the clock starts with the first round's prefill
        s.prefill_s = self._start(s.rows, s.sampling, s.generator, len(s.rows[0]) + s.max_new_tokens + max_gamma + 1,
                                  max_gamma, s.arms)
        window = self.target.context_window
        while s.produced < s.max_new_tokens:
            arm = s.bandit.select() if s.bandit else s.arms[0]
            limit = min(s.max_new_tokens - s.produced - 1, window - len(s.rows[0]) - 1)  # K + 1 tokens must fit
            before = s.rows[0][:]
            out = self._round(s.rows, self.drafters[arm], self._gamma(s, arm, limit), s.sampling, s.generator)
            emitted = s.rows[0][len(before):]
            self._learn(s, arm, out, before, emitted, limit)
            finished, emitted = self._finish(emitted, s.produced, s.max_new_tokens)
            s.produced += len(emitted)
            if finished == "eos":
                del s.rows[0][len(before) + len(emitted):]
            yield self._event(s, arm, out, before, emitted, finished)
            s.index += 1
            if finished:
                return

    def _gamma(self, s: _Stream, arm: str, limit: int) -> int:
        """K for this round: a fixed gamma, or for "auto" the K that maximises expected tokens per second from the
        arm's acceptance; a drafter that sets its own draft length (<= K, from the measured costs) gets the
        largest K under "auto". Costs are the ones `calibrate` measured."""
        gamma = s.gamma
        if gamma == "auto":
            drafter = self.drafters[arm]
            gamma = MAX_AUTO_GAMMA if drafter.sets_length else best_gamma(s.acceptance[arm].rate, self.draft_steps[arm],
                                                                         self.costs, MAX_AUTO_GAMMA)
        return max(0, min(gamma, limit))

    def _learn(self, s: _Stream, arm: str, out: RoundOutput, before: list[int], emitted: list[int], limit: int):
        """After a round: the arm's acceptance, the bandit's reward (tokens emitted over the round's cost as
        calibrated, not as timed: the same tokens always earn the same reward), the other arms' scores."""
        K, n = len(out.draft), out.num_accepted[0]
        s.acceptance[arm].observe(n, K)
        if s.bandit:
            ref = 1.0 / max(self.costs.plain_step(), 1e-9)
            s.bandit.update(arm, speed_reward(len(emitted) / max(self._cost(arm, K), 1e-9), ref))
            self._score_counterfactuals(s, arm, before, emitted, limit, ref)

    def _score_counterfactuals(self, s: _Stream, pulled: str, before: list[int], emitted: list[int], limit: int,
                               ref: float):
        """Score model-free arms that were not pulled against the tokens the target actually emitted.

        What each would have proposed at the pre-round context is kept until later rounds show how far the target
        would have accepted it (its first mismatch, or all of it); it then scores as (matching prefix + 1) tokens
        at the calibrated cost of a round that drafts len(proposal) tokens. Free: no target
        forward, and no guess for the part of a long proposal that a short round does not reveal (a proposal the
        stream ends before resolving is dropped). The open proposals live in the stream's state.
        """
        for c in s.open:
            c.seen.extend(emitted)  # the tokens emitted since each open proposal was made
        for arm in s.arms:
            drafter = self.drafters[arm]
            if arm == pulled or not drafter.model_free:
                continue
            proposal = drafter.propose_ids(before, self._gamma(s, arm, limit))
            s.open.append(_Counterfactual(arm, proposal, list(emitted)))
        still_open = []
        for c in s.open:
            m, known = 0, min(len(c.proposal), len(c.seen))
            while m < known and c.proposal[m] == c.seen[m]:
                m += 1
            if m == known < len(c.proposal):  # everything seen so far matched; the rest is not known yet
                still_open.append(c)
                continue
            s.acceptance[c.arm].observe(m, len(c.proposal))
            seconds = self._cost(c.arm, len(c.proposal))
            s.bandit.update(c.arm, speed_reward((m + 1) / max(seconds, 1e-9), ref), pulled=False)
        s.open = still_open

    def _cost(self, arm: str, K: int) -> float:
        """A round's seconds as calibrated: K draft steps of the arm and a target forward over K + 1 tokens."""
        return K * self.draft_steps[arm] + self.costs.forward(K + 1)

    def _finish(self, emitted: list[int], produced: int, max_new_tokens: int):
        for i, t in enumerate(emitted):
            if t in self.eos_ids:
                return "eos", emitted[:i + 1]
        if produced + len(emitted) >= max_new_tokens:
            return "length", emitted[:max_new_tokens - produced]
        return None, emitted

    def _event(self, s: _Stream, arm: str, out: RoundOutput, before: list[int], emitted: list[int], finished):
        K, n = len(out.draft), out.num_accepted[0]
        accepted = tuple(emitted[:n])
        last = emitted[n] if len(emitted) > n else None
        kinds = ["accepted"] * len(accepted) + ["rejected"] * (K - n)
        ids = list(accepted) + out.draft[n:]
        ps, qs = out.p[:len(accepted)] + out.p[n:K], out.q[:len(accepted)] + out.q[n:K]
        if last is not None:
            kinds.append("plain" if K == 0 else "bonus" if n == K else "resampled")  # K = 0 is a plain step
            ids.append(last)
            ps.append(out.p[K])
            qs.append(None)
        pieces = self._pieces(before, list(accepted), out.draft[n:], [last] if last is not None else [])
        spans = tuple(TokenSpan(*fields) for fields in zip(kinds, ids, pieces, ps, qs))
        return RoundEvent(index=s.index, mode=s.mode, drafter=arm, gamma=K, accepted=accepted,
                          rejected=tuple(out.draft[n:]), resampled=last if last is not None and n < K else None,
                          bonus=last if last is not None and n == K else None, spans=spans,
                          text="".join(span.text for span in spans if span.kind != "rejected"),
                          draft_s=out.draft_s, verify_s=out.verify_s, round_s=out.draft_s + out.verify_s,
                          elapsed_s=time.perf_counter() - s.t_start, new_tokens=s.produced,
                          arms=s.bandit.state() if s.bandit else (), finished=finished, prefill_s=s.prefill_s)

    def _pieces(self, before: list[int], accepted: list[int], rejected: list[int], final: list[int]) -> list[str]:
        """Decoded text of each display token, each decoded after the accepted prefix it follows."""
        if self.tokenizer is None:
            return [""] * (len(accepted) + len(rejected) + len(final))

        def run(prefix, new):
            out, prev = [], self.tokenizer.decode(prefix)
            for t in new:
                prefix = prefix + [t]
                cur = self.tokenizer.decode(prefix)
                out.append(cur[len(prev):] if cur.startswith(prev) else self.tokenizer.decode([t]))
                prev = cur
            return out

        tail = before[-4:]  # a little context so that leading spaces decode as they will in the text
        base = tail + accepted
        return run(tail, accepted) + run(base, rejected) + run(base, final)


# ----------------------------------------------------------------------------------------------------
# Helpers


class _RoundTimer:
    """Draft and verify wall times of a round without an extra sync: on CUDA an event marks the end of drafting
    and is read after the round's one sync; on the CPU the host clock is exact."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        if self.cuda:
            self.start, self.mid = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()

    def drafted(self):
        if self.cuda:
            self.mid.record()
        else:
            self.t1 = time.perf_counter()

    def done(self) -> tuple[float, float]:
        total = time.perf_counter() - self.t0
        draft = self.start.elapsed_time(self.mid) / 1e3 if self.cuda else self.t1 - self.t0
        return draft, max(0.0, total - draft)


def summarize(events: list[RoundEvent]) -> dict:
    """Stats of a (finished or partial) stream: tok/s (prefill included), acceptance, tokens per target forward..."""
    tokens = sum(len(e.emitted) for e in events)
    proposed = sum(e.gamma for e in events)
    accepted = sum(len(e.accepted) for e in events)
    elapsed = events[-1].elapsed_s if events else 0.0
    decode_s = sum(e.round_s for e in events)
    pulls = {}
    for e in events:
        pulls[e.drafter] = pulls.get(e.drafter, 0) + 1
    return {
        "new_tokens": tokens,
        "rounds": len(events),
        "target_forwards": len(events),  # one verify forward per round (prefill not counted)
        "tok_per_s": tokens / elapsed if elapsed else 0.0,
        "decode_tok_per_s": tokens / decode_s if decode_s else 0.0,
        "acceptance": accepted / proposed if proposed else 0.0,
        "tokens_per_forward": tokens / len(events) if events else 0.0,
        "proposed": proposed,
        "accepted": accepted,
        "elapsed_s": elapsed,
        "prefill_s": events[0].prefill_s if events else 0.0,
        "pulls": pulls,
        "finished": events[-1].finished if events else None,
    }


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


def _short(name: str) -> str:
    return name if name in MODEL_FREE or name == DRAFT_HEAD else "draft:" + name.rstrip("/").split("/")[-1]


def head_for(target: str, model, int8: bool = False) -> DraftHeadDrafter:
    """The drafter of the trained head shipped for `target` (HEADS), on the model's device and in its dtype, or
    with int8=True in bfloat16 with int8 products (`DraftHead.pack_int8`; beside the GGUF target on the CPU).
    Raises HeadMismatchError (a ValueError) when none ships, the file is missing, or it fits another target."""
    if target not in HEADS:
        raise HeadMismatchError(f"no draft head ships for target {target!r} (heads: {sorted(HEADS)}); train one with "
                                f"`python -m flashspec_core.train_head`")
    embed = model.get_input_embeddings().weight
    head = load_head(HEADS[target].folder, model.config, embed, dtype=torch.bfloat16 if int8 else embed.dtype)
    if int8:
        head.pack_int8()
    return DraftHeadDrafter(head, model.config.vocab_size, HEADS[target].vocab_limit)
