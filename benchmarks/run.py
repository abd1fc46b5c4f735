"""Side-by-side decoding benchmark: own plain decoding, the bandit, each drafter fixed, Hugging Face generate(),
and on request llama.cpp on the same GGUF file.

    python -m benchmarks.run --preset embedded [--precision gguf] [--float32-plain] [--peers llama.cpp] [--tree auto]

Every row runs the same prompt (assets/examples.json), seed and machine, greedy, one after the other.
`--peers llama.cpp` runs llama-cpp-python (not in requirements.txt) in its own interpreter
(`--llama-python`, default $FLASHSPEC_LLAMA_PYTHON) on the same prompt token ids, threads and GGUF file,
while this process waits. `--float32-plain` adds own plain decoding on the float32 path beside the
precision under test. `--tree` makes the draft head draft trees in the bandit's and its own rows. Writes JSON
and CSV under benchmarks/results/ and prints a markdown table. Numbers, not assertions.
"""
from __future__ import annotations

import argparse
import cProfile
import csv
import gc
import hashlib
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from statistics import geometric_mean, median

import torch

from flashspec_core import Engine, SamplingConfig
from flashspec_core.drafters import CopyDrafter, DraftHeadDrafter
from flashspec_core.tree_round import TreeSize

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("FLASHSPEC_RESULTS") or ROOT / "benchmarks" / "results")  # where every benchmark writes
GREEDY = SamplingConfig(temperature=0.0)
GROUNDED = {"code edit", "rename", "summary", "document QA", "long repetitive answer"}
LONG = 3.0  # a round this many times its arm's median is listed in its row (`long_rounds`)


def shown_path(path: Path) -> Path:
    """A results file as a benchmark prints it: from the repository root, or whole where it lies elsewhere."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


PROMPT_SETS = {"examples": ROOT / "assets" / "examples.json", "open": ROOT / "benchmarks" / "open_prompts.json"}


def load_prompt_set(name: str) -> list[dict]:
    """[{"kind", "prompt", ...}]: the app's examples, or the hand-written open requests (96 tokens each, one
    name per prompt: kind and number)."""
    prompts = json.loads(PROMPT_SETS[name].read_text())
    if name == "open":
        prompts = [{**p, "kind": f"{p['kind']} {i}", "max_new_tokens": 96} for i, p in enumerate(prompts)]
    return prompts


def environment() -> dict:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":!benchmarks/results"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit, changed = "unknown", ""
    commit = os.environ.get("FLASHSPEC_COMMIT", commit)  # a copied tree whose git metadata lags names its code so
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"machine": cpu, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit,
            "tracked_files_changed": bool(changed),  # the code is not the commit's (results aside)
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "load_average": list(os.getloadavg()), "layer_ops": os.environ.get("FLASHSPEC_LAYER_OPS", "auto"),
            "gemv": os.environ.get("FLASHSPEC_GEMV", "loop")}


def run_engine(engine: Engine, prompt: str, max_new: int, seed: int, sampling: SamplingConfig = GREEDY,
               **kwargs) -> dict:
    """One cold run (drafter memories reset) and its figures; draft cost per drafted token, median verify time."""
    engine.reset_session()  # no n-gram memory of an earlier row's answer
    with GcPauses() as pauses:
        result = engine.generate(prompt, max_new_tokens=max_new, sampling=sampling, seed=seed, **kwargs)
    s = result.stats
    drafted = [e for e in result.events if e.gamma]
    draft_ms = 1e3 * sum(e.draft_s for e in drafted) / sum(e.gamma for e in drafted) if drafted else None
    return {"tokens": s["new_tokens"], "seconds": s["elapsed_s"], "tok_per_s": s["tok_per_s"],
            "acceptance": s["acceptance"], "tokens_per_forward": s["tokens_per_forward"],
            "target_forwards": s["target_forwards"], "draft_ms_per_token": draft_ms,
            "verify_ms": 1e3 * median(e.verify_s for e in result.events), "pulls": s["pulls"],
            "prefill_ms": 1e3 * s["prefill_s"],  # the stream's start (prefill, drafters' start), inside "seconds"
            **round_times(result.events), "gc": pauses.summary(), "ids": result.token_ids}


class GcPauses:
    """The cyclic garbage collector's passes while a row runs (`gc.callbacks`), so that a long round can be told
    apart from a collector's pause: how many passes per generation, their milliseconds in all and the longest."""

    def __enter__(self) -> "GcPauses":
        self.passes, self.began = [], None  # passes: (generation, seconds)
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        elif self.began is not None:
            self.passes.append((info["generation"], time.perf_counter() - self.began))
            self.began = None

    def summary(self) -> dict:
        seconds = [t for _, t in self.passes]
        return {"passes": [sum(g == n for g, _ in self.passes) for n in range(3)],
                "ms": 1e3 * sum(seconds), "max_ms": 1e3 * max(seconds, default=0.0)}


