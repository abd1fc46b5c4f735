"""Drafters: cheap proposers of up to k next tokens, all behind one narrow interface.

    start(rows, sampling, generator, hidden=None)  a new generation; rows are the prompt ids, one list per
                                      batch row
    propose(rows, k) -> Proposal      up to k tokens per row, with q (None for a deterministic drafter)
    observe(rows, kept, hidden=None)  after a round: rows are the new contexts and the first `kept` ids of
                                      each are unchanged since propose (what a draft cache may keep)

`hidden` is given only to drafters whose `aux_layers` names target layers (the draft head): the target's
residual streams entering those layers, [B, n, len(aux_layers) * H], for the positions that became certain
(in `start`, the prompt but its last token; in `observe`, the round's pending token and accepted drafts).
Everyone else gets None and pays nothing for it.

A deterministic drafter has q = one-hot at its token; the verifier then accepts with probability p(x).
Model-free drafters also expose `propose_ids(row, k)`, which the engine uses to score them
counterfactually after every round at no target cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashspec_core.draft_head import DraftHead, HeadCache
from flashspec_core.models import CausalLM
from flashspec_core.sampling import SamplingConfig, logits_to_probs, sample


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [B, K] int64 on the engine's device
    q: torch.Tensor | None  # [B, K, V] float32, None when deterministic (or greedy)


class Drafter:
    name = "drafter"
    model_free = True  # proposals are a pure function of the context
    aux_layers: tuple[int, ...] = ()  # target layers whose input hidden states this drafter reads

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def start(self, rows: list[list[int]], sampling: SamplingConfig, generator: torch.Generator | None,
              hidden: torch.Tensor | None = None) -> None:
        pass

    def propose_ids(self, row: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose(self, rows: list[list[int]], k: int) -> Proposal:
        ids = [self.propose_ids(row, k) for row in rows]
        n = min(len(x) for x in ids)  # rows advance together, so they share K
        tokens = torch.tensor([x[:n] for x in ids], dtype=torch.int64).reshape(len(rows), n)
        return Proposal(tokens.to(self.device, non_blocking=True), None)

    def observe(self, rows: list[list[int]], kept: int, hidden: torch.Tensor | None = None) -> None:
        pass

    def reset_session(self) -> None:
        """Forget what was learnt across generations (only the n-gram cache learns any)."""


class NoDraft(Drafter):
    """K = 0: the round is one plain decoding step, so the bandit can always fall back to plain decoding."""

    name = "no_draft"

    def propose_ids(self, row, k):
        return []


class PromptLookup(Drafter):
    """Match the last n-gram (n = max_ngram..min_ngram) earlier in the context; propose what followed it."""

    name = "prompt_lookup"

    def __init__(self, device="cpu", max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(device)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose_ids(self, row, k):
        T = len(row)
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            tail = row[T - n:]
            for start in range(T - n - 1, -1, -1):  # the most recent earlier occurrence wins
                if row[start:start + n] == tail:
                    return row[start + n:start + n + k]
        return []


class NgramCache(Drafter):
    """An n-gram table over everything generated in this session (recurring answers, code, JSON).

    Proposes by chaining the most frequent continuation of the last n tokens (n = max_ngram..2).
    """

    name = "ngram_cache"

    def __init__(self, device="cpu", max_ngram: int = 3):
        super().__init__(device)
        self.max_ngram = max_ngram
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self._start = 0  # where generated text begins in each row (the prompt is prompt lookup's domain)
        self._seen = 0  # how much of each row has been indexed

    def start(self, rows, sampling, generator, hidden=None):
        self._start = self._seen = len(rows[0])

    def reset_session(self):
        self.table.clear()

    def _next(self, row):
        for n in range(self.max_ngram, 1, -1):
            counts = self.table.get(tuple(row[-n:]))
            if counts:
                return max(counts, key=counts.get)
        return None

    def propose_ids(self, row, k):
        out, ctx = [], list(row[-self.max_ngram:])
        while len(out) < k:
            nxt = self._next(ctx)
            if nxt is None:
                break
            out.append(nxt)
            ctx = ctx[1:] + [nxt]
        return out

    def observe(self, rows, kept, hidden=None):
        for row in rows:
            for j in range(max(self._seen, self._start), len(row)):  # each newly generated token
                for n in range(2, min(self.max_ngram, j) + 1):
                    counts = self.table.setdefault(tuple(row[j - n:j]), {})
                    counts[row[j]] = counts.get(row[j], 0) + 1
        self._seen = len(rows[0])


class DraftModel(Drafter):
    """A small causal LM with its own KV cache; samples k tokens from q and rolls back after each round."""

    model_free = False

    def __init__(self, lm: CausalLM, name: str = "draft_model"):
        super().__init__(lm.device)
        self.lm, self.name = lm, name
        self.sampling = SamplingConfig()
        self.generator = None

    def start(self, rows, sampling, generator, hidden=None):
        self.sampling, self.generator = sampling, generator
        self.lm.reset()
        if len(rows[0]) > 1:  # the last prompt token is fed by the first propose
            self.lm.forward(torch.tensor([r[:-1] for r in rows], device=self.device), logits_to_keep=1)

    def propose(self, rows, k):
        B = len(rows)
        if k == 0:
            return Proposal(torch.empty((B, 0), dtype=torch.int64, device=self.device), None)
        new = torch.tensor([r[self.lm.length:] for r in rows], device=self.device)  # [B, 1 or 2]
        tokens, qs = [], []
        for i in range(k):
            logits = self.lm.forward(new, logits_to_keep=1)[:, -1]  # [B, V]
            token, q = draw(logits, self.sampling, self.generator)
            tokens.append(token)
            qs.append(q)
            new = token[:, None]
        return Proposal(torch.stack(tokens, dim=1), None if self.sampling.greedy else torch.stack(qs, dim=1))

    def observe(self, rows, kept, hidden=None):
        self.lm.crop(min(self.lm.length, kept))


class DraftHeadDrafter(Drafter):
    """An EAGLE-3 style head (`flashspec_core.draft_head`) over the target's hidden states, with its own KV cache.

    Features of verified positions arrive through `start`/`observe` and wait in `pending`; `propose` runs them
    through the head in one pass (its cache keeps those slots), then feeds its own output back for the
    remaining K - 1 tokens and rolls those K - 1 slots back. It samples from exactly the q it reports: the
    head's distribution over its draft vocabulary, placed at the target ids (zero elsewhere).
    """

    name = "draft_head"
    model_free = False

    def __init__(self, head: DraftHead, vocab_size: int, vocab_limit: int | None = None):
        """vocab_limit: draft from the first (most frequent) ids of the head's vocabulary only: a cheaper step."""
        super().__init__(head.d2t.device)
        ids = head.draft_ids[:vocab_limit]
        if int(ids.max()) >= vocab_size:
            raise ValueError(f"the draft head names target ids up to {int(ids.max())}; the vocabulary has {vocab_size}")
        self.head, self.vocab_size, self.ids, self.limit = head, vocab_size, ids, vocab_limit
        self.aux_layers = head.cfg.aux_layers
        self.dtype = next(head.parameters()).dtype
        self.sampling, self.generator = SamplingConfig(), None
        self.cache, self.pending = None, None

    def start(self, rows, sampling, generator, hidden=None):
        self.sampling, self.generator = sampling, generator
        self.cache = HeadCache(self.head.cfg, len(rows), max(64, 2 * len(rows[0])), self.device, self.dtype)
        self.pending = None
        self.observe(rows, len(rows[0]), hidden)

    def observe(self, rows, kept, hidden=None):
        if hidden is None or hidden.shape[1] == 0:
            return
        hidden = hidden.to(self.dtype)
        self.pending = hidden if self.pending is None else torch.cat([self.pending, hidden], dim=1)

    @torch.inference_mode()
    def propose(self, rows, k):
        B = len(rows)
        if k == 0 or self.pending is None:  # nothing verified since the last draft: a plain round
            return Proposal(torch.empty((B, 0), dtype=torch.int64, device=self.device), None)
        s, n = self.cache.length, self.pending.shape[1]
        following = torch.tensor([r[s + 1:s + 1 + n] for r in rows], device=self.device)  # token t + 1 of each slot
        h = self.head.step(self.cache, following, self.head.fc(self.pending))[:, -1:]  # [B, 1, H]
        self.pending, verified = None, self.cache.length
        tokens, qs = [], []
        for i in range(k):
            index, q = draw(self.head.logits(h[:, -1], self.limit), self.sampling, self.generator)  # draft vocabulary
            tokens.append(self.ids[index])
            qs.append(q)
            if i + 1 < k:
                h = self.head.step(self.cache, tokens[-1][:, None], h)
        self.cache.crop(verified)  # the draft slots go; the verified ones stay
        q = None if self.sampling.greedy else self._widen(torch.stack(qs, dim=1))
        return Proposal(torch.stack(tokens, dim=1), q)

    def _widen(self, q: torch.Tensor) -> torch.Tensor:
        """q over the draft vocabulary [B, K, draft V] -> over the target's [B, K, V] (zero outside it)."""
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.ids, q)


def draw(logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row from logits [B, V]: the argmax when greedy (q None), else a sample from q [B, V]."""
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    q = logits_to_probs(logits, sampling)
    return sample(q, generator), q


MODEL_FREE = {"prompt_lookup": PromptLookup, "ngram_cache": NgramCache, "no_draft": NoDraft}
