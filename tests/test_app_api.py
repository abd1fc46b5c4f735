"""The running app as a remote user meets it: `python app.py` in its default (public) configuration, called
through gradio_client and through raw queue and upload requests with values the page never sends. Every hostile
case gets a short message (or a correct result), the server stays up, the next normal run's text is unchanged,
nothing loads from the server's disk, 8 sessions at once each get their own text, run files are checked value by
value and kept within a memory bound, replays are paced and bounded and never hold their slots unread, exports
stay while their session lives, the queue is bounded per client, and identical seeded races give the same tokens.
"""
from __future__ import annotations

import html
import json
import re
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file

import app
from flashspec_core.models import embedded_model_dir
from tests.run_files import run_document, write
from tests.served_app import ROOT, app_env, rss_mb, served_app

ARTIFACTS = ROOT / "tests" / "artifacts"
SETTINGS = dict(pair="embedded", target="", draft="", roles=["prompt_lookup", "ngram_cache"], gamma_auto=False,
                gamma=4, temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0, bandit="ucb1", backend="auto",
                shape="chain")
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
    (dict(seed=10**400), "seed must be an integer in 0..18446744073709551615, got 10000000000000000000000000000000"),
    (dict(top_p=1e-300), "top_p 1e-300 is 0 as a 32-bit float"),
    (dict(temperature=1e-300), "temperature 1e-300 is 0 as a 32-bit float"),
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


def test_exports_stay_while_their_session_lives_and_clear_removes_them(server):
    url, dirs = server
    clients = [Client(url, verbose=False, download_files=False) for _ in range(10)]
    outs = [run(c, max_new_tokens=2) for c in clients]  # ten sessions: more than the eight the app once kept
    first = outs[0]["download_json"]["value"]["path"]
    assert Path(first).name == "flashspec_runs_1.json" and "flashspec-sessions-" in first
    (root,) = dirs["tmp"].glob("flashspec-sessions-*")
    assert len([p for p in root.iterdir()]) >= 10 and Path(first).exists()
    assert httpx.get(url + "gradio_api/file=" + first).status_code == 200  # the first session's download works
    assert [p for p in dirs["gradio"].rglob("*") if p.is_file() and p.suffix != ".json"] == []  # nothing copied
    clients[0].predict(api_name="/clear_runs")
    assert not Path(first).parent.exists()  # Clear removes the session's files, and only its own
    assert Path(outs[1]["download_json"]["value"]["path"]).exists()


HOSTILE_FILES = [
    (dict(), "span", "\ud800", r"lone surrogate \(U\+D800\)"),
    (dict(name="run \udc00"), None, None, r"'run' contains a lone surrogate"),
    (dict(), "gamma", -5, r"'gamma' should be an integer in 0..32, got -5"),
    (dict(), "elapsed_s", 1e308, r"'elapsed_s' should be a number in 0..86400, got 1e\+308"),
    (dict(), "elapsed_s", 5e-324, r"should be at least 1e-06 s"),
    (dict(), "index", 2**70, r"'index' should be an integer in 0..30000"),
    (dict(spans=64), None, None, r"'spans' and 'arms' should be short lists|do not agree|'gamma' should be"),
]


@pytest.mark.parametrize("doc_args, key, value, message", HOSTILE_FILES)
def test_run_files_with_hostile_values_get_a_short_message(server, tmp_path, doc_args, key, value, message):
    doc = run_document(**doc_args)
    if key == "span":
        doc["runs"][0]["events"][0]["spans"][0][2] = value
    elif key:
        doc["runs"][0]["events"][0][key] = value
    client = Client(server[0], verbose=False, download_files=False)
    position = load_file(client, write(tmp_path / "hostile.json", doc))["replay_position"]
    assert position.startswith("**Cannot load this file:**") and re.search(message, position), position
    assert len(position) < 300 and "\n" not in position
    assert load_file(client, write(tmp_path / "good.json", run_document()))["replay_position"].startswith("Round 0 of 20")


REPLAY_OUTPUTS = [n for n in app.REPLAY_OUTPUTS if n != "state"] + ["replay_pick"]


def load_file(client: Client, path: Path) -> dict:
    return dict(zip(REPLAY_OUTPUTS, client.predict(handle_file(str(path)), api_name="/replay_load")))


def test_markup_in_a_run_file_is_text_in_the_figure(server, tmp_path):
    client = Client(server[0], verbose=False, download_files=False)
    out = load_file(client, write(tmp_path / "link.json", run_document(bandit="<a href='https://x.test'>click</a>")))
    plot = json.dumps(out["replay_arms"])
    assert "&lt;a href=" in plot and "<a href" not in plot


def test_repeated_loads_of_large_run_files_keep_memory_bounded(server, tmp_path):
    url = server[0]
    path = tmp_path / "big.json"
    size = write(path, run_document(rounds=1500, spans=33)).stat().st_size  # ~1.7 MB, 49,500 tokens
    clients = [Client(url, verbose=False, download_files=False) for _ in range(4)]
    load_file(clients[0], path)
    before = rss_mb(url.pid)
    for i in range(8):
        assert load_file(clients[i % 4], path)["replay_position"].startswith("Round 0 of 1500")
    grown = rss_mb(url.pid) - before
    assert grown < 60, f"{grown:.0f} MB more after 8 more loads of a {size / 2**20:.1f} MB file"


def stream(url: str, api_name: str, data: list, session: str, timeout: float = 60) -> tuple[dict, int]:
    """A raw queue request under a given session: its last message and the bytes the stream carried."""
    body = json.dumps({"data": data, "event_data": None, "fn_index": fn_index(url, api_name), "trigger_id": None,
                       "session_hash": session})
    joined = httpx.post(url + "gradio_api/queue/join", content=body, headers={"content-type": "application/json"})
    assert joined.status_code == 200, joined.text[:300]
    total = 0
    with httpx.stream("GET", url + "gradio_api/queue/data", params={"session_hash": session}, timeout=timeout) as s:
        for line in s.iter_lines():
            total += len(line)
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed":
                    return message, total
    raise AssertionError("the event never completed")


