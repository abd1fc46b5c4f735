"""Runs kept for replay in a compact form, and the server-wide store of the runs loaded from files.

A `CompactRun` holds a run's rounds (tree rounds with their draft trees) as numbers in typed arrays and its token
texts as one UTF-8 string (about 30 bytes a token, against ~250 as parsed JSON or RoundEvents). It rebuilds the
RoundEvents of any range of rounds, and the headline stats of any prefix, without touching the other rounds.
`LoadedRuns` keeps the runs loaded from files for every session, bounded per session and in total by bytes, least
recently used first out.
"""
from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from flashspec_core import ArmState, RoundEvent, TokenSpan
from flashspec_core.engine import MODES
from flashspec_core.stream import DraftedTree

KINDS = ("accepted", "rejected", "resampled", "bonus", "plain")  # components.tokens.KINDS, in this order
FINISHED = (None, "eos", "length")
MB = 1 << 20


class NamedByRecord:
    """A run named by its runs-table row (`record`): a session's own runs and loaded ones alike."""

    record: dict

    @property
    def name(self) -> str:
        """'run 3', 'race 2 · A', or a loaded run's name."""
        leg = self.record.get("leg")
        return f"{self.record['run']} · {leg}" if leg else str(self.record["run"])

    def label(self) -> str:
        r = self.record
        return f"{self.name}: {r.get('mode')}, {r.get('new_tokens')} tokens, {r.get('example') or r.get('pair')}"


