"""The captured round: a speculative round (draft, verify, accept test, the pending token, the host record and the
draft head's update) as one CUDA graph per `Shape`, over fixed buffers, with the cache length on the device. On
the CPU the same `body` runs eagerly: it is the specification the graphs replay, and the tests run it there.

    CapturedRound(target, head, backend, batch, graphs)  buffers for `batch` rows
    capture(shapes)          warm up and capture each shape (before a stream: it writes into the caches)
    run(shape) -> packed     replay (or run eagerly); packed is the round's host record (`pack` below)

A shape is what the host decides before a round: whether the head drafts inside the graph or the ids come from
the host (a model-free drafter; none for the no-draft arm), K, the context bucket S that attention reads, greedy
or sampling (the sampling settings are a device tensor, so one graph serves every temperature, top-k and top-p),
and whether a draft head reads the verify's hidden states. The host copies in what only it knows (a model-free
draft's ids) and reads one packed tensor back; positions, the pending token and the head's state stay here.

The head's backlog: where the head runs its first pass only once several slots wait (`DraftHeadDrafter.catch_up_slots`
> 1, the default), a round of another arm (`Shape.defer`) stores the verify's features and emitted ids for it instead
of running the pass, so that such a round costs what a plain round does; `catch_up` later runs the pass over them in
`PromptPiece`s, as over a prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flashspec_core.drafters import DraftHeadDrafter, Proposal, TreeProposal
from flashspec_core.fast_path import MAX_GRAPH_TOKENS
from flashspec_core.sampling import SamplingConfig, draft_sampling, logits_to_probs_at, sampling_params
from flashspec_core.tree import TensorTree
from kernels import verify, verify_tree
from kernels.verify import argmax
from kernels.tree_level import copy_graft_triton


PIECE = 32  # the longest piece of a prompt the head takes in one graph
LONGEST_RUN = 4  # the longest run of last ids that the copied branch's lookup matches (`copied`)


def prompt_pieces(T: int, max_tokens: int = MAX_GRAPH_TOKENS) -> list[int]:
    """The pieces the head's first pass takes a prompt of T slots in: as many of the longest piece (32, or the
    largest power of two up to max_tokens) as fit, then the rest's binary digits, largest first (60 -> 32, 16, 8,
    4). They follow from T alone."""
    longest = min(PIECE, 1 << (max_tokens.bit_length() - 1))
    rest = T % longest
    return [longest] * (T // longest) + [1 << b for b in reversed(range(longest.bit_length())) if rest >> b & 1]


def piece_sizes(max_tokens: int = MAX_GRAPH_TOKENS) -> list[int]:
    """Every piece `prompt_pieces` may cut a prompt into: the head's prompt graphs."""
    return sorted(set(prompt_pieces(2 * PIECE - 1, max_tokens)))


@dataclass(frozen=True)
class Shape:
    head: bool  # the draft head drafts inside the round (else the ids are copied in from the host)
    K: int  # tokens drafted
    S: int  # cache slots the target and the head attend over (the context bucket)
    greedy: bool
    observe: bool  # the verify forward's hidden states go through the head's first pass
    tree: "TreeSize | None" = None  # the head drafts a tree of this shape (K: its nodes), else a chain; sampled:
    #                                 its static shape (`TreeSize.sampled`)
    defer: bool = False  # the verify's features wait in the head's backlog (`CapturedRound.catch_up`) instead of
    #                      going through its first pass in the round
    truncates: bool = False  # sampling with top-k or top-p on (`SamplingConfig.truncates`): the laws sort the
    #                          vocabulary; a graph without it serves temperature alone


def law(sampling: SamplingConfig) -> dict:
    """A `Shape`'s fields for a stream's sampling: greedy, and whether top-k or top-p truncate its laws."""
    return dict(greedy=sampling.greedy, truncates=sampling.truncates)


@dataclass(frozen=True)
class PromptPiece:
    """The head's first pass over T of a prompt's slots, attending over S slots (`CapturedRound.prompt`)."""
    T: int
    S: int
    greedy: bool = True  # no random draws
    observe: bool = False  # the target does not run
    tree: None = None  # no draft
    defer: bool = False


