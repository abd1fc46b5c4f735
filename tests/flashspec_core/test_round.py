"""The device round on its own: driven directly it gives the engine's tokens; the draft head stays current whatever
arm drafts (after other arms its cache holds every verified slot and its next draft has nothing to catch up on)
and is scored every round; a round reads the device once."""
import pytest
import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.draft_head import HeadCache
from flashspec_core.drafters import DraftHeadDrafter, NoDraft, PromptLookup
from flashspec_core.fast_path import StaticCausalLM, fast_or_eager
from flashspec_core.round import DeviceRound
from tests.conftest import tiny_llama
from tests.flashspec_core.test_draft_head import tiny_head

V = 50
PROMPT = [5, 7, 11, 13, 17, 19, 23, 5, 7, 11, 13, 17]  # prompt lookup has something to copy
GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


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
    rows = drive(fresh_round(target, head), lambda i: "draft_head", 3, sampling, 5, 24)
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


def test_the_head_is_current_after_other_arms(target, head, monkeypatch):
    round_ = fresh_round(target, head)
    schedule = lambda i: "draft_head" if i == 0 else ("prompt_lookup" if i % 2 else "no_draft")  # noqa: E731
    rows = drive(round_, schedule, 3, GREEDY, 0, 20)  # the head drafts once, then other arms for 10+ rounds
    drafter = round_.drafters["draft_head"]
    slots = len(rows[0]) - 1  # every position before the pending token is verified
    assert drafter.cache.length == slots
    cache, h = one_pass(target, head, rows[0], slots)
    torch.testing.assert_close(drafter.cache.k[:, :, :slots], cache.k[:, :, :slots], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.cache.v[:, :, :slots], cache.v[:, :, :slots], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.h[:, -1], h, atol=1e-4, rtol=1e-4)
    fed = []  # tokens fed per head step while it drafts K = 4 now: one each, K - 1 steps, no catching up
    step = head.step
    monkeypatch.setattr(head, "step", lambda cache, tokens, hidden: fed.append(tokens.shape[1]) or step(cache, tokens, hidden))
    proposal = drafter.propose(rows, 4)
    assert proposal.tokens.shape == (1, 4) and fed == [1, 1, 1]
    assert drafter.cache.length == slots  # the draft slots were rolled back


def test_the_head_is_scored_every_round(target, head):
    """Pulled or not, every round gives the head one observation (its first-pass guess against the emitted token)."""
    engine = Engine.from_models(target, [head, "prompt_lookup"], kernel_backend="torch")
    events = list(engine.stream(PROMPT, 40, gamma="auto", drafters=["prompt_lookup", "draft_head"]))
    assert events[0].drafter != "draft_head"  # UCB pulls the first unobserved arm first
    for e in events:
        state = {a.name: a for a in e.arms}["draft_head"]
        assert state.observations == e.index + 1, (e.index, e.drafter, state)
    assert state.pulls == sum(e.drafter == "draft_head" for e in events)


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
    for _ in range(3):
        before = len(reads)
        out = round_.run(rows, round_.drafters[arm], 3, sampling, gen)
        assert reads[before:] == ["tolist"], reads[before:]
        assert set(out.guesses) == {"draft_head"}  # the head's guess rode in the same copy
