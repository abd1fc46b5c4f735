"""The draft head on prompts it never trained on: the hand-written `benchmarks/open_prompts.json` (the way people
type into a demo; never generated, never trained on) and the generator's held-out split (whole kinds and topics
kept out of training), per kind of request.

    python -m benchmarks.head [--head assets/draft_head ...] [--sets open,heldout] [--heldout 40] [--online-k 4,6,8]

For each prompt, own plain decoding gives the target's greedy answer and a sampled answer at --temperature (1 by
default; same seed).
Teacher-forced along them, the head's K draft passes from every answer position give the first pass's top-1
agreement with the target, the greedy chain's tokens per target forward at K = 4, 6, 8 (exact: a chain is
accepted while it equals the target's argmax) and the expected tokens per forward when sampling (sum over k
of the product of sum_v min(p, q) of the first k passes, along the sampled answer; q at the head's draft
temperature, or at each of --draft-temperatures). Online, the engine drafts with the head alone at each K of
--online-k (greedy, cold; with --online-sampled at --temperature instead): tokens per forward and tok/s against
own plain (on the CPU the head ends a chain early where one more token does not pay: `--fixed-chains` keeps K).
`--precision gguf` runs the target on the file's 4-bit weights throughout (the answers, the features and argmax
the head is scored on, the online runs), the head beside it as the engine runs it there (Q8_0 products).
Several --head folders are compared on the same answers. Writes JSON under benchmarks/results/ and prints a
table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from statistics import mean

import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.draft_head import load_head
from flashspec_core.engine import HEADS, head_for
from flashspec_core.models import embedded_gguf, load_model, pick_device, pick_dtype
from flashspec_core.train_head import agreement, draft_side, target_side

from benchmarks.run import GREEDY, RESULTS, ROOT, environment, run_engine, shown_path

KS = (4, 6, 8)


def sampled_key(temperature: float) -> str:
    """The sampled columns' name: tf_t1_k6 at temperature 1, tf_t0.7_k6 at 0.7."""
    return f"tf_t{temperature:g}"


def load_prompts(name: str, head_folder: Path, n: int | None) -> list[dict]:
    """[{"kind", "prompt"}] of a set: "open" (hand-written) or "heldout" (the head's generator's held-out split)."""
    path = ROOT / "benchmarks" / "open_prompts.json" if name == "open" else head_folder / "heldout_prompts.json"
    rows = [r if isinstance(r, dict) else {"kind": "heldout", "prompt": r} for r in json.loads(path.read_text())]
    return rows[:n] if n else rows


def static_side(target):
    """`target_side` on a `StaticCausalLM` (the GGUF path's target): its aux features and its logits over ids."""
    @torch.inference_mode()
    def side(ids, aux_layers, draft_ids, temperature=1.0):
        target.aux_layers = tuple(aux_layers)
        target.reset()
        logits = target.forward(ids, logits_to_keep=0)
        features = target.aux.float()
        target.reset()
        return features, *draft_side(logits, draft_ids, temperature)
    return side


