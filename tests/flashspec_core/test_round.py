"""The device round on its own: driven directly it gives the engine's tokens; the draft head keeps every verified
slot whatever arm drafts (waiting slots go through one batched first pass before it drafts, or once CATCH_UP of
them wait) and is scored whenever it is current; a round reads the device once; a copy drafter or draft model
outside the stream's arms is not fed, and the n-gram cache later learns the streams it missed."""
import dataclasses

import pytest
import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.draft_head import HeadCache
from flashspec_core.drafters import DraftHeadDrafter, NoDraft, PromptLookup
from flashspec_core.fast_path import StaticCausalLM, fast_or_eager
from flashspec_core.gamma import CostModel, DraftCost
from flashspec_core.round import DeviceRound
from tests.conftest import tiny_llama
from tests.flashspec_core.test_draft_head import tiny_head

V = 50
PROMPT = [5, 7, 11, 13, 17, 19, 23, 5, 7, 11, 13, 17]  # prompt lookup has something to copy
GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
# Tensor methods that read a device tensor on the host. Not `numpy`: it raises on a device tensor, so only CPU-only
# code calls it (`kernels.verify.argmax` takes NumPy's argmax over CPU logits).
HOST_READS = ("tolist", "item", "cpu", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, seed=3, layers=4)


@pytest.fixture(scope="module")
def head(target):
    return tiny_head(target)


def fresh_round(target, head, captured: str = "auto") -> DeviceRound:
    drafters = {"draft_head": DraftHeadDrafter(head, V), "prompt_lookup": PromptLookup(), "no_draft": NoDraft()}
    return DeviceRound(fast_or_eager(target.eval(), V), drafters, kernel_backend="torch", captured=captured)


def drive(round_: DeviceRound, schedule, k: int, sampling: SamplingConfig, seed: int, n: int) -> list[list[int]]:
    """Rounds until n new tokens, the arm of round i from schedule(i), K cut as the engine cuts it near the end."""
    rows, gen = [list(PROMPT)], torch.Generator().manual_seed(seed)
    round_.start(rows, sampling, gen, arms=list(round_.drafters))
    i = 0
    while len(rows[0]) - len(PROMPT) < n:
        limit = n - (len(rows[0]) - len(PROMPT)) - 1
        round_.run(rows, round_.drafters[schedule(i)], min(k, limit), sampling, gen)
        i += 1
    return rows


@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "t1"])
def test_the_round_driven_directly_gives_the_engines_tokens(target, head, sampling):
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch")
    want = engine.generate(PROMPT, 24, sampling=sampling, gamma=3, drafters=["draft_head"], seed=5).token_ids
    round_ = fresh_round(target, head)
    mine, theirs = round_.drafters["draft_head"], engine.drafters["draft_head"]
    mine.costs, mine.step_s = theirs.costs, theirs.step_s  # the engine's head ends its chains by its measured costs
    rows = drive(round_, lambda i: "draft_head", 3, sampling, 5, 24)
    assert rows[0][len(PROMPT):len(PROMPT) + 24] == want


def one_pass(target, head, row: list[int], slots: int):
    """A fresh head cache over the first `slots` slots of `row` in one pass, from Hugging Face's hidden states."""
    cache = HeadCache(head.cfg, 1, 8, "cpu", torch.float32)
    ids = torch.tensor([row])
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in head.cfg.aux_layers], dim=-1)[:, :slots]
        h = head.step(cache, ids[:, 1:slots + 1], head.fuse(features))
    return cache, h[:, -1]