@dataclass
class CompactRun(NamedByRecord):
    """A finished run for replay: its runs-table row, its prompt and its rounds, as arrays (see the module)."""
    record: dict
    prompt: str = ""
    names: list[str] = field(default_factory=list)  # drafter and arm names, numbered by first use
    # per round
    mode: bytearray = field(default_factory=bytearray)  # index into MODES
    drafter: array = field(default_factory=lambda: array("H"))  # index into names
    gamma: array = field(default_factory=lambda: array("H"))
    accepted: array = field(default_factory=lambda: array("H"))  # accepted drafts
    finished: bytearray = field(default_factory=bytearray)  # index into FINISHED
    seconds: array = field(default_factory=lambda: array("d"))  # draft_s, verify_s, round_s, elapsed_s per round
    new_tokens: array = field(default_factory=lambda: array("L"))
    span_end: array = field(default_factory=lambda: array("L"))  # round i's spans: span_end[i - 1]..span_end[i]
    arm_end: array = field(default_factory=lambda: array("L"))  # likewise for its arm states
    node_end: array = field(default_factory=lambda: array("L"))  # likewise for its draft tree's nodes (none: a chain)
    sums: array = field(default_factory=lambda: array("d"))  # running gamma, accepted, round_s sums per round
    prefill_s: float = 0.0
    # per span
    kind: bytearray = field(default_factory=bytearray)  # index into KINDS
    token: array = field(default_factory=lambda: array("L"))
    pq: array = field(default_factory=lambda: array("d"))  # p, q per span (q = -1: none)
    text: bytearray = field(default_factory=bytearray)  # the spans' texts, UTF-8, one after the other
    text_end: array = field(default_factory=lambda: array("L"))
    # per arm state
    arm: array = field(default_factory=lambda: array("H"))  # index into names
    counts: array = field(default_factory=lambda: array("L"))  # pulls, observations
    scores: array = field(default_factory=lambda: array("d"))  # mean, score (inf: untried)
    # per draft tree node (tree rounds only)
    node_token: array = field(default_factory=lambda: array("L"))
    node_parent: array = field(default_factory=lambda: array("b"))  # -1: the root
    node_accepted: bytearray = field(default_factory=bytearray)  # 1 on the accepted path (its nodes ascend)
    node_text: bytearray = field(default_factory=bytearray)  # the nodes' texts, UTF-8, one after the other
    node_text_end: array = field(default_factory=lambda: array("L"))

    def __len__(self) -> int:
        return len(self.gamma)

    @property
    def nbytes(self) -> int:
        arrays = (self.drafter, self.gamma, self.accepted, self.seconds, self.new_tokens, self.span_end, self.arm_end,
                  self.sums, self.token, self.pq, self.text_end, self.arm, self.counts, self.scores, self.node_end,
                  self.node_token, self.node_parent, self.node_text_end)
        small = len(self.prompt) + sum(len(n) for n in self.names) + 2000
        return sum(a.itemsize * len(a) for a in arrays) + len(self.mode) + len(self.finished) + len(self.kind) + \
            len(self.text) + len(self.node_accepted) + len(self.node_text) + small

    # -- building ------------------------------------------------------------------------------------
    def _number(self, name: str) -> int:
        if name not in self.names:
            self.names.append(name)
        return self.names.index(name)

    def add(self, e: RoundEvent) -> None:
        """Append one round (already checked)."""
        i = len(self)
        self.mode.append(MODES.index(e.mode))
        self.drafter.append(self._number(e.drafter))
        self.gamma.append(e.gamma)
        self.accepted.append(len(e.accepted))
        self.finished.append(FINISHED.index(e.finished))
        self.seconds.extend((e.draft_s, e.verify_s, e.round_s, e.elapsed_s))
        self.new_tokens.append(e.new_tokens)
        before = self.sums[3 * i - 3:3 * i] if i else (0.0, 0.0, 0.0)
        self.sums.extend((before[0] + e.gamma, before[1] + len(e.accepted), before[2] + e.round_s))
        for s in e.spans:
            self.kind.append(KINDS.index(s.kind))
            self.token.append(s.id)
            self.pq.extend((s.p, -1.0 if s.q is None else s.q))
            self.text += s.text.encode("utf-8")
            self.text_end.append(len(self.text))
        self.span_end.append(len(self.kind))
        for a in e.arms:
            self.arm.append(self._number(a.name))
            self.counts.extend((a.pulls, a.observations))
            self.scores.extend((a.mean, a.score))
        self.arm_end.append(len(self.arm))
        self.add_tree(e.drafted_tree)
        self.prefill_s = e.prefill_s

    def add_tree(self, tree: DraftedTree | None) -> None:
        if tree is not None:
            path = set(tree.accepted)
            for i, (t, parent) in enumerate(zip(tree.tokens, tree.parents)):
                self.node_token.append(t)
                self.node_parent.append(parent)
                self.node_accepted.append(i in path)
                self.node_text += (tree.texts[i] if i < len(tree.texts) else "").encode("utf-8")
                self.node_text_end.append(len(self.node_text))
        self.node_end.append(len(self.node_token))

    # -- reading -------------------------------------------------------------------------------------
    def elapsed(self, i: int) -> float:
        return self.seconds[4 * i + 3]

    def spans(self, a: int, b: int) -> list[TokenSpan]:
        """Spans a..b-1 (over the whole run)."""
        out = []
        for j in range(a, b):
            start = self.text_end[j - 1] if j else 0
            q = self.pq[2 * j + 1]
            out.append(TokenSpan(KINDS[self.kind[j]], self.token[j], self.text[start:self.text_end[j]].decode("utf-8"),
                                 self.pq[2 * j], None if q < 0 else q))
        return out

    def round_spans(self, i: int) -> tuple[int, int]:
        return (self.span_end[i - 1] if i else 0), self.span_end[i]

    def event(self, i: int, spans: bool = True) -> RoundEvent:
        """Round i; spans=False leaves its spans (and text) out, the ids stay: cheaper, for the bandit figure."""
        a, b = self.round_spans(i)
        kinds, ids = [KINDS[k] for k in self.kind[a:b]], list(self.token[a:b])
        last = kinds[-1] if kinds and kinds[-1] in ("resampled", "bonus", "plain") else None
        pieces = self.spans(a, b) if spans else []
        draft_s, verify_s, round_s, elapsed_s = self.seconds[4 * i:4 * i + 4]
        return RoundEvent(
            index=i, mode=MODES[self.mode[i]], drafter=self.names[self.drafter[i]], gamma=self.gamma[i],
            accepted=tuple(t for t, k in zip(ids, kinds) if k != "rejected")[:self.accepted[i]],
            rejected=tuple(t for t, k in zip(ids, kinds) if k == "rejected"),
            resampled=ids[-1] if last == "resampled" else None, bonus=ids[-1] if last in ("bonus", "plain") else None,
            spans=tuple(pieces), text="".join(s.text for s in pieces if s.kind != "rejected"), draft_s=draft_s,
            verify_s=verify_s, round_s=round_s, elapsed_s=elapsed_s, new_tokens=self.new_tokens[i],
            arms=self.event_arms(i), finished=FINISHED[self.finished[i]], prefill_s=self.prefill_s,
            tree_nodes=self.node_end[i] - (self.node_end[i - 1] if i else 0),
            drafted_tree=self.tree(i) if spans else None)

    def tree(self, i: int) -> DraftedTree | None:
        """Round i's draft tree, None for a chain round."""
        lo, hi = (self.node_end[i - 1] if i else 0), self.node_end[i]
        if lo == hi:
            return None
        texts = [self.node_text[(self.node_text_end[j - 1] if j else 0):self.node_text_end[j]].decode("utf-8")
                 for j in range(lo, hi)]
        return DraftedTree(tuple(self.node_token[lo:hi]), tuple(self.node_parent[lo:hi]),
                           tuple(j - lo for j in range(lo, hi) if self.node_accepted[j]), tuple(texts))

    def event_arms(self, i: int) -> tuple[ArmState, ...]:
        lo, hi = (self.arm_end[i - 1] if i else 0), self.arm_end[i]
        return tuple(ArmState(self.names[self.arm[j]], self.counts[2 * j], self.counts[2 * j + 1], self.scores[2 * j],
                              self.scores[2 * j + 1]) for j in range(lo, hi))

    def events(self, indices, spans: bool = True) -> list[RoundEvent]:
        return [self.event(i, spans) for i in indices]

    def stats(self, shown: int) -> dict:
        """The headline stats after `shown` rounds: what flashspec_core.engine.summarize gives (without pulls)."""
        if not shown:
            return {}
        proposed, accepted, decode_s = self.sums[3 * shown - 3:3 * shown]
        tokens, elapsed = self.new_tokens[shown - 1], self.elapsed(shown - 1)
        return {"new_tokens": tokens, "rounds": shown, "target_forwards": shown,
                "tok_per_s": tokens / elapsed if elapsed else 0.0, "decode_tok_per_s": tokens / decode_s if decode_s else 0.0,
                "acceptance": accepted / proposed if proposed else 0.0, "tokens_per_forward": tokens / shown,
                "proposed": int(proposed), "accepted": int(accepted), "elapsed_s": elapsed, "prefill_s": self.prefill_s,
                "finished": FINISHED[self.finished[shown - 1]]}

    def pulls(self, shown: int) -> dict[str, int]:
        """Rounds per drafter among the first `shown`."""
        out: dict[str, int] = {}
        for d in self.drafter[:shown]:
            out[self.names[d]] = out.get(self.names[d], 0) + 1
        return out


