"""A greedy draft tree's level and ranking (`kernels.tree_level`): the Triton kernels against the PyTorch reference,
on CUDA or under TRITON_INTERPRET=1, and the reference's two-pass top-k against one top-k."""
import pytest
import torch

from kernels.tree_level import CHUNK, chunked_topk, next_frontier, rank_tree_triton, tree_level

SHAPES = [(1, 1, 16384, 4, 4), (1, 4, 16384, 4, 4), (2, 4, 1000, 3, 5), (1, 3, 64, 2, 6), (2, 2, 16384, 1, 2),
          (1, 4, 16384, 4, 0)]  # B, W, V, k, w: the head's levels, a vocabulary off the chunks, tiny, k = 1, last


@pytest.mark.parametrize("B,W,V,k,w", SHAPES)
def test_the_level_kernels_give_the_reference(device, B, W, V, k, w):
    """Float32 logits with distinct values: the same children, chosen candidates, frontier nodes and picks, scores
    within a rounding (the log-sum-exp summed by chunks)."""
    g = torch.Generator(device=device).manual_seed(V + W)
    logits = torch.randn(B, W, V, generator=g, device=device) * 3
    base = torch.randn(B, W, generator=g, device=device) - 2
    want, got = (tree_level(logits, base, k, w, 7, backend) for backend in ("torch", "triton"))
    for name in ("child", "chosen", "up", "picked_child"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.score, want.score, rtol=0, atol=2e-6)
    torch.testing.assert_close(got.picked_score, want.picked_score, rtol=0, atol=2e-6)


def test_bfloat16_logits_give_the_references_values(device):
    """The head's own logits (bfloat16, ties likely): each row's children carry the reference's best values, best
    first, and row 0's chosen candidates the reference's best scores."""
    g = torch.Generator(device=device).manual_seed(3)
    logits = (torch.randn(2, 4, 16384, generator=g, device=device) * 3).bfloat16()
    base = torch.randn(2, 4, generator=g, device=device)
    want, got = (tree_level(logits, base, 4, 4, 0, backend) for backend in ("torch", "triton"))
    picked = logits.float().flatten(1).gather(1, (got.child.view(2, 4, 4) + torch.arange(4, device=device)[:, None]
                                                  * 16384).flatten(1))
    expected = logits.float().flatten(1).gather(1, (want.child.view(2, 4, 4) + torch.arange(4, device=device)[:, None]
                                                    * 16384).flatten(1))
    assert torch.equal(picked, expected)
    torch.testing.assert_close(got.picked_score, want.picked_score, rtol=0, atol=2e-6)


def test_ties_go_to_the_lower_id_and_the_earlier_candidate(device):
    """Equal logits everywhere: every node's children are ids 0..k-1 and the chosen are the first w candidates."""
    logits = torch.zeros(1, 3, 2000, device=device)
    level = tree_level(logits, torch.zeros(1, 3, device=device), 2, 4, 10, "triton")
    assert level.child.tolist() == [[0, 1] * 3]
    assert level.chosen.tolist() == [10, 11, 12, 13] and level.up.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(level.score, torch.full((1, 6), -float(torch.log(torch.tensor(2000.0))),
                                                       device=device))


@pytest.mark.parametrize("B,W,w,S,dtype", [(1, 1, 4, 37, torch.bfloat16), (2, 4, 4, 1500, torch.bfloat16),
                                           (1, 3, 2, 1100, torch.float32)])
