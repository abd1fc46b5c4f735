"""Rounds that verify the head's draft trees (`flashspec_core.tree_round`): greedy output equals plain decoding on
both target paths, the emitted tokens follow the target (chi-squared through the round, N = 30,000 rows, trees of
width 1 (a chain), 2 and 4), and the caches end on the accepted path (the head's equals one pass over the rows)."""
from dataclasses import replace

import pytest
import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.drafters import DraftHeadDrafter, TreeProposal
from flashspec_core.fast_path import fast_or_eager
from flashspec_core.round import DeviceRound
from flashspec_core.tree import DraftTree, TensorTree
from flashspec_core.tree_round import TreeSize
from tests.conftest import tiny_llama
from tests.flashspec_core.test_distribution import CRITICAL, N, V, chi2, exact_laws
from tests.flashspec_core.test_distribution import PROMPT as LAW_PROMPT
from tests.flashspec_core.test_draft_head import tiny_head
from tests.flashspec_core.test_round import GREEDY, PROMPT, fresh_round, one_pass

SIZES = {"chain": TreeSize(4, 1, 4), "width2": TreeSize(3, 2, 6), "width4": TreeSize(3, 4, 12)}


def tree_rows(round_, shape: TreeSize, sampling, seed: int, n: int) -> list[list[int]]:
    """Tree rounds of the head until n new tokens."""
    rows, gen = [list(PROMPT)], torch.Generator().manual_seed(seed)
    round_.start(rows, sampling, gen, arms=list(round_.drafters))
    while len(rows[0]) - len(PROMPT) < n:
        round_.run_tree(rows, round_.drafters["draft_head"], shape, sampling, gen)
    return rows


@pytest.fixture(scope="module")
def tiny():
    target = tiny_llama(vocab=50, seed=3, layers=4)
    return target, tiny_head(target)


@pytest.mark.parametrize("fast_path", ["auto", "off"], ids=["static", "eager_hf"])
@pytest.mark.parametrize("name", list(SIZES))
def test_greedy_tree_rounds_equal_plain(tiny, name, fast_path):
    target, head = tiny
    plain = Engine.from_models(target, [head], kernel_backend="torch").generate(PROMPT, 40, mode="plain").token_ids
    round_ = fresh_round(target, head)
    if fast_path == "off":
        round_.target = fast_or_eager(target.eval(), 50, mode="off")
    rows = tree_rows(round_, SIZES[name], GREEDY, 0, 40)
    assert rows[0][len(PROMPT):len(PROMPT) + 40] == plain


def test_a_copied_chain_hangs_below_the_node_where_the_tree_stops_following_it():
    tree = DraftTree.full((2, 2))  # nodes 0, 1 below the root; 2, 3 below node 0; 4, 5 below node 1
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    proposal = TreeProposal(tree, tokens, None, -torch.arange(6.0).expand(2, -1))
    grown = proposal.graft(torch.tensor([[11, 15, 7, 8], [1, 2, 3, -1]]))  # row 0 follows nodes 1 and 5
    assert grown.tree.parents == tree.parents + (5, 6)
    assert grown.tokens.tolist() == [[10, 11, 12, 13, 14, 15, 7, 8], [20, 21, 22, 23, 24, 25, 3, -1]]
    assert grown.score[0, 6:].tolist() == [-5.0, -5.0]  # as the node they hang from
    assert proposal.graft(torch.tensor([[11, 14], [0, 0]])) is proposal  # the tree holds the whole chain
    assert proposal.graft(torch.tensor([[9], [9]])).tree.parents == tree.parents + (-1,)  # a new child of the root
    with pytest.raises(ValueError, match="greedy"):
        TreeProposal(tree, tokens, torch.ones(2, 6, 30), proposal.score).graft(torch.tensor([[9], [9]]))


