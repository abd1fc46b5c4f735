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
- One device-to-host copy a round. `captured.pack` puts the accepted counts, the emitted ids, row 0's drafted ids, p and
  q values and the hidden-state readers' first-pass guesses into one float32 tensor; `HostCopy.read` reads it
  with one `.tolist()`. Nothing else in `run` reads the device (tests/flashspec_core/test_round.py counts).
  A greedy eager round on the CPU (the torch backend) packs the argmax instead (`captured.pack_greedy`) and runs
  the accept test on the host after that copy (`HostCopy.read_greedy`, the reference's greedy test): on a CPU
  each tensor operation costs microseconds, and the pending token is then made on the host.
- The pending token (the last emitted id, which the next verify feeds first) stays on the device: `launch`
  gathers it from the accept test's output at the shortest accepted count, itself a device tensor. The host's
  rows reach the device only through `start` and the model-free drafters' proposals.
- The copy drafters and draft models learn each round only where they are among the stream's arms (`fed`): one
  that is not cannot draft in the stream, and a copy drafter's update is most of a round's host work on the CPU (a
  draft model's start, a prefill). The n-gram cache, which remembers across streams, catches up on a stream it
  missed before it is next fed (`Transcript`).
- The draft head reads every verify forward (`observe` with the target's hidden states, whatever arm was
  pulled) and runs its first pass once `catch_up_slots` wait and before it drafts, so a head draft is K - 1
  chained steps from state already on the device, and its first-pass guess (`Drafter.guess`, a device tensor),
  where it is current, rides in the next round's host copy: a counterfactual score for the bandit.

On CUDA (and on the CPU with captured="eager") `launch` hands the round to `captured.CapturedRound`: the same
steps as one CUDA graph per shape, the head's update from the verify's hidden states inside it (all K + 1 slots
with the accepted count as a device tensor), the cache length on the device; where the head waits for several
slots, other arms' rounds store theirs in its backlog instead (`head_ready`). `land` then only reads, extends
the rows and moves the host's lengths. Stays on the host: the arm and K (bandit, gamma), the model-free
drafters (host tries), the cache lengths as host ints (they pick the context bucket), the rows (text, stop
checks, counterfactual scores).

One round ahead: a captured round whose draft needs no host rows (`on_device`: the head's, or none) may be
launched before the round before it lands (the engine does, choosing its arm and K one round late). Its record
is copied to pinned host memory after its graph, so the host's work on one round overlaps the device's on the
next; while it is in flight the host's cache length counts what it may append (so its context bucket is chosen
from an upper bound), and `land` takes rounds in launch order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashspec_core.captured import PIECE, CapturedRound, PromptPiece, Shape, law, pack, pack_greedy, piece_sizes
from flashspec_core.drafters import DraftHeadDrafter, DraftModel, Drafter, NoDraft
from flashspec_core.gamma import MAX_AUTO_GAMMA, CostModel, DraftCost
from flashspec_core.sampling import SamplingConfig, logits_to_probs
from flashspec_core.stream import RoundOutput
from kernels import resolve_backend, verify


@dataclass
class Launched:
    """A round whose device work is queued: what `land` needs to finish it."""
    K: int  # tokens drafted
    packed: torch.Tensor  # the round's host record (see `captured.pack`): on the device, or copying to the host
    guessers: list[str]  # the drafters whose first-pass guesses are packed, in order
    timer: "RoundTimer"
    captured: bool = False  # ran as a captured round: the head has observed it already
    ready: torch.cuda.Event | None = None  # recorded after `packed`'s copy into pinned host memory was queued
    tree: "TreeSize | None" = None  # a tree round of this shape (K: its nodes), `tree_round.launch_tree`
    stored: bool = False  # a captured round that left its verified slots in the head's backlog (`Shape.defer`)
    head_current: bool = True  # no slots waited for the head's first pass when it launched
    greedy_on_host: bool = False  # an eager greedy round on the CPU: `land` runs its accept test (`greedy_on_host`)

    @property
    def most(self) -> int:
        """The most tokens the round may append to the rows: a chain's K + 1, a tree's longest path + 1."""
        return self.K + 1 if self.tree is None else self.tree.longest + 1


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
    def read_greedy(cls, packed: torch.Tensor, K: int, guessers: list[str]) -> "HostCopy":
        """`captured.pack_greedy`'s record, with the greedy accept test on the host: each row keeps its drafts while
        they equal the target's argmax, then emits the argmax where they stopped."""
        *rows, p, q, guess = packed.tolist()  # the round's one device->host copy
        num_accepted, tokens, drafts = [], [], []
        for r in rows:
            best, drafted = [int(t) for t in r[:K + 1]], [int(t) for t in r[K + 1:2 * K + 1]]
            n = next((i for i in range(K) if drafted[i] != best[i]), K)
            num_accepted.append(n)
            tokens.append(drafted[:n] + [best[n]] + [-1] * (K - n))
            drafts.append(drafted)
        return cls(num_accepted=num_accepted, tokens=tokens, p=p[:K] + [p[K + num_accepted[0]]], q=q[:K],
                   draft=drafts[0], guesses={name: int(g) for name, g in zip(guessers, guess)})

    @classmethod
    def read(cls, packed: torch.Tensor, K: int, guessers: list[str]) -> "HostCopy":
        rows = packed.tolist()  # the round's one device->host copy
        *counts, p, q, draft, guess = rows
        return cls(num_accepted=[int(r[0]) for r in counts], tokens=[[int(t) for t in r[1:K + 2]] for r in counts],
                   p=p[:K + 1], q=q[:K], draft=[int(t) for t in draft[:K]],
                   guesses={name: int(g) for name, g in zip(guessers, guess)})


@dataclass
class Transcript:
    """A stream's row 0 as a copy drafter reads it: the prompt, then each landed round's new ids. A drafter that
    remembers across streams (`Drafter.remembers`) and is not among a stream's arms is not fed during it; the
    transcript is replayed into it before it is next fed, so that it learns what every round would have taught it."""
    prompt: list[int]
    rounds: list[list[int]] = field(default_factory=list)
    length: int = 0  # row 0's length after the last round recorded (the prompt's before the first)

    def __post_init__(self):
        self.length = len(self.prompt)

    def record(self, row: list[int]) -> None:
        """After a round landed on `row`: the ids it appended."""
        self.rounds.append(row[self.length:])
        self.length = len(row)

    def replay(self, drafter: Drafter) -> None:
        """`start` and each round's `observe`, as the stream would have called them on row 0."""
        row = self.prompt[:]
        drafter.start([row], None, None)
        for new in self.rounds:
            row.extend(new)
            drafter.observe([row], len(row) - 1)


CAPTURED = ("auto", "eager", "off")


class DeviceRound:
    """The target, its drafters and the accept test, driven one round at a time. Not thread-safe."""

    def __init__(self, target, drafters: dict[str, Drafter], kernel_backend: str = "auto", captured: str = "auto"):
        """captured: "auto" = captured rounds (`flashspec_core.captured`) where CUDA graphs replay them, "eager" = the
        captured rounds' code without graphs (what the CPU tests run), "off" = the rounds below."""
        if captured not in CAPTURED:
            raise ValueError(f"unknown captured mode {captured!r}; expected one of {list(CAPTURED)}")
        self.target, self.drafters, self.kernel_backend = target, drafters, kernel_backend
        self.device = target.device
        self.pending: torch.Tensor | None = None  # [B, 1] the id the next verify feeds first (device)
        self.mode = captured
        self.captured: CapturedRound | None = None  # the stream's, set by `start` where it applies
        self._built: CapturedRound | None = None  # the last one built, kept (with its graphs) across eager streams
        self.unlanded: list[Launched] = []  # launched, not landed yet, oldest first (two while one runs ahead)
        self.launched_ahead = 0  # rounds launched before the one before them landed (a stream's counter)
        self._landed_at = 0.0  # when the last round landed (a round's wall time starts no earlier)
        self._pinned: dict[tuple, list[torch.Tensor]] = {}  # host buffers for captured rounds' records, two a size
        self.fed: list[Drafter] = list(drafters.values())  # the drafters the stream keeps current (`start`)
        self.transcript: Transcript | None = None  # the stream's, while a drafter that remembers is not fed
        self.backlog: dict[str, list[Transcript]] = {}  # per such drafter: the streams it missed, oldest first
        self.unsettled: tuple[list[list[int]], int, list[Drafter]] = ([], 0, [])  # `land` left them for `settle`
        self.stream: torch.cuda.Stream | None = None  # the stream's CUDA stream (`start`), for the rounds' events
        self.behind = 0  # captured rounds: slots in the head's backlog (of the rounds launched whose count is known)

    # -- the two calls -------------------------------------------------------------------------------
    def start(self, rows: list[list[int]], sampling: SamplingConfig, generator: torch.Generator,
              max_context: int | None = None, max_gamma: int = MAX_AUTO_GAMMA, arms: list[str] | None = None,
              captured: bool = True, tree_tokens: int = 0, tree=None) -> float:
        """Prefill the target (all but the last token: each round feeds the pending token) and the drafters;
        returns the seconds it took. The target reports hidden states from here on only if one of `arms`
        (default: every drafter) reads them, and only they and the hidden-state readers are fed (`feed`).
        captured=False: this stream runs eager rounds (auto-sized trees do); tree_tokens: the most slots
        an eager tree's verify may take (graphs for 2..tree_tokens are captured now, not mid-stream); tree: the
        `TreeSize` a captured stream's tree rounds take (their graphs are captured now too)."""
        t0 = time.perf_counter()
        self.unlanded.clear()  # a round the last stream left in flight is dropped (its device work is queued first)
        self.unsettled = ([], 0, [])
        self.launched_ahead = 0
        self.behind = 0
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.feed(rows, arms)
        readers = [self.drafters[a] for a in (arms or self.drafters)]
        self.target.aux_layers = next((d.aux_layers for d in readers if d.aux_layers), ())
        self.target.reset()
        self._capture(len(rows), sampling, max_context, max_gamma, captured, tree_tokens, tree)
        hidden = None
        if len(rows[0]) > 1:
            self.target.forward(torch.tensor([r[:-1] for r in rows], device=self.device), logits_to_keep=1)
            hidden = self.target.aux
        c = self.captured
        if c is not None:
            generator = c.begin(torch.tensor(rows, device=self.device), sampling, generator)
        for d in self.fed:
            in_graphs = c is not None and d is c.head and hidden is not None and c.takes_prompt(hidden.shape[1])
            d.start(rows, sampling, generator, hidden=hidden if d.aux_layers and not in_graphs else None)
            if in_graphs:  # the head's first pass over the prompt replays graphs
                c.prompt(rows, hidden)
        self.pending = torch.tensor([r[-1:] for r in rows], device=self.device) if c is None else c.pending  # [B, 1]
        self.sync()
        return time.perf_counter() - t0

    def run(self, rows: list[list[int]], drafter: Drafter, k: int, sampling: SamplingConfig,
            generator: torch.Generator) -> RoundOutput:
        """One round over rows of equal length: draft, verify, accept, roll back, update."""
        return self.land(rows, self.launch(rows, drafter, k, sampling, generator))

    def run_tree(self, rows: list[list[int]], drafter: DraftHeadDrafter, shape, sampling: SamplingConfig,
                 generator, nodes=None) -> RoundOutput:
        """One round that verifies a draft tree of `shape` (`tree_round.TreeSize`) from the head: eager, or on a
        captured round (every node verified: `nodes` None; sampled: the static shape) as one graph."""
        from flashspec_core.tree_round import run_tree

        if self.captured is None:
            return run_tree(self, rows, drafter, shape, sampling, generator, nodes)
        if nodes is not None:
            raise ValueError("a captured round verifies trees of a fixed size from its own head: build the round "
                             "with captured='off' for auto-sized trees")
        return self.land(rows, self.launch(rows, drafter, 0, sampling, generator, tree=shape))

    def feed(self, rows: list[list[int]], arms: list[str] | None) -> None:
        """Choose the drafters the stream starting at `rows` keeps current: its arms (default: every drafter) and the
        hidden-state readers (the draft head: its state is a captured round's; it gets features only when an arm
        reads them). A draft model that is not an arm is not started (its prefill would be wasted: a plain stream
        paid it). One that remembers across streams first replays the streams it missed (in order), and this
        stream's transcript is kept for it when it misses this one."""
        names = set(arms or self.drafters) | {NoDraft.name}  # a plain step is always allowed
        self.fed = [d for name, d in self.drafters.items() if name in names or d.aux_layers]
        missed = [name for name, d in self.drafters.items() if d.remembers and d not in self.fed]
        self.transcript = Transcript(rows[0][:]) if missed else None
        for d in self.fed:
            for transcript in self.backlog.pop(d.name, []):
                transcript.replay(d)
        for name in missed:
            self.backlog.setdefault(name, []).append(self.transcript)

    def reset_session(self) -> None:
        """Forget the streams that drafters which remember missed (with the drafters' own `reset_session`)."""
        self.backlog = {}

    # -- the round -----------------------------------------------------------------------------------
    def greedy_on_host(self, sampling: SamplingConfig) -> bool:
        """Whether an eager round's greedy accept test runs on the host after the round's one copy (on the CPU, with
        the torch backend: the same test as `verify_torch`'s greedy branch, in a third of the tensor operations, each
        a few microseconds there) rather than in `verify` before it. The triton backend keeps its kernel."""
        return sampling.greedy and self.device.type == "cpu" and \
            resolve_backend(self.kernel_backend, self.device) == "torch"

    def on_device(self, drafter: Drafter) -> bool:
        """Whether a round of `drafter` can be launched before the round before it lands: captured rounds whose
        draft needs no host rows (the head drafts inside the graph; no draft), unless the head must first take a
        backlog whose size waits on the round in flight (`_must_catch_up`)."""
        c = self.captured
        if c is None or not (drafter is c.head or isinstance(drafter, NoDraft)):
            return False
        return self._waiting()[1] or not self._must_catch_up(drafter is c.head, 1)

    def launch(self, rows, drafter: Drafter, k: int, sampling: SamplingConfig, generator, tree=None) -> Launched:
        """Draft, verify and the accept test, all on the device; nothing here reads the device. With a round in
        flight (`on_device` arms only) it runs after that round on the device and lands after it. tree: a tree
        of that `TreeSize` from the head instead of a chain (a captured round: `tree_round.launch_tree`)."""
        if drafter not in self.fed:
            raise ValueError(f"{drafter.name} is not among the stream's arms: start the stream with it")
        if tree is not None and (self.captured is None or drafter is not self.captured.head):
            raise ValueError("a launched tree round runs on a captured round, from its head")
        if self.unlanded:
            if not self.on_device(drafter):
                raise ValueError(f"a round of {drafter.name} needs the host's rows: land the round in flight first")
            self.launched_ahead += 1
        if tree is not None:
            from flashspec_core.tree_round import launch_tree

            launched = launch_tree(self, drafter, tree, sampling)
        else:
            launched = self._launch(rows, drafter, k, sampling, generator)
        self.unlanded.append(launched)
        return launched

    def _launch(self, rows, drafter: Drafter, k: int, sampling: SamplingConfig, generator) -> Launched:
        if self.captured is not None:
            return self._launch_captured(rows, drafter, k, sampling)
        timer = RoundTimer(self.device, self.stream)
        guessers = self._guessers()
        guesses = [self.drafters[name].guess for name in guessers]  # taken before this round's update
        proposal = drafter.propose(rows, k)  # draft
        K = proposal.tokens.shape[1]
        timer.drafted()
        logits = self.target.forward(torch.cat([self.pending, proposal.tokens], dim=1), logits_to_keep=K + 1)  # [B, K+1, V]
        if self.greedy_on_host(sampling):  # the accept test and the pending token wait for `land`'s one copy
            timer.launched()
            return Launched(K, pack_greedy(proposal, logits, guesses), guessers, timer, greedy_on_host=True)
        p = logits if sampling.greedy else logits_to_probs(logits, sampling)  # verify (greedy compares argmaxes)
        result = verify(proposal.tokens, proposal.q, p, generator=generator, greedy=sampling.greedy,
                        backend=self.kernel_backend)  # accept test
        shortest = result.num_accepted.min().view(1)  # rows advance together by the shortest accepted prefix + 1
        self.pending = result.tokens.index_select(1, shortest)  # [B, 1]: that row position's emitted id
        shown = logits.softmax(dim=-1) if sampling.greedy else p  # the p values shown with each token
        timer.launched()
        return Launched(K, pack(proposal, shown, result, guesses), guessers, timer)

    def land(self, rows: list[list[int]], launched: Launched, first: Drafter | None = None) -> RoundOutput:
        """Read the round's host record (the one sync), then accept on the rows, roll back and update. Rounds land
        in the order they were launched. `first` (captured rounds): only that drafter learns the round now (it
        drafts next); the other model-free drafters learn it at `settle`, once the next round is launched."""
        if not self.unlanded or launched is not self.unlanded[0]:
            raise ValueError("rounds land in the order they were launched")
        if launched.ready is not None:
            launched.ready.synchronize()
        if launched.tree is not None:
            from flashspec_core.tree_round import land_tree

            return land_tree(self, rows, launched, first)
        read = HostCopy.read_greedy if launched.greedy_on_host else HostCopy.read
        host = read(launched.packed, launched.K, launched.guessers)
        L, m = len(rows[0]), min(host.num_accepted)
        if launched.greedy_on_host:  # the pending token: each row's emitted id at the shortest accepted count
            self.pending = torch.tensor([[t[m]] for t in host.tokens], device=self.device)
        for row, toks in zip(rows, host.tokens):  # accept
            row.extend(toks[:m + 1])
        if launched.stored:  # its m + 1 slots wait for the head
            if launched.K:  # (a round of K = 0 counted its one slot at launch)
                self.behind += m + 1
            if launched.head_current:
                self.captured.head.cache.length = L - 1
        self.landed(rows, L + m, first)
        if not launched.captured:
            self._update(rows, L + m, None if self.target.aux is None else self.target.aux[:, :m + 1])
        draft_s, verify_s, device_s = self.landing_times(launched.timer)
        return RoundOutput(host.num_accepted, host.tokens, host.draft, host.p, host.q, draft_s, verify_s, host.guesses,
                           device_s)

    def landing_times(self, timer: "RoundTimer") -> tuple[float, float, float | None]:
        """A landed round's (draft_s, verify_s, device_s), its wall time counted from the last landing at the
        earliest (a round launched ahead started before it); this landing's time is kept for the next."""
        times = timer.done(since=self._landed_at)
        self._landed_at = time.perf_counter()
        return times

    def landed(self, rows: list[list[int]], kept: int, first: Drafter | None) -> None:
        """The oldest round in flight has landed on `rows` (the cache keeps `kept` tokens): out of flight, the cache
        rolled back, a round still in flight counted by the most it may append, and after a captured round the
        drafters' learning (`_update_captured`; an eager round's caller passes the hidden states to `_update`)."""
        launched = self.unlanded.pop(0)
        self.target.crop(kept)  # roll back: the cache keeps the context and the accepted drafts
        self.target.length += sum(r.most for r in self.unlanded)  # a round in flight: what it may append
        if launched.captured:
            self._update_captured(rows, kept, first, launched.stored)

    def _update(self, rows: list[list[int]], kept: int, hidden: torch.Tensor | None) -> None:
        """Every fed drafter learns the round; the hidden-state readers get `hidden` [B, n, F], the target's features
        of the n newly verified positions (the pending token and the accepted drafts), whichever arm drafted."""
        self._record(rows)
        for d in self.fed:
            d.observe(rows, kept, hidden=hidden if d.aux_layers else None)

    # -- captured rounds ------------------------------------------------------------------------------
    def _launch_captured(self, rows, drafter: Drafter, k: int, sampling: SamplingConfig) -> Launched:
        """The round as one captured graph: the head drafts inside it; a model-free drafter's ids are copied in.
        Where the head waits for several slots (`CapturedRound.defers`), another arm's round stores its slots in the
        head's backlog (`Shape.defer`), and the head takes them before it drafts (`head_ready`)."""
        timer, c, head = RoundTimer(self.device, self.stream), self.captured, self.captured.head
        drafts = drafter is head and head.h is not None and k > 0
        if drafts:
            K = k
        else:
            tokens = drafter.propose(rows, k).tokens if drafter is not head else c.draft[:, :0]
            K = tokens.shape[1]
            c.draft[:, :K].copy_(tokens)
        observe = bool(self.target.aux_layers)
        stores = observe and c.defers and not drafts
        current = self.head_ready(drafts, K + 1 if stores else 0)
        guessers = [head.name] if observe and head.h is not None and current else []
        shape = Shape(drafts, K, self.target.bucket(self.target.length + K + 1), observe=observe, defer=stores,
                      **law(sampling))
        timer.drafted()  # a model-free draft ends here; the head's drafting runs inside the round (in verify_s)
        packed = self._to_host(c.run(shape))
        timer.launched()  # after the record's copy was queued: this event also says when the host may read it
        self.target.length += K + 1  # the host's count of what the verify appended (rolled back in `land`)
        if stores and K == 0:
            self.behind += 1  # its one slot, known now
        return Launched(K, packed, guessers, timer, captured=True, ready=timer.end if timer.cuda else None,
                        stored=stores, head_current=current)

    # -- the head's backlog (captured rounds where the head waits for several slots) ------------------
    def _waiting(self) -> tuple[int, bool]:
        """(the most slots the head's backlog holds once the rounds in flight land, whether that count is known)."""
        unknown = [r.most for r in self.unlanded if r.stored and r.K]
        return self.behind + sum(unknown), not unknown

    def _must_catch_up(self, drafts: bool, slots: int) -> bool:
        """Whether the head must take its backlog before a round: it drafts in it, or the round's slots may not fit."""
        c, (most, _) = self.captured, self._waiting()
        return c.defers and ((drafts and most > 0) or most + slots > PIECE)

    def head_ready(self, drafts: bool, slots: int) -> bool:
        """Before a captured round that stores `slots` in the backlog or in which the head `drafts`: the head's first
        pass over its backlog where it must take it, or once `catch_up_slots` wait (then its guess scores the
        round); returns whether the head is current as the round starts."""
        c, (most, known) = self.captured, self._waiting()
        if not (c.defers and self.target.aux_layers):
            return True
        if self._must_catch_up(drafts, slots) or (known and most >= c.head.catch_up_slots):
            if not known:
                raise ValueError("the head's backlog waits on the round in flight: land it first")
            c.catch_up(self.behind, self.target.bucket(self.target.length))  # the length counts rounds in flight
            self.behind = 0
        return known and self.behind == 0

    def _to_host(self, packed: torch.Tensor) -> torch.Tensor:
        """On CUDA, queue the record's copy into a pinned host buffer (two a size, taken in turn: at most two rounds
        are in flight, and a graph's next replay overwrites its own record)."""
        if packed.device.type != "cuda":
            return packed
        pair = self._pinned.setdefault(tuple(packed.shape), [torch.empty(packed.shape, dtype=packed.dtype,
                                                                          pin_memory=True) for _ in range(2)])
        pair.reverse()
        pair[0].copy_(packed, non_blocking=True)
        return pair[0]

    def _update_captured(self, rows: list[list[int]], kept: int, first: Drafter | None = None,
                         stored: bool = False) -> None:
        """After a captured round: the head has observed it on the device (its cache now holds `kept` slots) unless
        the round `stored` its slots in the head's backlog; every other fed drafter learns it as in `_update`, now if
        it is `first` (or none is named), else at `settle`."""
        self._record(rows)
        later = []
        for d in self.fed:
            if d is self.captured.head:
                if stored:
                    continue
                d.cache.length = kept
                f = d.fixed
                d.h, d.logits, d.guess = f.h, f.logits, f.guess
            elif first is None or d is first:
                d.observe(rows, kept)
            else:
                later.append(d)
        self.unsettled = (rows, kept, later)

    def settle(self) -> None:
        """The drafters that `land` left for later learn the landed round (before anything reads them again)."""
        rows, kept, later = self.unsettled
        self.unsettled = ([], 0, [])
        for d in later:
            d.observe(rows, kept)

    def _record(self, rows: list[list[int]]) -> None:
        if self.transcript is not None:
            self.transcript.record(rows[0])

    def _guessers(self) -> list[str]:
        """The drafters that hold a first-pass guess at the current context (the draft head, when it is fed)."""
        if not self.target.aux_layers:
            return []
        return [name for name, d in self.drafters.items() if d.aux_layers and d.guess is not None]

    def _capture(self, batch: int, sampling: SamplingConfig, max_context: int | None, max_gamma: int,
                 captured: bool = True, tree_tokens: int = 0, tree=None) -> None:
        """CUDA graphs: captured once per shape, kept on each model and on the captured round (a no-op without
        graphs). Builds the captured round where it applies (`captured`) and is wanted."""
        self.captured = self._captured_round(batch) if captured else None
        if not max_context:
            return
        for lm in self._models():
            if hasattr(lm, "capture_prefill"):  # the padded prompts' graphs (the draft models' caches are empty too)
                lm.reset()
                lm.capture_prefill(max_context)
        if self.captured is not None:
            self.captured.capture(self.shapes(sampling, max_context, max_gamma, tree))
            return
        for lm in self._models():
            if hasattr(lm, "capture"):
                lm.reset()
                lm.capture(range(1, max_gamma + 2) if lm is self.target else [1, 2], max_context=max_context,
                           tree_counts=range(2, min(tree_tokens, lm.max_graph_tokens) + 1) if lm is self.target else ())

    def _models(self) -> list:
        """The models whose caches a stream fills: the target and each draft model's."""
        return [self.target] + [d.lm for d in self.drafters.values() if isinstance(d, DraftModel)]

    def _captured_round(self, batch: int) -> CapturedRound | None:
        """The captured round for `batch` rows (kept while the batch stays), or None where it does not apply: mode
        "off", a target without a static cache, graphs off in "auto", or a draft model among the drafters."""
        graphs = getattr(self.target, "use_graphs", False)
        if self.mode == "off" or not hasattr(self.target, "capacity") or (self.mode == "auto" and not graphs):
            return None
        heads = [d for d in self.drafters.values() if isinstance(d, DraftHeadDrafter)]
        if len(heads) > 1 or any(not d.model_free and d not in heads for d in self.drafters.values()):
            return None
        if self._built is None or not self._built.serves(batch):
            self._built = CapturedRound(self.target, heads[0] if heads else None, self.kernel_backend, batch,
                                        graphs=graphs and self.mode == "auto")
        return self._built

    def warm_up(self, sampling: SamplingConfig, max_context: int, max_gamma: int = MAX_AUTO_GAMMA, trees=()) -> int:
        """Capture every shape a one-row stream up to max_context tokens can run (`shapes`, and those of greedy
        `trees`), with the head reading the verify's hidden states and without; returns how many graphs were
        captured (0 without graphs)."""
        readers = {d.aux_layers for d in self.drafters.values() if d.aux_layers}
        count = 0
        for aux in [*readers, ()]:
            self.target.aux_layers = aux
            self.target.reset()
            self.captured = self._captured_round(1)
            if self.captured is None:
                return 0
            count += self.target.capture_prefill(max_context)
            count += self.captured.capture([shape for tree in (None, *trees)
                                            for shape in self.shapes(sampling, max_context, max_gamma, tree)])
        return count

    def warm_up_trees(self, max_context: int, tree_tokens: int) -> int:
        """Capture the target's tree verifies of 2..tree_tokens slots over every context bucket up to max_context,
        with the hidden-state readers a tree stream has (the head's: only it drafts trees), so that a tree stream's
        start finds them; returns how many graphs were captured (0 without graphs)."""
        if not hasattr(self.target, "capture"):
            return 0
        counts = range(2, min(tree_tokens, self.target.max_graph_tokens) + 1)
        count = 0
        for aux in {d.aux_layers for d in self.drafters.values() if d.aux_layers}:
            self.target.aux_layers = aux
            self.target.reset()
            count += self.target.capture((), max_context=max_context, tree_counts=counts)
        return count

    def shapes(self, sampling: SamplingConfig, max_context: int, max_gamma: int, tree=None) -> list:
        """Every shape a stream may run: the head's first pass over a prompt in pieces (`PromptPiece`), its drafts
        and host ids at each K <= max_gamma, over every context bucket up to max_context, with the target's current
        hidden-state readers; and the head's trees of shape `tree` (a `TreeSize`; sampled: its static shape) where one
        is given."""
        from flashspec_core.tree_round import captured_nodes

        observe, head = bool(self.target.aux_layers), self.captured.head is not None
        buckets = [S for S in self.target.buckets if S <= self.target.bucket(max_context)]
        N = captured_nodes(tree, sampling.greedy) if tree is not None else 0
        if N + 1 > self.target.max_graph_tokens:
            raise ValueError(f"a captured tree round verifies at most {self.target.max_graph_tokens - 1} drafted "
                             f"tokens; this tree has {N} (its nodes and its copied branch): ask for a smaller one")
        trees = [Shape(True, N, S, observe=True, tree=tree, **law(sampling)) for S in buckets if S > N] \
            if tree is not None and observe and head else []
        defers = observe and head and self.captured.defers
        prompt_S = [S for S in [self.captured.prompt_S()] if observe and S is not None]
        prompt = [PromptPiece(T, S) for S in dict.fromkeys(prompt_S + (buckets if defers else []))
                  for T in piece_sizes(self.target.max_graph_tokens)]  # the head's first pass over a prompt, a backlog
        chains = [Shape(h, K, S, observe=observe, defer=defers and not h, **law(sampling)) for S in buckets
                  for K in range(max_gamma + 1)
                  for h in ((False, True) if observe and head and K else (False,)) if S >= K + 1]
        return prompt + trees + chains

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

    def draft_cost(self, rows: list[list[int]], drafter: Drafter, reps: int, k: int = 4) -> DraftCost:
        """A drafter's propose time after `rows` from rounds of 1 and of k tokens, alternating (the fastest of `reps`
        each): per token the difference over k - 1, per round the rest (for the draft head: its first pass over
        the slots the last round verified, which wait for a draft; none inside a captured round). On a captured
        round a drafter that reads the host's rows also waits for the round before it to land, which rounds
        launched ahead (`on_device`) never do: per round it pays too what a round's landing takes past its
        device time (the fastest of its rounds)."""
        greedy, generator = SamplingConfig(), torch.Generator(device=self.device).manual_seed(0)
        row = [rows[0][:]]
        self.start(row, greedy, generator, len(row[0]) + (reps + 1) * 2 * (MAX_AUTO_GAMMA + 1), MAX_AUTO_GAMMA)
        if self.captured is not None and drafter is self.captured.head:
            return DraftCost(per_token=self._captured_draft_step(k, reps))
        best, landing = {1: float("inf"), k: float("inf")}, float("inf")
        for rep in range(reps + 1):  # the first pair warms up (and its first round finds nothing waiting)
            for K in best:
                out = self.land(row, self.launch(row, drafter, K, greedy, generator), first=drafter)
                self.settle()  # as a stream lands it: the drafter learns first, the others once it has drafted again
                best[K] = min(best[K], out.draft_s) if rep else best[K]
                if rep and out.device_s is not None:
                    landing = min(landing, out.verify_s - out.device_s)
        per_token = max(0.0, (best[k] - best[1]) / (k - 1))
        waits = max(0.0, landing) if self.captured is not None and landing < float("inf") else 0.0
        return DraftCost(per_token=per_token, per_round=max(0.0, best[1] - per_token) + waits)

    def _captured_draft_step(self, k: int, reps: int) -> float:
        """The head's seconds per drafted token inside a captured round: a round where it drafts k tokens less one
        that verifies k given ids (the fastest of reps + 1 each; the rows are scratch: a calibration stream)."""
        S = self.target.bucket(self.target.length + 2 * (reps + 1) * (k + 1))

        c, observe = self.captured, bool(self.target.aux_layers)

        def seconds(head: bool) -> float:
            defer = observe and c.defers and not head
            if defer:
                c.head_length.copy_(c.length)  # the round's slots from the backlog's front
            t0 = time.perf_counter()
            c.run(Shape(head, k, S, True, observe, defer=defer))
            self.sync()
            return time.perf_counter() - t0

        best = {head: min(seconds(head) for _ in range(reps + 1)) for head in (True, False)}
        return max(0.0, best[True] - best[False]) / k


class RoundTimer:
    """Draft and round wall times without an extra sync: on CUDA events mark the end of drafting and of the round's
    device work and are read after the round's one sync; on the CPU the host clock is exact. `done` gives (draft,
    the rest: verify, accept, roll back and update, device): device is the GPU's time from the end of drafting to
    the end of the launched work (a captured round: its graph's time), None on the CPU."""

    def __init__(self, device: torch.device, stream: "torch.cuda.Stream | None" = None):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        if self.cuda:  # events recorded on a given stream: looking the current one up costs host time each call
            self.stream = stream or torch.cuda.current_stream(device)
            self.start, self.mid, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            self.start.record(self.stream)

    def drafted(self):
        if self.cuda:
            self.mid.record(self.stream)
        else:
            self.t1 = time.perf_counter()

    def launched(self):
        if self.cuda:
            self.end.record(self.stream)

    def done(self, since: float = 0.0) -> tuple[float, float, float | None]:
        """`since`: the last round's landing; a round launched before it counts its wall time from there."""
        total = time.perf_counter() - max(self.t0, since)
        draft = self.start.elapsed_time(self.mid) / 1e3 if self.cuda else self.t1 - self.t0
        device = self.mid.elapsed_time(self.end) / 1e3 if self.cuda else None
        return draft, max(0.0, total - draft), device
