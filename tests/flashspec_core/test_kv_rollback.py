"""After a rejection the caches roll back exactly: the next logits equal a fresh forward on the same ids."""
import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.drafters import Drafter
from flashspec_core.models import CausalLM
from tests.conftest import tiny_llama


class WrongDrafter(Drafter):
    """Proposes k copies of the token the target is least likely to pick: rejected at once under greedy."""
    name = "wrong"

    def __init__(self, device, target, vocab):
        super().__init__(device)
        self.target, self.vocab = target, vocab

    def propose_ids(self, row, k):
        with torch.no_grad():
            worst = int(self.target(torch.tensor([row])).logits[0, -1, :self.vocab].argmin())
        return [worst] * k


def fresh_last_logits(model, ids, vocab):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1, :vocab].float()


def check_rollback(engine, prompt_ids, rounds=4):
    model, V = engine.target.model, engine.target.vocab_size
    rows = [list(prompt_ids)]
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingConfig()
    engine._start(rows, greedy, gen)
    for _ in range(rounds):
        out = engine._round(rows, engine.drafters["wrong"], 4, greedy, gen)
        assert out.num_accepted == [0], "the wrong drafter must be rejected for this test"
        assert engine.target.length == len(rows[0]) - 1  # the cache holds all but the pending token
        cached = engine.target.forward(torch.tensor([rows[0][-1:]]), logits_to_keep=1)[0, -1]
        torch.testing.assert_close(cached, fresh_last_logits(model, rows[0], V), atol=1e-4, rtol=1e-4)
        engine.target.crop(len(rows[0]) - 1)


def test_rollback_tiny_model():
    target = tiny_llama(vocab=50, seed=3)
    engine = Engine.from_models(target, ["prompt_lookup"])
    engine.drafters["wrong"] = WrongDrafter(engine.target.device, target, 50)
    check_rollback(engine, [5, 7, 11, 13, 17, 19])


def test_rollback_embedded_model(embedded_engine):
    engine = Engine.from_models(embedded_engine.target.model, ["prompt_lookup"], tokenizer=embedded_engine.tokenizer)
    engine.drafters["wrong"] = WrongDrafter(engine.target.device, engine.target.model, engine.target.vocab_size)
    check_rollback(engine, engine.encode("The capital of France is"), rounds=3)


def test_causal_lm_crop_then_forward_matches_fresh():
    model = tiny_llama(vocab=40, seed=4)
    lm = CausalLM(model)
    lm.reset()
    ids = torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(1))
    lm.forward(ids[:, :8])
    lm.forward(ids[:, 8:12])  # 4 more, then drop 3 of them
    lm.crop(9)
    assert lm.length == 9
    new = torch.tensor([[3, 4]])
    got = lm.forward(new)[0, -1]
    torch.testing.assert_close(got, fresh_last_logits(model, ids[0, :9].tolist() + [3, 4], 40), atol=1e-5, rtol=1e-5)


def test_draft_model_cache_follows_accepted_prefix():
    """The draft model's cache never holds rejected tokens after observe()."""
    target, draft = tiny_llama(vocab=30, seed=5), tiny_llama(vocab=30, seed=6)
    engine = Engine.from_models(target, [draft])
    rows, gen = [[1, 2, 3, 4]], torch.Generator().manual_seed(0)
    cfg = SamplingConfig(temperature=1.0)
    engine._start(rows, cfg, gen)
    lm = engine.drafters["draft_model"].lm
    for _ in range(6):
        before = len(rows[0])
        out = engine._round(rows, engine.drafters["draft_model"], 4, cfg, gen)
        assert lm.length <= before + out.num_accepted[0]
        nxt = lm.forward(torch.tensor([rows[0][lm.length:]]), logits_to_keep=1)[0, -1]
        torch.testing.assert_close(nxt, fresh_last_logits(draft, rows[0], 30), atol=1e-4, rtol=1e-4)
        lm.crop(len(rows[0]) - 1)