class CapturedRound:
    """Fixed buffers and one graph per `Shape` for a `StaticCausalLM` target and an optional draft head."""

    def __init__(self, target, head: DraftHeadDrafter | None, backend: str, batch: int, graphs: bool):
        dev = target.device
        target._fit_batch(batch)  # its caches for `batch` rows before any graph reads them (an empty cache allows it)
        self.target, self.head, self.backend, self.use_graphs = target, head, backend, graphs
        T = target.max_graph_tokens
        self.length = torch.zeros(1, dtype=torch.int64, device=dev)  # the target's cache length (the head's too)
        self.pending = torch.zeros((batch, 1), dtype=torch.int64, device=dev)  # the id the next verify feeds first
        self.draft = torch.zeros((batch, T - 1), dtype=torch.int64, device=dev)  # a host drafter's ids
        self.params = sampling_params(SamplingConfig(1.0), dev)  # temperature, top_k, top_p while sampling
        self.head_params = self.params.clone()  # the head's (`draft_sampling`: its own draft temperature)
        self.steps = torch.arange(T, device=dev)
        self.history = torch.full((batch, target.capacity + T + 1), -1, dtype=torch.int64, device=dev)  # ids by
        #                                 position (the pending one at `length`): what a tree's copied branch reads
        self.generator = torch.Generator(device=dev)  # every random draw of a captured round
        self.graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.eager_rounds = 0  # rounds that found no graph of their shape (graphs on) and ran eagerly
        if head is not None:
            head.bind(batch, target.capacity)
            F_in = head.head.cfg.feature_size  # the aux features the head's first pass reads
            self.features = torch.zeros((batch, PIECE, F_in), dtype=head.dtype, device=dev)  # a prompt piece's
            self.following = torch.zeros((batch, PIECE), dtype=torch.int64, device=dev)  # token t + 1 of slot t
            self.piece = torch.zeros(1, dtype=torch.int64, device=dev)  # the piece's first slot
            self.head_length = torch.zeros(1, dtype=torch.int64, device=dev)  # slots through the head's first pass:
            #                                 the backlog (`features`, `following` from 0) holds the slots after them
        self._reads = self._buffers()  # what its graphs read: valid while the models keep these

    def _buffers(self) -> tuple:
        head = self.head.fixed.cache if self.head is not None else None
        return (self.target.kv_cache[0], None if head is None else head.k)

    def serves(self, batch: int) -> bool:
        """Whether this round still serves streams of `batch` rows: same batch, and the target's and the head's
        caches are the tensors its graphs were captured on (a stream of another batch reallocates them)."""
        return self.batch == batch and all(a is b for a, b in zip(self._buffers(), self._reads))

    @property
    def batch(self) -> int:
        return self.pending.shape[0]

    @property
    def defers(self) -> bool:
        """Whether other arms' rounds leave their slots in the head's backlog (the head waits for several)."""
        return self.head is not None and self.head.catch_up_slots > 1

    def begin(self, rows: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> torch.Generator:
        """A stream starts: its ids [B, n] (the last one pending), the cache length (the target's), the sampling
        settings and the random state (`generator`'s, copied in when graphs replay on their own generator).
        Returns the generator the rounds draw from."""
        self.pending.copy_(rows[:, -1:])
        self.history[:, :rows.shape[1]].copy_(rows)
        self.length.fill_(self.target.length)
        if self.head is not None:
            self.head_length.fill_(self.target.length)  # the head's start (or `prompt`) passes over the prompt
        if not sampling.greedy:
            self.params.copy_(sampling_params(sampling, self.params.device))
            tau = self.head.head.cfg.draft_temperature if self.head is not None else 1.0
            self.head_params.copy_(sampling_params(draft_sampling(sampling, tau), self.params.device))
        if not self.use_graphs:
            self.generator = generator
        elif generator is not self.generator:
            self.generator.set_state(generator.get_state())
        return self.generator

    def prompt_S(self) -> int | None:
        """The slots a prompt piece's head pass attends over; None where the target prefills no prompt as a graph
        (then the head takes its prompt in its own one pass)."""
        limit = getattr(self.target, "prefill_limit", 0)
        return self.target.bucket(limit) if self.head is not None and limit else None

    def takes_prompt(self, n: int) -> bool:
        """Whether `prompt` runs the head's first pass over a prompt of n slots (they fit `prompt_S`)."""
        return self.prompt_S() is not None and 0 < n <= self.target.prefill_limit

    def prompt(self, rows: list[list[int]], hidden: torch.Tensor) -> None:
        """The head's first pass over a stream's prompt (hidden [B, n, F]: slot t pairs position t's features with
        token t + 1; `takes_prompt(n)`) in `prompt_pieces`, each a `PromptPiece` graph's replay, after the head's
        `start` without features; the head is then current, as its own first pass would leave it."""
        n = hidden.shape[1]
        following = torch.tensor([r[1:n + 1] for r in rows], device=self.features.device)
        self.head_length.zero_()
        self._pieces(hidden, following, n, self.prompt_S())
        self.head.caught_up(n)

    def catch_up(self, n: int, S: int) -> None:
        """The head's first pass over the n slots waiting in its backlog (stored by `Shape.defer` rounds), in
        `PromptPiece`s attending over S slots (a context bucket that holds them). Positions come from the device's
        head length, so the pass may be queued behind rounds in flight whose counts the host knows."""
        self._pieces(self.features, self.following, n, S)

    def _pieces(self, features: torch.Tensor, following: torch.Tensor, n: int, S: int) -> None:
        """The first pass over n slots of features [B, >= n, F] and following [B, >= n] (or the backlog in place) from
        the head's length on, one `PromptPiece` each of `prompt_pieces(n)`; the head's length then counts them."""
        c0 = 0
        for T in prompt_pieces(n, self.target.max_graph_tokens):
            if features is not self.features or c0:  # a later piece of the backlog moves to its front (c0 >= T)
                self.features[:, :T].copy_(features[:, c0:c0 + T])
                self.following[:, :T].copy_(following[:, c0:c0 + T])
            torch.add(self.head_length, c0, out=self.piece)
            self.run(PromptPiece(T, S))
            c0 += T
        self.head_length.add_(n)

    def run(self, shape: Shape) -> torch.Tensor:
        """One round of `shape`; returns its packed host record (a graph's own buffer: read it before the next).
        A shape that was not captured runs eagerly (capturing now would write into the stream's caches)."""
        if shape not in self.graphs:
            self.eager_rounds += self.use_graphs
            return self.body(shape)
        graph, packed = self.graphs[shape]
        graph.replay()
        return packed

    def capture(self, shapes) -> int:
        """Warm up and capture every shape not captured yet; returns how many. It writes into the caches, the
        pending id and the length: call it before a stream starts (`DeviceRound.start` does)."""
        if not self.use_graphs:
            return 0
        todo = [s for s in dict.fromkeys(shapes) if s not in self.graphs]
        state = self.generator.get_state()
        for shape in todo:
            self._capture(shape)
        self.generator.set_state(state)  # the warm-ups' draws do not count
        return len(todo)

    # -- the round -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def body(self, shape: Shape) -> torch.Tensor:
        """Draft, verify, accept test, pending token, host record, the head's update, the length: device work only."""
        if isinstance(shape, PromptPiece):
            pos = self.piece + self.steps[:shape.T]
            self.head.prompt_at(self.following[:, :shape.T], self.features[:, :shape.T], pos, shape.S)
            return self.head.fixed.guess
        if shape.tree is not None:
            return self.tree_body(shape)
        K, greedy = shape.K, shape.greedy
        guess = [self.head.fixed.guess] if shape.observe else []  # the head's guess at the pre-round context
        if shape.head:
            proposal = self.head.propose_at(K, self.length, shape.S, None if greedy else self.head_params,
                                            self.generator, shape.truncates)
        else:
            proposal = Proposal(self.draft[:, :K], None)
        pos = self.length + self.steps[:K + 1]  # [K+1] cache slots and rotary positions of the verify
        logits, aux = self.target._forward(torch.cat([self.pending, proposal.tokens], dim=1), pos, shape.S, K + 1)
        logits = logits[..., :self.target.vocab_size].float()  # [B, K+1, V]
        p = logits if greedy else logits_to_probs_at(logits, self.params, shape.truncates)
        result = verify(proposal.tokens, proposal.q, p, generator=self.generator, greedy=greedy, backend=self.backend)
        kept = result.num_accepted.min().view(1)  # rows advance together by the shortest accepted prefix + 1
        packed = pack(proposal, logits.softmax(dim=-1) if greedy else p, result, guess)
        self.pending.copy_(result.tokens.index_select(1, kept))
        if shape.defer:
            self._store(aux, result.tokens, K)
        elif shape.observe:
            self.head.observe_at(aux, result.tokens, kept, pos, shape.S)
        self._remember(result.tokens)
        self.length.add_(kept + 1)
        if shape.observe and not shape.defer:
            self.head_length.copy_(self.length)  # the head is current
        return packed

    def _remember(self, emitted: torch.Tensor) -> None:
        """A round's emitted ids [B, W] (the kept ones, then the next pending one, then -1s) into `history` after the
        pending id; the next round overwrites what lies past its own pending id."""
        self.history.index_copy_(1, self.length + 1 + self.steps[:emitted.shape[1]], emitted)

    def copied(self, C: int, longest: int = LONGEST_RUN) -> torch.Tensor:
        """Prompt lookup on the device, for a tree's copied branch: per row, the C ids after the latest earlier
        occurrence of the longest (2..longest) run of its last ids (the pending one last), -1 where there is none
        or past the pending id. [B, C] int64."""
        hist, end = self.history, self.length.view(1, 1)  # end: the pending id's position
        pos = torch.arange(hist.shape[1], device=hist.device)[None, :]  # where an earlier run ends
        run = pos < end  # [1, P]: runs that end before the pending id
        score = torch.full(hist.shape, -1, dtype=torch.int64, device=hist.device)
        for g in range(longest):  # run: the g + 1 ids ending at pos equal the g + 1 ending at the pending id
            same = hist.gather(1, (pos - g).clamp_min(0).expand(hist.shape[0], -1)) == \
                hist.gather(1, (end - g).clamp_min(0).expand(hist.shape[0], 1))
            run = run & same & (pos >= g)
            if g:
                score = torch.where(run, g * hist.shape[1] + pos, score)  # longer runs first, then the latest
        best, at = score.max(dim=1)  # [B]
        src = at[:, None] + 1 + self.steps[:C]  # [B, C]
        ids = hist.gather(1, src.clamp_max(hist.shape[1] - 1))
        return torch.where((best[:, None] >= 0) & (src <= end), ids, -1)

    def grafted(self, proposal: TreeProposal, C: int) -> TreeProposal:
        """The head's greedy tree with the C ids of `copied` as one more branch (`TreeProposal.graft_at`): in one
        kernel where the tree's views came from one (`kernels.tree_level.copy_graft_triton`), else in torch ops."""
        tree = proposal.tree
        if tree.views is None:
            return proposal.graft_at(self.copied(C))
        r = copy_graft_triton(self.history, self.length, tree.parents, proposal.tokens, proposal.score, C,
                              tree.max_depth, tree.width, LONGEST_RUN)
        return TreeProposal(TensorTree(r.parents, tree.max_depth + C, tree.width + 1, views=r), r.tokens, None,
                            r.scores)

    def _store(self, aux: torch.Tensor, emitted: torch.Tensor, K: int) -> None:
        """A deferred round's K + 1 verified slots into the head's backlog after those waiting: their features (aux
        [B, K+1, F]) and the ids emitted after them (emitted [B, K+1]); those past the accepted count are overwritten
        by the next round's. The host keeps the backlog within its PIECE slots (`DeviceRound`)."""
        at = self.length - self.head_length + self.steps[:K + 1]  # [K+1] backlog slots
        self.features.index_copy_(1, at, aux.to(self.features.dtype))
        self.following.index_copy_(1, at, emitted.clamp_min(0))

    def tree_body(self, shape: Shape) -> torch.Tensor:
        """A tree round (`tree_round.run_tree`'s, on the device): the head's tree (greedy: `propose_tree_at`;
        sampled: the static shape's, `propose_sampled_tree_at`), the target's tree forward, the exact tree walk, the
        accepted path compacted in both caches, the pending token and the length; returns `pack_tree`'s record plus
        a row of the tree's parents."""
        greedy = shape.greedy
        proposal = self.head.propose_tree_at(shape.tree, self.length, shape.S) if greedy else \
            self.head.propose_sampled_tree_at(shape.tree, self.length, shape.S, self.head_params, self.generator,
                                              shape.truncates)
        if greedy and shape.tree.copy:  # prompt lookup's chain as one more branch
            proposal = self.grafted(proposal, shape.tree.copy)
        tree, guess = proposal.tree, [self.head.fixed.guess] if shape.observe else []
        fed = torch.cat([self.pending, proposal.tokens.clamp_min(0)], dim=1)  # (a -1 node is never accepted)
        logits, aux = self.target.forward_tree_at(fed, tree, self.length, shape.S)
        logits = logits[..., :self.target.vocab_size].float()  # [B, N+1, V]
        p = logits if greedy else logits_to_probs_at(logits, self.params, shape.truncates)
        result = verify_tree(tree, proposal.tokens, proposal.q, p, generator=self.generator, greedy=greedy,
                             backend=self.backend)
        kept = result.num_accepted.min().view(1)
        packed = pack_tree(result, logits.softmax(dim=-1) if greedy else p, proposal.tokens, guess, tree)
        path = F.pad(result.path + 1, (1, 0)).clamp_min(0)  # [B, D+1] tree slots: the root, the accepted nodes
        self.target.compact_at(self.length + path, self.length)
        self.pending.copy_(result.tokens.index_select(1, kept))
        if shape.observe:
            hidden = aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))  # the kept slots' features
            self.head.observe_at(hidden, result.tokens, kept, self.length + self.steps[:path.shape[1]], shape.S)
        self._remember(result.tokens)
        self.length.add_(kept + 1)
        if shape.observe:
            self.head_length.copy_(self.length)
        parents = F.pad(tree.parents.float()[None], (0, packed.shape[1] - tree.N))
        return torch.cat([packed, parents], dim=0)

    @torch.inference_mode()
    def _capture(self, shape: Shape):
        """Warm up on a side stream (from length 0, so positions stay in range), then capture into a shared pool."""
        dev = self.target.device
        self.target.aux_layers, saved = (self.head.aux_layers if shape.observe else ()), self.target.aux_layers
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.length.zero_()
                if self.head is not None:  # a prompt piece's (or a stored round's) warm-up writes slots from 0
                    self.piece.zero_()
                    self.head_length.zero_()
                self.body(shape)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.length.zero_()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        if not shape.greedy:
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            packed = self.body(shape)
        self.target.aux_layers = saved
        self.graphs[shape] = (graph, packed)
        return graph, packed


