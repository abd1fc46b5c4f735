"""The app under hostile replay use, measured against `python app.py` on this machine (as tests/served_app starts it):

1. memory: a ~9.9 MB run file loaded 20 times over 8 sessions through /replay_load; the server's RSS before,
   after each load (the highest is reported) and at the end. Twice: a file shaped as issue 17's (64 tokens a
   round, 3,050 rounds here: refused, a round holds at most 33 tokens) and one the app accepts (5,450 rounds x
   33 tokens, 180,000 tokens);
2. others' speed: a second client's runs (prompt lookup alone, gamma 4, greedy: the same rounds every time),
   tok/s as its status line reports them, alone, while 4 other sessions play long replays at full speed (the
   most the app plays at once), and while one other client loads the accepted 9.8 MB file in a loop (loads
   take turns with runs: the run's wall time, queueing included, is reported too).

    python -m benchmarks.replay_load [--loads 20] [--sessions 8] [--runs 3]

Writes benchmarks/results/replay_load.json and prints the figures. Targets (issue 17): memory within a stated
bound; others' runs at >= 80% of their solo speed while replays play.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

from gradio_client import Client, handle_file

import app
from benchmarks.run import RESULTS
from tests.run_files import run_document, write
from tests.served_app import ROOT, app_env, rss_mb, served_app
from tests.test_app_api import SETTINGS as API_SETTINGS

OUT = RESULTS / "replay_load.json"
SETTINGS = {**API_SETTINGS, "roles": ["prompt_lookup"], "max_new_tokens": 96}  # the API tests' settings, every name
PROMPT = "Repeat this list three times: apples, pears, plums, cherries, grapes, melons, lemons, limes."


def client(url: str) -> Client:
    return Client(url, verbose=False, download_files=False)


def load(c: Client, path: Path) -> str:
    out = c.predict(handle_file(str(path)), api_name="/replay_load")
    return out[2]  # replay_position


def memory(url: str, path: Path, loads: int, sessions: int) -> dict:
    clients = [client(url) for _ in range(sessions)]
    before, samples, message = rss_mb(url.pid), [], ""
    for i in range(loads):
        t0 = time.perf_counter()
        message = load(clients[i % sessions], path)
        samples.append((round(rss_mb(url.pid)), round(time.perf_counter() - t0, 2)))
    return {"file_mb": round(path.stat().st_size / 2**20, 2), "rss_before_mb": round(before),
            "rss_max_mb": max(s[0] for s in samples), "rss_after_mb": samples[-1][0],
            "load_s_median": statistics.median(s[1] for s in samples), "last_message": message[:160]}


def run_tok_s(c: Client) -> float:
    out = c.predict(PROMPT, "", False, *[SETTINGS[n] for n in app.SETTING_NAMES], api_name="/run_stream")
    status = dict(zip([n for n in app.STREAM_OUTPUTS if n not in ("state", "tabs")], out))["status"]
    return float(re.search(r"at ([\d.]+) tok/s", status).group(1))


def speed_while_replaying(url: str, replay_file: Path, runs: int) -> dict:
    runner = client(url)
    run_tok_s(runner)  # warm-up
    solo = [run_tok_s(runner) for _ in range(runs)]
    players, stop = [client(url) for _ in range(4)], threading.Event()
    for p in players:
        load(p, replay_file)

    def play(c: Client):
        while not stop.is_set():
            try:
                c.predict("replay: run 1", 1.0, api_name="/replay_play")
            except Exception:  # noqa: BLE001 - the client stops when the server does
                return

    threads = [threading.Thread(target=play, args=(p,), daemon=True) for p in players]
    for t in threads:
        t.start()
    time.sleep(3)
    busy = [run_tok_s(runner) for _ in range(runs)]
    stop.set()
    return {"solo_tok_s": solo, "with_4_replays_tok_s": busy,
            "ratio": round(statistics.median(busy) / statistics.median(solo), 3)}


def speed_while_loading(url: str, path: Path, runs: int) -> dict:
    runner, loader, stop = client(url), client(url), threading.Event()
    solo = [run_tok_s(runner) for _ in range(runs)]
    waits = []

    def loop():
        while not stop.is_set():
            load(loader, path)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    busy = []
    for _ in range(runs):
        t0 = time.perf_counter()
        busy.append(run_tok_s(runner))
        waits.append(round(time.perf_counter() - t0, 2))
    stop.set()
    thread.join()
    return {"solo_tok_s": solo, "with_loads_looping_tok_s": busy, "with_loads_run_wall_s": waits,
            "ratio": round(statistics.median(busy) / statistics.median(solo), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=["memory", "replays", "loads"], nargs="*", default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="replay-load-"))
    issue = write(tmp / "issue17.json", run_document(rounds=3050, spans=64, gap=0.05))
    accepted = write(tmp / "largest.json", run_document(rounds=5450, spans=33, gap=0.05))
    replay = write(tmp / "replay.json", run_document(rounds=1200, spans=9, gap=0.05))  # 60 s at full speed
    result = {}
    with served_app(tmp / "app.log", app_env(TMPDIR=str(tmp))) as url:
        client(url)
        time.sleep(5)  # the embedded model preloads and calibrates
        only = set(args.only or ["memory", "replays", "loads"])
        if "memory" in only:
            result["memory_issue17_file"] = memory(url, issue, args.loads, args.sessions)
            result["memory_largest_accepted_file"] = memory(url, accepted, args.loads, args.sessions)
        if "replays" in only:
            result["others_speed"] = speed_while_replaying(url, replay, args.runs)
            time.sleep(2)
        if "loads" in only:
            result["others_speed_while_loading"] = speed_while_loading(url, accepted, args.runs)
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    OUT.write_text(json.dumps({**old, **result}, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