@torch.no_grad()
def teacher_forced(side, head, prompt_ids: list[int], answer: list[int], K: int,
                   temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Per answer slot: hits [S, K] (pass j's argmax equals the target's) and alphas [S, K] (sum_v min(p, q), p at
    `temperature`, q at it times the head's draft temperature). side: `target_side` of a model, or `static_side`."""
    ids = torch.tensor([prompt_ids + answer], device=head.d2t.device)
    features, probs, top = side(ids, head.cfg.aux_layers, head.draft_ids, temperature)
    outs = head.ttt_forward(features.to(head.fc.weight.dtype), ids, K)
    start, L = len(prompt_ids), ids.shape[1]
    slots = torch.arange(max(0, start - 1), max(0, L - 1 - K), device=ids.device)  # first draft after the bonus token
    hits, alphas, moments = [], [], torch.zeros(5, dtype=torch.float64)
    for j, h in enumerate(outs):
        logits = head.logits(h[0, slots]).float()
        tau = temperature * head.cfg.draft_temperature
        hit, alpha = agreement(head, logits, probs[0, slots + 1 + j], top[0, slots + 1 + j], tau)
        hits.append(hit)
        alphas.append(alpha)
        moments += acceptance_moments(probs[0, slots + 1 + j], (logits / tau).softmax(-1))
    return {"hits": torch.stack(hits, -1).float(), "alphas": torch.stack(alphas, -1), "moments": moments}


def acceptance_moments(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Sums over rows and over tokens x drawn from q (weights q(x)) of 1, q(x), q(x)^2, a(x) and q(x) a(x), where
    a(x) = min(1, p(x) / q(x)) is the chance that a drawn x is accepted: the moments of the least-squares line
    a ~ c0 + c1 q(x) (`acceptance_fit`), the head's own probability of a draw read as its chance of acceptance."""
    a = torch.where(q > 0, (p / q.clamp(min=1e-30)).clamp(max=1.0), torch.zeros_like(q)).double()
    q = q.double()
    return torch.stack([q.sum(), (q * q).sum(), (q ** 3).sum(), (q * a).sum(), (q * q * a).sum()]).cpu()


def acceptance_fit(m) -> tuple[float, float]:
    """(c0, c1) of a ~ c0 + c1 q(x) from `acceptance_moments` (summed over any rows)."""
    w, x, xx, y, xy = (float(v) for v in m)
    if w <= 0:  # no draws to fit (answers shorter than the chains)
        return float("nan"), float("nan")
    c1 = (xy * w - x * y) / max(xx * w - x * x, 1e-30)
    return (y - c1 * x) / w, c1


def chain(x: torch.Tensor, K: int) -> float:
    """Mean tokens per target forward of K-token chains whose step k is accepted with x[:, k] (0/1 or a probability)."""
    return float((1 + x[:, :K].cumprod(-1).sum(-1)).mean()) if len(x) else float("nan")


def measure_prompt(engine: Engine, side, heads: dict, row: dict, args) -> dict:
    prompt_ids = engine.encode(row["prompt"])
    plain = run_engine(engine, row["prompt"], args.max_new_tokens, args.seed, mode="plain")
    sampling = SamplingConfig(temperature=args.temperature)
    sampled = run_engine(engine, row["prompt"], args.max_new_tokens, args.seed, sampling, mode="plain")
    out = {**row, "plain_tok_per_s": plain["tok_per_s"], "answer_tokens": len(plain["ids"]), "heads": {}}
    for name, (head, head_engine) in heads.items():
        g = teacher_forced(side, head, prompt_ids, plain["ids"], max(KS))
        s = teacher_forced(side, head, prompt_ids, sampled["ids"], max(KS), args.temperature)
        r = {"top1": float(g["hits"][:, 0].mean()) if len(g["hits"]) else float("nan"),
             **{f"tf_greedy_k{k}": chain(g["hits"], k) for k in KS},
             **{f"{sampled_key(args.temperature)}_k{k}": chain(s["alphas"], k) for k in KS}}
        out.setdefault("moments", {})[name] = s["moments"].tolist()
        for k in args.online_k:
            if args.online_sampled:  # at --temperature, against own plain decoding's sampled run
                o = run_engine(head_engine, row["prompt"], args.max_new_tokens, args.seed, sampling,
                               drafters=["draft_head"], gamma=k)
                t = sampled_key(args.temperature)[3:]
                r[f"online_{t}_k{k}"] = o["tokens_per_forward"]
                r[f"speedup_{t}_k{k}"] = o["tok_per_s"] / sampled["tok_per_s"]
                continue
            o = run_engine(head_engine, row["prompt"], args.max_new_tokens, args.seed, drafters=["draft_head"], gamma=k)
            r[f"online_k{k}"] = o["tokens_per_forward"]
            r[f"speedup_k{k}"] = o["tok_per_s"] / plain["tok_per_s"]
            r[f"same_k{k}"] = o["ids"] == plain["ids"]
        out["heads"][name] = r
    return out


def summarize(rows: list[dict]) -> dict:
    """Means over prompts, per set and head, overall and per kind."""
    out = {}
    for set_name in dict.fromkeys(r["set"] for r in rows):
        of_set = [r for r in rows if r["set"] == set_name]
        for head in of_set[0]["heads"]:
            def means(rs):
                keys = rs[0]["heads"][head].keys()
                return {k: mean(float(r["heads"][head][k]) for r in rs) for k in keys} | {"prompts": len(rs)}
            kinds = {k: means([r for r in of_set if r["kind"] == k]) for k in dict.fromkeys(r["kind"] for r in of_set)}
            fit = acceptance_fit(torch.tensor([r["moments"][head] for r in of_set]).sum(0))
            out[f"{set_name} | {head}"] = {"all": means(of_set), "kinds": kinds, "acceptance_fit": fit}
    return out


def table(summary: dict, online_k: list[int], temperature: float, online_sampled: bool) -> str:
    t = sampled_key(temperature)[3:]
    online = [f"{c}_{t}_k{k}" if online_sampled else f"{c}_k{k}" for c in ("online", "speedup") for k in online_k]
    cols = ["top1", *[f"tf_greedy_k{k}" for k in KS], *[f"{sampled_key(temperature)}_k{k}" for k in KS], *online]
    lines = ["| set / head | prompts | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['all']['prompts']} | " + " | ".join(f"{s['all'][c]:.3f}" for c in cols) + " |")
    fits = [f"{name}: {s['acceptance_fit'][0]:.3f} + {s['acceptance_fit'][1]:.3f} q(x)" for name, s in summary.items()]
    return "\n".join(lines + [f"chance that a token drawn at temperature {temperature:g} is accepted: " + "; ".join(fits)])


def load_heads(folders: list[Path], model, tokenizer, args) -> dict:
    """folder name (@ draft temperature) -> (head, an engine drafting with it alone): on the float32 path, or with
    --precision gguf beside the 4-bit target as the engine runs it there (`head_for`'s packed products)."""
    gguf = embedded_gguf(model.config) if args.precision == "gguf" else None
    heads = {}
    taus = [float(t) for t in args.draft_temperatures.split(",") if t] or [None]
    for f, tau in ((f, tau) for f in folders for tau in taus):
        name = f.parent.name + "/" + f.name + ("" if tau is None else f"@{tau:g}")
        deep = layers(f) > 1  # drafting runs one-layer heads: a deeper one gets the teacher-forced columns only
        if deep and (args.online_k or args.precision == "gguf"):
            raise SystemExit(f"{f}: a {layers(f)}-layer head is measured teacher-forced on the float32 path only "
                             "(pass --online-k= and no --precision gguf)")
        drafter = None if deep else head_for("embedded", model, packed=gguf is not None, folder=f)
        head = load_head(f, model.config, model.get_input_embeddings().weight) if deep else drafter.head
        head.cfg = head.cfg if tau is None else replace(head.cfg, draft_temperature=tau)
        if deep:
            heads[name] = (head, None)
            continue
        drafter.sets_length = drafter.sets_length and not args.fixed_chains
        heads[name] = (head, Engine.from_models(model, [drafter], tokenizer=tokenizer, name="embedded", gguf=gguf))
        run_engine(heads[name][1], "Hello!", 8, args.seed, drafters=["draft_head"], gamma=4)  # warm-up
    return heads


def layers(folder: Path) -> int:
    """A head folder's decoder layers (its config.json)."""
    return int(json.loads((Path(folder) / "config.json").read_text()).get("num_hidden_layers", 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="append", help="an EAGLE-3 head folder (repeat to compare); default: the shipped one")
    ap.add_argument("--sets", default="open,heldout")
    ap.add_argument("--heldout", type=int, default=40, help="held-out prompts of the first head's generator")
    ap.add_argument("--prompts", type=int, default=0, help="at most this many prompts of each set (0 = all)")
    ap.add_argument("--online-k", default="4,6,8", help="draft lengths of the online runs ('' = none)")
    ap.add_argument("--draft-temperatures", default="", help="compare each head at these draft temperatures "
                    "(e.g. 0.9,1.0; default: each head's own)")
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled answers and their p and q")
    ap.add_argument("--online-sampled", action="store_true", help="online runs sample at --temperature (not greedy)")
    ap.add_argument("--fixed-chains", action="store_true", help="online chains of exactly K (on the CPU the head "
                    "otherwise ends a chain early where one more token is not worth its measured cost)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", choices=["float32", "gguf"], default="float32",
                    help="the target's path: gguf = the file's 4-bit weights (answers, features and online runs)")
    ap.add_argument("--tag", default="", help="suffix of the result file")
    args = ap.parse_args(argv)
    args.online_k = [int(k) for k in args.online_k.split(",") if k]
    folders = [Path(h) for h in args.head or [HEADS["embedded"].folder]]
    device = pick_device(args.device)
    model, tokenizer = load_model("embedded", device, pick_dtype("auto", device))
    heads = load_heads(folders, model, tokenizer, args)
    engine = next((e for _, e in heads.values() if e is not None), None)
    if engine is None:
        raise SystemExit("name a one-layer head too (--head): its engine decodes the answers the heads are measured on")
    side = static_side(engine.target) if args.precision == "gguf" else partial(target_side, model)
    rows = []
    for set_name in args.sets.split(","):
        n = args.heldout if set_name == "heldout" else args.prompts
        for row in load_prompts(set_name, folders[0], n or None):
            rows.append({"set": set_name, **measure_prompt(engine, side, heads, row, args)})
            h = rows[-1]["heads"]
            print(f"{set_name:8s} {row['kind']:16s} " + " ".join(
                f"{name}: top1 {r['top1']:.2f} tf6 {r['tf_greedy_k6']:.2f}" for name, r in h.items()), flush=True)
    summary = summarize(rows)
    env = environment()
    payload = {"command": "python -m benchmarks.head " + " ".join(sys.argv[1:] if argv is None else argv),
               "heads": [str(f) for f in folders], "precision": args.precision, "temperature": args.temperature,
               "max_new_tokens": args.max_new_tokens, "seed": args.seed,
               "env": env, "summary": summary, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    where = ("cuda" if env["cuda"] else "cpu") + ("_gguf" if args.precision == "gguf" else "")
    out = RESULTS / f"head_embedded_{where}{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(payload, indent=1))
    print(f"{env['cuda'] or env['machine']}, torch {env['torch']}, commit {env['commit']}; {shown_path(out)}")
    print(table(summary, args.online_k, args.temperature, args.online_sampled))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