def pack(proposal: Proposal, p: torch.Tensor, result, guesses: list[torch.Tensor]) -> torch.Tensor:
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


def pack_greedy(proposal: Proposal, logits: torch.Tensor, guesses: list[torch.Tensor]) -> torch.Tensor:
    """A greedy eager round's host record on the CPU with its accept test left to the host (`HostCopy.read_greedy`:
    the longest prefix of drafts equal to the target's argmax, `verify_torch`'s greedy branch), one float32 tensor
    [B + 3, W] built through NumPy views of the CPU tensors (a torch operation costs a few microseconds there, more
    with the caches cold after a forward: `verify` and `pack` took ~0.3 ms a round).

    Rows 0..B-1: [the target's argmax at each of the K + 1 slots, the drafted ids (K)]. Row B: row 0's p (softmax of
    its logits) at each drafted id (K), then at each slot's argmax (K + 1). Row B+1: q of each drafted id (1 for a
    deterministic drafter). Row B+2: the guesses' row 0."""
    B, K = proposal.tokens.shape
    best = argmax(logits).numpy()  # [B, K+1]
    drafted = proposal.tokens.numpy()
    probs = logits[0].softmax(dim=-1).float().numpy()  # [K+1, V] row 0's, for the values shown
    slots = np.arange(K + 1)
    p0 = np.concatenate([probs[slots[:K], drafted[0]], probs[slots, best[0]]])
    q0 = np.ones(K) if proposal.q is None else proposal.q[0].float().numpy()[slots[:K], drafted[0]]
    guess = torch.stack([g[0] for g in guesses]).numpy() if guesses else np.zeros(0)
    out = np.zeros((B + 3, max(2 * K + 1, guess.size)), dtype=np.float32)
    out[:B, :K + 1], out[:B, K + 1:2 * K + 1] = best, drafted
    out[B, :2 * K + 1], out[B + 1, :K], out[B + 2, :guess.size] = p0, q0, guess
    return torch.from_numpy(out)