def test_the_head_catches_up_in_one_pass_after_other_arms(target, head, monkeypatch):
    round_ = fresh_round(target, head)
    schedule = lambda i: "draft_head" if i == 0 else ("prompt_lookup" if i % 2 else "no_draft")  # noqa: E731
    rows = drive(round_, schedule, 3, GREEDY, 0, 20)  # the head drafts once, then other arms for 10+ rounds
    drafter = round_.drafters["draft_head"]
    slots = len(rows[0]) - 1  # every position before the pending token is verified
    waiting = sum(w.shape[1] for w in drafter.waiting)
    assert 0 < waiting < drafter.catch_up_slots and drafter.cache.length + waiting == slots
    assert drafter.guess is None  # no guess for a context it has not caught up with
    fed = []  # tokens fed per head step while it drafts K = 4: the waiting slots in one pass, then K - 1 steps
    step = head.step
    monkeypatch.setattr(head, "step", lambda cache, tokens, hidden: fed.append(tokens.shape[1]) or step(cache, tokens, hidden))
    proposal = drafter.propose(rows, 4)
    assert proposal.tokens.shape == (1, 4) and fed == [waiting, 1, 1, 1]
    assert drafter.cache.length == slots  # the verified slots stay, the draft slots were rolled back
    cache, h = one_pass(target, head, rows[0], slots)
    torch.testing.assert_close(drafter.cache.k[:, :, :slots], cache.k[:, :, :slots], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.cache.v[:, :, :slots], cache.v[:, :, :slots], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.h[:, -1], h, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("catch_up", [1, 4])
def test_waiting_slots_reach_the_first_pass_at_the_threshold(target, head, catch_up):
    """catch_up=1: a pass every round (always current); catch_up=4: a pass once 4 or more slots wait."""
    drafters = {"draft_head": DraftHeadDrafter(head, V, catch_up=catch_up), "no_draft": NoDraft()}
    round_ = DeviceRound(fast_or_eager(target.eval(), V), drafters, kernel_backend="torch")
    rows, gen = [list(PROMPT)], torch.Generator().manual_seed(0)
    round_.start(rows, GREEDY, gen, arms=list(drafters))
    d = drafters["draft_head"]
    assert d.cache.length == len(PROMPT) - 1 and not d.waiting and d.guess is not None  # the prompt at once
    for i in range(1, 9):
        round_.run(rows, drafters["no_draft"], 0, GREEDY, gen)  # one verified slot a round
        assert d.cache.length == len(PROMPT) - 1 + i // catch_up * catch_up
        assert (d.guess is not None) == (i % catch_up == 0)
    with pytest.raises(ValueError, match="catch_up"):
        DraftHeadDrafter(head, V, catch_up=0)


def test_the_head_is_scored_whenever_it_is_current(target, head):
    """Every round where the head has just caught up (it drafted, or CATCH_UP slots waited) gives it one
    observation: its first-pass guess against the emitted token, pulled or not."""
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch")
    drafter = engine.drafters["draft_head"]
    drafter.catch_up_slots = 1  # current every round: an observation every round
    events = list(engine.stream(PROMPT, 40, gamma="auto", drafters=["prompt_lookup", "draft_head"]))
    assert events[0].drafter != "draft_head"  # UCB pulls the first unobserved arm first
    for e in events:
        state = {a.name: a for a in e.arms}["draft_head"]
        assert state.observations == e.index + 1, (e.index, e.drafter, state)
    assert state.pulls == sum(e.drafter == "draft_head" for e in events)
    drafter.catch_up_slots = 4
    events = list(engine.stream(PROMPT, 40, gamma="auto", drafters=["prompt_lookup", "draft_head"]))
    final = {a.name: a for a in events[-1].arms}["draft_head"]
    assert final.pulls < final.observations < len(events)  # scored when current only


def counting(original, name: str, reads: list[str]):
    def read(self, *args, **kwargs):
        reads.append(name)
        return original(self, *args, **kwargs)
    return read


@pytest.mark.parametrize("captured", ["auto", "eager"], ids=["eager_rounds", "captured_rounds"])
@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "t1"])
@pytest.mark.parametrize("arm", ["draft_head", "prompt_lookup", "no_draft"])
def test_a_round_reads_the_device_once(target, head, arm, sampling, captured, monkeypatch):
    """Eager rounds (what "auto" runs on the CPU) and captured rounds (`flashspec_core.captured`, run eagerly)."""
    round_ = fresh_round(target, head, captured=captured)
    assert isinstance(round_.target, StaticCausalLM)  # the product path (Hugging Face's own forward reads more)
    rows, gen = [list(PROMPT)], torch.Generator().manual_seed(0)
    round_.start(rows, sampling, gen, arms=list(round_.drafters))
    reads = []
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), name, reads))
    for i in range(3):
        before = len(reads)
        out = round_.run(rows, round_.drafters[arm], 3, sampling, gen)
        assert reads[before:] == ["tolist"], reads[before:]
        # current after the prompt, then slots wait; a captured round where the head drafts leaves it current
        current = i == 0 or (captured == "eager" and arm == "draft_head")
        assert set(out.guesses) == ({"draft_head"} if current else set())  # its guess rode in the same copy


def counted(drafter, monkeypatch) -> dict[str, int]:
    """Count the drafter's start and observe calls from now on."""
    calls = {"start": 0, "observe": 0}
    for method in calls:
        def wrapper(*args, _inner=getattr(drafter, method), _name=method, **kwargs):
            calls[_name] += 1
            return _inner(*args, **kwargs)
        monkeypatch.setattr(drafter, method, wrapper)
    return calls


