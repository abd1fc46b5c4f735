"""`python app.py` started on a free local port for the end-to-end tests (browser, API, Space simulation),
as a person would start it: HF_HUB_OFFLINE=1, no SPACE_ID, no TRITON_INTERPRET (tests/conftest.py sets it).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_env(**extra: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    for name in ("SPACE_ID", "TRITON_INTERPRET"):
        env.pop(name, None)
    return {**env, **extra}


class Served(str):
    """The app's URL, with the server's process id (to read its memory)."""
    pid: int


@contextmanager
def served_app(log_path: Path, env: dict | None = None, args: tuple = (), python: tuple = ("app.py",)) -> Iterator[str]:
    """Start the app (python + python args + --port N + args), wait until it answers, yield its URL (a `Served`),
    stop it.
    `python` may replace "app.py" with e.g. ("-c", code) to start it in a simulated environment."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, *python, "--port", str(port), *args], cwd=ROOT, env=env or app_env(),
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the app exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the app did not answer on {url} within {START_TIMEOUT_S} s")
                time.sleep(0.5)
        served = Served(url)
        served.pid = proc.pid
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