def test_the_next_frontier_kernel_gives_the_reference(device, B, W, w, S, dtype):
    """The chosen nodes' tokens, their parents' hidden states and visible slots (the parent's or their own): the
    reference's bits, from one level's picks (a root level of width 1, the head's width, S over a block of slots)."""
    g = torch.Generator(device=device).manual_seed(S)
    level = tree_level(torch.randn(B, W, 3000, generator=g, device=device), torch.zeros(B, W, device=device), 4, w,
                       0, "torch")
    ids = torch.randperm(3000, generator=g, device=device) * 7
    h = torch.randn(B, W, 576, generator=g, device=device).to(dtype)
    visible = torch.rand(W, S, generator=g, device=device) < 0.5
    own = torch.zeros(w, S, dtype=torch.bool, device=device)
    own[torch.arange(w, device=device), S - w + torch.arange(w, device=device)] = True
    want, got = (next_frontier(level, ids, h, visible, own, backend) for backend in ("torch", "triton"))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[2][:, -w:].diagonal().all() and not torch.equal(got[2], visible[:1].expand(w, S))
    with pytest.raises(ValueError, match="frontier"):
        next_frontier(level, ids, h, visible, own[:, 1:], "triton")


@pytest.mark.parametrize("k,w,base", [(0, 0, (1, 2)), (CHUNK + 1, 1, (1, 2)), (2, 5, (1, 2)), (2, 1, (2,))])
def test_a_bad_level_is_refused(k, w, base):
    with pytest.raises(ValueError, match="tree level"):
        tree_level(torch.zeros(1, 2, 1024), torch.zeros(base), k, w)


@pytest.mark.parametrize("shape,k,chunk", [((2, 4, 16384), 4, 512), ((1, 1, 2048), 2, 128), ((3, 1000), 3, 512),
                                           ((2, 1024), 5, 1024), ((1, 3, 4096), 8, 256)])
def test_the_chunked_top_k_is_top_k(shape, k, chunk):
    """The reference expands its nodes' top k in two passes (the k best of each chunk, then of those): the same
    values and ids as one top-k over the whole row (distinct values; a long row, one within a chunk, one not a
    multiple of it)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(k))
    values, index = chunked_topk(x, k, chunk)
    expected = x.topk(k, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(index, expected.indices)


def candidates(B: int, M: int, seed: int, grid: float = 0.0):
    """A tree's candidates as its levels leave them: candidate m's parent an earlier candidate or the root (-1), its
    score its parent's plus a log-probability (grid > 0: scores rounded to it, so ties, a child's with its parent
    too), tokens [B, M] random ids."""
    g = torch.Generator().manual_seed(seed)
    parents, scores = [-1], torch.rand(B, M, generator=g).clamp_min(1e-3).log()
    for m in range(1, M):
        parents.append(int(torch.randint(-1, m, (1,), generator=g)))
        if parents[-1] >= 0:
            scores[:, m] += scores[:, parents[-1]]
    if grid:
        scores = (scores / grid).floor() * grid  # a child stays at or below its parent
    return scores, torch.tensor(parents), torch.randint(0, 49152, (B, M), generator=g)


@pytest.mark.parametrize("B,M,size,depth,width,grid", [(1, 84, 32, 6, 4, 0.0), (2, 84, 16, 6, 4, 0.0),
                                                       (1, 20, 10, 6, 2, 0.0), (1, 84, 32, 6, 4, 0.5),
                                                       (1, 12, 20, 8, 5, 0.25), (3, 40, 11, 3, 2, 0.0)])
def test_the_rank_kernel_gives_the_best_nodes_and_the_tensor_trees_views(device, B, M, size, depth, width, grid):
    """One kernel for the tree's ranking and views: `_best_nodes`' nodes and parents, the tokens and scores in node
    order, and TensorTree's ancestors, depths, child table and path table (bounds tight and loose, ties, a size
    above the candidates)."""
    from flashspec_core.drafters import _best_nodes
    from flashspec_core.tree import TensorTree

    scores, parents, tokens = (x.to(device) for x in candidates(B, M, seed=M + size, grid=grid))
    order, node_parents = _best_nodes(scores, parents, size)
    want = TensorTree(node_parents, depth, width)
    got = rank_tree_triton(scores, parents, tokens, size, depth, width)
    assert torch.equal(got.parents, node_parents)
    assert torch.equal(got.tokens, tokens[:, order]) and torch.equal(got.scores, scores[:, order])
    assert torch.equal(got.ancestors, want.ancestors()) and torch.equal(got.depth, want.slot_depth())
    assert torch.equal(got.child_table, want.child_table()) and torch.equal(got.path_table, want.path_table())
    tree = TensorTree(got.parents, depth, width, views=got)
    assert torch.equal(tree.position_ids(torch.tensor([5], device=device)), want.position_ids(5))


def device_lookup(history: torch.Tensor, length: torch.Tensor, C: int) -> torch.Tensor:
    """`CapturedRound.copied` (the torch reference) over these emitted ids, without a round around them."""
    from types import SimpleNamespace

    from flashspec_core.captured import CapturedRound

    steps = torch.arange(history.shape[1])
    return CapturedRound.copied(SimpleNamespace(history=history, length=length, steps=steps), C)


def copy_case(B: int, P: int, end: int, N: int, seed: int):
    """Emitted ids [B, P] from a small vocabulary (runs repeat) up to the pending one at `end`, -1 past it, and a
    random greedy tree of N nodes whose row 0 follows the copy lookup's continuation for a few levels (odd seeds)."""
    g = torch.Generator().manual_seed(seed)
    history = torch.full((B, P), -1, dtype=torch.int64)
    history[:, :end + 1] = torch.randint(0, 6, (B, end + 1), generator=g)
    length = torch.tensor([end])
    parents = [-1] + [int(torch.randint(-1, n, (1,), generator=g)) for n in range(1, N)]
    tokens = torch.randint(0, 6, (B, N), generator=g)
    chain = device_lookup(history, length, 4)
    if seed % 2:  # a path from the root carrying the chain's first ids
        at = -1
        for j in range(min(3, N)):
            kids = [n for n in range(N) if parents[n] == at]
            if not kids or chain[0, j] < 0:
                break
            at = kids[-1]
            tokens[0, at] = chain[0, j]
    scores = torch.rand(B, N, generator=g).log()
    return history, length, torch.tensor(parents), tokens, scores


