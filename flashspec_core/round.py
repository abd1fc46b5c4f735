"""The device round: draft, verify, accept test, roll back, update. Every step of a speculative round that touches
tensors lives here, and nothing that decides: the host policy (`policy.py`) picks the arm and K, the event
builder (`events.py`) turns the round's host numbers into an event.

    start(rows, sampling, generator, ...)       prefill the target and every drafter; returns its seconds
    run(rows, drafter, k, sampling, generator)  one round over rows of equal length -> RoundOutput

`run` is `launch` (draft, verify, accept test, the next pending token, the packed host record: device work only,
no host read) then `land` (the round's one device-to-host copy, then accept on the host's rows, roll back, update).
Batch 1 is the product; rows of equal length advance together by the shortest accepted prefix plus one, which
keeps every row exact (the distribution tests run 30,000 rows as one batch). Only `start` and `run` change the
rows and the device state, together.

Shaped for capture (the eager path here is the specification: a captured round must give its tokens):
- One device-to-host copy a round. `_pack` puts the accepted counts, the emitted ids, row 0's drafted ids, p and
  q values and the hidden-state readers' first-pass guesses into one float32 tensor; `HostCopy.read` reads it
  with one `.tolist()`. Nothing else in `run` reads the device (tests/flashspec_core/test_round.py counts).
- The pending token (the last emitted id, which the next verify feeds first) stays on the device: `launch`
  gathers it from the accept test's output at the shortest accepted count, itself a device tensor. The host's
  rows reach the device only through `start` and the model-free drafters' proposals.
- The draft head reads every verify forward (`observe` with the target's hidden states, whatever arm was
  pulled) and runs its first pass at once, so a head draft is K - 1 chained steps from state already on the
  device, and its first-pass guess (`Drafter.guess`, a device tensor) rides in the next round's host copy.

Left for the GPU session (issue 15, items 1 and 2), per draft-length bucket K, captured at load time:
- one CUDA graph for `launch` with the head pulled: its K draws and K - 1 chained steps (`DraftHeadDrafter.
  propose`), the target's verify over K + 1 tokens (`StaticCausalLM` already captures that forward per (T, S),
  its positions a device copy into `static_pos`), the accept test (`kernels.verify`, Triton), the pending gather
  and `_pack`; a model-free arm's graph starts at the verify, with its ids copied into the static input;
- the head's first pass over all K + 1 verify slots with the valid count n + 1 as a device tensor (slots past it
  are masked and overwritten next round, as in StaticCausalLM's cache), in place of `land`'s host-sliced
  `aux[:, :m + 1]`; HeadCache then needs device positions (today `HeadCache.length` is a host int).
Stays on the host: the arm and K (bandit, gamma), the model-free drafters (host tries), the cache lengths as
host ints (they pick the context bucket S; a launched round needs at most K + 1 more slots), the rows (text, stop
checks, counterfactual scores). Reading one round late: with the head pulled at a fixed K, or the no-draft arm,
round i + 1 needs nothing from round i's host copy (its pending token and head state are on the device; its
positions would be, in the graphs), so it can be launched before that copy is read. Where the arm or K depends
on round i's outcome (the bandit, gamma "auto"), or a stop check might end the stream, the host reads first:
launching on a stale choice would change the tokens of a sampled stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashspec_core.drafters import DraftModel, Drafter, Proposal
from flashspec_core.gamma import MAX_AUTO_GAMMA, CostModel
from flashspec_core.sampling import SamplingConfig, logits_to_probs
from flashspec_core.stream import RoundOutput
from kernels import verify


@dataclass
class Launched:
    """A round whose device work is queued: what `land` needs to finish it."""
    length: int  # L: the rows' length before the round
    K: int  # tokens drafted
    packed: torch.Tensor  # the round's host record, still on the device (see `_pack`)
    guessers: list[str]  # the drafters whose first-pass guesses are packed, in order
    timer: "RoundTimer"


@dataclass
class HostCopy:
    """The round's host record, unpacked from its one device-to-host copy."""
    num_accepted: list[int]  # [B]
    tokens: list[list[int]]  # [B][K+1]
    p: list[float]  # row 0: K + 1 values
    q: list[float]  # row 0: K values
    draft: list[int]  # row 0: K ids
    guesses: dict[str, int]

    @classmethod
    def read(cls, packed: torch.Tensor, K: int, guessers: list[str]) -> "HostCopy":
        rows = packed.tolist()  # the round's one device->host copy
        *counts, p, q, draft, guess = rows
        return cls(num_accepted=[int(r[0]) for r in counts], tokens=[[int(t) for t in r[1:K + 2]] for r in counts],
                   p=p[:K + 1], q=q[:K], draft=[int(t) for t in draft[:K]],
                   guesses={name: int(g) for name, g in zip(guessers, guess)})


