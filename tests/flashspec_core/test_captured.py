"""The captured round (`flashspec_core.captured`) run eagerly on the CPU, the code its CUDA graphs replay: greedy
output equals plain decoding, emitted tokens follow the target (chi-squared through the engine's round), the head
ends each round in the state the eager rounds leave, and the device-tensor sampling settings give
`logits_to_probs`'s probabilities (test_round.py counts a captured round's host reads). On CUDA: the graphs."""
import pytest
import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.captured import Shape
from flashspec_core.sampling import logits_to_probs, logits_to_probs_at, sampling_params
from flashspec_core.tree_round import TreeSize
from kernels.tree_level import copy_graft_triton
from tests.conftest import fixed_costs, tiny_llama
from tests.flashspec_core.test_distribution import PROMPT as LAW_PROMPT
from tests.flashspec_core.test_distribution import CRITICAL, N, V, chi2, exact_laws, first_two_tokens
from tests.flashspec_core.test_round import GREEDY, PROMPT, T1, fresh_round

WIDEST = TreeSize(6, 4, 32, copy=8)  # 41 tokens a verify: the captured rounds' bound (MAX_GRAPH_TOKENS)

SAMPLINGS = {"t1": SamplingConfig(temperature=1.0), "topk_topp": SamplingConfig(temperature=0.8, top_k=4, top_p=0.9),
             "t07": SamplingConfig(temperature=0.7), "topk1": SamplingConfig(temperature=1.3, top_k=1),
             "topp": SamplingConfig(temperature=1.0, top_p=0.5)}


@pytest.fixture(scope="module")
def tiny():
    from tests.flashspec_core.test_draft_head import tiny_head

    target = tiny_llama(vocab=50, seed=3, layers=4)
    return target, tiny_head(target)


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_device_settings_give_the_same_probabilities(name):
    cfg = SAMPLINGS[name]
    logits = torch.randn(3, 5, 1000, generator=torch.Generator().manual_seed(1)) * 4
    logits[0, 0, :10] = logits[0, 0, 0]  # ties at the top
    want, got = logits_to_probs(logits, cfg), logits_to_probs_at(logits, sampling_params(cfg, "cpu"))
    assert torch.equal(want > 0, got > 0)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_settings_that_keep_every_token_skip_the_sort_and_keep_its_bits(name):
    """A graph for temperature alone (`truncates=False`) gives the full sequence's bits for the settings it serves;
    the settings that drop tokens say so (`SamplingConfig.truncates`), so they get the graph that sorts."""
    cfg = SAMPLINGS[name]
    logits = torch.randn(3, 5, 1000, generator=torch.Generator().manual_seed(2)) * 4
    params = sampling_params(cfg, "cpu")
    full, short = logits_to_probs_at(logits, params), logits_to_probs_at(logits, params, truncates=False)
    assert cfg.truncates == (cfg.top_k > 0 or cfg.top_p < 1.0)
    assert torch.equal(short, full) != cfg.truncates


@pytest.mark.parametrize("drafters", [["draft_head"], ["prompt_lookup"], None], ids=["head", "lookup", "bandit"])
def test_greedy_captured_equals_plain(tiny, drafters):
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch", captured="eager")
    plain = engine.generate(PROMPT, 48, mode="plain").token_ids
    for gamma in ("auto", 1, 5):
        result = engine.generate(PROMPT, 48, gamma=gamma, drafters=drafters)
        assert engine.round.captured is not None
        assert result.token_ids == plain, gamma


@pytest.mark.parametrize("drafters,levels", [
    (["draft_head"], "torch"), (None, "torch"),
    pytest.param(["draft_head"], "triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason=(
        "the kernels on this CPU model need the interpreter; on a GPU the graph test runs them")))],
    ids=["head", "bandit", "head_kernels"])
def test_greedy_captured_trees_with_a_copied_branch_equal_plain(tiny, drafters, levels, monkeypatch):
    """Captured tree rounds (launched ahead where they can be) whose copied branch comes from the device's own
    lookup over the ids it emitted: plain decoding's tokens, and rounds whose tree holds a copy; at temperature 1
    the branch is dropped (it joins greedy trees only). levels "triton": the tree's levels, ranking and copied
    branch by the kernels (interpreted here), the branch in one kernel."""
    import flashspec_core.captured as captured

    monkeypatch.setenv("FLASHSPEC_TREE_LEVEL", levels)
    grafts = []
    monkeypatch.setattr(captured, "copy_graft_triton", lambda *a: grafts.append(1) or copy_graft_triton(*a))
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    plain = engine.generate(PROMPT, 48, mode="plain").token_ids
    tree = TreeSize(3, 2, 6, copy=8)
    result = engine.generate(PROMPT, 48, drafters=drafters, tree=tree)
    assert result.token_ids == plain
    trees = [e.tree_nodes for e in result.events if e.tree_nodes]
    assert trees and max(trees) > tree.nodes and engine.round.launched_ahead > 0
    assert bool(grafts) == (levels == "triton")
    sampled = engine.generate(PROMPT, 24, sampling=T1, drafters=drafters, tree=tree)
    assert all(e.tree_nodes <= tree.sampled.N for e in sampled.events)
    assert engine.generate(PROMPT, 8, drafters=["draft_head"], tree=WIDEST).token_ids == plain[:8]
    with pytest.raises(ValueError, match="at most 40 drafted tokens"):
        engine.generate(PROMPT, 8, drafters=["draft_head"], tree=TreeSize(6, 4, 32, copy=9))


