"""The speculative decoding engine: exact (output distribution = the target's), streaming, bandit-driven.

`Engine.stream` yields one `RoundEvent` per round; `Engine.generate` drains it. A round reads top to
bottom in `_round`: draft, verify, accept, roll back, update. Plain decoding is the same round with the
no-draft arm (K = 0), through the same caches, so comparisons are fair. Batch 1 is the product; the round
itself is vectorised over rows of equal length (used by the distribution tests): rows then advance together
by the shortest accepted prefix plus one, which keeps every row exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from flashspec_core.bandit import ArmState, Bandit, speed_reward
from flashspec_core.drafters import MODEL_FREE, DraftModel, Drafter, NoDraft
from flashspec_core.gamma import MAX_GAMMA, Acceptance, CostModel, best_gamma
from flashspec_core.fast_path import MODES as FAST_PATH_MODES
from flashspec_core.fast_path import fast_or_eager
from flashspec_core.models import CausalLM, load_model, pick_device, pick_dtype
from flashspec_core.sampling import SamplingConfig, logits_to_probs
from kernels import resolve_backend, verify

MODES = ("speculative", "plain")
MAX_AUTO_GAMMA = 16

# Model pairs are data. Drafter entries: a Hub id or folder (a draft model), or a model-free drafter name.
PRESETS = {
    "embedded": dict(target="embedded", drafters=["prompt_lookup", "ngram_cache"]),
    "smollm2-1.7b": dict(target="HuggingFaceTB/SmolLM2-1.7B-Instruct",
                         drafters=["HuggingFaceTB/SmolLM2-135M-Instruct", "prompt_lookup", "ngram_cache"]),
    "qwen2.5-1.5b": dict(target="Qwen/Qwen2.5-1.5B-Instruct",
                         drafters=["Qwen/Qwen2.5-0.5B-Instruct", "prompt_lookup", "ngram_cache"]),
    "tinyllama-1.1b": dict(target="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
                           drafters=["Felladrin/Llama-160M-Chat-v1", "prompt_lookup", "ngram_cache"]),
}


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


class Engine:
    """A target model, its drafters, a kernel backend and a bandit strategy. Not thread-safe: one stream at a time."""

    def __init__(self, target: CausalLM, drafters: list[Drafter], tokenizer=None, *, kernel_backend: str = "auto",
                 bandit: str = "ucb1", window: int = 200, eos_ids: set[int] | None = None, name: str = "custom"):
        resolve_backend(kernel_backend, target.device)  # fail early on unknown names
        Bandit(["x"], bandit, window)  # likewise for the strategy
        self.target, self.tokenizer, self.name = target, tokenizer, name
        self.kernel_backend, self.bandit_strategy, self.window = kernel_backend, bandit, window
        self.drafters: dict[str, Drafter] = {}
        for d in [*drafters, NoDraft(target.device)]:
            if d.name in self.drafters:
                if isinstance(d, NoDraft):
                    continue
                raise ValueError(f"two drafters are named {d.name!r}")
            self.drafters[d.name] = d
        self.eos_ids = set(eos_ids or ())
        self.costs = CostModel()  # the machine's forward costs, kept across streams

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
                        bandit: str = "ucb1", fast_path: str = "auto", progress=None, name: str | None = None) -> "Engine":
        """Load a target and its drafters by Hub id, local folder, 'embedded', or model-free drafter name."""
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        resolve_backend(kernel_backend, dev)
        Bandit(["x"], bandit)
        model, tokenizer = load_model(target, dev, dt, progress)
        draft_models = {}
        for d in drafters:
            if d not in MODEL_FREE:
                draft_models[d] = load_model(d, dev, dt, progress)
                check_same_vocabulary(tokenizer, draft_models[d][1], target, d)
        return cls.from_models(model, [draft_models[d][0] if d in draft_models else d for d in drafters],
                               tokenizer=tokenizer, kernel_backend=kernel_backend, bandit=bandit, fast_path=fast_path,
                               draft_names=[_short(d) for d in drafters], name=name or target)

    @classmethod
    def from_models(cls, target_model, drafters: list = ("prompt_lookup", "ngram_cache"), tokenizer=None, *,
                    kernel_backend: str = "auto", bandit: str = "ucb1", fast_path: str = "auto",
                    draft_names: list[str] | None = None, name: str = "custom") -> "Engine":
        """Wrap already-built Hugging Face models. Drafters: draft models or model-free drafter names.

        fast_path: "auto" = static KV cache + CUDA graphs on CUDA for Llama-family models, else eager;
        "on" = the static path (raises for unsupported models); "off" = eager Hugging Face with DynamicCache.
        """
        if fast_path not in FAST_PATH_MODES:
            raise ValueError(f"unknown fast_path {fast_path!r}; expected one of {list(FAST_PATH_MODES)}")
        device = next(target_model.parameters()).device
        models = [d for d in drafters if not isinstance(d, str)]
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
            else:
                label = draft_names[i] if draft_names else f"draft_model{'' if len(models) == 1 else i}"
                built.append(DraftModel(fast_or_eager(d.eval(), vocab, mode=fast_path), name=label))
        eos = _eos_ids(target_model, tokenizer)
        return cls(fast_or_eager(target_model.eval(), vocab, mode=fast_path), built, tokenizer,
                   kernel_backend=kernel_backend, bandit=bandit, eos_ids=eos, name=name)

    # ------------------------------------------------------------------------------------------------
    # Public API

    def encode(self, prompt, chat: bool = True) -> list[int]:
        if isinstance(prompt, str):
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
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")
        return list(ids)

    def stream(self, prompt, max_new_tokens: int = 64, sampling: SamplingConfig | None = None, gamma=4,
               mode: str = "speculative", seed: int = 0, chat: bool = True, drafters: list[str] | None = None,
               bandit: str | None = None) -> Iterator[RoundEvent]:
        """Generate up to max_new_tokens, yielding one RoundEvent per round.

        gamma: K in 0..32, or "auto" (per drafter, from its acceptance and the measured costs).
        drafters: names of the arms to use (default: all); one name = that drafter every round, several =
        a bandit over them and the no-draft arm. mode="plain" decodes one token a round through the same code.
        """
        sampling = sampling or SamplingConfig()
        ids = self.encode(prompt, chat)
        arms = self._check_request(len(ids), max_new_tokens, sampling, gamma, mode, drafters, bandit)
        return self._stream(ids, max_new_tokens, sampling, gamma, mode, seed, arms, bandit or self.bandit_strategy)

    def reset_session(self) -> None:
        """Forget cross-generation memory (the n-gram cache), e.g. between benchmark rows."""
        for d in self.drafters.values():
            d.reset_session()

    def generate(self, prompt, max_new_tokens: int = 64, sampling: SamplingConfig | None = None, **kwargs) -> GenerationResult:
        events = list(self.stream(prompt, max_new_tokens, sampling, **kwargs))
        ids = [t for e in events for t in e.emitted]
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
        stats = {**summarize(events, self._prefill_s), "paths": paths(self), "kernel_backend": resolve_backend(self.kernel_backend, self.target.device)}
        return GenerationResult(ids, text, stats, events)

    # ------------------------------------------------------------------------------------------------
    # Validation (before any state changes)

    def _check_request(self, prompt_len, max_new_tokens, sampling, gamma, mode, drafters, bandit) -> list[str]:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        window = self.target.context_window
        if prompt_len + max_new_tokens > window:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context window of {window} tokens")
        if gamma != "auto" and (not isinstance(gamma, int) or isinstance(gamma, bool) or not 0 <= gamma <= MAX_GAMMA):
            raise ValueError(f"gamma must be an integer in 0..{MAX_GAMMA} or 'auto', got {gamma!r}")
        if bandit is not None:
            Bandit(["x"], bandit)
        names = list(drafters) if drafters else [n for n in self.drafters if n != NoDraft.name]
        unknown = [n for n in names if n not in self.drafters]
        if unknown:
            raise ValueError(f"unknown drafters {unknown}; this engine has {sorted(self.drafters)}")
        if mode == "plain":
            return [NoDraft.name]
        if len(names) > 1 and NoDraft.name not in names:
            names.append(NoDraft.name)  # the bandit can always fall back to plain decoding
        return names or [NoDraft.name]

    # ------------------------------------------------------------------------------------------------
    # The loop

    def _start(self, rows: list[list[int]], sampling: SamplingConfig, generator: torch.Generator,
               max_context: int | None = None, max_gamma: int = MAX_AUTO_GAMMA) -> None:
        """Prefill the target (all but the last token: each round feeds the pending token) and the drafters."""
        t0 = time.perf_counter()
        self.target.reset()
        for lm in [self.target] + [d.lm for d in self.drafters.values() if isinstance(d, DraftModel)]:
            if hasattr(lm, "capture") and max_context:  # CUDA graphs: captured once per shape, kept on the model
                lm.reset()
                lm.capture(range(1, max_gamma + 2) if lm is self.target else [1, 2], max_context=max_context)
        if len(rows[0]) > 1:
            self.target.forward(torch.tensor([r[:-1] for r in rows], device=self.target.device), logits_to_keep=1)
        for d in self.drafters.values():
            d.start(rows, sampling, generator)
        self._sync()
        self._prefill_s = time.perf_counter() - t0

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
        for d in self.drafters.values():  # update
            d.observe(rows, L + m)
        self.costs.observe(K + 1, verify_s)
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

    def _stream(self, ids, max_new_tokens, sampling, gamma, mode, seed, arms, strategy) -> Iterator[RoundEvent]:
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        rows = [list(ids)]
        t_start = time.perf_counter()
        max_gamma = MAX_AUTO_GAMMA if gamma == "auto" else gamma
        self._start(rows, sampling, generator, len(ids) + max_new_tokens + max_gamma + 1, max_gamma)
        bandit = Bandit(arms, strategy, self.window, seed) if len(arms) > 1 else None
        acceptance = {a: Acceptance() for a in arms}
        draft_step = {a: 0.0 for a in arms}  # seconds per drafted token
        produced, index, window = 0, 0, self.target.context_window
        while produced < max_new_tokens:
            arm = bandit.select() if bandit else arms[0]
            drafter = self.drafters[arm]
            limit = min(max_new_tokens - produced - 1, window - len(rows[0]) - 1)  # K + 1 tokens must fit
            k = self._gamma(gamma, acceptance[arm], draft_step[arm], limit, drafter)
            before = rows[0][:]
            out = self._round(rows, drafter, k, sampling, generator)
            K, n = len(out.draft), out.num_accepted[0]
            emitted = rows[0][len(before):]
            acceptance[arm].observe(n, K)
            if K:
                draft_step[arm] = 0.7 * draft_step[arm] + 0.3 * out.draft_s / K if draft_step[arm] else out.draft_s / K
            if bandit:
                ref = 1.0 / max(self.costs.plain_step(), 1e-9)
                bandit.update(arm, speed_reward(len(emitted) / (out.draft_s + out.verify_s), ref))
                self._score_counterfactuals(bandit, arms, arm, before, emitted, gamma, acceptance, draft_step, limit, ref)
            finished, emitted = self._finish(emitted, produced, max_new_tokens)
            produced += len(emitted)
            if finished == "eos":
                del rows[0][len(before) + len(emitted):]
            yield self._event(index, mode, arm, out, before, emitted, bandit, t_start, produced, finished)
            index += 1
            if finished:
                return

    def _gamma(self, gamma, acceptance: Acceptance, draft_step: float, limit: int, drafter: Drafter | None = None) -> int:
        """K for this round: a fixed gamma, or for "auto" the K that maximises expected tokens per second from the
        arm's acceptance, except for a drafter that sets its own draft length (up to K, from this machine's
        measured forward costs, which it is handed here): under "auto" it gets the largest K."""
        sets_length = drafter is not None and drafter.sets_length
        if sets_length:
            drafter.costs = self.costs
        if gamma == "auto":
            gamma = MAX_AUTO_GAMMA if sets_length else best_gamma(acceptance.rate, draft_step, self.costs, MAX_AUTO_GAMMA)
        return max(0, min(gamma, limit))

    def _score_counterfactuals(self, bandit, arms, pulled, before, emitted, gamma, acceptance, draft_step, limit, ref):
        """Score model-free arms that were not pulled against the tokens the target actually emitted.

        What each would have proposed at the pre-round context is kept until later rounds show how far the target
        would have accepted it (its first mismatch, or all of it); it then scores as (matching prefix + 1) tokens
        at the measured cost of verifying len(proposal) + 1 tokens plus its own propose time. Free: no target
        forward, and no guess for the part of a long proposal that a short round does not reveal (a proposal the
        stream ends before resolving is dropped). The open proposals belong to this stream: a new bandit (a new
        stream) starts an empty list.
        """
        if getattr(self, "_open_for", None) is not bandit:
            self._open_for, self._open = bandit, []
        for item in self._open:
            item[3].extend(emitted)  # the tokens emitted since each open proposal was made
        for arm in arms:
            drafter = self.drafters[arm]
            if arm == pulled or not drafter.model_free:
                continue
            k = self._gamma(gamma, acceptance[arm], draft_step[arm], limit, drafter)
            t0 = time.perf_counter()
            proposal = drafter.propose_ids(before, k)
            self._open.append((arm, proposal, time.perf_counter() - t0, list(emitted)))
        still_open = []
        for item in self._open:
            arm, proposal, propose_s, seen = item
            m, known = 0, min(len(proposal), len(seen))
            while m < known and proposal[m] == seen[m]:
                m += 1
            if m == known < len(proposal):  # everything seen so far matched; the rest is not known yet
                still_open.append(item)
                continue
            acceptance[arm].observe(m, len(proposal))
            seconds = propose_s + self.costs.forward(len(proposal) + 1)
            bandit.update(arm, speed_reward((m + 1) / max(seconds, 1e-9), ref), pulled=False)
        self._open = still_open

    def _finish(self, emitted: list[int], produced: int, max_new_tokens: int):
        for i, t in enumerate(emitted):
            if t in self.eos_ids:
                return "eos", emitted[:i + 1]
        if produced + len(emitted) >= max_new_tokens:
            return "length", emitted[:max_new_tokens - produced]
        return None, emitted

    def _event(self, index, mode, arm, out: RoundOutput, before, emitted, bandit, t_start, produced, finished):
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
        spans = tuple(TokenSpan(k_, i, s, p, q) for k_, i, s, p, q in zip(kinds, ids, pieces, ps, qs))
        text = "".join(s.text for s in spans if s.kind != "rejected")
        now = time.perf_counter()
        return RoundEvent(index=index, mode=mode, drafter=arm, gamma=K, accepted=accepted,
                          rejected=tuple(out.draft[n:]), resampled=last if last is not None and n < K else None,
                          bonus=last if last is not None and n == K else None, spans=spans, text=text,
                          draft_s=out.draft_s, verify_s=out.verify_s, round_s=out.draft_s + out.verify_s,
                          elapsed_s=now - t_start, new_tokens=produced, arms=bandit.state() if bandit else (),
                          finished=finished)

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


def summarize(events: list[RoundEvent], prefill_s: float = 0.0) -> dict:
    """Stats of a finished stream: tok/s (prefill included), acceptance, tokens per target forward, ..."""
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
        "prefill_s": prefill_s,
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
    return name if name in MODEL_FREE else "draft:" + name.rstrip("/").split("/")[-1]