@pytest.mark.parametrize("B,P,end,N,C,depth,width,seed", [(1, 40, 30, 10, 8, 6, 2, 1), (1, 40, 30, 10, 8, 6, 2, 2),
                                                          (2, 3000, 2500, 24, 8, 6, 4, 3), (1, 64, 1, 6, 4, 4, 3, 5),
                                                          (3, 50, 45, 32, 4, 6, 4, 7), (1, 50, 0, 8, 8, 5, 4, 9)])
def test_the_copied_branch_kernel_gives_the_captured_rounds_lookup_graft_and_views(device, B, P, end, N, C,
                                                                                   depth, width, seed):
    """One kernel for a copied branch: `CapturedRound.copied`'s chain grafted by `TreeProposal.graft_at`, the same
    parents, tokens and scores, and `TensorTree`'s views of the grown tree (no copy found, a chain the tree holds in
    part or whole, a history over three blocks of the scan, a pending id at position 0 or 1, several rows)."""
    from flashspec_core.captured import LONGEST_RUN
    from flashspec_core.drafters import TreeProposal
    from flashspec_core.tree import TensorTree
    from kernels.tree_level import copy_graft_triton

    history, length, parents, tokens, scores = copy_case(B, P, end, N, seed)
    want = TreeProposal(TensorTree(parents, depth, width), tokens, None, scores).graft_at(
        device_lookup(history, length, C))
    got = copy_graft_triton(*(x.to(device) for x in (history, length, parents, tokens, scores)), C, depth, width,
                            LONGEST_RUN)
    tree = want.tree
    assert torch.equal(got.parents.cpu(), tree.parents), (got.parents, tree.parents)
    assert torch.equal(got.tokens.cpu(), want.tokens) and torch.equal(got.scores.cpu(), want.score)
    assert torch.equal(got.ancestors.cpu(), tree.ancestors()) and torch.equal(got.depth.cpu(), tree.slot_depth())
    assert torch.equal(got.child_table.cpu(), tree.child_table()) and torch.equal(got.path_table.cpu(),
                                                                                    tree.path_table())