@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "t1"])
def test_rounds_launched_ahead_give_the_tokens_of_rounds_one_at_a_time(tiny, sampling):
    """The head's (or no draft's) next round launched before the last one lands: the same tokens as rounds run one
    at a time, greedy and sampled (a fixed K, so the same draws in the same order); greedy, the bandit too."""
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    runs, ahead = {}, {}
    for launch_ahead in (True, False):
        engine.launch_ahead = launch_ahead
        runs[launch_ahead] = engine.generate(PROMPT, 40, sampling=sampling, gamma=3, drafters=["draft_head"], seed=5)
        ahead[launch_ahead] = engine.round.launched_ahead
    assert runs[True].token_ids == runs[False].token_ids
    assert [e.gamma for e in runs[True].events] == [e.gamma for e in runs[False].events]
    assert ahead[True] >= len(runs[True].events) // 2 and ahead[False] == 0  # not where the end could cut K
    if sampling.greedy:
        engine.launch_ahead = True
        assert engine.generate(PROMPT, 40).token_ids == engine.generate(PROMPT, 40, mode="plain").token_ids
        assert engine.round.launched_ahead > 0


@pytest.mark.parametrize("drafter", ["prompt_lookup", "ngram_cache"])
def test_a_copy_drafters_round_launches_before_the_last_rounds_event(tiny, drafter, monkeypatch):
    """A copy drafter drafts from the landed rows, so its round cannot run ahead; it launches as soon as the round
    before has landed, while the host learns from that round and builds its event. The same tokens and Ks as rounds
    one at a time, and plain decoding's tokens."""
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    in_flight, event = [], engine.events.event
    monkeypatch.setattr(engine.events, "event", lambda *a: in_flight.append(len(engine.round.unlanded)) or event(*a))
    runs, counts = {}, {}
    for launch_ahead in (True, False):
        engine.launch_ahead, in_flight[:] = launch_ahead, []
        engine.reset_session()  # the n-gram cache would remember the first run
        runs[launch_ahead] = engine.generate(PROMPT * 3, 40, gamma=4, drafters=[drafter], seed=5)
        counts[launch_ahead] = in_flight[:]
    assert runs[True].token_ids == runs[False].token_ids == engine.generate(PROMPT * 3, 40, mode="plain").token_ids
    assert [e.gamma for e in runs[True].events] == [e.gamma for e in runs[False].events]
    assert counts[True] == [1] * (len(counts[True]) - 1) + [0] and set(counts[False]) == {0}


def test_copy_drafters_score_counterfactuals_from_their_memo_when_the_next_round_drafted_first(tiny, monkeypatch):
    """With a copy drafter's round launched before the last round's learning, the bandit's counterfactual call on the
    pre-round context still finds that context's draft in the drafter's memo (it keeps the last two): no copy
    drafter re-indexes a row off its path in a stream."""
    from flashspec_core.drafters import CopyDrafter

    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    off_path, inner = [], CopyDrafter._off_path  # every draft off the indexed path goes through it
    monkeypatch.setattr(CopyDrafter, "_off_path", lambda self, *a: off_path.append(self.name) or inner(self, *a))
    result = engine.generate(PROMPT * 3, 60, bandit="thompson", seed=1)
    assert len({e.drafter for e in result.events}) >= 3 and off_path == []


def test_copy_drafters_that_do_not_draft_next_learn_a_round_once_the_next_is_launched(tiny, monkeypatch):
    """Between two copy drafters, the one that drafts the next round learns the landed round first; the other
    learns it once that round is in flight. Greedy, plain decoding's tokens; no drafter leaves its indexed path."""
    from flashspec_core.drafters import CopyDrafter

    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    seen, observe = [], CopyDrafter.observe
    monkeypatch.setattr(CopyDrafter, "observe", lambda self, *a, **k: seen.append(len(engine.round.unlanded))
                        or observe(self, *a, **k))
    monkeypatch.setattr(CopyDrafter, "_off_path", lambda self, *a: pytest.fail("drafted off its path"))
    engine.calibrate()
    seen.clear()
    rechosen = engine.rechosen
    result = engine.generate(PROMPT * 3, 60, drafters=["prompt_lookup", "ngram_cache"], seed=1)
    rechosen = engine.rechosen - rechosen
    assert result.token_ids == engine.generate(PROMPT * 3, 60, mode="plain").token_ids
    # The bandit may pick "no draft" (its rewards weigh this machine's measured costs): that round launches before
    # the landing, so both copy drafters then learn with one round in flight. A copy arm no longer sure at the
    # landed rows is chosen again once both have learnt the round (`Engine._play`): then none is in flight.
    copy_next = sum(e.drafter in ("prompt_lookup", "ngram_cache") for e in result.events[1:])
    assert copy_next >= 10 and rechosen < copy_next
    assert seen.count(1) >= len(result.events) - 1 - rechosen and seen.count(0) >= copy_next - 1