class DeviceRound:
    """The target, its drafters and the accept test, driven one round at a time. Not thread-safe."""

    def __init__(self, target, drafters: dict[str, Drafter], kernel_backend: str = "auto"):
        self.target, self.drafters, self.kernel_backend = target, drafters, kernel_backend
        self.device = target.device
        self.pending: torch.Tensor | None = None  # [B, 1] the id the next verify feeds first (device)

    # -- the two calls -------------------------------------------------------------------------------
    def start(self, rows: list[list[int]], sampling: SamplingConfig, generator: torch.Generator,
              max_context: int | None = None, max_gamma: int = MAX_AUTO_GAMMA, arms: list[str] | None = None) -> float:
        """Prefill the target (all but the last token: each round feeds the pending token) and the drafters;
        returns the seconds it took. The target reports hidden states from here on only if one of `arms`
        (default: every drafter) reads them."""
        t0 = time.perf_counter()
        readers = [self.drafters[a] for a in (arms or self.drafters)]
        self.target.aux_layers = next((d.aux_layers for d in readers if d.aux_layers), ())
        self.target.reset()
        self._capture(max_context, max_gamma)
        hidden = None
        if len(rows[0]) > 1:
            self.target.forward(torch.tensor([r[:-1] for r in rows], device=self.device), logits_to_keep=1)
            hidden = self.target.aux
        for d in self.drafters.values():
            d.start(rows, sampling, generator, hidden=hidden if d.aux_layers else None)
        self.pending = torch.tensor([r[-1:] for r in rows], device=self.device)  # [B, 1]
        self.sync()
        return time.perf_counter() - t0

    def run(self, rows: list[list[int]], drafter: Drafter, k: int, sampling: SamplingConfig,
            generator: torch.Generator) -> RoundOutput:
        """One round over rows of equal length: draft, verify, accept, roll back, update."""
        return self.land(rows, self.launch(rows, drafter, k, sampling, generator))

    # -- the round -----------------------------------------------------------------------------------
    def launch(self, rows, drafter: Drafter, k: int, sampling: SamplingConfig, generator) -> Launched:
        """Draft, verify and the accept test, all on the device; nothing here reads the device."""
        timer = RoundTimer(self.device)
        guessers = self._guessers()
        guesses = [self.drafters[name].guess for name in guessers]  # taken before this round's update
        proposal = drafter.propose(rows, k)  # draft
        K = proposal.tokens.shape[1]
        timer.drafted()
        logits = self.target.forward(torch.cat([self.pending, proposal.tokens], dim=1), logits_to_keep=K + 1)  # [B, K+1, V]
        p = logits if sampling.greedy else logits_to_probs(logits, sampling)  # verify (greedy compares argmaxes)
        result = verify(proposal.tokens, proposal.q, p, generator=generator, greedy=sampling.greedy,
                        backend=self.kernel_backend)  # accept test
        shortest = result.num_accepted.min().view(1)  # rows advance together by the shortest accepted prefix + 1
        self.pending = result.tokens.index_select(1, shortest)  # [B, 1]: that row position's emitted id
        shown = logits.softmax(dim=-1) if sampling.greedy else p  # the p values shown with each token
        return Launched(len(rows[0]), K, _pack(proposal, shown, result, guesses), guessers, timer)

    def land(self, rows: list[list[int]], launched: Launched) -> RoundOutput:
        """Read the round's host record (the one sync), then accept on the rows, roll back and update."""
        host = HostCopy.read(launched.packed, launched.K, launched.guessers)
        L, m = launched.length, min(host.num_accepted)
        for row, toks in zip(rows, host.tokens):  # accept
            row.extend(toks[:m + 1])
        self.target.crop(L + m)  # roll back: the cache keeps the context and the accepted drafts
        self._update(rows, L + m, m + 1)
        draft_s, verify_s = launched.timer.done()
        return RoundOutput(host.num_accepted, host.tokens, host.draft, host.p, host.q, draft_s, verify_s, host.guesses)

    def _update(self, rows: list[list[int]], kept: int, verified: int) -> None:
        """Every drafter learns the round; the hidden-state readers get the features of the `verified` new
        positions (the pending token and the accepted drafts), whichever arm drafted."""
        hidden = None if self.target.aux is None else self.target.aux[:, :verified]
        for d in self.drafters.values():
            d.observe(rows, kept, hidden=hidden if d.aux_layers else None)

    def _guessers(self) -> list[str]:
        """The drafters that hold a first-pass guess at the current context (the draft head, when it is fed)."""
        if not self.target.aux_layers:
            return []
        return [name for name, d in self.drafters.items() if d.aux_layers and d.guess is not None]

    def _capture(self, max_context: int | None, max_gamma: int) -> None:
        """CUDA graphs: captured once per shape, kept on each model (a no-op without graphs)."""
        if not max_context:
            return
        for lm in [self.target] + [d.lm for d in self.drafters.values() if isinstance(d, DraftModel)]:
            if hasattr(lm, "capture"):
                lm.reset()
                lm.capture(range(1, max_gamma + 2) if lm is self.target else [1, 2], max_context=max_context)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- measuring the machine (Engine.calibrate) ----------------------------------------------------
    def forward_costs(self, rows: list[list[int]], sizes: tuple[int, ...], reps: int) -> CostModel:
        """The target's forward seconds over each of `sizes` tokens after the context `rows` (the fastest of
        `reps`, after one pass that warms up: a fresh model's first forwards are slower)."""
        greedy, generator = SamplingConfig(), torch.Generator(device=self.device).manual_seed(0)
        self.start(rows, greedy, generator, len(rows[0]) + 2 * max(sizes), max(sizes) - 1)
        L, best = self.target.length, dict.fromkeys(sizes, float("inf"))
        for rep in range(reps + 1):
            for T in sizes:
                t0 = time.perf_counter()
                self.target.forward(torch.tensor([rows[0][-1:] * T], device=self.device), logits_to_keep=T)
                self.sync()
                best[T] = min(best[T], time.perf_counter() - t0) if rep else best[T]
                self.target.crop(L)
        costs = CostModel(decay=0.0)
        for T in sizes:
            costs.observe(T, best[T])
        return costs

    def draft_step(self, rows: list[list[int]], drafter: Drafter, reps: int, k: int = 4) -> float:
        """A drafter's seconds per drafted token: the fastest of `reps` rounds of k tokens after `rows`."""
        greedy, generator = SamplingConfig(), torch.Generator(device=self.device).manual_seed(0)
        row = [rows[0][:]]
        self.start(row, greedy, generator, len(row[0]) + (reps + 1) * (MAX_AUTO_GAMMA + 1), MAX_AUTO_GAMMA)
        return min(self.run(row, drafter, k, greedy, generator).draft_s / k for _ in range(reps))


