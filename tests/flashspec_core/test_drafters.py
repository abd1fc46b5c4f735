"""Model-free drafters (the suffix index, prompt lookup, the n-gram cache) and sampling transforms."""
import random

import pytest
import torch

from flashspec_core.drafters import SEP, CopyOdds, NgramCache, NoDraft, PromptLookup, SuffixIndex, match_bucket
from flashspec_core.gamma import CostModel
from flashspec_core.sampling import SamplingConfig, logits_to_probs


def flat_costs() -> CostModel:
    """Verifying any number of tokens costs one step: every draft token is free, so a drafter proposes all it has."""
    costs = CostModel()
    for t in range(1, 34):
        costs.observe(t, 1.0)
    return costs


def steep_costs() -> CostModel:
    """Each verified token costs a full step: no draft can pay, so a drafter proposes nothing."""
    costs = CostModel()
    for t in range(1, 34):
        costs.observe(t, float(t))
    return costs


def copier(cls=PromptLookup, costs=None, aligns=True, **kwargs):
    d = cls(**kwargs)
    d.costs, d.aligns = costs or flat_costs(), aligns
    return d


# ----------------------------------------------------------------------------------------------------
# The suffix index against brute force


def brute_match(stream, depth):
    """Longest suffix (<= depth tokens, within the last document) that ended earlier, in any document, with a token
    other than SEP after it; (length, most recent such end)."""
    doc = max([i + 1 for i, t in enumerate(stream) if t == SEP] + [0])
    for length in range(min(depth, len(stream) - doc), 0, -1):
        suffix = stream[len(stream) - length:]
        for end in range(len(stream) - 2, length - 2, -1):
            if stream[end - length + 1:end + 1] == suffix and stream[end + 1] != SEP:
                return length, end
    return 0, -1


