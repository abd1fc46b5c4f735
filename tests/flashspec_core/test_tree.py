"""Tests for flashspec_core/tree.py: a draft tree's shape, its attention mask and positions, its paths and the cache
slots kept after acceptance, on small hand-made trees and the chain; and one tree forward of a tiny Llama that
gives, at every slot, the logits of a plain forward over the context and that slot's path."""
import math

import pytest
import torch

from flashspec_core.tree import DraftTree, TensorTree

# root -+- 0 -+- 2 --- 5
#       |     +- 3
#       +- 1 --- 4
TREE = DraftTree((-1, -1, 0, 0, 1, 2))


def test_depths_children_and_paths_of_a_hand_made_tree():
    assert TREE.N == 6 and TREE.max_depth == 3 and not TREE.is_chain
    assert TREE.depth == (1, 1, 2, 2, 2, 3)
    assert TREE.children == ((0, 1), (2, 3), (4,), (5,), (), (), ())  # per slot: root, node 0, ..., node 5
    assert TREE.paths == ((0, 3), (1, 4), (0, 2, 5))  # leaves 3, 4, 5 in node order
    assert TREE.path_to(5) == (0, 2, 5) and TREE.path_to(-1) == ()
    assert TREE.child_table().tolist() == [[0, 1], [2, 3], [4, -1], [5, -1], [-1, -1], [-1, -1], [-1, -1]]


def test_full_trees_number_siblings_consecutively_level_by_level():
    tree = DraftTree.full((2, 2))
    assert tree.parents == (-1, -1, 0, 0, 1, 1) and tree.children[0] == (0, 1) and tree.max_depth == 2
    assert DraftTree.full((4, 1)).parents == (-1, -1, -1, -1, 0, 1, 2, 3)
    assert DraftTree.full((1, 1, 1)) == DraftTree.chain(3) and DraftTree.full(()).N == 0
    assert TREE.parent_slots().tolist() == [0, 0, 1, 1, 2, 3]


def test_a_static_tree_is_a_chain_first_then_siblings_near_the_root():
    assert DraftTree.static(4, 1, 4) == DraftTree.chain(4)
    t = DraftTree.static(3, 4, 12)
    assert t.N == 12 and t.max_depth == 3 and max(len(k) for k in t.children) <= 4
    assert t.parents[:3] == (-1, 0, 1) and t.parents[3] == -1  # the chain to depth 3, then the root's second child
    assert DraftTree.static(5, 2, 64).N == 2 + 4 + 8 + 16 + 32  # every node there is, when size allows
    full = DraftTree.static(2, 3, 100)  # all of a full (3, 3) tree, numbered best first
    assert sorted(full.depth) == sorted(DraftTree.full((3, 3)).depth) 
    assert len(full.children[0]) == 3 and all(len(full.children[i + 1]) == 3 for i in range(12) if full.depth[i] == 1)


def test_a_chain_is_the_special_case():
    K = 4
    chain = DraftTree.chain(K)
    assert chain.parents == (-1, 0, 1, 2) and chain.is_chain and chain.max_depth == K
    assert chain.paths == ((0, 1, 2, 3),)
    assert chain.child_table().tolist() == [[0], [1], [2], [3], [-1]]
    # the tree block's mask is causal and the positions count up: a chain verifies as today
    assert torch.equal(chain.attention_mask(3), torch.ones(K + 1, 3 + K + 1, dtype=torch.bool).tril(3))
    assert chain.position_ids(3).tolist() == [3, 4, 5, 6, 7]
    empty = DraftTree.chain(0)
    assert empty.N == 0 and empty.max_depth == 0 and empty.paths == () and empty.child_table().tolist() == [[-1]]


def test_attention_mask_sees_context_ancestors_and_self():
    C = 5
    mask = TREE.attention_mask(C)
    assert mask.shape == (TREE.N + 1, C + TREE.N + 1) and mask.dtype == torch.bool
    assert mask[:, :C].all(), "every slot sees the whole context"
    expected = [  # slots: root, node 0..5
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert mask[:, C:].int().tolist() == expected
    for node in range(TREE.N):  # the same, from the parent walk
        seen = {0} | {i + 1 for i in TREE.path_to(node)}
        assert {t for t in range(TREE.N + 1) if mask[node + 1, C + t]} == seen


def test_path_table_lists_each_slots_path_from_the_root_then_the_slots_past_it():
    # slot s (0 root, i + 1 node i): the slots from the root down to s at 0..depth, then depth + 1, ..., max_depth
    assert TREE.path_table().tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 2, 3], [0, 1, 3, 3], [0, 1, 4, 3],
                                          [0, 2, 5, 3], [0, 1, 3, 6]]
    assert TREE.path_table().dtype == torch.int32
    assert DraftTree.chain(3).path_table().tolist() == [[0, 1, 2, 3]] * 4  # a chain: its own layout


def test_position_ids_are_context_length_plus_depth():
    assert TREE.position_ids(10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert TREE.position_ids(0, device="cpu").dtype == torch.int64


def test_kept_slots_follow_the_accepted_path_in_order():
    path = torch.tensor([[0, 2, 5], [1, -1, -1], [-1, -1, -1], [0, 3, -1]])
    assert TREE.kept_slots(path, context_len=10).tolist() == [
        [10, 11, 13, 16], [10, 12, -1, -1], [10, -1, -1, -1], [10, 11, 14, -1]]
    assert TREE.kept_slots(path).tolist()[0] == [0, 1, 3, 6]  # relative to the tree block
    with pytest.raises(ValueError, match=r"path must be \[B, D\]"):
        TREE.kept_slots(path[:, :2])


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, -2), (-1, 0, 3, 1)])
def test_a_parent_must_come_before_its_child(parents):
    with pytest.raises(ValueError, match="a parent must be -1"):
        DraftTree(parents)