def test_a_copy_arm_chosen_before_the_last_round_landed_is_sure_of_the_rows_it_copies_or_chosen_again(tiny):
    """With the next round chosen while the last is in flight (`Engine.launch_ahead`), a copy arm drafts from rows
    that round had not yet added: it plays only where it is still sure of the landed rows (`HostPolicy.still_sure`),
    else the arm is chosen again on them. Every copy round was confirmed at its own context; plain's tokens."""
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    confirmed, choose, still_sure = set(), engine.policy.choose, engine.policy.still_sure

    def chose(s):
        arm = choose(s)
        confirmed.add((len(s.rows[0]), arm))
        return arm

    def sure(s, arm):
        kept = still_sure(s, arm)
        if kept:
            confirmed.add((len(s.rows[0]), arm))
        return kept

    engine.policy.choose, engine.policy.still_sure = chose, sure
    prompt = engine.encode(PROMPT * 3)
    with fixed_costs(engine, 1.0, 0.01, (0.0, 0.06), 0.001):  # an H100's shape: a wide verify costs little
        result = engine.generate(PROMPT * 3, 60, seed=1)
    assert result.token_ids == engine.generate(PROMPT * 3, 60, mode="plain").token_ids
    context, copies = len(prompt), 0
    for e in result.events:
        if e.drafter in ("prompt_lookup", "ngram_cache"):
            copies += 1
            assert (context, e.drafter) in confirmed, e.index
        context += len(e.emitted)
    assert copies >= 3 and engine.round.launched_ahead > 0


def test_a_late_copy_choice_unsure_of_the_landed_rows_gives_way_to_an_arm_that_does_not_copy(tiny, monkeypatch):
    """Where a copy arm chosen one round late is no longer sure at the landed rows, the round's arm is the bandit's
    among the arms that do not copy, launched before the other copy drafter learns the landed round. Greedy, plain
    decoding's tokens."""
    from flashspec_core.drafters import CopyDrafter

    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    unsure, still_sure = set(), engine.policy.still_sure
    in_flight, observe = {}, CopyDrafter.observe

    def sure(s, arm):
        kept = still_sure(s, arm)
        if not kept:
            unsure.add(len(s.rows[0]))
        return kept

    monkeypatch.setattr(engine.policy, "still_sure", sure)
    monkeypatch.setattr(CopyDrafter, "observe", lambda self, rows, *a, **k: in_flight.setdefault(
        len(rows[0]), []).append(len(engine.round.unlanded)) or observe(self, rows, *a, **k))
    with fixed_costs(engine, 1.0, 0.01, (0.0, 0.06), 0.001):
        result = engine.generate(PROMPT * 3, 60, seed=1)
    learnt = {n: list(calls) for n, calls in in_flight.items()}  # before the plain stream's own
    assert result.token_ids == engine.generate(PROMPT * 3, 60, mode="plain").token_ids
    context, after = len(engine.encode(PROMPT * 3)), []
    for e in result.events:
        if context in unsure:
            after.append(e.drafter)
            # the copy arm chosen late learnt the landed round first (its check reads it), the other one with this
            # round in flight
            assert learnt[context] == [0, 1], e.index
        context += len(e.emitted)
    assert after and not {"prompt_lookup", "ngram_cache"} & set(after)


def test_a_round_that_needs_the_hosts_rows_waits_for_the_round_in_flight(tiny):
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    r, rows = engine.round, [list(PROMPT)]
    r.start(rows, GREEDY, torch.Generator().manual_seed(0), max_context=64)
    first = r.launch(rows, r.drafters["draft_head"], 2, GREEDY, None)
    second = r.launch(rows, r.drafters["no_draft"], 0, GREEDY, None)
    with pytest.raises(ValueError, match="needs the host's rows"):
        r.launch(rows, r.drafters["prompt_lookup"], 2, GREEDY, None)
    with pytest.raises(ValueError, match="order they were launched"):
        r.land(rows, second)
    r.land(rows, first)
    r.land(rows, second)
    assert r.target.length == len(rows[0]) - 1 == r.captured.length.item()