def stored(row: dict) -> dict:
    """A row as the JSON keeps it: its ids as a digest, so that two runs' texts can be compared afterwards."""
    out = {k: v for k, v in row.items() if k != "ids"}
    if row.get("ids") is not None:
        out["ids_sha1"] = hashlib.sha1(json.dumps(row["ids"]).encode()).hexdigest()[:16]
    return out


def round_times(events) -> dict:
    """Per-round wall times (each from its event's clock: prefill excluded, host work between rounds included),
    and on CUDA the host's share: the time per round the GPU did not spend on the round's launched work."""
    ends = [events[0].prefill_s] + [e.elapsed_s for e in events]
    walls = [b - a for a, b in zip(ends, ends[1:])]
    out = {"rounds": len(walls), "round_ms_median": 1e3 * median(walls), "round_ms_max": 1e3 * max(walls),
           "round_ms_max_after_first": 1e3 * max(walls[1:]) if len(walls) > 1 else None, "host_ms_per_round": None}
    if all(e.device_s is not None for e in events):
        out["host_ms_per_round"] = 1e3 * (sum(walls) - sum(e.device_s for e in events)) / len(walls)
    by_arm = {}  # after the stream's first round: a bandit row's arms cost differently, so each against its own
    for e, wall in zip(events[1:], walls[1:]):
        by_arm.setdefault(e.drafter, []).append(wall)
    medians = {arm: median(w) for arm, w in by_arm.items()}
    out["round_ms_by_arm"] = {arm: {"rounds": len(w), "median": 1e3 * medians[arm], "max": 1e3 * max(w)}
                              for arm, w in by_arm.items()}
    out["round_max_over_median"] = max((max(w) / medians[arm] for arm, w in by_arm.items()), default=None)  # worst
    out["long_rounds"] = long_rounds(events, walls, medians)
    return out


def long_note(row: dict) -> str:
    """A row's long rounds for the console: each one's wall (and device) ms, and the collector's longest pass."""
    if not row.get("long_rounds"):
        return ""
    device = lambda x: "" if x["device_ms"] is None else f" (device {x['device_ms']:.1f})"  # noqa: E731
    each = ", ".join(f"#{x['index']} {x['wall_ms']:.1f}{device(x)}" for x in row["long_rounds"])
    return f"  long rounds (ms): {each}; longest gc pass {row['gc']['max_ms']:.1f} ms"


def long_rounds(events, walls: list[float], medians: dict) -> list[dict]:
    """Rounds after the first that took over LONG times their arm's median wall time: which round, its arm and
    draft, its wall time and (CUDA) the device's time, so that a stall on the device shows apart from one on the
    host."""
    out = []
    for e, wall in zip(events[1:], walls[1:]):
        if wall > LONG * medians[e.drafter]:
            out.append({"index": e.index, "arm": e.drafter, "gamma": e.gamma, "tree_nodes": e.tree_nodes,
                        "wall_ms": 1e3 * wall, "median_ms": 1e3 * medians[e.drafter],
                        "device_ms": None if e.device_s is None else 1e3 * e.device_s})
    return out


def run_hf(engine: Engine, prompt: str, max_new: int, **generate_kwargs) -> dict:
    model = engine.target.model
    ids = torch.tensor([engine.encode(prompt)], device=engine.target.device)
    eos = sorted(engine.eos_ids) or None
    with torch.inference_mode():
        if engine.target.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0] if eos else None, **generate_kwargs)
        if engine.target.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    new = new[:next((i + 1 for i, t in enumerate(new) if t in engine.eos_ids), len(new))]  # a static cache pads past EOS
    return {"tokens": len(new), "seconds": seconds, "tok_per_s": len(new) / seconds, "acceptance": None,
            "tokens_per_forward": None, "target_forwards": None, "draft_ms_per_token": None, "verify_ms": None,
            "pulls": None, "ids": new}


