"""The running app as a remote user meets it: `python app.py` in its default (public) configuration, called
through gradio_client and through raw queue requests with values the page never sends. Every hostile case
gets a short message (or a correct result), the server stays up, the next normal run's text is unchanged,
nothing loads from the server's disk, 8 sessions at once each get their own text, and temporary files stay
bounded.
"""
from __future__ import annotations

import html
import json
import re
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from gradio_client import Client

import app
from flashspec_core.models import embedded_model_dir
from tests.served_app import ROOT, app_env, served_app

ARTIFACTS = ROOT / "tests" / "artifacts"
SETTINGS = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False,
                gamma=4, temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0, bandit="ucb1", backend="auto")
PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat."
CLIENT_OUTPUTS = [n for n in app.STREAM_OUTPUTS if n not in ("state", "tabs")]  # gradio_client leaves these out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app with its own temporary folders, so the test can count what it leaves there."""
    tmp = tmp_path_factory.mktemp("served")
    dirs = {"gradio": tmp / "gradio", "tmp": tmp / "tmp"}
    for d in dirs.values():
        d.mkdir()
    env = app_env(GRADIO_TEMP_DIR=str(dirs["gradio"]), TMPDIR=str(dirs["tmp"]))
    with served_app(ARTIFACTS / "app_api.log", env) as url:
        yield url, dirs


@pytest.fixture(scope="module")
def baseline(server):
    return run(Client(server[0], verbose=False, download_files=False))


def text_of(tokens_html) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", tokens_html if isinstance(tokens_html, str) else ""))


def run(client: Client, prompt: str = PROMPT, **change) -> dict:
    """The Run button through gradio_client; its outputs by name, plus the generated text."""
    values = {**SETTINGS, **change}
    out = client.predict(prompt, "", False, *[values[n] for n in app.SETTING_NAMES], api_name="/run_stream")
    named = dict(zip(CLIENT_OUTPUTS, out))
    return {**named, "text": text_of(named["tokens"])}


def fn_index(url: str, api_name: str) -> int:
    config = httpx.get(url + "config").json()
    return next(d["id"] for d in config["dependencies"] if d.get("api_name") == api_name)


def queue_call(url: str, api_name: str, data: list, timeout: float = 120) -> dict:
    """A raw queue request, JSON written by hand (NaN, Infinity, lone surrogates as the wire carries them):
    POST queue/join, then read queue/data until the event completes; returns that last message."""
    session = uuid.uuid4().hex[:12]
    body = json.dumps({"data": data, "event_data": None, "fn_index": fn_index(url, api_name), "trigger_id": None,
                       "session_hash": session})
    joined = httpx.post(url + "gradio_api/queue/join", content=body, headers={"content-type": "application/json"})
    assert joined.status_code == 200, joined.text[:300]
    with httpx.stream("GET", url + "gradio_api/queue/data", params={"session_hash": session}, timeout=timeout) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed":
                    return message
    raise AssertionError("the event never completed")


def raw_run(url: str, prompt=PROMPT, **change) -> dict:
    """The Run event's raw request: every input as sent (the session's state is the server's: null here)."""
    values = {"state": None, "prompt": prompt, "example": "", "keep_rejected": False, **SETTINGS, **change}
    message = queue_call(url, "run_stream", [values[n] for n in app.RUN_INPUTS])
    assert message["success"], message
    return dict(zip(app.STREAM_OUTPUTS, message["output"]["data"]))


FOLDERS_ON_DISK = ["/etc", "/nonexistent/dir", "/root", str(ROOT / "tests"), "//etc/", "/proc/self/cwd"]


def test_no_folder_on_the_server_loads_and_none_can_be_told_apart(server, baseline):
    client = Client(server[0], verbose=False, download_files=False)
    real_model = str(embedded_model_dir())  # a loadable model folder on this server's disk
    messages = {name: run(client, pair="custom", target=name)["status"] for name in FOLDERS_ON_DISK + [real_model]}
    assert len(set(messages.values())) == 1, messages  # /etc, a missing folder and a real model: one answer
    assert "local model folders are off on this server" in messages["/etc"]
    draft = run(client, pair="custom", target="org/model", draft=real_model)["status"]
    assert draft == messages["/etc"]
    assert run(client)["text"] == baseline["text"]


@pytest.mark.parametrize("name, message", [
    ("~", "model name '~' is not a Hub id"),
    ("../../etc/passwd", "is not a Hub id"),
    ("tests/components", "'tests/components' is not in the local Hugging Face cache"),  # a folder here: never read
    ("x" * 100_000, "is 100,000 characters long; at most 10,000"),
    ("y" * 9_000, "(9,002 characters) is not a Hub id"),
    ("org/model\u0000", "is not a Hub id"),
])
def test_model_names_get_short_messages_that_name_no_server_path(server, name, message):
    status = run(Client(server[0], verbose=False, download_files=False), pair="custom", target=name)["status"]
    assert message in status and len(status) < 400, status
    assert "/root" not in status and str(ROOT) not in status and "Traceback" not in status


