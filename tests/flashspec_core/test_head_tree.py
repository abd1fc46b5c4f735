"""The draft head's dynamic tree (`DraftHeadDrafter.propose_tree`): the masked head step equals the chain along each
node's path, a top-1 tree is the greedy chain, the kept nodes are EAGLE-2's best by cumulative draft log-probability,
the head's cache is left as it was, and the greedy tree verifier accepts exactly the target's greedy continuation."""
import pytest
import torch

from flashspec_core import SamplingConfig
from flashspec_core.drafters import DraftHeadDrafter
from flashspec_core.draft_head import HeadCache
from flashspec_core.tree import DraftTree
from kernels.tree_verify import verify_tree
from tests.conftest import tiny_llama
from tests.flashspec_core.test_draft_head import tiny_head

V = 50
ROWS = [[5, 7, 11, 13, 17, 19, 23, 29, 31, 37]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, seed=3, layers=4)


def drafter_at(target, seed=0, sampling=SamplingConfig()) -> DraftHeadDrafter:
    """A head drafter that has observed ROWS (random features for the verified slots, all but the last token)."""
    head = tiny_head(target, seed=seed)
    drafter = DraftHeadDrafter(head, V)
    feats = torch.randn(1, len(ROWS[0]) - 1, head.cfg.feature_size, generator=torch.Generator().manual_seed(seed))
    drafter.start(ROWS, sampling, torch.Generator().manual_seed(seed), feats)
    return drafter


@torch.inference_mode()
def chain_logits(drafter: DraftHeadDrafter, path) -> torch.Tensor:
    """[draft V] the head's logits after the verified slots and the target ids `path`, run as a plain chain."""
    head, cache, h = drafter.head, drafter.cache, drafter.h
    if not path:
        return drafter.logits[0]
    verified = cache.length
    for token in path:
        h = head.step(cache, torch.tensor([[token]]), h)
    cache.crop(verified)
    return head.logits(h[0, -1]).float()


def node_paths(proposal) -> list[tuple[int, ...]]:
    tokens = proposal.tokens[0].tolist()
    return [tuple(tokens[n] for n in proposal.tree.path_to(i)) for i in range(proposal.tree.N)]


def test_masked_step_over_a_whole_tree_equals_the_chain_along_each_path(target):
    """One step over every node of a tree (positions by depth, mask = verified slots + ancestors + itself) gives each
    node the head output that the chain along its path gives."""
    drafter = drafter_at(target)
    head, cache = drafter.head, drafter.cache
    tree = DraftTree((-1, -1, 0, 0, 1, 2, 2, 4, -1))  # irregular: widths 3, 2/1/0, ...
    g = torch.Generator().manual_seed(5)
    tokens = head.draft_ids[torch.randint(0, head.cfg.draft_vocab_size, (tree.N,), generator=g)]
    verified = cache.length
    mask = torch.cat([torch.ones(tree.N, verified, dtype=torch.bool), tree.ancestor_mask()[1:, 1:]], dim=1)
    positions = torch.tensor(tree.depth) - 1 + verified
    hidden = torch.stack([drafter.h[0, 0] if p < 0 else torch.zeros_like(drafter.h[0, 0]) for p in tree.parents])
    with torch.inference_mode():  # the chain feeds each node its parent's output: do the same level by level
        for level in range(1, tree.max_depth + 1):
            h = head.step(cache, tokens[None], hidden[None], positions, mask)[0]
            cache.crop(verified)
            hidden = torch.stack([drafter.h[0, 0] if p < 0 else h[p] for p in tree.parents])
        logits = head.logits(h).float()  # [N, draft V]: every node's output with exact inputs at the last level
    for i in range(tree.N):
        want = chain_logits(drafter, [int(tokens[n]) for n in tree.path_to(i)])
        torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)
    assert cache.length == verified


@pytest.mark.parametrize("k", [1, 3, 6])
def test_top_1_tree_is_the_greedy_chain(target, k):
    drafter = drafter_at(target)
    chain = drafter.propose(ROWS, k).tokens
    proposal = drafter.propose_tree(ROWS, depth=k, top_k=1, size=k + 2)
    assert proposal.tree.is_chain and proposal.tree.N == k and proposal.q is None
    assert torch.equal(proposal.tokens, chain)
    assert torch.equal(drafter.propose_tree(ROWS, depth=k, top_k=1, size=2).tokens, chain[:, :min(k, 2)])