def test_the_tree_is_frozen_and_hashable():
    assert DraftTree([-1, 0]) == DraftTree((-1, 0)) and hash(DraftTree([-1, 0])) == hash(DraftTree.chain(2))
    with pytest.raises(AttributeError):
        TREE.parents = (-1,)


def test_one_tree_forward_gives_every_path_its_plain_logits():
    """A tiny Llama reads the context into its cache, then the root and the nodes in one forward with the tree
    mask and positions: the logits at each slot equal a plain causal forward over context + root + that slot's
    path (what the verifier's target_probs must hold)."""
    from tests.conftest import tiny_llama

    model = tiny_llama(50, seed=3)
    context, root, tokens = [3, 7, 1, 9], 4, [11, 12, 13, 14, 15, 16]
    C = len(context)
    allowed = TREE.attention_mask(C)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]  # [1, 1, N+1, C+N+1]
    with torch.no_grad():
        cache = model(torch.tensor([context]), use_cache=True).past_key_values
        tree_logits = model(torch.tensor([[root] + tokens]), past_key_values=cache, attention_mask=mask,
                            position_ids=TREE.position_ids(C)[None]).logits[0]
        paths = [context + [root] + [tokens[i] for i in TREE.path_to(s - 1)] for s in range(TREE.N + 1)]
        plain = torch.stack([model(torch.tensor([seq])).logits[0, -1] for seq in paths])
    diff = (tree_logits - plain).abs().max().item()
    assert diff < 1e-4, f"max |tree - plain| logit difference {diff}"
    # and the mask matters: a causal block over the same tokens differs at the nodes off the first path
    causal = model(torch.tensor([context + [root] + tokens])).logits[0, C:]
    assert (causal - plain).abs().amax(-1)[[3, 5, 6]].min() > 1e-3


def test_a_static_trees_first_nodes_are_the_smaller_static_tree_and_their_priors_fall():
    big = DraftTree.static(6, 4, 32)
    for n in (1, 5, 12, 31):
        assert DraftTree.static(6, 4, n).parents == big.parents[:n]
    prior = DraftTree.static_prior(6, 4, 32)
    assert len(prior) == 32 and prior == sorted(prior, reverse=True)
    assert prior[0] == pytest.approx(math.log(0.6)) and prior[1] == pytest.approx(2 * math.log(0.6))


def random_trees(count: int, seed: int = 0):
    """Trees of 1..40 nodes with random parents (each an earlier node or the root)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        N = int(torch.randint(1, 41, (1,), generator=g))
        yield DraftTree(tuple(int(torch.randint(-1, i, (1,), generator=g)) for i in range(N)))


@pytest.mark.parametrize("slack", [0, 2], ids=["tight", "loose"])
def test_a_tensor_tree_gives_the_draft_trees_views(slack):
    """TensorTree (the shape as device tensors, its bounds fixed) builds DraftTree's views without the host: the
    same child table, path table, ancestor mask, positions and parent slots, padded past the true bounds."""
    for tree in random_trees(30):
        W = max(len(k) for k in tree.children)
        t = TensorTree(torch.tensor(tree.parents), tree.max_depth + slack, W + slack)
        D = tree.max_depth
        assert t.N == tree.N and t.check_ids(torch.zeros((1, tree.N + 1), dtype=torch.long)) == tree.N + 1
        table = t.child_table()
        assert torch.equal(table[:, :W], tree.child_table()) and (table[:, W:] == -1).all()
        paths = t.path_table()
        assert torch.equal(paths[:, :D + 1], tree.path_table())
        past = torch.arange(D + 1, D + 1 + slack, dtype=torch.int32)
        assert torch.equal(paths[:, D + 1:], past.expand(tree.N + 1, -1))
        assert torch.equal(t.ancestor_mask(), tree.ancestor_mask())
        assert torch.equal(t.position_ids(torch.tensor([7])), tree.position_ids(7))
        assert torch.equal(t.parent_slots(), tree.parent_slots())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_tree_verifier_walks_a_tensor_tree_as_its_draft_tree(backend):
    """kernels.verify_tree (greedy) on a TensorTree with loose bounds: the accepted count, the tokens and the path
    of the DraftTree it holds (the path padded with -1 to the bound)."""
    from kernels import verify_tree

    g, accepted = torch.Generator().manual_seed(4), 0
    for tree in random_trees(8, seed=5):
        t = TensorTree(torch.tensor(tree.parents), tree.max_depth + 1, max(len(k) for k in tree.children) + 1)
        V = 7
        drafted = torch.randint(0, V, (3, tree.N), generator=g)
        p = torch.randn(3, tree.N + 1, V, generator=g).softmax(-1)
        for i, parent in enumerate(tree.parents):  # some nodes equal their parent slot's argmax: paths accepted
            if i % 2 == 0:
                drafted[:, i] = p[:, parent + 1].argmax(-1)
        want = verify_tree(tree, drafted, None, p, greedy=True, backend=backend)
        got = verify_tree(t, drafted, None, p, greedy=True, backend=backend)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.path[:, :tree.max_depth], want.path) and (got.path[:, tree.max_depth:] == -1).all()
        assert torch.equal(got.tokens[:, :tree.max_depth + 1], want.tokens)
        accepted += int(want.num_accepted.sum())
    assert accepted > 0, "the test needs accepted paths"