def run_llama_cpp(python: str, engine: Engine, prompts: list[dict], max_new: dict[str, int], repeats: int) -> dict:
    """llama.cpp's rows, {prompt kind: [run, ...]}, from benchmarks/llama_cpp_peer.py in `python`."""
    from flashspec_core.models import embedded_gguf_path

    runs = [{"ids": engine.encode(p["prompt"]), "max_new_tokens": max_new[p["kind"]]} for p in prompts] * repeats
    request = {"gguf": str(embedded_gguf_path()), "threads": torch.get_num_threads(), "runs": runs,
               "eos_ids": sorted(engine.eos_ids)}
    done = subprocess.run([python, str(ROOT / "benchmarks" / "llama_cpp_peer.py")], input=json.dumps(request),
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp peer failed ({python}):\n{done.stderr[-2000:]}")
    answer = json.loads(done.stdout)
    out = {}
    for p, r in zip(prompts * repeats, answer["results"]):
        out.setdefault(p["kind"], []).append(r)
    return {"version": answer["version"], "runs": out}


def best(runs: list[dict]) -> dict:
    """The median run by tok/s (the one reported when a row runs several times)."""
    return sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="embedded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override each prompt's own length")
    ap.add_argument("--gamma", default="auto")
    ap.add_argument("--only", nargs="*", help="prompt kinds to run (default: all)")
    ap.add_argument("--prompt-set", default="examples", choices=sorted(PROMPT_SETS), help="the app's examples or the hand-written open requests")
    ap.add_argument("--configs", nargs="*", help="engine rows to run, e.g. plain bandit fixed:draft_head (default: all); "
                    "bandit:STRATEGY runs the bandit under that strategy (named ones only)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate() rows")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto = float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--precision", default="auto", choices=["auto", "gguf", "float32"],
                    help="the target's weights: auto = the GGUF file's own 4-bit weights on the CPU where it can")
    ap.add_argument("--float32-plain", action="store_true", help="add own plain decoding on the float32 path")
    ap.add_argument("--peers", nargs="*", default=[], choices=["llama.cpp"], help="other engines on the same file")
    ap.add_argument("--llama-python", default=os.environ.get("FLASHSPEC_LLAMA_PYTHON", "python"),
                    help="an interpreter with llama-cpp-python installed")
    ap.add_argument("--repeats", type=int, default=1, help="run every row this many times; report the median")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the peers and all own rows this many times, one round after the other; report medians")
    ap.add_argument("--tag", default="", help="a suffix for the result files (a variant beside the main run)")
    ap.add_argument("--captured", default="auto", choices=["auto", "eager", "off"],
                    help="whole rounds as CUDA graphs (auto), their code without graphs (eager), or eager rounds (off)")
    ap.add_argument("--launch-ahead", default="on", choices=["on", "off"],
                    help="captured rounds: launch the next on-device round before this one lands (Engine.launch_ahead)")
    ap.add_argument("--warm-up-context", type=int, default=2048,
                    help="the engine's warm-up captures every graph a stream of up to this many tokens can choose")
    ap.add_argument("--profile", action="store_true",
                    help="profile the host's Python over the rows (cProfile; benchmarks/results/profile_*.txt)")
    ap.add_argument("--hf-compiled", action="store_true",
                    help="add Hugging Face generate() with a static cache under torch.compile (CUDA; warm-up untimed)")
    ap.add_argument("--tree", default=None, help="the draft head's trees in the bandit and fixed:draft_head rows: "
                    "DEPTH,TOP_K,SIZE, or auto (up to 6,4,32, sized each round; on a GPU its bound, sampled: its static shape), "
                    "then optionally ,copyN (greedy: up to N copied tokens as one more branch, TreeSize.copy)")
    ap.add_argument("--head-catch-up", type=int, default=None,
                    help="verified slots that wait before the draft head's first pass (1: every round, inside a "
                    "captured round; default: the head's own, CATCH_UP)")
    ap.add_argument("--head-vocab", type=int, default=None, help="the draft head drafts from this many of its most "
                    "frequent ids (0: all of them; default: the shipped head's, engine.HEADS)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the engine rows' sampling temperature (0: greedy); the Hugging Face rows stay greedy")
    ap.add_argument("--aligned-copies", default=None, choices=["on", "off"], help="the copy drafters' aligned "
                    "copies where the last token broke a copy (default: the drafters' own, CopyDrafter.aligns)")
    args = ap.parse_args(argv)
    if args.head_catch_up is not None and args.head_catch_up < 1:
        ap.error(f"--head-catch-up must be at least 1, got {args.head_catch_up}")
    if args.head_vocab is not None and args.head_vocab < 0:
        ap.error(f"--head-vocab must be 0 (all) or more, got {args.head_vocab}")
    args.sampling = SamplingConfig(temperature=args.temperature)
    args.gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    args.tree = parse_tree(args.tree)
    return args