@pytest.mark.parametrize("seed,depth,top_k,size", [(0, 4, 3, 12), (1, 5, 4, 20), (2, 3, 2, 5)])
def test_every_node_is_a_top_k_child_under_the_chain_logits(target, seed, depth, top_k, size):
    drafter = drafter_at(target, seed)
    proposal = drafter.propose_tree(ROWS, depth, top_k, size)
    ids = drafter.ids
    for path in node_paths(proposal):
        logits = chain_logits(drafter, path[:-1])
        assert path[-1] in ids[logits.topk(top_k).indices].tolist()
    assert proposal.tree.N == size and proposal.tree.max_depth <= depth


def reference_tree(drafter, depth, top_k, size) -> list[tuple[float, tuple[int, ...]]]:
    """EAGLE-2's expansion and rerank, one chain per node: (cumulative log q, path of target ids), best first."""
    ids, candidates, frontier = drafter.ids.tolist(), [], [(0.0, ())]
    for _ in range(depth):
        children = []
        for score, path in frontier:
            logq, index = chain_logits(drafter, path).log_softmax(-1).topk(top_k)
            children += [(score + v, path + (ids[i],)) for v, i in zip(logq.tolist(), index.tolist())]
        candidates += children
        frontier = sorted(children, key=lambda c: -c[0])[:min(top_k, size)]
    return sorted(candidates, key=lambda c: -c[0])[:size]


@pytest.mark.parametrize("seed,depth,top_k,size", [(0, 4, 3, 12), (1, 5, 4, 20), (2, 6, 2, 9), (3, 3, 5, 4)])
def test_kept_nodes_are_the_best_by_cumulative_log_probability(target, seed, depth, top_k, size):
    drafter = drafter_at(target, seed)
    proposal = drafter.propose_tree(ROWS, depth, top_k, size)
    want = reference_tree(drafter, depth, top_k, size)
    assert node_paths(proposal) == [path for _, path in want]  # the same nodes, numbered best first
    tree, score = proposal.tree, [s for s, _ in want]
    torch.testing.assert_close(proposal.score[0], torch.tensor(score), atol=1e-4, rtol=1e-4)  # the masked steps
    assert all(p < i for i, p in enumerate(tree.parents))
    for kids in tree.children:  # siblings are tried most probable first
        assert all(score[a] >= score[b] for a, b in zip(kids, kids[1:]))
    assert tree.max_depth > 1 and max(len(k) for k in tree.children) > 1  # a real tree, not a chain or a fan


def test_cache_is_left_as_it_was(target):
    drafter = drafter_at(target)
    cache = drafter.cache
    length = cache.length
    k, v = cache.k[:, :, :length].clone(), cache.v[:, :, :length].clone()
    h, logits, chain = drafter.h.clone(), drafter.logits.clone(), drafter.propose(ROWS, 5).tokens
    first = drafter.propose_tree(ROWS, depth=6, top_k=8, size=40)  # grows the cache past its first capacity
    assert cache.length == length
    assert torch.equal(cache.k[:, :, :length], k) and torch.equal(cache.v[:, :, :length], v)
    assert torch.equal(drafter.h, h) and torch.equal(drafter.logits, logits)
    assert torch.equal(drafter.propose(ROWS, 5).tokens, chain)
    again = drafter.propose_tree(ROWS, depth=6, top_k=8, size=40)
    assert again.tree == first.tree and torch.equal(again.tokens, first.tokens)


def test_observe_after_a_tree_equals_observe_after_a_chain(target):
    """The next round's first pass sees the same cache whichever way the head drafted."""
    a, b = drafter_at(target), drafter_at(target)
    a.propose(ROWS, 4)
    b.propose_tree(ROWS, depth=4, top_k=4, size=16)
    rows = [ROWS[0] + [41, 43]]
    feats = torch.randn(1, 2, a.head.cfg.feature_size, generator=torch.Generator().manual_seed(9))
    for d in (a, b):
        d.observe(rows, len(ROWS[0]), feats)
        d.catch_up(rows)
    assert a.cache.length == b.cache.length == len(rows[0]) - 1
    torch.testing.assert_close(b.logits, a.logits, atol=0, rtol=0)
    assert torch.equal(a.propose_tree(rows, 3, 3, 9).tokens, b.propose_tree(rows, 3, 3, 9).tokens)