def pack_tree(result, p: torch.Tensor, drafted: torch.Tensor, guesses: list[torch.Tensor], tree) -> torch.Tensor:
    """The tree round's host record in one float32 tensor [B + 3, W], copied to the host once.

    Rows 0..B-1: [num_accepted, tokens (D + 1), path (D)]. Row B: row 0's p of every node's token (drafted [B, N])
    at its parent's slot (N values), then p of its emitted token at the slot where its walk stopped. Row B+1: the
    guesses' row 0. Row B+2: row 0's drafted tokens. p is [B, N+1, V]. Ids < 2^24 are exact in float32. (A
    captured round appends one more row, the tree's parents: its host cannot know the shape otherwise.)"""
    n0 = result.num_accepted[:1]  # [1]
    at = tree.parent_slots(p.device)
    p_nodes = p[0].index_select(0, at).gather(-1, drafted[0].clamp_min(0)[:, None]).squeeze(-1)  # [N] (-1: none)
    last = result.path[0].gather(0, (n0 - 1).clamp(min=0))  # the last accepted node (if any)
    stop = torch.where(n0 > 0, last + 1, torch.zeros_like(last))  # its slot, or the root's
    p_last = p[0].index_select(0, stop).gather(-1, result.tokens[0].gather(0, n0)[:, None]).view(1)
    guess = torch.stack([g[0] for g in guesses]).float() if guesses else p.new_zeros(0)
    parts = [torch.cat([result.num_accepted[:, None], result.tokens, result.path], dim=1).float(),
             torch.cat([p_nodes, p_last])[None], guess[None], drafted[:1].float()]
    W = max(x.shape[1] for x in parts)
    return torch.cat([F.pad(x, (0, W - x.shape[1])) for x in parts], dim=0)