@pytest.mark.parametrize("captured", ["eager", "off"])
def test_model_free_drafters_that_are_not_arms_are_not_fed(target, head, captured, monkeypatch):
    """A model-free drafter outside the stream's arms is neither started nor updated (and cannot be launched); one
    among them is started once and updated after every round; the tokens stay plain decoding's."""
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured=captured)
    plain = engine.generate(PROMPT, 24, mode="plain").token_ids
    calls = {name: counted(engine.drafters[name], monkeypatch) for name in ("prompt_lookup", "ngram_cache")}
    assert engine.generate(PROMPT, 24, drafters=["draft_head"]).token_ids == plain
    assert calls["prompt_lookup"] == calls["ngram_cache"] == {"start": 0, "observe": 0}
    with pytest.raises(ValueError, match="not among the stream's arms"):
        engine.round.launch([list(PROMPT)], engine.drafters["prompt_lookup"], 2, GREEDY, None)
    lookup = engine.generate(PROMPT, 24, drafters=["prompt_lookup"])
    assert lookup.token_ids == plain
    assert calls["prompt_lookup"] == {"start": 1, "observe": len(lookup.events)}
    assert calls["ngram_cache"] == {"start": 0, "observe": 0}


def test_a_draft_model_that_is_not_an_arm_runs_nothing(target, monkeypatch):
    """A plain stream (or one of other arms) neither prefills nor rolls back a draft model; as the stream's arm it is
    started once and the tokens stay plain decoding's."""
    engine = Engine.from_models(target, [tiny_llama(vocab=V, seed=5), "prompt_lookup"], kernel_backend="torch")
    name = next(n for n, d in engine.drafters.items() if not d.model_free)
    engine.calibrate()  # measures each drafter's cost once (it starts them)
    calls = counted(engine.drafters[name], monkeypatch)
    plain = engine.generate(PROMPT, 16, mode="plain").token_ids
    assert engine.generate(PROMPT, 16, drafters=["prompt_lookup"]).token_ids == plain
    assert calls == {"start": 0, "observe": 0}
    assert engine.generate(PROMPT, 16, drafters=[name], gamma=3).token_ids == plain
    assert calls["start"] == 1 and calls["observe"] > 0


@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "t1"])
@pytest.mark.parametrize("reset", [False, True], ids=["session", "reset"])
def test_the_ngram_cache_learns_the_streams_it_missed(target, head, reset, sampling, monkeypatch):
    """The n-gram cache remembers across streams: one it was not an arm of (not fed) is replayed into it before it is
    next fed, so that it then drafts and knows what it would have had every round fed it; after reset_session it
    forgets that stream too."""
    runs = []
    for feed_all in (False, True):
        engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                    captured="eager")
        costs = CostModel(decay=0.0)  # the same costs in both engines (the copy drafters' lengths weigh them)
        for T, seconds in ((1, 0.010), (17, 0.014)):
            costs.observe(T, seconds)
        engine.policy.set_costs(costs)
        engine.policy.draft_costs.update({name: DraftCost(per_token=0.001) for name in engine.drafters})
        if feed_all:  # the reference: every drafter fed in every stream, whatever its arms
            r = engine.round
            monkeypatch.setattr(r, "feed", lambda rows, arms, r=r: setattr(r, "fed", list(r.drafters.values())))
        engine.generate(PROMPT, 30, drafters=["draft_head"])
        if reset:
            engine.reset_session()
        result = engine.generate(PROMPT, 30, sampling=sampling, drafters=["ngram_cache"], seed=2)
        ngram = engine.drafters["ngram_cache"]
        runs.append(([(e.gamma, e.emitted) for e in result.events], ngram.index.stream, ngram.odds.buckets))
    assert runs[0] == runs[1]
    assert reset or max(gamma for gamma, _ in runs[0][0]) > 0  # it copied the missed stream's answer


def test_calibration_streams_leave_no_trace_in_what_drafters_remember(target, head):
    """The engine's calibration runs rounds of every drafter over scratch rows; afterwards the n-gram cache's text and
    the copy drafters' records of their acceptance are what they were before it (here: empty)."""
    engine = Engine.from_models(target, [head, "prompt_lookup", "ngram_cache"], kernel_backend="torch",
                                captured="eager")
    fresh = PromptLookup().odds.buckets
    engine.calibrate()
    assert engine.policy.calibrated and set(engine.policy.draft_costs) == set(engine.drafters)
    ngram, lookup = engine.drafters["ngram_cache"], engine.drafters["prompt_lookup"]
    assert ngram.index.stream == [] and ngram.odds.buckets == fresh and lookup.odds.buckets == fresh