@pytest.mark.parametrize("tree", [None, TreeSize(6, 4, 32, auto=True)], ids=["chains", "trees"])
def test_greedy_captured_equals_plain_on_the_embedded_model(embedded_engine, tree):
    """The shipped head and the CPU default target, in captured rounds launched ahead (then back to the engine's own
    mode): chains, and trees, whose compaction moves cache slots under the ordered attention's widened keys."""
    prompt = "Write a short story about a fox who learns to swim."
    plain = embedded_engine.generate(prompt, 64, mode="plain").token_ids
    mode, embedded_engine.round.mode = embedded_engine.round.mode, "eager"
    try:
        for drafters in (["draft_head"], None):
            embedded_engine.reset_session()  # cold: the n-gram cache would copy the answer of an earlier stream
            assert embedded_engine.generate(prompt, 64, drafters=drafters, tree=tree).token_ids == plain
            assert embedded_engine.round.captured is not None
            assert drafters is None or embedded_engine.round.launched_ahead > 0
    finally:
        embedded_engine.round.mode = mode


@pytest.mark.parametrize("sampling", ["t1", "topk_topp"])
@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_head"])
@pytest.mark.parametrize("K", [1, 4])
def test_emitted_tokens_follow_target(drafter, K, sampling):
    from tests.flashspec_core.test_draft_head import tiny_head

    target = tiny_llama(V, seed=1, sharpness=0.5)
    head = tiny_head(target, draft_vocab=V - 1, seed=4)  # q has a zero where p has mass
    cfg = SAMPLINGS[sampling]
    engine = Engine.from_models(target, ["prompt_lookup", head], kernel_backend="torch", captured="eager")
    first, second, out = first_two_tokens(engine, drafter, K, cfg, seed=K)
    assert engine.round.captured is not None
    p1, p2 = exact_laws(target, cfg)
    assert 0 < sum(out.num_accepted) < N * K, "the test needs both accepts and rejects"
    assert chi2(first, p1.float()) < CRITICAL
    assert chi2(second, p2.float()) < CRITICAL


