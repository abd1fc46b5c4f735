"""Hand-made round events for the formatter tests (a module of its own, so tests can import it by name)."""
from __future__ import annotations

import dataclasses
import math

from flashspec_core import ArmState, RoundEvent, TokenSpan
from flashspec_core.stream import DraftedTree

ARMS = ("prompt_lookup", "ngram_cache", "no_draft")


def make_event(index, drafter="prompt_lookup", accepted=("a",), rejected=(), last=("bonus", "!"), elapsed=None,
               new_tokens=None, arms=None, finished=None, mode="speculative") -> RoundEvent:
    """A RoundEvent whose spans carry the given texts; ids are small made-up integers."""
    spans = [TokenSpan("accepted", 10 + i, t, 0.9, 1.0) for i, t in enumerate(accepted)]
    spans += [TokenSpan("rejected", 20 + i, t, 0.1, 1.0) for i, t in enumerate(rejected)]
    if last is not None:
        spans.append(TokenSpan(last[0], 30, last[1], 0.7, None))
    ids = [s.id for s in spans]
    n_acc = len(accepted)
    if arms is None:
        arms = tuple(ArmState(a, index + 1 if a == drafter else 0, index + 1, 0.5, math.inf if a == "no_draft" else 1.2)
                     for a in ARMS)
    return RoundEvent(
        index=index, mode=mode, drafter=drafter, gamma=len(accepted) + len(rejected),
        accepted=tuple(ids[:n_acc]), rejected=tuple(ids[n_acc:n_acc + len(rejected)]),
        resampled=30 if last and last[0] == "resampled" else None,
        bonus=30 if last and last[0] in ("bonus", "plain") else None, spans=tuple(spans),
        text="".join(s.text for s in spans if s.kind != "rejected"), draft_s=0.001, verify_s=0.01, round_s=0.011,
        elapsed_s=elapsed if elapsed is not None else 0.05 + 0.011 * (index + 1),
        new_tokens=new_tokens if new_tokens is not None else (index + 1) * (n_acc + (last is not None)),
        arms=arms, finished=finished)


# a tree round's tree: " the" (id 10) accepted, then " cat" (20, tried and rejected) and its child "\n" (22); and
# '<b onmouseover="x">' (21), a rejected branch at the root
TREE = DraftedTree(tokens=(10, 20, 21, 22), parents=(-1, 0, -1, 1), accepted=(0,),
                   texts=(" the", " cat", '<b onmouseover="x">', "\n"))


def make_tree_event(index, **kwargs) -> RoundEvent:
    """A draft head's tree round whose spans agree with TREE: " the" accepted, " cat" rejected, " dog" resampled."""
    event = make_event(index, "draft_head", accepted=(" the",), rejected=(" cat",), last=("resampled", " dog"),
                       **kwargs)
    return dataclasses.replace(event, drafted_tree=TREE, tree_nodes=len(TREE.tokens))