def compact(record: dict, prompt: str, events) -> CompactRun:
    run = CompactRun(dict(record), prompt)
    for e in events:
        run.add(e)
    return run


class RunsTooLarge(ValueError):
    """Runs that take more room than one session may hold."""


class LoadedRuns:
    """Every session's runs loaded from files, by (session id, run name): at most `session_bytes` per session (its
    oldest go first) and `total_bytes` for the server (the least recently used go first, whoever loaded them)."""

    def __init__(self, session_bytes: int = 24 * MB, total_bytes: int = 96 * MB):
        self.session_bytes, self.total_bytes = session_bytes, total_bytes
        self._runs: OrderedDict[tuple[str, str], CompactRun] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def add(self, session_id: str, runs: list[CompactRun]) -> None:
        """Keep these runs for the session (replacing runs of the same names). Raises RunsTooLarge."""
        size = sum(r.nbytes for r in runs)
        if size > self.session_bytes:
            raise RunsTooLarge(f"its runs take {size / MB:.1f} MB here; a session may keep "
                               f"{self.session_bytes // MB} MB of loaded runs")
        with self._lock:
            for r in runs:
                self._runs.pop((session_id, r.name), None)
                self._runs[(session_id, r.name)] = r
            mine = [k for k in self._runs if k[0] == session_id]
            while sum(self._runs[k].nbytes for k in mine) > self.session_bytes:
                self._runs.pop(mine.pop(0))
            while self.nbytes() > self.total_bytes:
                self._runs.popitem(last=False)

    def get(self, session_id: str, name: str) -> CompactRun | None:
        with self._lock:
            run = self._runs.get((session_id, name))
            if run is not None:
                self._runs.move_to_end((session_id, name))
            return run

    def names(self, session_id: str) -> set[str]:
        """The names of the session's loaded runs still kept."""
        with self._lock:
            return {k[1] for k in self._runs if k[0] == session_id}

    def drop(self, session_id: str) -> None:
        with self._lock:
            for k in [k for k in self._runs if k[0] == session_id]:
                del self._runs[k]

    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._runs.values())


LOADED = LoadedRuns()
