"""Drafters: cheap proposers of up to k next tokens, all behind one narrow interface.

    start(rows, sampling, generator)  a new generation; rows are the prompt ids, one list per batch row
    propose(rows, k) -> Proposal      up to k tokens per row, with q (None for a deterministic drafter)
    observe(rows, kept)               after a round: rows are the new contexts and the first `kept` ids of
                                      each are unchanged since propose (what a draft cache may keep)

A deterministic drafter has q = one-hot at its token; the verifier then accepts with probability p(x).
Model-free drafters also expose `propose_ids(row, k)`, which the engine uses to score them
counterfactually after every round at no target cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashspec_core.models import CausalLM
from flashspec_core.sampling import SamplingConfig, logits_to_probs, sample


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [B, K] int64 on the engine's device
    q: torch.Tensor | None  # [B, K, V] float32, None when deterministic (or greedy)


class Drafter:
    name = "drafter"
    model_free = True  # proposals are a pure function of the context

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def start(self, rows: list[list[int]], sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        pass

    def propose_ids(self, row: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose(self, rows: list[list[int]], k: int) -> Proposal:
        ids = [self.propose_ids(row, k) for row in rows]
        n = min(len(x) for x in ids)  # rows advance together, so they share K
        tokens = torch.tensor([x[:n] for x in ids], dtype=torch.int64).reshape(len(rows), n)
        return Proposal(tokens.to(self.device, non_blocking=True), None)

    def observe(self, rows: list[list[int]], kept: int) -> None:
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

    def start(self, rows, sampling, generator):
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

    def observe(self, rows, kept):
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

    def start(self, rows, sampling, generator):
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
            if self.sampling.greedy:
                token = logits.argmax(dim=-1)
            else:
                q = logits_to_probs(logits, self.sampling)
                token = sample(q, self.generator)
                qs.append(q)
            tokens.append(token)
            new = token[:, None]
        q = torch.stack(qs, dim=1) if qs else None  # [B, K, V]
        return Proposal(torch.stack(tokens, dim=1), q)

    def observe(self, rows, kept):
        self.lm.crop(min(self.lm.length, kept))


MODEL_FREE = {"prompt_lookup": PromptLookup, "ngram_cache": NgramCache, "no_draft": NoDraft}
