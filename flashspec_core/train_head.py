"""Train the draft head (`flashspec_core.draft_head`) on one GPU by self-distillation, then ship it.

    python -m flashspec_core.train_head --out assets/draft_head --init assets/draft_head --set total_minutes=21.5

Stages, each resumable from the checkpoint folder `--ckpt`: (1) a corpus of broad prompts and the target's own
answers (`flashspec_core.head_data`, `flashspec_core.prompt_bank`), saved round by round as uint16 shards
`corpus-NNN.safetensors` under 15 MB, finished when `corpus.json` is written; (2) training with "training-time
test": every step unrolls the K draft passes of inference (`DraftHead.ttt_forward`) and matches each pass's
distribution to the target's own next-token distribution (cross-entropy over the draft vocabulary, pass j
weighted decay**j); held-out loss and acceptance are logged as training goes (the curve in `meta.json`); the
trainable weights and their AdamW moments are saved in float32 shards of at most 15 MB (a resumed run, or one
started `--init` from a checkpoint folder, goes on with those moments); a run from trained weights peaks at
TRAINED_LR; (3) export: the EAGLE-3 folder (bfloat16) with a card. `--resume --train-minutes 0` exports a checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from flashspec_core.draft_head import DraftHead, HeadConfig, load_head, save_head
from flashspec_core.head_data import (Corpus, Gen, answer_all, bank_sources, broad_prompts, coverage, draft_vocabulary,
                                     follow_ups, load_sources, save_sources)

ROOT = Path(__file__).resolve().parent.parent
OPEN_PROMPTS = ROOT / "benchmarks" / "open_prompts.json"  # hand-written, never trained on
SHARD_BYTES = 15 * 2 ** 20
TRAINED_LR = 1e-4  # the peak lr of a run from trained weights (--init, --resume) unless --set lr= says otherwise
SHARD_TOKENS = 7 * 2 ** 20  # corpus shards: uint16 ids (vocabularies up to 65,536 tokens), under 15 MB each


@dataclass(frozen=True)
class TrainConfig:
    target: str = "embedded"  # Hub id, folder or "embedded"
    seed: int = 0
    topic_asks_per_domain: int = 12  # topic lists the target writes for each seed domain
    materials: int = 24000  # passages, code snippets and item lists the target writes for the bank's templates
    bank_prompts: int = 120000  # prompts drawn from the bank (before de-duplication)
    self_prompts: int = 16000  # user turns the target writes itself
    follow_ups: int = 12000  # second turns on greedy first answers
    max_new_tokens: int = 256  # per answer
    gen_batch: int = 2048  # rows per generate() call (fewer for long prompts)
    gen_cache: str = "slots"  # how the generating copy decodes (head_data.CACHES): rows refilled from a ring cache
    gen_compile: bool = False  # let generate() compile the static decode step on CUDA (one compile per shape)
    sampled_fraction: float = 0.5  # prompts that also get a sampled answer, at one of sampled_temperatures
    sampled_temperatures: str = "0.7,1"  # comma-separated, drawn with equal odds ("1": every sampled answer at 1)
    round_answers: int = 49152  # answers made in one pass (all temperatures at once), then saved as shards
    draft_vocab: int = 16384  # rows of the head's output layer
    head_intermediate: int = 0  # the head's MLP width (0: the target's); past --init's, the new units start silent
    head_layers: int = 1  # the head's decoder layers; past --init's, the new ones start as the identity
    later_lr: float = 0.0  # peak lr of the later decoder layers (0: lr): a layer grown from a trained head learns from
    # zero, where lr 1e-4 (the trained weights') left its output products ~50x smaller than the trained layer's in 7 min
    ttt_steps: int = 7  # draft passes unrolled per training step
    step_decay: float = 0.8  # loss weight of pass j: decay**j
    tv_weight: float = 0.0  # weight of each pass's chance of rejection at temperature 1, 1 - sum min(p, q), in the loss
    lr: float = 6e-4
    warmup_steps: int = 60
    batch_tokens: int = 16384  # padded tokens per training batch
    max_len: int = 768  # longer sequences are cut
    data_minutes: float = 8.0  # generation budget (prompt making included); the corpus keeps what is done by then
    earlier: str = ""  # corpus folders of earlier runs (comma-separated), joined to this run's for training
    sources: str = ""  # an earlier run's bank_sources.json.gz: draw this run's prompts from its topics and materials
    gen_dtype: str = "auto"  # the generating copy's dtype ("auto": bfloat16 on CUDA); training reads float32 features
    autocast: bool = True  # training and evaluation matmuls in bfloat16 on CUDA (float32 weights and optimizer)
    compile_loss: bool = True  # on CUDA: the loss's passes over the draft vocabulary fused by torch.compile
    train_minutes: float = 12.0
    total_minutes: float = 0.0  # if set, training gets what is left of this budget (from the start) after the data
    eval_every_s: float = 45.0
    profile_steps: int = 0  # if > 0: after 10 warm steps, log where `profile_steps` training steps spend their time
    eval_sequences: int = 192
    weight_average: float = 0.0  # decay a step of an exponential moving average of the weights (0: none), evaluated
    # beside them at the end; the run ends on the average where its held-out loss is lower (`WeightAverage`)

    def __post_init__(self):
        if self.ttt_steps < 1 or self.draft_vocab < 1 or self.batch_tokens < self.max_len:
            raise ValueError(f"need ttt_steps >= 1, draft_vocab >= 1 and batch_tokens >= max_len, got {self}")
        if not 0.0 <= self.weight_average < 1.0:
            raise ValueError(f"weight_average must be in [0, 1), got {self.weight_average}")
        try:
            temperatures = self.temperatures()
        except ValueError:
            temperatures = ()
        if not temperatures or min(temperatures) <= 0:
            raise ValueError(f"sampled_temperatures must list temperatures > 0, got {self.sampled_temperatures!r}")

    def temperatures(self) -> tuple[float, ...]:
        """The sampled answers' temperatures."""
        return tuple(float(t) for t in self.sampled_temperatures.split(",") if t.strip())


