"""Chi-squared tests through the engine's own round: emitted tokens follow the target p, not the draft q.

Tiny random Llama target and draft with vocabulary 6 whose distributions differ; N = 30,000 rows run as one
batch through Engine._start and Engine._round; the first and second emitted tokens are compared with the
target's exact laws; critical value 15.086 (df 5, 1%).
"""
import pytest
import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.sampling import logits_to_probs
from tests.conftest import tiny_llama

N, V, CRITICAL = 30_000, 6, 15.086
PROMPT = [1, 2, 3, 1, 2]  # prompt lookup proposes [3, 1, 2, ...] from it


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(V, seed=1, sharpness=0.5)
    draft = tiny_llama(V, seed=2, sharpness=0.5)
    return target, draft


@pytest.fixture(scope="module")
def head(pair):
    """A random draft head over the target's hidden states; its draft vocabulary leaves one token out, so its
    q has a zero where p has mass."""
    from tests.flashspec_core.test_draft_head import tiny_head

    return tiny_head(pair[0], draft_vocab=V - 1, seed=4)


def exact_laws(target, sampling):
    """Target laws of the first and second emitted token, from full forwards (no cache, no engine code)."""
    with torch.no_grad():
        p1 = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], sampling).double()
        nxt = torch.stack([logits_to_probs(target(torch.tensor([PROMPT + [t]])).logits[0, -1], sampling)
                           for t in range(V)]).double()
    return p1, p1 @ nxt


def first_two_tokens(engine, drafter, K, sampling, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [list(PROMPT) for _ in range(N)]
    engine._start(rows, sampling, gen)
    out = engine._round(rows, engine.drafters[drafter], K, sampling, gen)
    first = [t[0] for t in out.tokens]
    second = [t[1] if n >= 1 else None for t, n in zip(out.tokens, out.num_accepted)]
    for tok in sorted({first[i] for i in range(N) if second[i] is None}):  # rows that emitted one token
        idx = [i for i in range(N) if second[i] is None and first[i] == tok]
        rows2 = [PROMPT + [tok] for _ in idx]
        engine._start(rows2, sampling, gen)
        out2 = engine._round(rows2, engine.drafters[drafter], K, sampling, gen)
        for i, t in zip(idx, out2.tokens):
            second[i] = t[0]
    return torch.tensor(first), torch.tensor(second), out


def chi2(samples, law):
    observed = torch.bincount(samples, minlength=V).double()
    support = law > 0
    assert observed[~support].sum() == 0, f"tokens outside the target's support: {observed.tolist()}"
    expected = len(samples) * law[support]
    return float(((observed[support] - expected) ** 2 / expected).sum())


SAMPLINGS = {"t1": SamplingConfig(temperature=1.0), "topk_topp": SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)}


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup", "draft_head"])
@pytest.mark.parametrize("K", [1, 4])
def test_emitted_tokens_follow_target(pair, head, drafter, K, sampling):
    target, draft = pair
    cfg = SAMPLINGS[sampling]
    engine = Engine.from_models(target, [draft, "prompt_lookup", head], kernel_backend="torch")
    first, second, out = first_two_tokens(engine, drafter, K, cfg, seed=K)
    p1, p2 = exact_laws(target, cfg)
    assert 0 < sum(out.num_accepted) < N * K, "the test needs both accepts and rejects"
    s1, s2 = chi2(first, p1), chi2(second, p2)
    assert s1 < CRITICAL and s2 < CRITICAL, f"chi2 first={s1:.1f} second={s2:.1f} (critical {CRITICAL})"


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("captured", ["off", "eager"])
def test_a_head_drafting_at_its_own_temperature_keeps_the_target(pair, sampling, captured):
    """A head whose draft temperature (0.4) makes q far sharper than the target's law: its rounds draw from that q
    (eager rounds and the captured round's device settings) and the emitted tokens still follow p."""
    from dataclasses import replace

    from tests.flashspec_core.test_draft_head import tiny_head

    target, cfg = pair[0], SAMPLINGS[sampling]
    head = tiny_head(target, draft_vocab=V - 1, seed=4)  # a new head: the module's fixture keeps its temperature
    head.cfg = replace(head.cfg, draft_temperature=0.4)
    engine = Engine.from_models(target, [head], kernel_backend="torch", captured=captured)
    first, second, out = first_two_tokens(engine, "draft_head", 4, cfg, seed=7)
    drafted = engine.drafters["draft_head"].sampling.temperature if captured == "off" else \
        float(engine.round.captured.head_params[0])
    assert drafted == pytest.approx(cfg.temperature * 0.4)
    p1, p2 = exact_laws(target, cfg)
    assert 0 < sum(out.num_accepted) < N * 4, "the test needs both accepts and rejects"
    s1, s2 = chi2(first, p1), chi2(second, p2)
    assert s1 < CRITICAL and s2 < CRITICAL, f"chi2 first={s1:.1f} second={s2:.1f} (critical {CRITICAL})"