def parse_tree(text: str | None) -> TreeSize | None:
    """--tree's value as a TreeSize (None: chains): DEPTH,TOP_K,SIZE or auto, then optionally ",copyN" (greedy: up
    to N copied tokens join the tree as one more branch, `TreeSize.copy`)."""
    if text is None:
        return None
    head, _, copy = text.partition(",copy")
    try:
        tree = TreeSize(6, 4, 32, auto=True) if head == "auto" else TreeSize(*(int(x) for x in head.split(",")))
        return replace(tree, copy=int(copy)) if copy else tree
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--tree takes DEPTH,TOP_K,SIZE or auto, then optionally ,copyN, got {text!r}: {e}")


def engine_configs(engine: Engine, args) -> list[tuple[str, dict]]:
    """(name, generate kwargs) of the engine rows: plain (the baseline, always), the bandit, each drafter fixed."""
    drafters = [n for n in engine.drafters if n != "no_draft"]
    configs = [("plain", dict(mode="plain")), ("bandit", dict(gamma=args.gamma, tree=args.tree))]
    configs += [(f"fixed:{d}", dict(gamma=args.gamma, drafters=[d], tree=args.tree if d == "draft_head" else None))
                for d in drafters]
    configs = [c for c in configs if not args.configs or c[0] in args.configs or c[0] == "plain"]
    strategies = [c.split(":", 1)[1] for c in args.configs or () if c.startswith("bandit:")]  # named ones only
    return configs + [(f"bandit:{st}", dict(gamma=args.gamma, bandit=st, tree=args.tree)) for st in strategies]