def brute_find(stream, tokens, depth):
    """Longest suffix of `tokens` (<= depth) that occurs in the stream (not across SEP) with a token other than SEP
    after it; (length, most recent such end)."""
    for length in range(min(depth, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - length:]
        for end in range(len(stream) - 2, length - 2, -1):
            if stream[end - length + 1:end + 1] == suffix and stream[end + 1] != SEP:
                return length, end
    return 0, -1


def brute_before_last(stream, depth):
    """Longest suffix (2..depth tokens) of the stream without its last token that ended before that suffix's own
    end, among its two latest ends (what the index keeps per string); (length, that end)."""
    n = len(stream)
    for length in range(min(depth, n - 1), 1, -1):
        suffix = stream[n - 1 - length:n - 1]
        ends = [e for e in range(n - 1, length - 2, -1) if stream[e - length + 1:e + 1] == suffix][:2]
        for end in ends:
            if end < n - 2:
                return length, end
    return 0, -1


@pytest.mark.parametrize("seed", range(3))
def test_before_last_finds_the_source_of_the_tokens_before_the_last(seed):
    rng = random.Random(seed)
    for _ in range(60):
        vocab, depth = rng.choice([2, 3, 6, 50]), rng.choice([2, 3, 16])
        index = SuffixIndex(depth)
        for _ in range(rng.randint(1, 30)):
            index.extend([rng.randrange(vocab) for _ in range(rng.randint(1, 4))])
            assert index.before_last() == brute_before_last(index.stream, depth), (index.stream, depth)


@pytest.mark.parametrize("seed", range(6))
def test_suffix_index_finds_the_longest_match_and_its_latest_occurrence(seed):
    rng = random.Random(seed)
    for _ in range(40):
        vocab, depth = rng.choice([2, 3, 6, 50]), rng.choice([1, 3, 16])
        index = SuffixIndex(depth)
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.1:
                index.new_document()
                continue
            index.extend([rng.randrange(vocab) for _ in range(rng.randint(1, 5))])
            length, end, _ = index.match()
            assert (length, end) == brute_match(index.stream, depth), (index.stream, depth)
            query = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            length, end, _ = index.find(query)
            assert (length, end) == brute_find(index.stream, query, depth), (index.stream, query, depth)


def test_suffix_index_built_in_pieces_equals_one_built_at_once():
    rng = random.Random(7)
    tokens = [rng.randrange(5) for _ in range(300)]
    whole = SuffixIndex(8)
    whole.extend(tokens)
    pieces, i = SuffixIndex(8), 0
    while i < len(tokens):
        n = rng.randint(1, 9)
        pieces.extend(tokens[i:i + n])
        i += n
    assert (pieces.stream, pieces.kids, pieces.last, pieces.prev, pieces.active) == \
           (whole.stream, whole.kids, whole.last, whole.prev, whole.active)


def test_continuation_copies_itself_past_the_end_and_stops_at_a_document_boundary():
    index = SuffixIndex(4)
    index.extend([5, 1, 2, 1, 2])
    length, end, _ = index.match()  # "1 2" ended at 2 before
    assert (length, end) == (2, 2)
    assert index.continuation(end, 7) == [1, 2, 1, 2, 1, 2, 1]  # a period-2 repeat
    index.new_document()
    index.extend([9, 5])
    length, end, _ = index.match()  # "5" ended at 0, followed by 1
    assert (length, end) == (1, 0) and index.continuation(end, 10) == [1, 2, 1, 2]  # stops at the boundary


# ----------------------------------------------------------------------------------------------------
# Prompt lookup


def test_prompt_lookup_copies_after_the_longest_match_not_the_latest_short_one():
    d = copier()
    row = [1, 2, 3, 4, 5, 9, 3, 7, 0, 2, 3]  # "3" last followed by 7, but "2 3" (longer) by 4
    assert d.propose_ids(row, 3) == [4, 5, 9]
    assert copier().propose_ids([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]  # equal lengths: the most recent occurrence
    assert copier().propose_ids([1, 2, 3], 4) == []


def test_prompt_lookup_copies_on_past_a_replaced_or_an_inserted_token():
    source = [10, 11, 12, 13, 14, 15, 16, 17]
    rows = [source + [5, 10, 11, 12, 99]]  # 99 broke the copy where the source has 13
    d = copier()
    d.start(rows, SamplingConfig(), None)
    assert d.propose_ids(rows[0], 4) == [14, 15, 16, 17]  # no record yet: 99 replaced 13, copy on after it
    before = len(rows[0])
    rows[0].append(13)  # the target went on with 13: 99 had come in before it
    d.observe(rows, before)
    assert d.alignment["ins"] > d.alignment["sub"]
    rows[0] += [14, 77]  # 77 breaks the copy again
    assert d.propose_ids(rows[0], 3) == [15, 16, 17]  # insertions went on in this stream: copy on from 15
    unaligned = copier(aligns=False)
    unaligned.start(rows, SamplingConfig(), None)
    assert unaligned.propose_ids(rows[0], 3) == []  # 77 follows nothing earlier


def test_prompt_lookup_draft_length_follows_costs_and_match():
    row = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 10-token match
    assert copier(costs=flat_costs()).propose_ids(row, 8) == [11, 12, 0, 1, 2, 3, 4, 5]  # free tokens: all k
    assert copier(costs=steep_costs()).propose_ids(row, 8) == []  # no length pays
    cpu = CostModel()  # one step plus 6% a token: a long match drafts long, a one-token match with several
    cpu.observe(1, 1.0)  # continuations seen (9 was followed by 1 and by 3) drafts less
    long_match = len(copier(costs=cpu).propose_ids(row, 16))
    weak = len(copier(costs=cpu).propose_ids([9, 1, 4, 9, 3, 4, 8, 9], 16))
    assert long_match >= 12 and weak < long_match / 2, (long_match, weak)


def test_draft_length_shrinks_when_copies_keep_failing():
    odds = CopyOdds()
    bucket = match_bucket(2, False)
    before = odds.chance(bucket)
    for _ in range(20):
        odds.observe(match_bucket(1, True), False)
    assert odds.factor < 1 and odds.chance(bucket) < before  # failures elsewhere lower every bucket
    for _ in range(20):
        odds.observe(bucket, True)
    assert odds.chance(bucket) > before


def test_prompt_lookup_incremental_index_equals_a_fresh_one():
    """Following a generation through start/observe gives the drafts a drafter built from scratch on the same context
    gives (with free tokens, so both propose everything their match supports)."""
    rng = random.Random(3)
    prompt = [rng.randrange(6) for _ in range(60)]
    d = copier(aligns=False)  # aligned copies follow the stream's record of them (`_aligned`, tested below)
    rows = [list(prompt)]
    d.start(rows, SamplingConfig(), None)
    for _ in range(30):
        assert d.propose_ids(rows[0], 8) == copier(aligns=False).propose_ids(list(rows[0]), 8)
        rows[0].extend(rng.randrange(6) for _ in range(rng.randint(1, 4)))
        d.observe(rows, 0)


def test_counterfactual_draft_at_the_pre_round_context_does_not_see_the_round():
    """The engine asks for the pre-round draft after observe: it must be what the drafter proposed then, not a draft
    that already knows the tokens the round emitted."""
    d = copier()
    before = [1, 2, 3, 9, 1, 2]
    d.start([list(before)], SamplingConfig(), None)
    proposed = d.propose_ids(before, 4)
    assert proposed == [3, 9, 1, 2]
    rows = [before + [7, 7, 4]]
    d.observe(rows, 0)
    assert d.propose_ids(before, 4) == proposed
    assert d.propose_ids(rows[0], 4) == copier().propose_ids(rows[0], 4)


def test_a_copy_offer_is_worked_out_once_per_context_and_k():
    """The bandit's check before a round and the counterfactual score after it read one offer: once the round's
    scores moved the odds, the pre-round context's offer is still the one made before it; a memo recalled from a copy
    (the engine's calibration streams) makes its offers again, with the odds of then."""
    cpu = CostModel()  # one step plus 6% a token
    cpu.observe(1, 1.0)
    d = copier(costs=cpu)
    row = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # a 10-token match
    d.start([list(row)], SamplingConfig(), None)
    first = d.offer(row, 16)
    assert len(first[0]) >= 12 and first[1] > 0 and d.copy_rate(row, 16) == first[1]
    for _ in range(40):
        d.odds.observe(match_bucket(10, False), False)  # copies kept failing since
    assert d.offer(row, 16) == first and d.propose_ids(row, 16) == first[0]
    d.recall(d.memory())
    again = d.offer(row, 16)
    assert len(again[0]) < len(first[0]) and again[1] < first[1], (first, again)


def test_rows_that_differ_get_their_own_drafts_and_share_k():
    d = copier()
    rows = [[1, 2, 3, 1, 2], [1, 2, 3, 1, 2], [4, 5, 6, 7, 4]]
    d.start(rows, SamplingConfig(), None)
    proposal = d.propose(rows, 4)
    assert proposal.q is None and proposal.tokens.tolist() == [[3, 1, 2, 3], [3, 1, 2, 3], [5, 6, 7, 4]]
    rows.append([4, 5, 6, 7, 8])  # no match: every row proposes nothing
    assert d.propose(rows, 4).tokens.shape == (4, 0)


# ----------------------------------------------------------------------------------------------------
# The n-gram cache


def test_ngram_cache_learns_generated_text_across_generations_and_forgets_on_reset():
    d = copier(NgramCache, prompt_context=2)
    d.start([[100, 101, 102, 103]], SamplingConfig(), None)
    d.observe([[100, 101, 102, 103, 1, 2, 3, 4]], 0)
    assert d.propose_ids([100, 101], 2) == []  # the prompt before its last two tokens is prompt lookup's
    assert d.propose_ids([9, 1, 2], 2) == [3, 4]  # generated text, matched from any context
    d.start([[50, 102, 103]], SamplingConfig(), None)  # a new generation: the same prompt tail
    assert d.propose_ids([50, 102, 103], 3) == [1, 2, 3]  # drafts the earlier answer
    rows = [[50, 102, 103, 1, 2]]
    d.observe(rows, 0)
    assert d.propose_ids(rows[0], 2) == [3, 4]
    d.reset_session()
    d.start([[50, 102, 103]], SamplingConfig(), None)
    assert d.propose_ids([50, 102, 103], 3) == []


def test_ngram_cache_does_not_copy_across_generations_boundaries():
    d = copier(NgramCache, prompt_context=1)
    d.start([[10]], SamplingConfig(), None)
    d.observe([[10, 1, 2]], 0)  # first answer: 1 2, then the document ends
    d.start([[11]], SamplingConfig(), None)
    rows = [[11, 2]]
    d.observe(rows, 0)
    assert d.propose_ids(rows[0], 4) == []  # "2" ended the first answer: nothing followed it there


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