def test_sampling_draws_each_nodes_children_without_replacement_on_a_fixed_shape(target):
    """At temperature > 0 the shape is `DraftTree.static` whatever the draws (the seed changes tokens, not the
    shape); siblings differ; each node's law sums to 1, gives its token mass, and for a later sibling is the first
    sibling's law with the earlier tokens removed, renormalised; the head's cache ends on the verified slots."""
    hot = SamplingConfig(temperature=1.0, top_p=0.95)
    shape = DraftTree.static(4, 3, 12)
    proposals = []
    for seed in (0, 1):
        drafter = drafter_at(target, sampling=hot)
        drafter.generator = torch.Generator().manual_seed(seed)
        verified = drafter.cache.length
        proposals.append(drafter.propose_tree(ROWS, 4, 3, 12))
        assert drafter.cache.length == verified
    a, b = proposals
    assert a.tree == b.tree == shape and not torch.equal(a.tokens, b.tokens)
    q, tokens = a.q[0], a.tokens[0]
    torch.testing.assert_close(q.sum(-1), torch.ones(shape.N))
    assert (q.gather(-1, tokens[:, None]) > 0).all()
    for kids in shape.children:
        assert len({int(tokens[k]) for k in kids}) == len(kids)
        for j, k in enumerate(kids[1:], start=1):
            first = q[kids[0]].clone()
            first[tokens[list(kids[:j])]] = 0
            torch.testing.assert_close(q[k], first / first.sum())


def test_a_batch_shares_row_0s_shape_with_its_own_tokens(target):
    """Rows share the shape row 0's scores choose; each row drafts its own ranked children there."""
    alone = drafter_at(target).propose_tree(ROWS, 4, 3, 12)
    head = tiny_head(target)
    drafter = DraftHeadDrafter(head, V)
    feats = torch.randn(1, len(ROWS[0]) - 1, head.cfg.feature_size, generator=torch.Generator().manual_seed(0))
    other = torch.randn(1, len(ROWS[0]) - 1, head.cfg.feature_size, generator=torch.Generator().manual_seed(9))
    drafter.start(ROWS * 3, SamplingConfig(), None, torch.cat([feats, feats, other]))
    batch = drafter.propose_tree(ROWS * 3, 4, 3, 12)
    assert batch.tree == alone.tree and batch.q is None
    assert torch.equal(batch.tokens[0], alone.tokens[0]) and torch.equal(batch.tokens[1], alone.tokens[0])
    top = drafter.ids[drafter.logits[2].topk(3).indices]  # row 2's own first-level choices, best first
    first_level = [i for i, p in enumerate(batch.tree.parents) if p < 0]
    assert batch.tokens[2, first_level].tolist() == top[:len(first_level)].tolist()
    assert not torch.equal(batch.tokens[2], batch.tokens[0])


def test_bad_arguments_raise(target):
    drafter = drafter_at(target)
    for bad in ({"depth": 0}, {"top_k": 0}, {"size": -1}, {"size": 2.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            drafter.propose_tree(ROWS, **{"depth": 3, "top_k": 2, "size": 4, **bad})
    empty = DraftHeadDrafter(tiny_head(target), V)
    empty.cache = HeadCache(empty.head.cfg, 1, 8, "cpu", torch.float32)  # nothing observed yet
    assert empty.propose_tree(ROWS, 3, 2, 4).tree.N == 0


def toy_target_probs(drafter, path) -> torch.Tensor:
    """[V] a toy target law after `path`: half its mass on the head's second choice after an even number of
    tokens and on its first choice after an odd number, the rest spread evenly: its greedy walk leaves the head's
    first sibling at the root, then follows and leaves it in turn."""
    logits = chain_logits(drafter, list(path))
    favoured = int(drafter.ids[logits.topk(2).indices[1 - len(path) % 2]])
    probs = torch.full((V,), 0.5 / (V - 1))
    probs[favoured] = 0.5
    return probs


@pytest.mark.parametrize("seed,depth,top_k,size", [(0, 4, 3, 16), (1, 5, 4, 24), (2, 4, 2, 10)])
def test_greedy_tree_verify_accepts_the_targets_greedy_continuation(target, seed, depth, top_k, size):
    drafter = drafter_at(target, seed)
    proposal = drafter.propose_tree(ROWS, depth, top_k, size)
    tree, paths = proposal.tree, [()] + node_paths(proposal)
    target_probs = torch.stack([toy_target_probs(drafter, path) for path in paths])[None]  # [1, N+1, V]
    greedy = []
    for _ in range(tree.max_depth + 1):
        greedy.append(int(toy_target_probs(drafter, greedy).argmax()))
    result = verify_tree(tree, proposal.tokens, None, target_probs, greedy=True, backend="torch")
    n = int(result.num_accepted[0])
    assert n >= 2  # the walk took a second sibling and went on below it
    assert result.tokens[0, :n + 1].tolist() == greedy[:n + 1]
    assert paths[int(result.path[0, n - 1]) + 1] == tuple(greedy[:n])  # the accepted node's path
