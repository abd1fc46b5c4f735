"""Model-free drafters and sampling transforms."""
import torch

from flashspec_core.drafters import NgramCache, NoDraft, PromptLookup
from flashspec_core.sampling import SamplingConfig, logits_to_probs


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    d = PromptLookup()
    assert d.propose_ids([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]
    assert d.propose_ids([7, 1, 2, 7, 8, 1, 2], 2) == [7, 8]  # the 2-gram (1, 2) wins over the 1-gram (2,)
    assert d.propose_ids([1, 2, 3], 4) == []


def test_prompt_lookup_prefers_most_recent_match():
    assert PromptLookup().propose_ids([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]


def test_ngram_cache_learns_generated_text_only_and_chains():
    d = NgramCache()
    d.start([[100, 101, 102]], SamplingConfig(), None)
    d.observe([[100, 101, 102, 1, 2, 3, 4]], 0)
    assert (100, 101) not in d.table  # n-grams predicting prompt tokens are prompt lookup's job
    assert d.propose_ids([9, 1, 2], 2) == [3, 4]
    d.start([[50]], SamplingConfig(), None)  # the table survives across generations in a session
    assert d.propose_ids([50, 2, 3], 1) == [4]


def test_no_draft_proposes_nothing():
    proposal = NoDraft().propose([[1, 2]], 4)
    assert proposal.tokens.shape == (1, 0) and proposal.q is None


def test_logits_to_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.allclose(logits_to_probs(logits, SamplingConfig(temperature=1.0)), torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = logits_to_probs(logits, SamplingConfig(temperature=0.0))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]