@pytest.mark.parametrize("chain", [[11, 15, 7, 8], [11, 14, 3, 4], [9, 8, 7, 6], [11, 15, -1, -1]])
def test_the_device_graft_is_the_host_graft_with_the_copies_the_tree_held_as_minus_one(chain):
    """`graft_at` (a captured round's, fixed C nodes) against `graft` (the host's): the same parents and tokens for
    the nodes `graft` adds, then -1 nodes continuing the branch, and a tree whose views match `DraftTree`'s."""
    tree = DraftTree.full((2, 2))
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    score = -torch.arange(6.0).expand(2, -1)
    chains = torch.tensor([chain, [1, 2, 3, 4]])
    host = TreeProposal(tree, tokens, None, score).graft(chains[:, :sum(t >= 0 for t in chain)])
    on_device = TensorTree(torch.tensor(tree.parents), tree.max_depth, 2)
    device = TreeProposal(on_device, tokens, None, score).graft_at(chains)
    n = host.tree.N
    assert device.tree.parents[:n].tolist() == list(host.tree.parents)
    assert device.tokens[:, :n].tolist() == host.tokens.tolist()
    assert (device.tokens[0, n:] == -1).all() and device.tree.N == tree.N + 4
    grown = DraftTree(tuple(device.tree.parents.tolist()))
    assert torch.equal(device.tree.child_table()[:, :grown.child_table().shape[1]], grown.child_table())


@pytest.mark.parametrize("path", ["static", "eager_hf", "captured"])
def test_greedy_tree_rounds_with_a_copied_branch_equal_plain_in_fewer_rounds(tiny, path):
    """The head's tree with a copied chain as one more branch (eager rounds: prompt lookup's; the captured round's
    code: its own lookup on the device): plain decoding's tokens, and fewer rounds than the tree alone on this
    prompt (the copied branch is taken), each round's tree larger than the head's where a copy was found."""
    target, head = tiny
    plain = Engine.from_models(target, [head], kernel_backend="torch").generate(PROMPT, 40, mode="plain").token_ids
    rounds = {}
    for copy in (0, 8):
        round_ = fresh_round(target, head, captured="eager" if path == "captured" else "auto")
        if path == "eager_hf":
            round_.target = fast_or_eager(target.eval(), 50, mode="off")
        rows, gen, shape = [list(PROMPT)], torch.Generator().manual_seed(0), replace(SIZES["width2"], copy=copy)
        round_.start(rows, GREEDY, gen, arms=list(round_.drafters))
        assert (round_.captured is not None) == (path == "captured")
        outs = []
        while len(rows[0]) - len(PROMPT) < 40:
            outs.append(round_.run_tree(rows, round_.drafters["draft_head"], shape, GREEDY, gen))
        assert rows[0][len(PROMPT):len(PROMPT) + 40] == plain
        rounds[copy] = len(outs)
        assert any(out.tree[0] > SIZES["width2"].size for out in outs) == bool(copy)
    assert rounds[8] < rounds[0]


def test_the_caches_end_on_the_accepted_path(tiny):
    target, head = tiny
    round_ = fresh_round(target, head)
    rows = tree_rows(round_, SIZES["width4"], GREEDY, 0, 24)
    drafter = round_.drafters["draft_head"]
    slots = len(rows[0]) - 1  # every position before the pending token is verified
    assert drafter.cache.length + sum(w.shape[1] for w in drafter.waiting) == slots  # kept or waiting
    drafter.catch_up(rows)
    assert round_.target.length == drafter.cache.length == slots
    cache, h = one_pass(target, head, rows[0], slots)
    torch.testing.assert_close(drafter.cache.k[:, :, :slots], cache.k[:, :, :slots], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.h[:, -1], h, atol=1e-4, rtol=1e-4)
    fresh = fast_or_eager(target.eval(), 50)  # the target's cache gives what a fresh prefill of the rows gives
    want = fresh.forward(torch.tensor(rows))[:, -1]
    torch.testing.assert_close(round_.target.forward(torch.tensor([rows[0][-1:]]))[:, -1], want, atol=1e-4, rtol=1e-4)


