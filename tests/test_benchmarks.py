"""The CPU benchmarks still run end to end, at tiny settings, writing into a temporary folder (FLASHSPEC_RESULTS):
a script that calls an engine function by an old name or misses a new setting fails here, not in the next measured
run. Their numbers are not looked at. One interpreter runs them one after another (each loads its own engine), so
the imports are paid once; the GPU-only ones and those that serve the app are left to their own machines.
"""
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.run import GcPauses, long_note, round_times, summary

ROOT = Path(__file__).resolve().parent.parent

RUNS = {  # benchmark module -> (its command line, {out} the results folder; a file it writes there)
    "run": (["--configs", "plain", "bandit", "--no-hf", "--only", "code edit", "--max-new-tokens", "8", "--rounds", "1",
             "--tag", "smoke"], "engine_embedded_cpu_smoke.json"),
    "head": (["--sets", "open", "--prompts", "1", "--online-k", "2", "--max-new-tokens", "16", "--precision", "gguf",
              "--fixed-chains"], "head_embedded_cpu_gguf.json"),
    "head_step": (["--reps", "8", "--repeats", "1", "--intermediate", "2048"], "head_step_cpu_gguf_w2048.json"),
    "head_tree": (["--prompts", "1", "--reps", "1"], "head_tree_cpu_packed.json"),
    "head_feed": (["--prompts", "1", "--max-new-tokens", "8", "--repeats", "1"], "head_feed_cpu_gguf.json"),
    "step_profile": (["--reps", "2", "--prefill", "16"], "step_profile_cpu_gguf.json"),
    "tree_forward": (["--reps", "1"], "tree_forward_cpu_gguf.json"),
    "tree_round": (["--prompts", "1", "--max-new-tokens", "8"], "tree_round_cpu_float32.json"),
    "tree_exact": (["--prompts", "1", "--max-new-tokens", "8"], "tree_exact_cpu_gguf.json"),
    "start_profile": (["--prompts", "1"], "start_profile_cpu_gguf.json"),
    "host_round": (["--streams", "1", "--max-new-tokens", "8"], "host_round_cpu.json"),
    "drafters": (["--rounds", "3"], "drafters_cpu.json"),
    "copy_ceiling": (["--only", "document QA", "--max-new-tokens", "8", "--ks", "4", "--tag", "smoke"],
                     "copy_ceiling_cpu_gguf_examples_smoke.json"),
    "app_overhead": (["--reps", "1", "--max-new-tokens", "8"], "app_overhead.json"),
    "warm_restart": (["--minutes", "0.05", "--max-new-tokens", "8", "--steps", "2", "--eval", "1", "--recipes",
                      "3e-4/60/0", "1e-4/1/1", "--heldout-batches", "1"], "warm_restart_cpu.json"),
    "policy_costs": (["--costs", "benchmarks/results/engine_embedded_cuda_ex_h100_s66.json", "--every", "8",
                      "--launch-ahead", "on", "--tag", "smoke"], "policy_costs_smoke.json"),
    "kernels": (["--cpu-smoke", "--sweep", "--out", "{out}/kernels_smoke.json"], "kernels_smoke.json"),
}

RUNNER = """
import importlib, json, sys, traceback
for name, argv in json.loads(sys.argv[1]).items():
    sys.argv = ["benchmarks." + name, *argv]
    try:
        importlib.import_module("benchmarks." + name).main()
        print("BENCHMARK RAN", name, flush=True)
    except BaseException:  # SystemExit from argparse too
        traceback.print_exc()
        print("BENCHMARK FAILED", name, flush=True)
"""


def results_files() -> dict:
    return {p.name: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").iterdir()}


def test_the_cpu_benchmarks_run_and_write_their_results(tmp_path):
    env = {**os.environ, "FLASHSPEC_RESULTS": str(tmp_path)}
    before = results_files()
    argvs = {name: [a.format(out=tmp_path) for a in argv] for name, (argv, _) in RUNS.items()}
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argvs)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    ran = {line.split()[-1] for line in done.stdout.splitlines() if line.startswith("BENCHMARK RAN")}
    assert ran == set(RUNS), f"did not run: {sorted(set(RUNS) - ran)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    for name, (_, written) in RUNS.items():
        assert json.loads((tmp_path / written).read_text()), f"{name} wrote no {written}"
    assert results_files() == before, "a benchmark wrote into the repository's results"


def test_a_long_round_is_listed_with_its_device_time_and_gc_passes_are_counted():
    ends = [0.010, 0.012, 0.014, 0.016, 0.026, 0.028, 0.030]  # the round of index 4 takes 10 ms, the others 2 ms
    events = [SimpleNamespace(index=i, drafter="draft_head", gamma=4, tree_nodes=0, device_s=0.0015, elapsed_s=t,
                              prefill_s=0.008) for i, t in enumerate(ends)]
    row = round_times(events)
    assert [(x["index"], round(x["wall_ms"], 3), x["device_ms"]) for x in row["long_rounds"]] == [(4, 10.0, 1.5)]
    with GcPauses() as pauses:
        gc.collect()
    row["gc"] = pauses.summary()
    assert row["gc"]["passes"][2] >= 1 and row["gc"]["max_ms"] > 0
    assert long_note(row).startswith("  long rounds (ms): #4 10.0 (device 1.5)")
    assert round_times(events[:4])["long_rounds"] == []  # even rounds: none listed


def test_the_oracle_copies_the_longest_run_found_so_far_and_a_drafter_no_more():
    from benchmarks.copy_ceiling import drafter_tokens_per_forward, oracle_tokens_per_forward
    from flashspec_core.drafters import PromptLookup

    context, answer = [5, 1, 2, 3, 4, 6], [1, 2, 3, 4, 9, 1, 2, 3, 4, 9]
    assert oracle_tokens_per_forward(context, answer, 8) == 5.0  # 1 2 3 4 from the prompt, then all five again
    assert oracle_tokens_per_forward(context, answer, 2) == 2.5  # 1 2 +3 | 4 +9 | 1 2 +3 | 4 9 +end
    assert oracle_tokens_per_forward([7], answer, 8) == 10 / 6  # five rounds of one token, then the repeat in one
    assert 1.0 <= drafter_tokens_per_forward(PromptLookup(), context, answer, 8) <= 5.0


def test_the_summary_gives_each_config_over_llama_cpp_where_it_ran():
    row = lambda prompt, config, tok_per_s, speedup: dict(prompt=prompt, config=config, tok_per_s=tok_per_s,  # noqa: E731
                                                            speedup=speedup, same_as_plain=config != "llama.cpp:plain")
    rows = [row("a", "plain", 200.0, 1.0), row("a", "bandit", 300.0, 1.5), row("a", "llama.cpp:plain", 100.0, 0.5),
            row("b", "plain", 100.0, 1.0), row("b", "bandit", 80.0, 0.8), row("b", "llama.cpp:plain", 50.0, 0.5)]
    lines = dict(line.split(": ", 1) for line in summary(rows))
    assert lines["plain"].endswith("; 2.00x llama.cpp plain, lowest 2.00x")
    assert lines["bandit"].startswith("1.10x own plain") and lines["bandit"].endswith("; 2.19x llama.cpp plain, lowest 1.60x")
    assert "llama.cpp plain," not in lines["llama.cpp:plain"]  # not over itself
    assert "llama.cpp" not in summary(rows[:2])[0]  # no peer, no such column