@pytest.mark.parametrize("catch_up", [1, 4])
def test_the_head_ends_each_round_as_in_eager_rounds(tiny, catch_up):
    """Same schedule, eager rounds feeding the head every round against captured ones: the head's cache, state and
    guess agree whenever the captured head is current. catch_up=1: it runs its first pass inside every round;
    catch_up=4: other arms' rounds store their slots in its backlog, which it takes in pieces before it drafts or
    once 4 wait, so it lags behind the target's cache in between and is current after its own rounds."""
    target, head = tiny
    rounds = {mode: fresh_round(target, head, captured=mode) for mode in ("off", "eager")}
    rows = {mode: [list(PROMPT)] for mode in rounds}
    for mode, r in rounds.items():
        r.drafters["draft_head"].catch_up_slots = catch_up if mode == "eager" else 1
        r.start(rows[mode], GREEDY, torch.Generator().manual_seed(0), arms=list(r.drafters))
    schedule = ["draft_head", "prompt_lookup", "no_draft", "no_draft"] * 3 + (["no_draft"] * 5 + ["draft_head"]) * 2
    compared, lagged, scored = 0, 0, 0
    for arm in schedule:
        a, b = (rounds[m].drafters["draft_head"] for m in ("off", "eager"))
        before = int(a.guess[0])  # the current head's guess at the pre-round context
        out = {mode: r.run(rows[mode], r.drafters[arm], 3, GREEDY, None) for mode, r in rounds.items()}
        guessed = out["eager"].guesses.get("draft_head")
        assert guessed in (None, before)  # a guess is scored only where the head was current
        scored += guessed is not None and arm == "no_draft"
        assert rows["off"] == rows["eager"] and rounds["eager"].captured.length.item() == rounds["eager"].target.length
        n = len(rows["off"][0]) - 1
        assert a.cache.length == n and n - catch_up - 3 <= b.cache.length <= n
        assert rounds["eager"].captured.head_length.item() == b.cache.length or arm != "draft_head"
        lagged += b.cache.length < n
        if b.cache.length == n:
            torch.testing.assert_close(b.cache.k[:, :, :n], a.cache.k[:, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.h, a.h, atol=1e-5, rtol=1e-5)
            assert torch.equal(b.guess, a.guess)
            compared += 1
        assert compared > 0 or arm != "draft_head"
    assert compared == (len(schedule) if catch_up == 1 else schedule.count("draft_head"))
    assert bool(lagged) == (catch_up > 1)
    assert scored >= (schedule.count("no_draft") if catch_up == 1 else 3)  # after a head round or a catch-up


def test_prompt_pieces_follow_the_prompt_length_alone():
    from flashspec_core.captured import prompt_pieces

    assert prompt_pieces(60) == [32, 16, 8, 4] and prompt_pieces(100) == [32, 32, 32, 4]
    assert prompt_pieces(1) == [1] and prompt_pieces(32) == [32] and prompt_pieces(31) == [16, 8, 4, 2, 1]
    assert prompt_pieces(20, max_tokens=9) == [8, 8, 4]  # the longest piece fits the graphs' buffers


def test_the_heads_first_pass_over_a_prompt_in_pieces_leaves_its_own_state(tiny):
    """A prompt that the target prefills as a graph (set here; a GPU's default): the captured round runs the head's
    first pass over it in pieces (`PromptPiece`s, graphs on a GPU), which leave the cache, state and guess of the
    head's own one pass; streams keep plain decoding's tokens."""
    from flashspec_core.captured import PromptPiece

    target, head = tiny
    rounds = {mode: fresh_round(target, head, captured=mode) for mode in ("off", "eager")}
    prompt, ran = PROMPT * 4, []  # 47 slots before the pending token: pieces of 32, 8, 4, 2, 1
    c = rounds["eager"].captured = rounds["eager"]._captured_round(1)
    original = c.run
    c.run = lambda shape: ran.append(shape) or original(shape)
    for r in rounds.values():
        r.target.prefill_graphs = 64
        r.start([list(prompt)], GREEDY, torch.Generator().manual_seed(0), arms=list(r.drafters))
    assert [s.T for s in ran if isinstance(s, PromptPiece)] == [32, 8, 4, 2, 1]
    assert set(ran) <= set(rounds["eager"].shapes(GREEDY, 64, 4))
    a, b = (rounds[m].drafters["draft_head"] for m in ("off", "eager"))
    n = len(prompt) - 1
    assert a.cache.length == b.cache.length == n and b.cache is b.fixed.cache
    torch.testing.assert_close(b.cache.k[:, :, :n], a.cache.k[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.h, a.h, atol=1e-5, rtol=1e-5)
    assert torch.equal(b.guess, a.guess)
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    engine.target.prefill_graphs = 64
    plain = engine.generate(prompt, 32, mode="plain").token_ids
    assert engine.generate(prompt, 32, drafters=["draft_head"], gamma=3).token_ids == plain


def test_every_shape_a_stream_runs_is_listed(tiny):
    """`shapes` (what a stream captures before it starts) covers every round the stream then runs."""
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch", captured="eager")
    ran = []
    with fixed_costs(engine, step_ms=1.0, slope=0.1, head_ms=(0.1, 0.2), copy_ms=0.02):  # not a tiny model's timings
        for sampling in (GREEDY, T1, SAMPLINGS["topk_topp"]):
            engine.generate(PROMPT, 2)  # builds the captured round
            c = engine.round.captured
            original = c.run
            c.run = lambda shape: ran.append(shape) or original(shape)
            engine.generate(PROMPT, 60, sampling=sampling, gamma="auto")
            listed = set(engine.round.shapes(sampling, len(PROMPT) + 60 + 17, 16))
            assert ran and set(ran) <= listed, set(ran) - listed
            rounds = [s for s in ran if isinstance(s, Shape)]  # not the head's passes over the prompt
            assert any(s.head for s in rounds) and any(not s.head and s.K for s in rounds)
            assert any(s.K == 0 for s in rounds)
            assert {s.truncates for s in rounds} == {sampling.truncates}  # the graph its sampling needs
            ran.clear()
            c.run = original


TREES = {"d3k2s4": (3, 2, 4), "d4k2s10": (4, 2, 10), "d6k4s16": (6, 4, 16), "d2k4s3": (2, 4, 3)}


@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("drafters", [["draft_head"], None], ids=["head", "bandit"])
def test_greedy_captured_trees_equal_plain(tiny, shape, drafters, monkeypatch):
    """Greedy trees on the captured round (`CapturedRound.tree_body`: the head's tree, the tree forward, the walk
    and both caches compacted on the device) give plain decoding's tokens, alone and among the bandit's arms, with
    tree rounds launched before the round before them landed (`Engine.launch_ahead`) and without. (The tiny target
    repeats itself, so the bandit's copy arms would be sure of every round: they play by the bandit's means here.)"""
    from flashspec_core.tree_round import TreeSize

    monkeypatch.setattr("flashspec_core.policy.SURE_COPY", float("inf"))
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    plain = engine.generate(PROMPT, 48, mode="plain").token_ids
    for ahead in (True, False):
        engine.launch_ahead = ahead
        result = engine.generate(PROMPT, 48, drafters=drafters, tree=TreeSize(*TREES[shape]))
        assert engine.round.captured is not None
        trees = [e for e in result.events if e.drafted_tree is not None]
        assert result.token_ids == plain and trees
        if drafters:  # the head alone (the bandit may pull it seldom)
            assert sum(len(e.accepted) for e in trees) > 0, "the test needs accepted tree drafts"
            assert (engine.round.launched_ahead > 0) == ahead


def test_a_launched_tree_round_is_the_heads(tiny):
    """A tree round launched on the captured round must be from its head; a refused one counts nothing."""
    from flashspec_core.tree_round import TreeSize

    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    rows, gen, tree = [list(PROMPT)], torch.Generator().manual_seed(0), TreeSize(3, 2, 4)
    engine.round.start(rows, GREEDY, gen, len(PROMPT) + 40, 16, tree=tree)
    with pytest.raises(ValueError, match="runs on a captured round, from its head"):
        engine.round.launch(rows, engine.drafters["prompt_lookup"], 0, GREEDY, gen, tree=tree)
    assert not engine.round.unlanded and engine.round.launched_ahead == 0
    out = engine.round.run_tree(rows, engine.drafters["draft_head"], tree, GREEDY, gen)
    assert out.drafted_tree is not None and len(rows[0]) > len(PROMPT) and not engine.round.unlanded


def test_a_captured_tree_round_drafts_and_accepts_as_an_eager_one(tiny):
    """Round by round, the captured tree round (device tree drafting, device compaction) drafts the tree the eager
    round drafts and accepts the same path (so the head's state after each round is the same)."""
    from flashspec_core.tree_round import TreeSize

    target, head = tiny
    shape = TreeSize(4, 3, 9)
    runs = {}
    for mode in ("eager", "off"):
        engine = Engine.from_models(target, [head], kernel_backend="torch", captured=mode)
        events = engine.generate(PROMPT, 40, drafters=["draft_head"], tree=shape).events
        runs[mode] = [(t.tokens, t.parents, t.accepted) for t in (e.drafted_tree for e in events) if t is not None]
    # the captured stream's last rounds are chains where the stream's end cuts the depth (a cut tree has no graph)
    assert runs["eager"] == runs["off"][:len(runs["eager"])] and len(runs["eager"]) > 3


# -- on CUDA: the graphs themselves -------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def cuda_engine(tiny, dtype, captured="auto"):
    """The tiny pair on the GPU (the head built over the moved target's embedding, which it shares)."""
    import copy

    from tests.flashspec_core.test_draft_head import tiny_head

    target = copy.deepcopy(tiny[0]).to("cuda", dtype)
    return Engine.from_models(target, [tiny_head(target).to("cuda", dtype), "prompt_lookup", "ngram_cache"],
                              captured=captured)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graphs_replay_every_round_and_keep_greedy_exact(tiny, dtype):
    engine = cuda_engine(tiny, dtype)
    plain = engine.generate(PROMPT, 48, mode="plain").token_ids
    for drafters in (["draft_head"], ["prompt_lookup"], None):
        for gamma in ("auto", 1, 5):
            assert engine.generate(PROMPT, 48, gamma=gamma, drafters=drafters).token_ids == plain, (drafters, gamma)
    c = engine.round.captured
    assert c is not None and c.use_graphs and c.graphs and c.eager_rounds == 0
    eager = cuda_engine(tiny, dtype, captured="off")
    assert eager.generate(PROMPT, 48, mode="plain").token_ids == plain


@cuda
def test_greedy_tree_graphs_replay_every_round_and_keep_greedy_exact_a_copied_branch_too(tiny):
    """Greedy fixed-size trees on a GPU: each tree round one graph (captured when the stream starts, a chain where
    the stream's end cuts the depth) and the tokens plain decoding's; with a copied branch too (its lookup and
    graft in one kernel inside the graph: trees over the head's 8 nodes)."""
    from flashspec_core.tree_round import TreeSize

    engine = cuda_engine(tiny, torch.float32)
    plain = engine.generate(PROMPT, 48, mode="plain").token_ids
    for drafters, copy in ((["draft_head"], 0), (None, 0), (["draft_head"], 8)):
        engine.reset_session()  # cold: an n-gram cache that remembers the last run copies all of it, no tree drafted
        result = engine.generate(PROMPT, 48, drafters=drafters, tree=TreeSize(4, 2, 8, copy=copy))
        assert result.token_ids == plain, (drafters, copy)
        assert any(e.drafted_tree is not None for e in result.events)
        assert any(e.tree_nodes > 8 for e in result.events) == bool(copy)
    engine.reset_session()  # the widest tree a graph holds: 32 head nodes and 8 copied
    assert engine.generate(PROMPT, 48, drafters=None, tree=WIDEST).token_ids == plain
    c = engine.round.captured
    assert c is not None and c.use_graphs and any(s.tree for s in c.graphs) and c.eager_rounds == 0


@cuda
def test_the_head_drafts_the_same_in_graphs_as_in_eager_rounds(tiny):
    """Greedy, the head alone: every round proposes the same drafts with graphs as in eager rounds (graphs captured
    while the engine calibrates must update the head's fixed state, not a buffer of their own)."""
    drafts = {}
    for mode in ("auto", "off"):
        engine = cuda_engine(tiny, torch.float32, captured=mode)
        events = engine.generate(PROMPT, 48, gamma=4, drafters=["draft_head"]).events
        drafts[mode] = [e.accepted + e.rejected for e in events]  # each round's proposal
    assert drafts["auto"] == drafts["off"] and len(set(drafts["off"])) > 1


@cuda
def test_the_heads_backlog_replays_in_graphs_as_without_them(tiny):
    """On the GPU, graphs against the same captured code run without them, a fixed schedule of arms in which rounds of
    prompt lookup and of no draft store their slots in the head's backlog (the default catch_up): the same rows and
    guesses every round, the same head after each of its rounds, and every round and catch-up piece a graph."""
    from flashspec_core.captured import PromptPiece

    engines = {mode: cuda_engine(tiny, torch.float32, captured=mode) for mode in ("auto", "eager")}
    rows = {mode: [list(PROMPT)] for mode in engines}
    for mode, e in engines.items():
        assert e.drafters["draft_head"].catch_up_slots > 1
        e.round.start(rows[mode], GREEDY, torch.Generator(device="cuda").manual_seed(0), len(PROMPT) + 200,
                      arms=list(e.drafters))
    schedule = ["draft_head", "prompt_lookup", "no_draft", "no_draft"] * 3 + (["no_draft"] * 17 + ["draft_head"]) * 2
    for arm in schedule:
        out = {mode: e.round.run(rows[mode], e.drafters[arm], 3, GREEDY, None) for mode, e in engines.items()}
        a, b = (engines[m].drafters["draft_head"] for m in ("auto", "eager"))
        assert rows["auto"] == rows["eager"] and out["auto"].guesses == out["eager"].guesses
        assert a.cache.length == b.cache.length
        if arm == "draft_head":
            assert a.cache.length == len(rows["auto"][0]) - 1
            torch.testing.assert_close(a.h, b.h, atol=1e-5, rtol=1e-5)
    c = engines["auto"].round.captured
    assert c.use_graphs and c.eager_rounds == 0
    assert any(isinstance(s, PromptPiece) for s in c.graphs) and any(s.defer for s in c.graphs)


@cuda
def test_sampled_graph_streams_repeat_with_their_seed(tiny):
    engine = cuda_engine(tiny, torch.float32)
    runs = [engine.generate(PROMPT, 40, sampling=T1, gamma=3, drafters=["draft_head"], seed=s).token_ids
            for s in (7, 8, 7)]
    assert runs[0] == runs[2] and runs[0] != runs[1]
    assert engine.round.captured.eager_rounds == 0


@cuda
@pytest.mark.parametrize("drafter,tau", [("prompt_lookup", 1.0), ("draft_head", 1.0), ("draft_head", 0.4)])
def test_emitted_tokens_follow_target_through_graphs(drafter, tau):
    """The chi-squared test of the first emitted token, every row of one replayed graph (N rows, K = 4); the head
    also at a draft temperature of 0.4 (its q far sharper than p, read from the round's device settings)."""
    from dataclasses import replace

    from tests.flashspec_core.test_draft_head import tiny_head

    target = tiny_llama(V, seed=1, sharpness=0.5)
    cfg = SAMPLINGS["topk_topp"]
    p1, _ = exact_laws(target, cfg)
    target = target.cuda()
    head = tiny_head(target, draft_vocab=V - 1, seed=4).cuda()
    head.cfg = replace(head.cfg, draft_temperature=tau)
    engine = Engine.from_models(target, ["prompt_lookup", head], captured="auto")
    rows, gen = [list(LAW_PROMPT) for _ in range(N)], torch.Generator(device="cuda").manual_seed(0)
    engine._start(rows, cfg, gen, max_context=len(LAW_PROMPT) + 8, max_gamma=4)
    out = engine._round(rows, engine.drafters[drafter], 4, cfg, gen)
    c = engine.round.captured
    assert c.graphs and c.eager_rounds == 0 and float(c.head_params[0]) == pytest.approx(cfg.temperature * tau)
    assert 0 < sum(out.num_accepted) < N * 4, "the test needs both accepts and rejects"
    assert chi2(torch.tensor([t[0] for t in out.tokens]), p1.float()) < CRITICAL


@cuda
@pytest.mark.parametrize("tau", [1.0, 0.4])
def test_emitted_tokens_follow_target_through_sampled_tree_graphs(tau):
    """The chi-squared test of the first emitted token, every row of one replayed sampled tree graph (N rows, a
    tree of depth 3 and width 2: the head's levels drawn, the tree walked and both caches compacted on the GPU);
    the head also at a draft temperature of 0.4."""
    from dataclasses import replace

    from flashspec_core.tree_round import TreeSize
    from tests.flashspec_core.test_draft_head import tiny_head

    target = tiny_llama(V, seed=1, sharpness=0.5)
    cfg, shape = SAMPLINGS["topk_topp"], TreeSize(3, 2, 6)
    p1, _ = exact_laws(target, cfg)
    target = target.cuda()
    head = tiny_head(target, draft_vocab=V - 1, seed=4).cuda()
    head.cfg = replace(head.cfg, draft_temperature=tau)
    engine = Engine.from_models(target, [head], captured="auto")
    rows, gen = [list(LAW_PROMPT) for _ in range(N)], torch.Generator(device="cuda").manual_seed(0)
    engine.round.start(rows, cfg, gen, len(LAW_PROMPT) + 8, 4, tree=shape)
    out = engine.round.run_tree(rows, engine.drafters["draft_head"], shape, cfg, gen)
    c = engine.round.captured
    assert c.graphs and c.eager_rounds == 0 and out.drafted_tree is not None
    assert 0 < sum(out.num_accepted) < N * shape.depth, "the test needs both accepts and rejects"
    assert chi2(torch.tensor([t[0] for t in out.tokens]), p1.float()) < CRITICAL


def test_the_captured_round_outlives_eager_streams_and_not_a_new_batch(tiny):
    """A stream of eager rounds keeps the captured round and its graphs for the next stream; a stream of another
    batch reallocates the caches the graphs read, so the next one-row stream builds a new round."""
    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    engine.generate(PROMPT, 8)
    first = engine.round.captured
    engine.round.start([list(PROMPT)], T1, torch.Generator().manual_seed(0), captured=False)
    assert engine.round.captured is None
    engine.generate(PROMPT, 8)
    assert engine.round.captured is first
    engine.round.start([list(PROMPT)] * 3, GREEDY, torch.Generator().manual_seed(0), captured=False)  # three rows
    plain = engine.generate(PROMPT, 24, mode="plain").token_ids
    assert engine.round.captured is not first
    assert engine.generate(PROMPT, 24, drafters=["draft_head"]).token_ids == plain


def test_warm_up_lists_the_captured_tree_rounds_of_fixed_size(tiny, monkeypatch):
    """Engine.warm_up(trees=...): the captured round is asked for the tree rounds of each fixed-size tree (an
    auto-sized one's bound; every bucket, with the head's readers), greedy and sampled (the static shape's nodes)."""
    from flashspec_core.captured import CapturedRound
    from flashspec_core.tree_round import TreeSize

    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    asked = []
    monkeypatch.setattr(CapturedRound, "capture", lambda self, shapes: asked.extend(shapes) or 0)
    fixed, auto = TreeSize(4, 2, 8), TreeSize(6, 4, 32, auto=True)
    engine.warm_up(256, trees=(fixed, auto, fixed))
    trees = [s for s in asked if s.tree is not None]
    assert trees and {s.tree for s in trees} == {fixed, auto.fixed} and all(s.observe for s in trees)
    assert len(trees) == len(set(trees))  # a tree given twice: asked once
    for greedy, nodes in ((True, fixed.nodes), (False, fixed.sampled.N)):
        assert {s.K for s in trees if s.tree == fixed and s.greedy == greedy} == {nodes}
        assert {s.S for s in trees if s.tree == fixed and s.greedy == greedy} == \
            {S for S in engine.target.buckets if nodes < S <= engine.target.bucket(256)}


@pytest.mark.parametrize("size", [(4, 3, 9), (6, 2, 4)], ids=["full_depth", "shallower"])
def test_a_sampled_tree_stream_runs_on_the_captured_round(tiny, size):
    """At temperature > 0 a tree stream keeps the captured round: the head's trees are the static shape
    (`TreeSize.sampled`, which may have fewer levels than the size's depth), one round each, drafted and walked on
    the device; the same seed repeats the stream."""
    from flashspec_core.tree_round import TreeSize

    target, head = tiny
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured="eager")
    shape = TreeSize(*size)
    runs = [engine.generate(PROMPT, 40, T1, drafters=["draft_head"], tree=shape, seed=s) for s in (5, 6, 5)]
    assert engine.round.captured is not None
    trees = [e.drafted_tree for e in runs[0].events if e.drafted_tree is not None]
    assert len(trees) > 3 and all(t.parents == shape.sampled.parents for t in trees)
    assert sum(len(t.accepted) for t in trees) > 0, "the test needs accepted tree drafts"
    assert runs[0].token_ids == runs[2].token_ids != runs[1].token_ids


def test_a_sampled_auto_tree_takes_chains_on_the_captured_round(tiny):
    """Tree "auto" at temperature > 0 on a captured round drafts chains (its static tree measured slower than a
    chain on an H200); a fixed sampled tree still drafts trees there."""
    from flashspec_core.tree_round import TreeSize

    target, head = tiny
    engine = Engine.from_models(target, [head], kernel_backend="torch", captured="eager")
    auto = engine.generate(PROMPT, 24, T1, drafters=["draft_head"], tree=TreeSize(4, 3, 9, auto=True), seed=1)
    fixed = engine.generate(PROMPT, 24, T1, drafters=["draft_head"], tree=TreeSize(4, 3, 9), seed=1)
    assert engine.round.captured is not None
    assert not any(e.drafted_tree for e in auto.events) and any(e.drafted_tree for e in fixed.events)
