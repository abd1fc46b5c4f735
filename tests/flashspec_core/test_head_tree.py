"""The draft head over a tree: the masked head step equals the chain along each node's path."""
import pytest
import torch

from flashspec_core import SamplingConfig
from flashspec_core.drafters import DraftHeadDrafter
from flashspec_core.tree import DraftTree
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