# ----------------------------------------------------------------------------------------------------
# Batches and the target's side


def batches(corpus: Corpus, indices: list[int], cfg: TrainConfig, rng: random.Random | None):
    """Lists of sequence indices of similar length, about cfg.batch_tokens padded tokens each (shuffled if rng)."""
    order = sorted(indices, key=lambda i: len(corpus.sequences[i]))
    out, cur = [], []
    for i in order:
        width = min(cfg.max_len, len(corpus.sequences[i]))
        if cur and (len(cur) + 1) * width > cfg.batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    out += [cur] if cur else []
    if rng is not None:
        rng.shuffle(out)
    return out


def pad(corpus: Corpus, idx: list[int], max_len: int, device):
    """ids [B, T] (right-padded with 0) on `device`; lengths [B] and answer starts [B] on the host, so that what
    depends on them (the loss's rows, token counts) never waits for the device."""
    seqs = [corpus.sequences[i][:max_len] for i in idx]
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs]).to(device, non_blocking=True)
    lengths = torch.tensor([len(s) for s in seqs])
    starts = torch.tensor([corpus.starts[i] for i in idx])
    return ids, lengths, starts


@torch.no_grad()
def target_side(model, ids: torch.Tensor, aux_layers, draft_ids: torch.Tensor, temperature: float = 1.0):
    """The target's aux features [B, T, F], its next-token distribution on the draft vocabulary [B, T, Vd]
    (at `temperature`, not renormalised: exp of the draft ids' logits less the whole vocabulary's log-sum-exp, so
    no full-width softmax is written) and its argmax over the whole vocabulary [B, T]."""
    out = model(input_ids=ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1).float()
    return features, *draft_side(out.logits, draft_ids, temperature)


def draft_side(logits: torch.Tensor, draft_ids: torch.Tensor, temperature: float = 1.0):
    """(`target_side`'s distribution on the draft vocabulary, its argmax over the whole vocabulary) from logits."""
    lse = torch.logsumexp(logits.float() / temperature, dim=-1, keepdim=True)
    return (logits[..., draft_ids].float() / temperature - lse).exp(), logits.argmax(dim=-1)


def valid(lengths, starts, T: int, j: int) -> torch.Tensor:
    """[B, T - 1 - j] bool: slot t's pass j predicts token t + 2 + j, which exists and is part of the answer."""
    token = torch.arange(T - 1 - j, device=lengths.device)[None, :] + 2 + j
    return (token < lengths[:, None]) & (token >= starts[:, None])


def answer_rows(lengths, starts, T: int, passes: int, device) -> list[torch.Tensor]:
    """Per pass j (those that fit in T), the flat rows b * T + t of [B * T] whose pass j predicts an answer token
    (`valid`), found on the host and sent to `device` without a sync (the boolean masks they replace each made
    the host wait for the device twice)."""
    out, cuda = [], torch.device(device).type == "cuda"
    for j in range(min(passes, T - 1)):
        b, t = valid(lengths, starts, T, j).nonzero(as_tuple=True)
        rows = b * T + t
        out.append((rows.pin_memory() if cuda else rows).to(device, non_blocking=True))
    return out


# ----------------------------------------------------------------------------------------------------
# Loss and evaluation


class SoftCrossEntropy(torch.autograd.Function):
    """Per row, the cross-entropy -sum_v p_v log softmax(z)_v of z = x @ W^T (W frozen) against a target law p
    given as pw = p @ W and s = sum_v p_v: s * logsumexp(z) - x . pw. Nothing [rows, V] is kept but z (the
    matrix product's own output): no log-probabilities, no products with p; backward recomputes softmax(z).
    With tv > 0, plus tv * (1 - sum_v min(p_v, q_v)), q = softmax(z): one minus the chance that a token drawn from
    q is accepted at temperature 1, read from p's rows `p_all[at]` (p itself, [rows of the batch, V]; no copy
    kept). Its gradient in z is q * (Q - [q < p]), Q the mass of q where q < p.
    The products run in bfloat16 where autocast is on (as `nn.Linear` would), the rest in float32."""

    @staticmethod
    def forward(ctx, x, weight, pw, s, p_all=None, at=None, tv=0.0):
        dt = torch.bfloat16 if torch.is_autocast_enabled(x.device.type) else x.dtype
        w = weight.to(dt)
        z = x.to(dt) @ w.t()  # [N, V]
        lse = LSE(z)
        loss = s * lse - (x.to(pw.dtype) * pw).sum(-1)
        under = None
        if tv > 0:
            accepted, under = TV_PARTS(z, lse, p_all.index_select(0, at))
            loss = loss + tv * (1 - accepted)
        ctx.tv = tv
        ctx.save_for_backward(x, w, z, lse, pw, s, p_all, at, under)
        return loss

    @staticmethod
    def backward(ctx, g):
        x, w, z, lse, pw, s, p_all, at, under = ctx.saved_tensors
        grad_z = SCALED_SOFTMAX(z, lse, g * s)
        if ctx.tv > 0:
            grad_z = grad_z + TV_GRAD(z, lse, p_all.index_select(0, at), under, g * ctx.tv)
        grad_z = grad_z.to(w.dtype)
        grad_x = (grad_z @ w).to(pw.dtype) - g[:, None] * pw
        return grad_x.to(x.dtype), None, None, None, None, None, None


def _wide(z: torch.Tensor) -> torch.Tensor:
    return z.to(torch.promote_types(z.dtype, torch.float32))  # bfloat16 -> float32; float64 stays