@pytest.mark.parametrize("change, message", [
    (dict(temperature=float("nan")), "temperature must be a number in 0.0..2.0, got nan"),
    (dict(temperature=float("inf")), "temperature must be a number in 0.0..2.0, got inf"),
    (dict(temperature="hot"), "temperature must be a number in 0.0..2.0, got 'hot'"),
    (dict(top_p=float("-inf")), "top_p must be a number in 0.0..1.0, got -inf"),
    (dict(seed=2**70), "seed must be an integer in 0..18446744073709551615, got 1180591620717411303424"),
    (dict(seed="abc"), "seed must be an integer in 0..18446744073709551615, got 'abc'"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(max_new_tokens=float("nan")), "max new tokens must be an integer in 1..1024, got nan"),
    (dict(max_new_tokens=10**9), "max new tokens must be an integer in 1..1024"),
    (dict(gamma=float("-inf")), "gamma must be an integer in 1..16, got -inf"),
    (dict(gamma_auto="yes"), "auto gamma must be true or false"),
    (dict(roles="prompt_lookup"), "drafters must be a list of names"),
    (dict(pair=["embedded"]), "unknown model pair ['embedded']"),
    (dict(bandit={"x": 1}), "unknown bandit strategy {'x': 1}"),
    (dict(prompt=[1.7]), "the prompt must be text, got list"),
    (dict(prompt=12), "the prompt must be text, got int"),
    (dict(prompt="\ud800 hello"), "the prompt contains a lone surrogate (U+D800) at character 0"),
    (dict(prompt="z" * 150_000), "the prompt is 150,000 characters long; at most 100,000"),
])
def test_raw_requests_with_hostile_values_get_a_clear_message(server, change, message):
    out = raw_run(server[0], **change)
    assert message in out["status"], out["status"]
    assert len(out["status"]) < 400 and out["status"].startswith("**Cannot run:**")
    assert "tok-" not in json.dumps(out["tokens"])  # no text was generated


def test_a_file_reference_to_a_server_path_is_refused(server):
    """A prompt disguised as a file: gradio refuses paths outside its upload folder before the handler runs."""
    url = server[0]
    fake_file = {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}
    values = {"state": None, "prompt": fake_file, "example": "", "keep_rejected": False, **SETTINGS}
    message = queue_call(url, "run_stream", [values[n] for n in app.RUN_INPUTS])
    assert not message["success"] and "root:x:0" not in json.dumps(message)


def test_the_server_is_unchanged_after_the_hostile_cases(server, baseline):
    again = run(Client(server[0], verbose=False, download_files=False))
    assert again["status"].startswith("Done") and again["text"] == baseline["text"]


def test_eight_sessions_at_once_each_get_their_own_text(server):
    prompts = [f"Write a sentence that uses the word '{w}'." for w in
               ("apple", "river", "seven", "green", "stone", "cloud", "paper", "tiger")]
    clients = [Client(server[0], verbose=False, download_files=False) for _ in prompts]
    alone = [run(c, p)["text"] for c, p in zip(clients, prompts)]
    together = [None] * len(prompts)

    def go(i):
        together[i] = run(clients[i], prompts[i])["text"]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == alone and len(set(alone)) == len(alone)  # greedy: equal to each one's sequential run


def test_temporary_files_stay_bounded(server):
    url, dirs = server
    for _ in range(12):  # twelve sessions, a run each; the last one runs three times
        client = Client(url, verbose=False, download_files=False)
        out = run(client, max_new_tokens=4)
    for _ in range(2):
        out = run(client, max_new_tokens=4)
    served = out["download_json"]["value"]  # the file's record (download_files=False): where the server has it
    assert Path(served["path"]).name == "flashspec_runs_3.json" and "flashspec-sessions-" in served["path"]
    gradio_files = [p for p in dirs["gradio"].rglob("*") if p.is_file()]
    assert gradio_files == []  # exports are served from the sessions' folders, never copied into gradio's cache
    (root,) = dirs["tmp"].glob("flashspec-sessions-*")
    sessions = [p for p in root.iterdir()]
    assert len(sessions) == 8  # the least recently written beyond eight are gone
    newest = max(sessions, key=lambda p: p.stat().st_mtime)
    assert sorted(p.name for p in newest.iterdir()) == ["flashspec_runs_3.csv", "flashspec_runs_3.json"]