def _pack(proposal: Proposal, p: torch.Tensor, result, guesses: list[torch.Tensor]) -> torch.Tensor:
    """Counts, tokens and row 0's values in one float32 tensor [B + 4, W], to be copied to the host once.

    Rows 0..B-1: [num_accepted, tokens (K + 1)]. Row B: p of each token row 0 proposed, then p of its emitted
    one; row B+1: q of each proposed token (1 for a deterministic drafter); row B+2: the proposed ids; row B+3:
    the guesses' row 0. p is [B, K+1, V]. Ids < 2^24 are exact in float32.
    """
    B, K = proposal.tokens.shape
    n0 = result.num_accepted[:1]  # [1]
    drafted = proposal.tokens[0]  # [K]
    p_draft = p[0, :K].gather(-1, drafted[:, None]).squeeze(-1)  # [K]
    p_last = p[0].index_select(0, n0).gather(-1, result.tokens[0].gather(0, n0)[:, None]).view(1)
    q_draft = torch.ones(K, device=p.device) if proposal.q is None else \
        proposal.q[0].gather(-1, drafted[:, None]).squeeze(-1)
    guess = torch.stack([g[0] for g in guesses]).float() if guesses else p.new_zeros(0)
    W = max(K + 2, guess.numel())
    parts = [torch.cat([result.num_accepted[:, None].float(), result.tokens.float()], dim=1),  # [B, K+2]
             torch.cat([p_draft, p_last])[None], q_draft[None], drafted.float()[None], guess[None]]
    return torch.cat([F.pad(x, (0, W - x.shape[1])) for x in parts], dim=0)


class RoundTimer:
    """Draft and round wall times without an extra sync: on CUDA an event marks the end of drafting and is read
    after the round's one sync; on the CPU the host clock is exact. `done` gives (draft, the rest: verify, accept,
    roll back and update)."""

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