def _lse(z: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(_wide(z), dim=-1)


def _scaled_softmax(z: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (_wide(z) - lse[:, None]).exp() * scale[:, None]


def _tv_parts(z: torch.Tensor, lse: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: sum_v min(p, q) and the mass of q where q < p (q = softmax(z), lse its log-sum-exp)."""
    q = (_wide(z) - lse[:, None]).exp()
    below = q < p
    return torch.where(below, q, p).sum(-1), torch.where(below, q, 0.0).sum(-1)


def _tv_grad(z: torch.Tensor, lse: torch.Tensor, p: torch.Tensor, under: torch.Tensor, scale: torch.Tensor):
    """d/dz of scale * (1 - sum_v min(p, q)) per row: scale * q * (under - [q < p])."""
    q = (_wide(z) - lse[:, None]).exp()
    return q * (under[:, None] - (q < p).to(q.dtype)) * scale[:, None]


# torch.compile'd on CUDA by `compile_loss` (one fused pass over [rows, V] each)
LSE, SCALED_SOFTMAX, TV_PARTS, TV_GRAD = _lse, _scaled_softmax, _tv_parts, _tv_grad


def compile_loss(enabled: bool) -> None:
    """Fuse the loss's passes over [rows, V] (log-sum-exp; the scaled softmax of backward; the acceptance term's
    sums and gradient) with torch.compile, shapes dynamic; `False` puts the eager functions back."""
    global LSE, SCALED_SOFTMAX, TV_PARTS, TV_GRAD
    wrap = (lambda f: torch.compile(f, dynamic=True)) if enabled else (lambda f: f)
    LSE, SCALED_SOFTMAX, TV_PARTS, TV_GRAD = wrap(_lse), wrap(_scaled_softmax), wrap(_tv_parts), wrap(_tv_grad)


def soft_targets(head: DraftHead, probs: torch.Tensor, keep: bool = False):
    """The target's laws on the draft vocabulary [B, T, V] as the loss reads them: p @ W [B, T, H] and sum p [B, T],
    in float32 (autocast off: one product a step, and backward subtracts it from softmax(z) @ W); and, if `keep`
    (the acceptance term reads them), the laws themselves, else None."""
    with torch.autocast(probs.device.type, enabled=False):
        return probs.float() @ head.lm_head.weight.float(), probs.sum(-1), probs if keep else None


def pass_loss(head: DraftHead, outs: list[torch.Tensor], target, rows: list[torch.Tensor],
              cfg: TrainConfig) -> torch.Tensor:
    """Weighted cross-entropy of every pass against the target's distribution at the position it predicts, plus
    cfg.tv_weight times its chance of rejection at temperature 1 (`target`: `soft_targets` of the target's laws,
    kept if tv_weight > 0; `rows`: `answer_rows`)."""
    B, T, H = target[0].shape
    pw, s = target[0].reshape(B * T, H), target[1].reshape(B * T)
    p_all = target[2].reshape(B * T, -1) if cfg.tv_weight > 0 else None
    total, weight = 0.0, 0.0
    for j, (h, r) in enumerate(zip(outs, rows)):
        if r.numel() == 0:  # known on the host
            continue
        x = head.norm(h.reshape(B * T, -1).index_select(0, r))  # [N, H]: slot t of row b
        at = r + 1 + j  # position t + 1 + j: the target's law there is of the token pass j predicts
        ce = SoftCrossEntropy.apply(x, head.lm_head.weight, pw.index_select(0, at), s.index_select(0, at),
                                    p_all, at, cfg.tv_weight).mean()
        total = total + cfg.step_decay ** j * ce
        weight += cfg.step_decay ** j
    return total / max(weight, 1e-9)


def step_loss(head: DraftHead, model, batch, cfg: TrainConfig) -> torch.Tensor:
    """A batch's loss: the target's features and laws (`target_side`), then the head's passes (`head_loss`)."""
    features, probs, _ = target_side(model, batch[0], head.cfg.aux_layers, head.draft_ids)
    target = soft_targets(head, probs, keep=cfg.tv_weight > 0)
    del probs
    return head_loss(head, batch, features, target, cfg)


def head_loss(head: DraftHead, batch, features: torch.Tensor, target, cfg: TrainConfig) -> torch.Tensor:
    """`pass_loss` of the head's cfg.ttt_steps passes over a batch (ids, lengths, starts), given the target's features
    and its laws as `soft_targets` gives them."""
    ids, lengths, starts = batch
    rows = answer_rows(lengths, starts, ids.shape[1], cfg.ttt_steps, ids.device)
    return pass_loss(head, head.ttt_forward(features, ids, cfg.ttt_steps), target, rows, cfg)


def agreement(head: DraftHead, logits: torch.Tensor, p: torch.Tensor, top: torch.Tensor, tau: float = 1.0):
    """One draft pass against the target at the positions it predicts: hit (the head's argmax over the draft
    vocabulary is the target's argmax `top`) and alpha = sum_v min(p, q), its chance of acceptance when sampling
    (p: the target's distribution on the draft vocabulary, q = softmax(logits / tau), tau the temperature drafted
    at: the target's times the head's draft temperature)."""
    return head.draft_ids[logits.argmax(-1)] == top, torch.minimum(p, (logits.float() / tau).softmax(-1)).sum(-1)


DRAFT_TEMPERATURES = (0.7, 0.8, 0.9, 1.0)  # drafting at temperature 1 from softmax(logits / tau): evaluated for each


@torch.no_grad()
def evaluate(head: DraftHead, model, corpus: Corpus, cfg: TrainConfig, device) -> dict:
    """Held-out loss, top-1 agreement per pass, and the chain's expected tokens per target forward at
    K = ttt_steps: greedy answers (exact: a chain is accepted while it equals the target's argmax) and
    temperature-1 answers (expected: sum over k of the product of sum_v min(p, q) of the first k passes), the
    latter for each draft temperature of DRAFT_TEMPERATURES too."""
    K, losses, greedy_tpf = cfg.ttt_steps, [], []
    by_tau = {tau: [] for tau in DRAFT_TEMPERATURES}  # sampled answers' expected tokens per forward
    agree, counted = torch.zeros(K), torch.zeros(K)
    held = corpus.split(heldout=True)
    spread = held[:: max(1, len(held) // max(1, cfg.eval_sequences))][: cfg.eval_sequences]  # greedy and sampled alike
    for idx in batches(corpus, spread, cfg, None):
        ids, lengths, starts = pad(corpus, idx, cfg.max_len, device)
        features, probs, top = target_side(model, ids, head.cfg.aux_layers, head.draft_ids)
        outs = head.ttt_forward(features, ids, K)
        rows = answer_rows(lengths, starts, ids.shape[1], K, device)
        losses.append(float(pass_loss(head, outs, soft_targets(head, probs, keep=True), rows, cfg)))
        W = ids.shape[1] - K  # slots whose K passes fit
        if W <= 0:
            continue
        slots = valid(lengths, starts, ids.shape[1], K - 1)[:, :W].to(device)  # ... and all predict answer tokens
        sampled = slots & ~torch.tensor([corpus.greedy[i] for i in idx], device=device)[:, None]
        hits, alphas = [], {tau: [] for tau in by_tau}
        for j, h in enumerate(outs):
            logits, p, t = head.logits(h[:, :W]), probs[:, 1 + j:1 + j + W], top[:, 1 + j:1 + j + W]
            for tau in by_tau:
                hit, alpha = agreement(head, logits, p, t, tau)
                alphas[tau].append(alpha)
            agree[j] += float(hit[slots].sum())
            counted[j] += float(slots.sum())
            hits.append(hit)
        run = 1 + torch.stack(hits, -1).long().cumprod(-1).sum(-1).float()  # greedy: exact accepted chain
        greedy_tpf += run[slots & ~sampled].tolist()
        for tau, a in alphas.items():  # temperature 1: expected
            by_tau[tau] += (1 + torch.stack(a, -1).cumprod(-1).sum(-1))[sampled].tolist()
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"loss": mean(losses), "greedy_tokens_per_forward": mean(greedy_tpf),
            "t1_tokens_per_forward": mean(by_tau[1.0]), "K": K,
            "t1_by_draft_temperature": {str(tau): round(mean(v), 4) for tau, v in by_tau.items()},
            "top1_per_pass": [round(x, 4) for x in (agree / counted.clamp(min=1)).tolist()]}


# ----------------------------------------------------------------------------------------------------
# Training


def autocast(cfg: TrainConfig, device):
    """bfloat16 autocast on CUDA when cfg.autocast (weights, optimizer and softmaxes stay float32)."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=cfg.autocast and kind == "cuda")


def evaluate_in(cfg: TrainConfig, device, head, model, corpus) -> dict:
    with autocast(cfg, device):
        return evaluate(head, model, corpus, cfg, device)


def lr_at(step: int, fraction: float, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then a cosine over the time budget down to 10%."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, fraction))))


def set_lr(opt: torch.optim.Optimizer, step: int, fraction: float, cfg: TrainConfig) -> None:
    """`lr_at` for each of opt's groups, scaled to its own peak ("peak": lr, or later_lr for the later layers)."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, fraction, cfg) * g.get("peak", cfg.lr) / cfg.lr


def train_step(head: DraftHead, model, batch, cfg: TrainConfig, opt, params) -> torch.Tensor:
    with autocast(cfg, next(model.parameters()).device):
        loss = step_loss(head, model, batch, cfg)
    optimizer_step(loss, opt, params)
    return loss.detach()  # read when the curve is logged, not every step (a read waits for the device)


def optimizer_step(loss: torch.Tensor, opt, params) -> None:
    """Backward, the gradients clipped to norm 1, one step of `opt`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


class StepProfile:
    """torch.profiler around training steps [FIRST, FIRST + steps), then one log line per row of the twelve ops
    that took the most device time (CPU time without a GPU): where a training step goes, on the machine itself."""
    FIRST = 10

    def __init__(self, steps: int, log):
        self.steps, self.log, self.prof = steps, log, None

    def before(self, step: int) -> None:
        if self.steps > 0 and step == self.FIRST:
            acts = [torch.profiler.ProfilerActivity.CPU]
            acts += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()

    def after(self, step: int) -> None:
        if self.prof is None or step < self.FIRST + self.steps - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.stop()
        key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        for line in self.prof.key_averages().table(sort_by=key, row_limit=12).splitlines():
            self.log(f"profile: {line}")
        self.prof = None


def optimizer(head: DraftHead, cfg: TrainConfig, folder: Path | None = None) -> torch.optim.AdamW:
    """AdamW over the head's trainable weights; with the moments a checkpoint in `folder` saved (`opt-NN` shards),
    if it has them."""
    params = dict((n, p) for n, p in head.named_parameters() if p.requires_grad)
    later = {n for n in params if n.startswith("later_layers.")}
    later_peak = cfg.later_lr if cfg.later_lr > 0 else cfg.lr
    groups = [{"params": [p for n, p in params.items() if n not in later], "peak": cfg.lr},
              {"params": [p for n, p in params.items() if n in later], "peak": later_peak}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = load_shards(folder, "opt") if folder is not None else {}
    for name, p in params.items():
        if f"{name}.exp_avg" in state and state[f"{name}.exp_avg"].shape == p.shape:  # a widened MLP starts fresh
            opt.state[p] = {"step": state["step"].clone(), "exp_avg": state[f"{name}.exp_avg"].to(p.device),
                            "exp_avg_sq": state[f"{name}.exp_avg_sq"].to(p.device)}
    return opt


def has_moments(opt: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds moments (a checkpoint's, or its own after a step)."""
    return bool(opt.state)


class WeightAverage:
    """An exponential moving average of the head's weights over the training steps (Polyak averaging, torch's
    `AveragedModel`), for cfg.weight_average > 0: the run's last evaluation reads it too (the point's "average") and
    puts it in the head where its held-out loss is the lower."""

    def __init__(self, head: DraftHead, decay: float):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.head = head
        self.model = AveragedModel(head, multi_avg_fn=get_ema_multi_avg_fn(decay))

    def update(self) -> None:
        self.model.update_parameters(self.head)

    def evaluate(self, cfg: TrainConfig, device, model, corpus) -> dict:
        return evaluate_in(cfg, device, self.model.module, model, corpus)

    def keep_if_better(self, point: dict) -> bool:
        """Put the average in the head where its held-out loss (point["average"]) is below the weights' own."""
        better = point["average"]["loss"] < point["loss"]
        if better:
            with torch.no_grad():
                for p, a in zip(self.head.parameters(), self.model.module.parameters()):
                    if p.requires_grad:  # the frozen rows (the target's embedding) stay untouched
                        p.copy_(a)
        point["kept_average"] = better
        return better


def train(head: DraftHead, model, corpus: Corpus, cfg: TrainConfig, opt, log=print, curve=None,
          on_eval=None) -> list[dict]:
    """Train with `opt` (`optimizer`) until cfg.train_minutes pass; evaluate every cfg.eval_every_s (then call
    on_eval(curve), e.g. to save a checkpoint); returns the curve (appended to). With cfg.weight_average, the
    weights' moving average is evaluated beside them at the end and the run ends on it where it is better
    (`WeightAverage`)."""
    curve = [] if curve is None else curve
    rng = random.Random(cfg.seed + len(curve))
    params = [p for group in opt.param_groups for p in group["params"]]
    device = next(model.parameters()).device
    budget, t0, step = cfg.train_minutes * 60, time.monotonic(), 0
    tokens = curve[-1]["tokens_seen"] if curve else 0
    base_step = curve[-1]["step"] if curve else 0
    next_eval, losses, profile = 0.0, [], StepProfile(cfg.profile_steps, log)
    average = WeightAverage(head, cfg.weight_average) if cfg.weight_average else None
    compile_loss(cfg.compile_loss and torch.device(device).type == "cuda")
    while True:  # epochs until the budget's last evaluation returns (an epoch may end past the budget)
        epoch = batches(corpus, corpus.split(heldout=False), cfg, rng)
        if not epoch:
            raise ValueError("the corpus has no training sequences")
        for idx in epoch:
            elapsed = time.monotonic() - t0
            if elapsed >= next_eval or elapsed >= budget:
                point = {"step": base_step + step, "seconds": round(elapsed, 1), "tokens_seen": tokens,
                         "train_loss": float(torch.stack(losses).mean()) if losses else None,
                         **evaluate_in(cfg, device, head, model, corpus)}
                if average is not None and elapsed >= budget:  # one evaluation more, at the end only
                    point["average"] = average.evaluate(cfg, device, model, corpus)
                    average.keep_if_better(point)
                curve.append(point)
                log(json.dumps(point))
                if on_eval is not None:
                    on_eval(curve)
                losses, next_eval = [], elapsed + cfg.eval_every_s
                if elapsed >= budget:
                    return curve
            batch = pad(corpus, idx, cfg.max_len, device)
            set_lr(opt, step, elapsed / budget, cfg)
            profile.before(step)
            losses.append(train_step(head, model, batch, cfg, opt, params))
            if average is not None:
                average.update()
            profile.after(step)
            tokens += int(batch[1].sum())
            step += 1


# ----------------------------------------------------------------------------------------------------
# Checkpoints (trainable weights in float32 shards, the corpus, the curve) and export


def save_checkpoint(head: DraftHead, folder: Path, meta: dict, opt: torch.optim.Optimizer | None = None) -> None:
    """The head's trainable weights (`head-NN` shards) and, given `opt`, its AdamW moments (`opt-NN`), float32, each
    shard under SHARD_BYTES (files that come back from a GPU machine one by one), and meta.json."""
    folder.mkdir(parents=True, exist_ok=True)
    save_shards({n: t for n, t in head.state_dict().items() if n != "lm_head.weight"}, folder, "head")
    if opt is not None and has_moments(opt):
        names = {p: n for n, p in head.named_parameters()}
        state = {"step": next(iter(opt.state.values()))["step"]}
        for p, st in opt.state.items():
            state.update({f"{names[p]}.exp_avg": st["exp_avg"], f"{names[p]}.exp_avg_sq": st["exp_avg_sq"]})
        save_shards(state, folder, "opt")
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def save_shards(state: dict[str, torch.Tensor], folder: Path, prefix: str) -> None:
    from safetensors.torch import save_file

    state = {n: t.detach().float().cpu().contiguous() for n, t in state.items()}
    shards, cur, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = t, size + nbytes
    shards.append(cur)
    for old in folder.glob(f"{prefix}-*.safetensors"):
        old.unlink()
    for i, shard in enumerate(shards):
        save_file(shard, str(folder / f"{prefix}-{i:02d}.safetensors"))


def load_shards(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(Path(folder).glob(f"{prefix}-*.safetensors")):
        state.update(load_file(str(shard)))
    return state


def load_checkpoint(folder: Path, model) -> tuple[DraftHead, dict]:
    meta = json.loads((folder / "meta.json").read_text())
    cfg = HeadConfig(**{**meta["head"], "aux_layers": tuple(meta["head"]["aux_layers"])})
    head = DraftHead(cfg, model.get_input_embeddings().weight)
    state = load_shards(folder, "head")
    head.set_draft_vocab(state["d2t"] + torch.arange(state["d2t"].numel()))
    head.load_state_dict(state, strict=False)
    return head.to(next(model.parameters()).device), meta


def save_corpus(corpus: Corpus, folder: Path, name: str = "corpus") -> list[Path]:
    """Write the corpus as `{name}-NNN.safetensors` shards of whole sequences, ids as uint16, each under 15 MB."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    while first < len(corpus):
        last, tokens = first, 0
        while last < len(corpus) and (last == first or tokens + len(corpus.sequences[last]) <= SHARD_TOKENS):
            tokens += len(corpus.sequences[last])
            last += 1
        part = Corpus(*(x[first:last] for x in (corpus.sequences, corpus.starts, corpus.heldout, corpus.greedy)))
        t = {k: v.numpy() for k, v in part.tensors().items()}
        if t["tokens"].size and (t["tokens"].min() < 0 or t["tokens"].max() > 65535):
            raise ValueError("corpus ids must fit in uint16 (vocabularies up to 65,536 tokens)")
        t["tokens"] = t["tokens"].astype(np.uint16)
        paths.append(folder / f"{name}-{len(list(folder.glob(name + '-*.safetensors'))):03d}.safetensors")
        save_file(t, str(paths[-1]))
        first = last
    return paths


def load_corpus(folder: Path, name: str = "corpus") -> Corpus:
    """Every `{name}-NNN.safetensors` shard in `folder`, in order, as one corpus."""
    from safetensors.numpy import load_file

    parts = []
    for path in sorted(folder.glob(f"{name}-*.safetensors")):
        t = {k: torch.from_numpy(v.astype("int32") if k == "tokens" else v) for k, v in load_file(str(path)).items()}
        parts.append(Corpus.from_tensors(t))
    return merge(parts)


def export(head: DraftHead, meta: dict, out: Path) -> Path:
    """The shipped folder: EAGLE-3 config and bfloat16 weights (lm_head left out: `save_head`), and the card. The head
    drafts at the draft temperature that did best at temperature 1 in the last held-out evaluation
    (`fitted_temperature`)."""
    card = {"what": "EAGLE-3 style draft head for " + meta["target"], **{k: meta[k] for k in (
        "recipe", "sizes", "data", "init", "seconds", "train", "steps", "seed", "hardware", "heldout", "curve", "versions")
        if k in meta}}
    head.cfg = replace(head.cfg, draft_temperature=fitted_temperature(meta.get("heldout"), head.cfg.draft_temperature))
    return save_head(head, out, card)


def fitted_temperature(point: dict | None, default: float) -> float:
    """The draft temperature of `DRAFT_TEMPERATURES` with the most expected tokens per forward at temperature 1 in
    an evaluation `point` (`evaluate`'s), or `default` where it has none."""
    grid = (point or {}).get("t1_by_draft_temperature") or {}
    scored = {float(t): v for t, v in grid.items() if v == v}  # NaN: no sampled answers held out
    return max(scored, key=scored.get) if scored else default


# ----------------------------------------------------------------------------------------------------
# The command


def make_corpus(gen: Gen, cfg: TrainConfig, folder: Path, log=print) -> Corpus:
    """The bank's prompts, then rounds of answers (greedy for all, a share sampled) and follow-ups, each round
    saved as shards in `folder`, until the data budget runs out: whatever the speed, the corpus keeps its mix."""
    rng = random.Random(cfg.seed)
    t0 = time.monotonic()
    deadline = t0 + cfg.data_minutes * 60
    sizes = {k: getattr(cfg, k) for k in ("topic_asks_per_domain", "materials", "bank_prompts", "self_prompts")}
    if cfg.sources:  # another seed draws other prompts from the same topics and materials
        sources = load_sources(Path(cfg.sources))
    else:
        sources = bank_sources(gen, sizes, rng, log)
        save_sources(sources, folder / "bank_sources.json.gz")
    prompts = broad_prompts(gen, sources, sizes, rng, banned_texts())
    held = [{"kind": p.kind, "prompt": p.text} for p in prompts if p.heldout]
    rng.shuffle(held)
    (folder / "heldout_prompts.json").write_text(json.dumps(held[:400], indent=1))
    log(f"{len(prompts)} prompts ({len(held)} held out), {gen.tokens} tokens in {time.monotonic() - t0:.0f} s")
    temperatures = cfg.temperatures()
    jobs = [(p, 0.0) for p in prompts] + [(p, rng.choice(temperatures)) for p in prompts
                                          if rng.random() < cfg.sampled_fraction]
    rng.shuffle(jobs)
    share = cfg.follow_ups / max(1, len(jobs))
    parts, made, t_answers, at = [], gen.tokens, time.monotonic(), 0
    while at < len(jobs) and time.monotonic() < deadline:
        n = round_size(cfg.round_answers, at, time.monotonic() - t_answers, deadline - time.monotonic())
        part, firsts = answer_all(gen, jobs[at:at + n], cfg.max_new_tokens)
        part = merge([part, follow_ups(gen, firsts, round(share * n), cfg.max_new_tokens, rng)])
        save_corpus(part, folder)
        parts.append(part)
        at += n
        answers = sum(len(s) - b for p in parts for s, b in zip(p.sequences, p.starts))
        spent = time.monotonic() - t0
        log(f"round {len(parts) - 1}: {sum(map(len, parts))} answers, {answers} answer tokens in {spent:.0f} s "
            f"({(gen.tokens - made) / (time.monotonic() - t_answers):.0f} new tokens/s answering); {gen.where_time_went()}")
    return merge(parts)


def round_size(most: int, done: int, spent: float, left: float) -> int:
    """Jobs for the next round of answers: `most`, or what the rate so far (done jobs in spent seconds) answers in
    the seconds left of the data budget, so the last round ends near the deadline instead of a round past it. The
    first round, at no known rate, takes a quarter of `most`."""
    if done == 0:
        return max(1, most // 4)
    return max(1, min(most, int(done / max(spent, 1e-9) * left)))


def banned_texts() -> list[str]:
    """Prompts that the data must never resemble: the app's examples and the hand-written evaluation set."""
    examples = [e["prompt"] for e in json.loads((ROOT / "assets" / "examples.json").read_text())]
    return examples + [e["prompt"] for e in json.loads(OPEN_PROMPTS.read_text())]


def merge(corpora: list[Corpus]) -> Corpus:
    out = Corpus([], [], [], [])
    for c in corpora:
        out.sequences += c.sequences
        out.starts += c.starts
        out.heldout += c.heldout
        out.greedy += c.greedy
    return out


def describe(corpus: Corpus, head: DraftHead, cfg: TrainConfig) -> dict:
    answer = lambda i: len(corpus.sequences[i]) - corpus.starts[i]  # noqa: E731
    train, held = corpus.split(False), corpus.split(True)
    return {"train_sequences": len(train), "train_answer_tokens": sum(map(answer, train)),
            "heldout_sequences": len(held), "heldout_answer_tokens": sum(map(answer, held)),
            "greedy_answers": sum(corpus.greedy), "sampled_answers": len(corpus) - sum(corpus.greedy),
            "draft_vocab": head.cfg.draft_vocab_size, "heldout_coverage": round(coverage(corpus, head.draft_ids.cpu()), 4),
            "trainable_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad)}


def new_head(model, corpus: Corpus, cfg: TrainConfig, eos_ids) -> DraftHead:
    head_cfg = HeadConfig.for_target(model.config, min(cfg.draft_vocab, model.config.vocab_size))
    if cfg.head_intermediate:
        head_cfg = replace(head_cfg, intermediate_size=cfg.head_intermediate)
    head_cfg = replace(head_cfg, num_layers=cfg.head_layers)
    head = DraftHead(head_cfg, model.get_input_embeddings().weight).to(next(model.parameters()).device)
    head.set_draft_vocab(draft_vocabulary(corpus, head_cfg.draft_vocab_size, head_cfg.vocab_size, eos_ids))
    return head


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashspec_core.train_head", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/draft_head", help="the shipped EAGLE-3 folder ('' = no export)")
    ap.add_argument("--ckpt", default="runs/draft_head", help="checkpoint folder: corpus, weights, curve")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint's weights")
    ap.add_argument("--train-minutes", type=float, help="override TrainConfig.train_minutes (0 = export only)")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override any TrainConfig field")
    ap.add_argument("--init", help="start from this head's weights (any draft vocabulary): a shipped folder, e.g. "
                    "assets/draft_head, or a checkpoint folder (then with its AdamW moments, if saved)")
    args = ap.parse_args(argv)
    fields = {f: type(v) for f, v in asdict(TrainConfig()).items()}
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in fields:
            ap.error(f"unknown field {name!r}; expected one of {sorted(fields)}")
        overrides[name] = fields[name](value)
    if args.train_minutes is not None:
        overrides["train_minutes"] = args.train_minutes
    if (args.init or args.resume) and "lr" not in overrides:  # (see benchmarks/warm_restart.py)
        overrides["lr"] = TRAINED_LR
    return args, TrainConfig(**overrides)


def corpus_for(cfg: TrainConfig, model, tokenizer, ckpt: Path, log=print) -> Corpus:
    """The checkpoint's corpus, or a new one made by a generating copy of the target (bfloat16 on CUDA)."""
    import copy

    from flashspec_core.grouped_attention import use_grouped_attention
    from flashspec_core.models import pick_dtype

    if (ckpt / "corpus.json").exists():
        return load_corpus(ckpt)
    if cfg.train_minutes <= 0 and (ckpt / "meta.json").exists():  # export only: never make a corpus for it
        raise FileNotFoundError(f"{ckpt / 'corpus.json'} is missing: copy the run's corpus.json into the checkpoint")
    for old in ckpt.glob("corpus-*.safetensors"):  # an unfinished corpus is made again
        old.unlink()
    t0 = time.monotonic()
    gen_model = copy.deepcopy(model).to(pick_dtype(cfg.gen_dtype, model.device))
    gen_model.generation_config.disable_compile = not cfg.gen_compile
    if cfg.gen_cache != "continuous":  # continuous batching brings its own paged attention
        use_grouped_attention(gen_model)  # each cached key/value read once per decode step, not once per query head
    gen = Gen(gen_model, tokenizer, cfg.gen_batch, cfg.gen_cache, cfg.max_new_tokens)
    corpus = make_corpus(gen, cfg, ckpt, log)
    spent = time.monotonic() - t0
    (ckpt / "corpus.json").write_text(json.dumps({"answers": len(corpus), "new_tokens": gen.tokens, "seconds": round(spent, 1),
                                                  "new_tokens_per_s": round(gen.tokens / spent)}, indent=1))
    del gen, gen_model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return corpus


def earlier_corpora(cfg: TrainConfig, resume: bool, log=print) -> list[Corpus]:
    """The corpora of earlier runs (`cfg.earlier`), each a folder of shards: data made in other sessions trains
    with this run's (its held-out flags kept). A folder that is not here stops training; an export-only call
    (which reads no corpus) goes on without it."""
    out = []
    for folder in filter(None, (f.strip() for f in cfg.earlier.split(","))):
        shards = sorted(Path(folder).glob("corpus-*.safetensors"))
        if not shards:
            if resume and cfg.train_minutes <= 0:
                continue
            raise FileNotFoundError(f"no corpus shards in {folder!r} (earlier={cfg.earlier!r})")
        out.append(load_corpus(Path(folder)))
        log(f"earlier corpus {folder}: {len(out[-1])} sequences from {len(shards)} shards")
    return out


def start_head(args, cfg: TrainConfig, model, corpus: Corpus, ckpt: Path, eos) -> tuple[DraftHead, dict]:
    """The head to train: resumed from the checkpoint, or new (its trainable weights from `--init` if given)."""
    if args.resume:
        head, meta = load_checkpoint(ckpt, model)
        if cfg.train_minutes > 0:  # an export-only call keeps the training run's settings
            meta["train"] = asdict(cfg)
        return head, meta
    head = new_head(model, corpus, cfg, eos)
    if args.init:
        init = Path(args.init)
        shipped = load_checkpoint(init, model)[0] if (init / "meta.json").exists() else \
            load_head(init, model.config, model.get_input_embeddings().weight, head.d2t.device)
        keep = {n: t for n, t in shipped.state_dict().items() if n not in ("lm_head.weight", "d2t", "t2d")}
        head.load_state_dict(widened(keep, head.state_dict()), strict=False)
    return head, {"target": cfg.target, "train": asdict(cfg), "curve": [], "seconds": {}, "init": args.init}


def widened(state: dict, into: dict) -> dict:
    """`state` (a trained head's weights) fitted to a head whose MLP is as wide or wider (`into`, its fresh weights):
    the trained units keep their weights, the new gate/up rows keep their fresh ones and the new down columns are
    zero, so the wider head computes what the trained one did and its new units start silent."""
    out = {}
    for name, t in state.items():
        fresh = into[name]
        if t.shape == fresh.shape:
            out[name] = t
        elif name.endswith(("gate_proj.weight", "up_proj.weight")) and t.shape[1:] == fresh.shape[1:] \
                and t.shape[0] < fresh.shape[0]:
            out[name] = torch.cat([t.to(fresh.dtype), fresh[t.shape[0]:]])
        elif name.endswith("down_proj.weight") and t.shape[0] == fresh.shape[0] and t.shape[1] < fresh.shape[1]:
            out[name] = torch.cat([t.to(fresh.dtype), fresh.new_zeros(fresh.shape[0], fresh.shape[1] - t.shape[1])], 1)
        else:
            raise ValueError(f"--init's {name} {tuple(t.shape)} does not fit this head's {tuple(fresh.shape)}")
    return out


def moments_from(args, ckpt: Path) -> Path | None:
    """The checkpoint folder whose AdamW moments training goes on with: the one resumed, or an --init checkpoint."""
    if args.resume:
        return ckpt
    return Path(args.init) if args.init and (Path(args.init) / "meta.json").exists() else None


def main(argv=None) -> int:
    from flashspec_core.models import load_model, pick_device

    start = time.monotonic()
    args, cfg = parse_args(argv)
    ckpt = Path(args.ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    device = pick_device("auto")
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.target, device, torch.float32)  # also converts the embedded model once
    t0 = time.monotonic()
    corpus = merge([corpus_for(cfg, model, tokenizer, ckpt), *earlier_corpora(cfg, args.resume)])
    data_s = time.monotonic() - t0
    if cfg.total_minutes > 0:  # the data took what it took; training fills the rest of the budget
        cfg = replace(cfg, train_minutes=max(0.5, cfg.total_minutes - (time.monotonic() - start) / 60))
    eos = [e for e in [tokenizer.eos_token_id] if e is not None]
    head, meta = start_head(args, cfg, model, corpus, ckpt, eos)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # training only (TF32 matmuls)
    t1 = time.monotonic()
    spent = dict(meta["seconds"])

    def checkpoint(curve):
        meta.update(head={**asdict(head.cfg), "aux_layers": list(head.cfg.aux_layers)}, seed=cfg.seed,
                    sizes=sizes, steps=curve[-1]["step"] if curve else 0, heldout=curve[-1] if curve else None,
                    curve=curve, recipe=RECIPE, data=json.loads((ckpt / "corpus.json").read_text()))
        if cfg.train_minutes > 0:  # what ran here (an export-only call keeps the training machine's record)
            meta["seconds"] = {"data": round(data_s + spent.get("data", 0), 1),
                               "train": round(time.monotonic() - t1 + spent.get("train", 0), 1)}
            meta.update(hardware=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        versions={"torch": torch.__version__, "transformers": __import__("transformers").__version__})
        save_checkpoint(head, ckpt, meta, opt)

    # an export-only call describes the corpus it was trained on, which need not all be here (shards left behind)
    sizes = meta["sizes"] if args.resume and cfg.train_minutes <= 0 and "sizes" in meta else describe(corpus, head, cfg)
    # an export-only call needs no moments (a checkpoint brought back without its opt shards exports too)
    opt = optimizer(head, cfg, moments_from(args, ckpt) if cfg.train_minutes > 0 else None)
    if cfg.train_minutes > 0:
        train(head, model, corpus, cfg, opt, curve=meta["curve"], on_eval=checkpoint)
    checkpoint(meta["curve"])
    if args.out:  # the head keeps the vocabulary it was trained with (most frequent first, from new_head)
        export(head, meta, Path(args.out))
        if (ckpt / "heldout_prompts.json").exists():  # prompts the head never saw, for benchmarks.head
            (Path(args.out) / "heldout_prompts.json").write_text((ckpt / "heldout_prompts.json").read_text())
    print(json.dumps({k: meta[k] for k in ("sizes", "steps", "heldout", "seconds")}, indent=1))
    return 0


RECIPE = ("Self-distillation, no data set: the target lists topics of ~100 seed domains and writes passages, code "
          "and item lists about them (temperature 0.8); 48 kinds of request (stories, poems, explanations for several "
          "audiences, letters and emails, recipes, how-tos, advice, comparisons, lists, plans, dialogues, definitions, "
          "trivia, opinions, summaries, questions and rewrites of passages, code written / explained / fixed / "
          "converted, JSON and tables, arithmetic and word problems, ...) are crossed with those topics, audiences, "
          "tones and lengths, plus user turns the target writes itself; prompts resembling assets/examples.json or "
          "benchmarks/open_prompts.json are dropped; every prompt gets the target's greedy answer, a share of them "
          "(train.sampled_fraction) a sampled one (at train.sampled_temperatures), and a share of first answers a "
          "follow-up turn; whole kinds and a share of topics are held out. Loss: training-time test over K draft "
          "passes, cross-entropy against the target's temperature-1 distribution restricted to the draft vocabulary "
          "(the most frequent answer tokens), pass j weighted decay**j; AdamW, warm-up, cosine; bfloat16 autocast on "
          "CUDA.")


if __name__ == "__main__":
    raise SystemExit(main())