def upload(url: str, path: Path) -> dict:
    files = httpx.post(url + "gradio_api/upload", files={"files": (path.name, path.read_bytes())}).json()
    return {"path": files[0], "meta": {"_type": "gradio.FileData"}, "orig_name": path.name}


def test_a_replay_sends_what_changed_and_unread_replays_never_hold_the_slots(server, tmp_path):
    url = server[0]
    long = write(tmp_path / "long.json", run_document(rounds=2000, spans=9, gap=0.05))  # 100 s at full speed
    sessions = [uuid.uuid4().hex[:12] for _ in range(4)]
    for s in sessions:  # four sessions load it, then play it without ever reading the stream
        message, _ = stream(url, "replay_load", [None, upload(url, long)], s)
        assert message["success"] and "Round 0 of 2000" in json.dumps(message["output"])
    for s in sessions:
        body = json.dumps({"data": [None, "long: run 1", 1.0], "event_data": None, "fn_index": fn_index(url, "replay_play"),
                           "trigger_id": None, "session_hash": s})
        assert httpx.post(url + "gradio_api/queue/join", content=body,
                          headers={"content-type": "application/json"}).status_code == 200
    reader = uuid.uuid4().hex[:12]
    short = write(tmp_path / "short.json", run_document(rounds=60, spans=9, gap=0.05))  # 3 s
    stream(url, "replay_load", [None, upload(url, short)], reader)
    t0 = time.monotonic()
    message, sent = stream(url, "replay_play", [None, "short: run 1", 1.0], reader)
    assert message["success"] and "(end)" in json.dumps(message["output"])
    assert time.monotonic() - t0 < 40  # the unread replays were dropped (else they hold the 4 slots for 100 s)
    whole = len(json.dumps(message["output"]))
    assert sent < 12 * whole, (sent, whole)  # ~30 updates, each only what changed


def test_every_endpoint_answers_null_values_with_a_short_message(server):
    url = server[0]
    config = httpx.get(url + "config").json()
    for dep in config["dependencies"]:
        name = dep.get("api_name")
        if not name or name in ("run_stream", "run_race"):  # covered by the hostile-value tests above
            continue
        message = queue_call(url, name, [None] * len(dep["inputs"]), timeout=30)
        text = json.dumps(message)
        assert "didn't return enough" not in text and "Traceback" not in text, (name, text[:300])
        if not message["success"]:
            assert len(message["output"].get("error") or "") < 300, (name, text[:300])
    assert raw_run(url)["status"].startswith("Done")


def test_embedded_typed_as_a_custom_target_is_the_one_embedded_model(server, baseline):
    before = rss_mb(server[0].pid)
    out = run(Client(server[0], verbose=False, download_files=False), pair="custom", target=" Embedded ")
    assert out["text"] == baseline["text"] and out["status"].startswith("Done")
    assert rss_mb(server[0].pid) - before < 200  # no second copy of the model (+983 MB)


LEG = dict(mode="speculative", pair="embedded", target="", draft="", roles=["prompt_lookup"], gamma_auto=False, gamma=4,
           bandit="ucb1", backend="auto", shape="chain")


@pytest.mark.parametrize("leg", [LEG, {**LEG, "roles": ["draft_head", "prompt_lookup", "ngram_cache"], "gamma_auto": True}],
                         ids=["prompt-lookup-gamma-4", "bandit-auto-gamma"])
def test_two_identical_seeded_configurations_give_the_same_tokens(server, leg):
    values = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 48, "seed": 7,
              **{f"{x}_{k}": v for x in ("a", "b") for k, v in leg.items()}}
    client = Client(server[0], verbose=False, download_files=False)
    out = client.predict("Write a short poem about the sea, then repeat it.", "", False,
                         *[values[n] for n in app.RACE_SETTING_NAMES], api_name="/run_race")
    named = dict(zip([n for n in app.RACE_OUTPUTS if n not in ("state", "tabs")], out))
    assert "Same tokens" in named["race_summary"], named["race_summary"]


def test_the_queue_is_bounded_per_client(server):
    url = server[0]
    codes = []
    # runs long enough that none ends while the 14 joins arrive (each run that ends makes room for one more):
    # an open request of 96 tokens, not PROMPT, whose copied answer ends after ~15 tokens on the 4-bit CPU path
    body = {"state": None, "prompt": "Write a long story about a dragon who learns to sing.", "example": "",
            "keep_rejected": False, **SETTINGS, "max_new_tokens": 96}
    for _ in range(14):  # one client joins many runs at once, never reading
        payload = json.dumps({"data": [body[n] for n in app.RUN_INPUTS], "event_data": None,
                              "fn_index": fn_index(url, "run_stream"), "trigger_id": None,
                              "session_hash": uuid.uuid4().hex[:12]})
        r = httpx.post(url + "gradio_api/queue/join", content=payload, headers={"content-type": "application/json"})
        codes.append((r.status_code, r.text[:200]))
    refused = [text for code, text in codes if code == 503]
    assert refused and all("Too many requests waiting from this client" in t for t in refused), codes
    assert sum(code == 200 for code, _ in codes) <= app.MAX_WAITING_PER_CLIENT + 2
    for _ in range(120):  # the accepted ones run; then the client may queue again
        try:
            assert raw_run(url)["status"].startswith("Done")
            return
        except AssertionError:
            time.sleep(1)
    pytest.fail("the client could not queue again")
