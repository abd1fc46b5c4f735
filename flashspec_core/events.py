"""From a round's host numbers to what a stream yields: where the stream stops (end of turn, length), the
`RoundEvent` with its display spans and decoded text pieces, and the stats of a list of events (`summarize`).
Python only; the tokenizer is the one outside object it calls.
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

from flashspec_core.stream import DraftedTree, Played, RoundEvent, StreamState, TokenSpan


class EventBuilder:
    """Stop checks and events of an engine's streams, with its tokenizer (None: empty text) and end-of-turn ids."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.decode = text_decoder(tokenizer)

    def finish(self, emitted: list[int], produced: int, max_new_tokens: int) -> tuple[str | None, list[int]]:
        """("eos" | "length" | None, the emitted ids that count): cut after an end-of-turn id or at the length."""
        for i, t in enumerate(emitted):
            if t in self.eos_ids:
                return "eos", emitted[:i + 1]
        if produced + len(emitted) >= max_new_tokens:
            return "length", emitted[:max_new_tokens - produced]
        return None, emitted

    def event(self, s: StreamState, played: Played, finished: str | None) -> RoundEvent:
        """The round's event; `played.emitted` is what counts (after `finish`), s.produced already includes it."""
        out, emitted = played.out, played.emitted
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
        pieces = self.pieces(played.before, list(accepted), out.draft[n:], [last] if last is not None else [])
        spans = tuple(TokenSpan(*fields) for fields in zip(kinds, ids, pieces, ps, qs))
        return RoundEvent(index=s.index, mode=s.mode, drafter=played.arm, gamma=K, accepted=accepted,
                          rejected=tuple(out.draft[n:]), resampled=last if last is not None and n < K else None,
                          bonus=last if last is not None and n == K else None, spans=spans,
                          text="".join(span.text for span in spans if span.kind != "rejected"),
                          draft_s=out.draft_s, verify_s=out.verify_s, round_s=out.draft_s + out.verify_s,
                          elapsed_s=time.perf_counter() - s.t_start, new_tokens=s.produced,
                          arms=s.bandit.state() if s.bandit else (), finished=finished, prefill_s=s.prefill_s,
                          device_s=out.device_s, tree_nodes=out.tree[0] if out.tree else 0,
                          drafted_tree=self.tree(played.before, out.drafted_tree, len(accepted)))

    def tree(self, before: list[int], tree: DraftedTree | None, n: int) -> DraftedTree | None:
        """A tree round's tree with each node's text (decoded after its ancestors), its accepted path cut to the n
        drafts the event emits (an end of turn or the length can stop a stream inside the path)."""
        if tree is None:
            return None
        return replace(tree, accepted=tree.accepted[:n], texts=tuple(self.node_texts(before[-4:], tree)))

    def node_texts(self, tail: list[int], tree: DraftedTree) -> list[str]:
        """Each node's decoded piece after the context tail and its ancestors ("" without a tokenizer)."""
        if self.tokenizer is None:
            return [""] * len(tree.tokens)
        root = self.decode(tail)
        prefixes, decoded, out = [], [], []  # per node: its ids from the tail on, and their text
        for t, parent in zip(tree.tokens, tree.parents):
            base, prev = (tail, root) if parent < 0 else (prefixes[parent], decoded[parent])
            prefixes.append(base + [t])
            decoded.append(self.decode(prefixes[-1]))
            out.append(decoded[-1][len(prev):] if decoded[-1].startswith(prev) else self.decode([t]))
        return out

    def pieces(self, before: list[int], accepted: list[int], rejected: list[int], final: list[int]) -> list[str]:
        """Decoded text of each display token, each decoded after the accepted prefix it follows."""
        if self.tokenizer is None:
            return [""] * (len(accepted) + len(rejected) + len(final))

        decoded = {}  # each prefix decoded once: the accepted run ends where the rejected and final runs begin

        def text(ids):
            key = tuple(ids)
            if key not in decoded:
                decoded[key] = self.decode(ids)
            return decoded[key]

        def run(prefix, new):
            out, prev = [], text(prefix) if new else ""
            for t in new:
                prefix = prefix + [t]
                cur = text(prefix)
                out.append(cur[len(prev):] if cur.startswith(prev) else self.decode([t]))
                prev = cur
            return out

        tail = before[-4:]  # a little context so that leading spaces decode as they will in the text
        base = tail + accepted
        return run(tail, accepted) + run(base, rejected) + run(base, final)


def text_decoder(tokenizer):
    """`tokenizer.decode` (special tokens kept) as a function of a list of ids: where that call's text is its
    `tokenizers` backend's own (transformers cleans up no spaces: the flag is off, or the model is BPE, where
    transformers ignores it), the backend's decode, which skips transformers' per-call Python (each round decodes a
    few prefixes for its pieces, right after a target forward has flushed the caches: ~20 us a call there)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    force = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True) and \
        (force or type(getattr(backend, "model", None)).__name__ != "BPE")
    if backend is None or cleans or not hasattr(backend, "decode"):
        return tokenizer.decode
    return partial(backend.decode, skip_special_tokens=False)


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