def test_a_copy_drafter_on_a_captured_round_pays_for_waiting_on_the_round_before(target, head, monkeypatch):
    """A captured round launches the next round of the head or of no draft before this one lands; a copy drafter's
    round must wait for it, so its measured cost per round adds what a round's landing takes past its device time
    (here 0.5 ms a round, as timed); without a captured round nothing is added."""
    rows, costs = [list(PROMPT)], {}
    for captured in ("eager", "off"):  # a captured round (run eagerly on the CPU), and none: every round waits
        engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch", captured=captured)
        real = engine.round.land
        timed = lambda *a, real=real, **k: dataclasses.replace(real(*a, **k), draft_s=1e-4, verify_s=2e-3,
                                                                device_s=1.5e-3)
        monkeypatch.setattr(engine.round, "land", timed)
        costs[captured] = engine.round.draft_cost(rows, engine.drafters["prompt_lookup"], 2)
    assert costs["eager"].per_round == pytest.approx(1e-4 + 5e-4) and costs["eager"].per_token == 0.0
    assert costs["off"].per_round == pytest.approx(1e-4)


def test_the_head_ends_its_chains_by_its_measured_costs_once_it_has_them(target, head):
    """On the CPU the head sets its own chain length (gamma "auto" hands it the largest K): all K tokens before its
    costs are measured; with a draft step priced at ten target forwards, one token (the first is always drafted)."""
    round_ = fresh_round(target, head)
    drafter = round_.drafters["draft_head"]
    assert drafter.sets_length
    costs = CostModel()
    for n in range(1, 10):
        costs.observe(n, 0.007 + 0.0005 * (n - 1))
    lengths = []
    for step_s in (0.0, 0.07):
        drafter.costs, drafter.step_s = costs, step_s
        rows, gen = [list(PROMPT)], torch.Generator().manual_seed(0)
        round_.start(rows, T1, gen, arms=list(round_.drafters))
        lengths.append(len(round_.run(rows, drafter, 6, T1, gen).draft))
    assert lengths == [6, 1]


def test_a_sampled_chain_reads_a_flat_draws_chance_of_acceptance_above_its_probability(target, head):
    """A token drawn from a flat q is accepted with min(1, p/q), far more often than q(x): the sampled chain grows
    where a greedy chain with the same probability of its token ends (`SAMPLED_ACCEPTANCE`), and ends where even
    that chance does not pay for a step."""
    drafter = fresh_round(target, head).drafters["draft_head"]
    costs = CostModel()
    for n in range(1, 10):
        costs.observe(n, 0.007 + 0.0002 * (n - 1))
    drafter.costs, drafter.step_s = costs, 0.0002
    V = 64
    logits = torch.full((1, V), -10.0)
    logits[0, :20] = 0.0  # 20 equal tokens: probability 0.05 each
    q, index = logits.softmax(-1), torch.tensor([3])
    assert not drafter._ends(index, q, logits, [])  # sampled: ~0.38 a token, one more pays
    assert drafter._ends(index, None, logits, [])  # greedy: 0.05, it does not
    drafter.step_s = 0.01
    assert drafter._ends(index, q, logits, [])  # a step costing more than a forward: no chance pays for it


@pytest.mark.parametrize("B,K", [(1, 0), (1, 1), (1, 4), (3, 3)])
def test_the_greedy_accept_test_on_the_host_reads_as_verify_and_pack(B, K):
    """`pack_greedy` + `HostCopy.read_greedy` (a greedy round on the CPU) against `kernels.verify` + `pack` +
    `HostCopy.read` on logits with ties and with drafts that match the argmax for a random length: the same accepted
    counts, tokens, drafted ids, p and q values and guesses; a drafter's q is read at its drafted ids."""
    from flashspec_core.captured import pack, pack_greedy
    from flashspec_core.drafters import Proposal
    from flashspec_core.round import HostCopy
    from kernels import verify

    gen = torch.Generator().manual_seed(B * 10 + K)
    for trial in range(40):
        logits = torch.randn(B, K + 1, V, generator=gen).round(decimals=0)  # ties in the argmax
        best = logits.argmax(-1)
        drafted = torch.randint(0, V, (B, K), generator=gen)
        keep = torch.randint(0, K + 1, (B, 1), generator=gen)
        drafted = torch.where(torch.arange(K) < keep, best[:, :K], drafted)
        q = None if trial % 2 else torch.rand(B, K, V, generator=gen).softmax(-1)
        proposal, guesses = Proposal(drafted, q), [torch.randint(0, V, (B,), generator=gen)]
        result = verify(drafted, q, logits, greedy=True, backend="torch")
        old = HostCopy.read(pack(proposal, logits.softmax(-1), result, guesses), K, ["draft_head"])
        new = HostCopy.read_greedy(pack_greedy(proposal, logits, guesses), K, ["draft_head"])
        assert new == old, (trial, old, new)