def first_two_tokens(round_, shape: TreeSize, sampling, seed: int):
    """The first and second emitted token of N identical rows, through tree rounds (rows that emitted one token
    run a second round from their new context, grouped by that token)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [list(LAW_PROMPT) for _ in range(N)]
    round_.start(rows, sampling, gen, arms=list(round_.drafters))
    out = round_.run_tree(rows, round_.drafters["draft_head"], shape, sampling, gen)
    first = [t[0] for t in out.tokens]
    second = [t[1] if n >= 1 else None for t, n in zip(out.tokens, out.num_accepted)]
    for tok in sorted({first[i] for i in range(N) if second[i] is None}):
        idx = [i for i in range(N) if second[i] is None and first[i] == tok]
        rows2 = [LAW_PROMPT + [tok] for _ in idx]
        round_.start(rows2, sampling, gen, arms=list(round_.drafters))
        out2 = round_.run_tree(rows2, round_.drafters["draft_head"], shape, sampling, gen)
        for i, t in zip(idx, out2.tokens):
            second[i] = t[0]
    return torch.tensor(first), torch.tensor(second), out


SAMPLINGS = {"t1": SamplingConfig(temperature=1.0), "topk_topp": SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)}


@pytest.mark.parametrize("captured", ["off", "eager"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("name", list(SIZES))
def test_emitted_tokens_follow_target(name, sampling, captured):
    """Eager tree rounds, and the captured round's (`CapturedRound.tree_body`: the static shape drafted level by
    level on the device, `propose_sampled_tree_at`), what a GPU replays as one graph."""
    target = tiny_llama(V, seed=1, sharpness=0.5)
    head = tiny_head(target, draft_vocab=V - 1, seed=4)  # its top-k can miss a token p gives mass to
    cfg, shape = SAMPLINGS[sampling], SIZES[name]
    round_ = DeviceRound(fast_or_eager(target.eval(), V), {"draft_head": DraftHeadDrafter(head, V)}, "torch",
                         captured=captured)
    first, second, out = first_two_tokens(round_, shape, cfg, seed=len(name))
    assert (round_.captured is not None) == (captured == "eager")
    p1, p2 = exact_laws(target, cfg)
    assert 0 < sum(out.num_accepted) < N * shape.depth, "the test needs both accepts and rejects"
    assert chi2(first, p1.float()) < CRITICAL
    assert chi2(second, p2.float()) < CRITICAL


@pytest.mark.parametrize("copy", [0, 8], ids=["", "copied_branch"])
@pytest.mark.parametrize("drafters", [["draft_head"], None], ids=["head", "bandit"])
def test_engine_streams_with_trees_equal_plain(tiny, drafters, copy, monkeypatch):
    """Trees in the engine's streams, with prompt lookup's chain as one more branch where asked (fed to it even
    where it is not among the stream's arms). (The tiny target repeats itself, so the bandit's copy arms would be
    sure of every round: they play by the bandit's means here.)"""
    monkeypatch.setattr("flashspec_core.policy.SURE_COPY", float("inf"))
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch")
    plain = engine.generate(PROMPT, 40, mode="plain").token_ids
    result = engine.generate(PROMPT, 40, drafters=drafters, tree=replace(SIZES["width4"], copy=copy))
    assert result.token_ids == plain
    trees = [e for e in result.events if e.drafter == "draft_head" and e.gamma]  # the last round may have no room
    assert trees and all(e.tree_nodes > 0 for e in trees)
    assert any(e.tree_nodes > SIZES["width4"].size for e in trees) == bool(copy)
    assert all(e.tree_nodes == 0 for e in result.events if e.drafter != "draft_head")


def test_a_tree_rounds_event_carries_its_tree(tiny):
    """Each tree round's event has row 0's tree: parents before children, the accepted path a path from the root
    whose tokens are the emitted drafts, and the event's rejected drafts the children tried where the walk stopped."""
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch")
    events = list(engine.stream(PROMPT, 40, drafters=["draft_head"], tree=SIZES["width4"]))
    events += list(engine.stream(PROMPT, 40, drafters=["prompt_lookup"], tree=SIZES["width4"]))
    trees = [e for e in events if e.drafted_tree is not None]
    assert trees and any(e.drafted_tree.accepted for e in trees) and any(e.rejected for e in trees)
    assert all(e.drafted_tree is None for e in events if e.tree_nodes == 0)  # chains' events are as before
    for e in trees:
        tree = e.drafted_tree
        assert len(tree.tokens) == len(tree.parents) == len(tree.texts) == e.tree_nodes
        assert all(-1 <= p < i for i, p in enumerate(tree.parents))
        assert [tree.parents[a] for a in tree.accepted] == [-1, *tree.accepted][:len(tree.accepted)]
        assert tuple(tree.tokens[a] for a in tree.accepted) == e.accepted
        stop = tree.accepted[-1] if tree.accepted else -1
        assert tuple(t for t, p in zip(tree.tokens, tree.parents) if p == stop) == e.rejected


def test_the_embedded_model_streams_trees(embedded_engine):
    """The shipped head's trees on the float32 path (`embedded_engine` runs the GGUF weights, where a tree forward's
    bfloat16 attention can flip near-ties against one-token steps: README, "chains against trees")."""
    from flashspec_core.engine import head_for

    target = embedded_engine.target.model
    engine = Engine.from_models(target, [head_for("embedded", target)], tokenizer=embedded_engine.tokenizer)
    prompt = "Write a short story about a fox who learns to swim."
    plain = engine.generate(prompt, 32, mode="plain").token_ids
    result = engine.generate(prompt, 32, drafters=["draft_head"], tree=TreeSize(5, 3, 12))
    assert result.token_ids == plain and result.stats["tokens_per_forward"] > 1.5
    for e in result.events:  # the tree's texts are the spans' texts along the accepted path and where it stopped
        if e.drafted_tree is not None and not e.finished:  # (a finished round may cut its path)
            tree, spans = e.drafted_tree, [s.text for s in e.spans if s.kind in ("accepted", "rejected")]
            stop = tree.accepted[-1] if tree.accepted else -1
            tried = [i for i, p in enumerate(tree.parents) if p == stop]
            assert [tree.texts[i] for i in [*tree.accepted, *tried]] == spans[:len(tree.accepted) + len(tried)]


@pytest.mark.parametrize("bad", [(0, 2, 4), (3, 0, 4), (3, 2, 0), (3, 2, 33), (2.5, 2, 4)])
def test_bad_tree_sizes_raise(bad):
    with pytest.raises(ValueError, match="tree"):
        TreeSize(*bad)


def test_a_tree_that_is_not_a_size_raises(tiny):
    target, head = tiny
    engine = Engine.from_models(target, [head], kernel_backend="torch")
    with pytest.raises(ValueError, match="TreeSize"):
        engine.generate(PROMPT, 8, tree=(3, 2, 4))


def test_tree_auto_cuts_greedy_trees_by_cost_and_keeps_plain_decodings_tokens(tiny):
    """Greedy tree "auto": a round drafts up to 12 nodes and verifies the best first n, n (and the depth) from the
    measured costs; the output stays plain decoding's. With a forward that costs in proportion to its tokens the
    trees shrink."""
    from flashspec_core.gamma import CostModel, DraftCost

    target, head = tiny
    engine = Engine.from_models(target, [head], kernel_backend="torch")
    plain = engine.generate(PROMPT, 40, mode="plain").token_ids
    engine.calibrate()
    sizes = {}
    for name, per_token in (("flat", 0.0), ("steep", 0.5)):
        costs = CostModel()
        for t in (1, 2, 4, 8, 13):
            costs.observe(t, 0.01 * (1 + per_token * (t - 1)))
        engine.policy.set_costs(costs)
        engine.policy.draft_costs["draft_head"] = DraftCost()  # free drafting: only the verify's cost decides
        result = engine.generate(PROMPT, 40, drafters=["draft_head"], tree=TreeSize(3, 4, 12, auto=True))
        assert result.token_ids == plain
        sizes[name] = [e.tree_nodes for e in result.events if e.drafter == "draft_head" and e.gamma]
    flat = sizes["flat"]  # nothing to save: all of it (the last rounds' depth is cut to the tokens left)
    assert flat and max(flat) == 12 and flat.count(12) >= len(flat) - 3
    assert max(sizes["steep"], default=0) < 12


def test_a_sampled_auto_tree_is_sized_before_its_draws(tiny):
    """At temperature > 0 a draw must not decide whether its own node is verified: tree "auto" picks a static
    tree's size from its prior before drafting, and leaves nothing to cut afterwards."""
    from flashspec_core.stream import StreamState

    target, head = tiny
    engine = Engine.from_models(target, [head], kernel_backend="torch")
    s = StreamState([list(PROMPT)], SamplingConfig(temperature=1.0), 1, "speculative", ["draft_head"], 8,
                    torch.Generator(), None)
    shape, nodes = engine.policy.tree_plan(s, "draft_head", TreeSize(3, 4, 12, auto=True))
    assert nodes is None and shape.auto and 1 <= shape.size <= 12
    s.sampling = GREEDY
    shape, nodes = engine.policy.tree_plan(s, "draft_head", TreeSize(3, 4, 12, auto=True))
    assert shape.size == 12 and callable(nodes)
    assert engine.policy.tree_plan(s, "draft_head", TreeSize(3, 4, 12)) == (TreeSize(3, 4, 12), None)


def test_the_first_nodes_of_a_proposal_are_a_tree_with_their_tokens(tiny):
    target, head = tiny
    round_ = fresh_round(target, head)
    rows = [list(PROMPT)]
    round_.start(rows, GREEDY, torch.Generator(), arms=list(round_.drafters))
    proposal = round_.drafters["draft_head"].propose_tree(rows, 3, 4, 12)
    cut = proposal.first(5)
    assert cut.tree.parents == proposal.tree.parents[:5] and cut.q is None
    assert torch.equal(cut.tokens, proposal.tokens[:, :5]) and torch.equal(cut.score, proposal.score[:, :5])


def test_warm_up_leaves_what_it_made_out_of_the_collectors_full_passes(tiny):
    """Engine.warm_up ends by settling the heap: what it left alive (on CUDA, the captured graphs) is frozen, so a
    full pass of the cyclic collector in a later stream does not scan it (such a pass stalled a round 4-5 ms)."""
    import gc

    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch")
    gc.unfreeze()
    made = []
    calibrate = engine.calibrate
    engine.calibrate = lambda: (made.append([object()]), calibrate())[1]  # a container made during the warm-up
    try:
        engine.warm_up(64)
        assert gc.get_freeze_count() > 0 and not any(o is made[0] for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_warm_up_asks_the_target_for_every_tree_verify_with_the_heads_readers(tiny, monkeypatch):
    """Engine.warm_up(tree_tokens=N): the target captures tree verifies of 2..N slots (every context bucket up to
    max_context) while it carries the head's hidden-state readers, as a tree stream does; without it, none."""
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch")
    asked, capture = [], engine.target.capture
    monkeypatch.setattr(engine.target, "capture", lambda counts=(), max_context=None, tree_counts=(): (
        asked.append((engine.target.aux_layers, max_context, list(tree_counts))), capture(counts, max_context,
                                                                                           tree_counts))[1])
    engine.warm_up(128)
    assert not any(trees for _, _, trees in asked)
    engine.warm_up(128, tree_tokens=13)
    assert (tuple(head.cfg.aux_layers), 128, list(range(2, 14))) in [(tuple(a), m, t) for a, m, t in asked]
    result = engine.generate(PROMPT, 24, drafters=["draft_head"], tree=SIZES["width4"])
    assert result.token_ids == engine.generate(PROMPT, 24, mode="plain").token_ids


def test_a_greedy_auto_tree_on_a_captured_round_verifies_its_bound(tiny):
    """Where greedy rounds are captured, tree "auto" runs its bound's fixed tree on the captured round (one graph a
    round, no per-round sizing, no eager round): every head round verifies the bound's nodes; plain's tokens."""
    target, head = tiny
    engine = Engine.from_models(target, [head], kernel_backend="torch", captured="eager")
    shape = TreeSize(3, 4, 12, auto=True)
    result = engine.generate(PROMPT, 40, drafters=["draft_head"], tree=shape)
    assert result.token_ids == engine.generate(PROMPT, 40, mode="plain").token_ids
    sizes = [e.tree_nodes for e in result.events if e.drafted_tree is not None]
    assert sizes and set(sizes) == {shape.fixed.nodes} and shape.fixed == TreeSize(3, 4, 12)
    assert engine.round.captured is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_tree_stream_after_warm_up_captures_nothing(tiny):
    """On CUDA, Engine.warm_up(tree_tokens=13, trees=(a 12-node tree,)) captures what its streams replay: the
    target's tree verifies (eager trees') and the captured tree rounds, greedy and sampled (temperature alone and
    with top-p); no stream adds a graph or runs an eager round, the sampled ones' rounds are trees, and the greedy
    one gives plain decoding's tokens."""
    from tests.flashspec_core.test_captured import cuda_engine

    engine, shape = cuda_engine(tiny, torch.float32), SIZES["width4"]
    engine.warm_up(256, tree_tokens=shape.size + 1, trees=(shape,))
    graphs = lambda: (len(engine.target.tree_graphs), len(engine.round._built.graphs))  # noqa: E731
    before = graphs()
    assert before[0] > 0 and before[1] > 0
    for sampling in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_p=0.8)):
        sampled = engine.generate(PROMPT, 40, sampling, drafters=["draft_head"], tree=shape)
        assert any(e.drafted_tree is not None for e in sampled.events)
    result = engine.generate(PROMPT, 40, drafters=["draft_head"], tree=shape)
    assert graphs() == before and engine.round._built.eager_rounds == 0
    assert result.token_ids == engine.generate(PROMPT, 40, mode="plain").token_ids