def run_rows(engine: Engine, float32, prompts: list[dict], peers: dict, args) -> list[dict]:
    """Every configuration on every prompt, one after the other, each against the prompt's first (plain) row."""
    configs = engine_configs(engine, args)
    hf = [] if args.no_hf else [("hf:generate", {}), ("hf:prompt_lookup_10", dict(prompt_lookup_num_tokens=10))]
    hf += [("hf:static_compiled", dict(cache_implementation="static"))] if args.hf_compiled else []
    extra = [("float32:plain", dict(mode="plain"))] if float32 else []
    on_cuda = engine.target.device.type == "cuda"
    rows = []
    for p in prompts:
        max_new = args.max_news[p["kind"]]
        if on_cuda:  # capture this prompt's CUDA graphs and compile kernels outside the timed runs
            run_engine(engine, p["prompt"], max_new, args.seed, args.sampling, gamma=args.gamma, tree=args.tree)
            if hf:
                run_hf(engine, p["prompt"], 16)
            if args.hf_compiled:  # torch.compile specialises on the static cache's length: warm up at this one
                t0 = time.perf_counter()
                run_hf(engine, p["prompt"], max_new, cache_implementation="static")
                print(f"{p['kind']:>24} hf:static_compiled warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        plain = None
        for name, kw in configs + extra + hf + [(f"{peer}:plain", {}) for peer in peers]:
            if name in (f"{peer}:plain" for peer in peers):
                r = best(peers[name.split(":")[0]]["runs"][p["kind"]])
            elif name.startswith("hf:"):
                r = best([run_hf(engine, p["prompt"], max_new, **kw) for _ in range(args.repeats)])
            else:
                lm = float32 if name.startswith("float32:") else engine
                r = best([run_engine(lm, p["prompt"], max_new, args.seed, args.sampling, **kw)
                          for _ in range(args.repeats)])
            plain = plain or r
            r.update(prompt=p["kind"], config=name, max_new_tokens=max_new,
                     speedup=r["tok_per_s"] / plain["tok_per_s"], same_as_plain=r["ids"] == plain["ids"])
            rows.append(r)
            host = "" if r.get("host_ms_per_round") is None else f"  host {r['host_ms_per_round']:.2f} ms/round"
            rounds = "" if r.get("round_ms_median") is None else \
                f"  rounds {r['round_ms_median']:.2f} ms median, {r['round_ms_max_after_first']:.2f} max after the first"
            print(f"{p['kind']:>24} {name:>22} {r['tok_per_s']:7.1f} tok/s  x{r['speedup']:.2f}{rounds}{host}"
                  f"{long_note(r)}", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    engine = Engine.from_preset(args.preset, device=args.device, dtype=args.dtype, precision=args.precision,
                                captured=args.captured)
    engine.launch_ahead = args.launch_ahead == "on"
    heads = [d for d in engine.drafters.values() if isinstance(d, DraftHeadDrafter)]
    copiers = [d for d in engine.drafters.values() if isinstance(d, CopyDrafter)]
    for d in copiers if args.aligned_copies else ():
        d.aligns = args.aligned_copies == "on"
    args.aligned_copies = copiers[0].aligns if copiers else None
    for d in heads if args.head_catch_up else ():  # before the warm-up: it sets which graphs other arms' rounds take
        d.catch_up_slots = args.head_catch_up
    for d in heads if args.head_vocab is not None else ():
        d.set_vocab_limit(args.head_vocab or None)
    args.catch_up = heads[0].catch_up_slots if heads else None
    args.head_vocab = int(heads[0].ids.numel()) if heads else None
    args.warm_up_s = engine.warm_up(args.warm_up_context, trees=[args.tree] if args.tree else ())
    print(f"engine warm-up (costs and every graph a run can choose): {args.warm_up_s:.1f} s", flush=True)
    float32 = Engine.from_preset(args.preset, device=args.device, dtype=args.dtype, precision="float32",
                                 drafters=[]) if args.float32_plain else None
    prompts = load_prompt_set(args.prompt_set)
    if args.only:
        prompts = [p for p in prompts if p["kind"] in args.only]
    args.max_news = {p["kind"]: args.max_new_tokens or p.get("max_new_tokens", 128) for p in prompts}
    run_engine(engine, "Hello!", 8, args.seed)  # warm up allocators and the cost model
    if float32:
        run_engine(float32, "Hello!", 8, args.seed)
    rounds, profile = [], cProfile.Profile() if args.profile else None
    for _ in range(args.rounds):  # the peer, then every own row, again: a slow spell of a shared machine hits both
        peers = {"llama.cpp": run_llama_cpp(args.llama_python, engine, prompts, args.max_news, args.repeats)} \
            if "llama.cpp" in args.peers else {}
        if profile:
            profile.enable()
        rounds.append(run_rows(engine, float32, prompts, peers, args))
        if profile:
            profile.disable()
    rows = median_rows(rounds)
    env = write_results(engine, rows, peers, args, argv)
    if profile:
        write_profile(profile, env, args)
    print()
    print(table(rows, env))
    return 0


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """Each row's median over the rounds (by tok/s; the rounds list the same rows in the same order), its speedup
    against its prompt's median plain row, and every round's tok/s."""
    rows = []
    for runs in zip(*rounds):
        row = dict(best(list(runs)))
        row["tok_per_s_rounds"] = [r["tok_per_s"] for r in runs]
        rows.append(row)
    plain = {}
    for row in rows:
        plain.setdefault(row["prompt"], row["tok_per_s"])  # the first row of a prompt is its plain decoding
        row["speedup"] = row["tok_per_s"] / plain[row["prompt"]]
    return rows


def calibration(engine: Engine) -> dict:
    """The costs every decision of the engine weighs (`Engine.calibrate`), in ms: the target's forward by tokens fed,
    and each drafter's propose time per round and per drafted token."""
    policy = engine.policy
    return {"forward_ms": {T: round(1e3 * s, 4) for T, s in sorted(policy.costs.seconds.items())},
            "draft_ms": {name: {"per_round": round(1e3 * c.per_round, 4), "per_token": round(1e3 * c.per_token, 4)}
                         for name, c in policy.draft_costs.items()}}


def write_results(engine: Engine, rows: list[dict], peers: dict, args, argv) -> dict:
    """JSON (with the environment and the command) and CSV under benchmarks/results/; returns the environment."""
    from flashspec_core.engine import paths

    env = environment()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"engine_{args.preset}_{'cuda' if env['cuda'] else 'cpu'}" + \
        (f"_{args.prompt_set}" if args.prompt_set != "examples" else "") + \
        (f"_t{args.temperature:g}" if args.temperature else "") + (f"_{args.tag}" if args.tag else "")
    env.update(dtype=str(next(engine.target.model.parameters()).dtype), paths=paths(engine),
               precision=engine.precision, peers={k: v["version"] for k, v in peers.items()}, repeats=args.repeats,
               rounds=args.rounds, temperature=args.temperature, captured=args.captured, launch_ahead=args.launch_ahead, warm_up_s=args.warm_up_s,
               head_catch_up=args.catch_up, head_vocab=args.head_vocab, aligned_copies=args.aligned_copies,
               eager_rounds=getattr(engine.round.captured, "eager_rounds", None), calibration=calibration(engine))
    payload = {"command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv), "preset": args.preset,
               "seed": args.seed, "gamma": args.gamma, "env": env, "rows": [stored(r) for r in rows]}
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    fields = ["prompt", "config", "tokens", "seconds", "tok_per_s", "speedup", "acceptance", "tokens_per_forward",
              "target_forwards", "draft_ms_per_token", "same_as_plain", "max_new_tokens", "round_ms_median",
              "round_ms_max_after_first", "host_ms_per_round"]
    with open(RESULTS / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return env


def write_profile(profile: cProfile.Profile, env: dict, args) -> None:
    """The host's Python functions over the rows (`--profile`), by own time then by cumulative time, as text."""
    out = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(40)
    stem = f"profile_{args.preset}_{'cuda' if env['cuda'] else 'cpu'}" + (f"_{args.tag}" if args.tag else "")
    (RESULTS / f"{stem}.txt").write_text(f"python -m benchmarks.run {' '.join(sys.argv[1:])}\n{out.getvalue()}")


def table(rows, env) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    where = env["cuda"] or f"{env['machine']}, {env['threads']} threads"
    lines = [f"{where}, precision {env.get('precision', env['dtype'])}, {env['paths']['target']}, torch {env['torch']}, "
             f"transformers {env['transformers']}, commit {env['commit']}", "",
             "| prompt | config | tokens | tok/s | speedup vs own plain | vs llama.cpp plain | acceptance | "
             "tokens/target forward | draft ms/token | start ms | round ms median / max after the 1st | "
             "host ms/round | same ids as plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    llama = peer_speeds(rows)
    for r in rows:
        peer = fmt(r["tok_per_s"] / llama[r["prompt"]], ".2f") + "x" if r["prompt"] in llama else "-"
        lines.append(f"| {r['prompt']} | {r['config']} | {r['tokens']} | {r['tok_per_s']:.1f} | {r['speedup']:.2f}x | {peer} | "
                     f"{fmt(r.get('acceptance'), '.2f')} | {fmt(r.get('tokens_per_forward'), '.2f')} | "
                     f"{fmt(r.get('draft_ms_per_token'), '.1f')} | {fmt(r.get('prefill_ms'), '.1f')} | "
                     f"{fmt(r.get('round_ms_median'), '.2f')} / "
                     f"{fmt(r.get('round_ms_max_after_first'), '.2f')} | {fmt(r.get('host_ms_per_round'), '.2f')} | "
                     f"{r['same_as_plain']} |")
    return "\n".join(lines + [""] + summary(rows))


def peer_speeds(rows) -> dict[str, float]:
    """llama.cpp's tok/s by prompt (empty where it did not run)."""
    return {r["prompt"]: r["tok_per_s"] for r in rows if r["config"] == "llama.cpp:plain"}


def summary(rows) -> list[str]:
    """Per config over the prompts: the geometric mean of its speedups over own plain, its lowest (three decimals: a
    0.966x must not read as a 0.97x floor), and how many rows gave plain decoding's ids; where llama.cpp ran, the same
    over llama.cpp's tok/s on each prompt."""
    llama = peer_speeds(rows)
    lines = []
    for config in dict.fromkeys(r["config"] for r in rows):
        sel = [r for r in rows if r["config"] == config]
        same = sum(bool(r["same_as_plain"]) for r in sel)
        ratios = [r["round_max_over_median"] for r in sel if r.get("round_max_over_median") is not None]
        worst = f", longest round {max(ratios):.2f}x its arm's median" if ratios else ""
        over = [r["tok_per_s"] / llama[r["prompt"]] for r in sel if r["prompt"] in llama]
        peer = f"; {geometric_mean(over):.2f}x llama.cpp plain, lowest {min(over):.2f}x" \
            if config != "llama.cpp:plain" and len(over) == len(sel) else ""
        lines.append(f"{config}: {geometric_mean([r['speedup'] for r in sel]):.2f}x own plain (geometric mean over "
                     f"{len(sel)} prompts), lowest {min(r['speedup'] for r in sel):.3f}x, plain's ids on {same} of "
                     f"{len(sel)}{worst}{peer}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