def test_the_test_has_power(pair):
    """The same statistic rejects the draft's law, so a verifier that emitted q-samples would fail."""
    target, draft = pair
    cfg = SAMPLINGS["t1"]
    engine = Engine.from_models(target, [draft], kernel_backend="torch")
    first, _, _ = first_two_tokens(engine, "draft_model", 1, cfg, seed=0)
    with torch.no_grad():
        q1 = logits_to_probs(draft(torch.tensor([PROMPT])).logits[0, -1], cfg).double()
        p1 = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], cfg).double()
    assert (p1 - q1).abs().sum() / 2 > 0.2, "p and q must differ for these tests to mean anything"
    assert chi2(first, q1) > 10 * CRITICAL


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    """A tiny target whose linear layers run on a Q4_1 GGUF file of its own weights (hidden 32: the 4-bit kernel
    needs blocks of 32), with a draft model and a draft head."""
    from flashspec_core.fast_path import StaticCausalLM
    from tests.flashspec_core.test_draft_head import tiny_head
    from tests.flashspec_core.test_gguf_weights import write_gguf

    target = tiny_llama(V, seed=1, sharpness=0.5, hidden=32)
    gguf = write_gguf(target, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    drafters = [tiny_llama(V, seed=2, sharpness=0.5), "prompt_lookup", tiny_head(target, draft_vocab=V - 1, seed=4)]
    return target, gguf, drafters, StaticCausalLM(target, gguf=gguf)


def gguf_laws(lm, sampling):
    """The GGUF target's own laws of the first and second emitted token, from fresh one-row forwards."""
    def last(seq):
        lm.reset()
        return lm.forward(torch.tensor([seq]))[0, -1]

    p1 = logits_to_probs(last(PROMPT), sampling).double()
    nxt = torch.stack([logits_to_probs(last(PROMPT + [t]), sampling) for t in range(V)]).double()
    return p1, p1 @ nxt


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup", "draft_head"])
def test_emitted_tokens_follow_the_gguf_target(gguf_target, drafter, sampling):
    target, gguf, drafters, lm = gguf_target
    engine = Engine.from_models(target, drafters, kernel_backend="torch", gguf=gguf)  # fresh: no measured costs yet
    assert engine.precision == "gguf"
    cfg = SAMPLINGS[sampling]
    first, second, out = first_two_tokens(engine, drafter, 4, cfg, seed=7)
    p1, p2 = gguf_laws(lm, cfg)
    assert 0 < sum(out.num_accepted) < N * 4, "the test needs both accepts and rejects"
    s1, s2 = chi2(first, p1), chi2(second, p2)
    assert s1 < CRITICAL and s2 < CRITICAL, f"chi2 first={s1:.1f} second={s2:.1f} (critical {CRITICAL})"


M = 4_000  # rounds of one row each: the chain's length then depends on that row's own draws


def test_a_head_that_ends_its_own_chains_keeps_the_target_law(pair, head):
    """On the CPU the head ends a chain after the token past which one more is not worth its price
    (`DraftHeadDrafter._ends`): the decision reads the tokens drawn so far only, so every emitted token still follows
    p. One row a round (in a batch the rows' mean decides), M rounds at temperature 1 with K = 4 and costs under
    which chains of 1, 2 and 3 tokens all occur; the first and second emitted tokens against the exact laws."""
    from flashspec_core.gamma import CostModel

    target, draft = pair
    engine = Engine.from_models(target, [draft, "prompt_lookup", head], kernel_backend="torch")
    drafter, costs, cfg = engine.drafters["draft_head"], CostModel(), SAMPLINGS["t1"]
    for n in range(1, 8):
        costs.observe(n, 0.010 + 0.002 * (n - 1))
    drafter.costs, drafter.step_s = costs, 0.001
    gen, first, second, lengths = torch.Generator().manual_seed(9), [], [], []
    for _ in range(M):
        rows = [list(PROMPT)]
        engine._start(rows, cfg, gen)
        out = engine._round(rows, drafter, 4, cfg, gen)
        lengths.append(len(out.draft))
        emitted = rows[0][len(PROMPT):]
        if len(emitted) == 1:  # one token: the second comes from the next round
            engine._round(rows, drafter, 4, cfg, gen)
        first.append(rows[0][len(PROMPT)])
        second.append(rows[0][len(PROMPT) + 1])
    assert {1, 2, 3} <= set(lengths), f"chain lengths {sorted(set(lengths))}: the costs should vary them"
    p1, p2 = exact_laws(target, cfg)
    s1, s2 = chi2(torch.tensor(first), p1), chi2(torch.tensor(second), p2)
    assert s1 < CRITICAL and s2 < CRITICAL, f"chi2 first={s1:.1f} second={s2:.1f} (critical {CRITICAL})"
