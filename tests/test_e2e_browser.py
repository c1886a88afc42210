"""End to end in a real headless Chromium: chat, watch the charts change, toggle a feature.

Needs Debian's chromium (`apt-get install -y chromium`) and Python Playwright (never `playwright install`).
With UPDATE_SCREENSHOTS=1 it also refreshes the README's screenshots in docs/.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import serve_app

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS = Path(__file__).resolve().parent.parent / "docs"

# every browser test file's marks: slow, served (`make test` runs them beside the rest), no chromium: skipped
BROWSER_MARKS = [pytest.mark.slow, pytest.mark.served,
                 pytest.mark.skipif(not (os.path.exists(CHROMIUM) or shutil.which("chromium")),
                                    reason="no chromium: apt-get install -y chromium")]
pytestmark = BROWSER_MARKS


def open_page(browser, url, **context):
    """A page at 1600x1200 in a fresh context (a visitor of its own), once the app has drawn."""
    page = browser.new_context(viewport={"width": 1600, "height": 1200}, **context).new_page()
    page.goto(url)
    page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)
    return page


@pytest.fixture(scope="module")
def app_url():
    from engine import LLM
    with serve_app(LLM(max_model_len=1024)) as served:
        yield served


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield pg
        browser.close()


def shot(page, name: str, tmp_path_factory) -> None:
    target = DOCS if os.environ.get("UPDATE_SCREENSHOTS") else tmp_path_factory.getbasetemp()
    target.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target / name), full_page=True)


# plotly redraws its SVG each tick: read with JavaScript instead of holding element handles. The dashboard's block
# table is the visible chart whose title starts "KV pool:" (the chat tab's live view comes first in the page).
POOL_TITLE = "() => Array.from(document.querySelectorAll('.js-plotly-plot'))" \
             ".filter(p => p.getBoundingClientRect().width > 0)" \
             ".map(p => p.querySelector('.gtitle')?.textContent || '').find(t => t.startsWith('KV pool:')) || ''"


def test_chat_dashboard_and_toggle_in_a_real_browser(app_url, page, tmp_path_factory):
    url, pg = app_url
    page.goto(url)
    page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)

    box = page.get_by_placeholder("Type a message and press Enter")
    box.fill("What is the capital of France?")
    box.press("Enter")
    page.get_by_text("finished:").wait_for(timeout=120_000)
    bubbles = page.locator(".message-row, [data-testid='bot']")
    shown = page.evaluate("() => Array.from(document.querySelectorAll('[data-testid=\"bot\"]'))"
                          ".map(e => e.innerText.trim()).pop() || ''")
    assert bubbles.count() >= 1 and shown
    # what the page streamed ends exactly as the engine's final reply (no duplicated or echoed text)
    assert " ".join(shown.split()) == " ".join(pg.replies[-1].split())
    assert "What is the capital" not in shown
    # beside it, the live view followed this tab's request to its end
    page.wait_for_function("() => (document.querySelector('#chat-live .gtitle')?.textContent || '')"
                           ".endsWith('finished, blocks freed')", timeout=60_000)
    shot(page, "chat.png", tmp_path_factory)

    page.get_by_role("tab", name="Dashboard").click()
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 5", timeout=60_000)
    page.wait_for_function(f"() => ({POOL_TITLE})() !== ''", timeout=60_000)
    before = page.evaluate(POOL_TITLE)
    page.get_by_role("tab", name="Chat").click()
    box.fill("Name three colours.")
    box.press("Enter")  # sent at once, the previous reply shown finished: the box gives it up (not "still on its way")
    page.wait_for_function("() => document.querySelector('textarea[placeholder^=\"Type a message\"]')?.value === ''",
                           timeout=30_000)
    page.get_by_role("tab", name="Dashboard").click()
    page.wait_for_function(f"(before) => ({POOL_TITLE})() !== before", arg=before, timeout=60_000)
    shot(page, "dashboard.png", tmp_path_factory)

    page.get_by_role("tab", name="Engine settings").click()
    page.get_by_text("empty = automatic:").first.wait_for(timeout=30_000)  # an empty size says what it means
    page.get_by_label("num_kv_blocks (pool size)").fill("10000000")  # terabytes: refused on any machine
    page.get_by_role("button", name="Apply").click()
    page.get_by_text(re.compile("Not applied.*GB of (RAM|GPU memory).* is available")).wait_for(timeout=30_000)
    # then the form is drawn again as the engine runs (the refused size gone): a box ticked before that is redrawn
    page.wait_for_function("() => [document.querySelector('#setting-num_kv_blocks input')?.value]"
                           ".every(v => v !== undefined && v !== '10000000')", timeout=30_000)
    assert pg.service.alive
    checkbox = page.get_by_label("prefix_caching")
    assert checkbox.is_checked()  # the controls show the engine's actual state on load
    checkbox.uncheck()
    page.get_by_role("button", name="Apply").click()
    page.get_by_text(re.compile(r"^Applied")).wait_for(timeout=30_000)
    # what the engine runs once its pending changes apply (read together: a step can apply the change between a
    # look at the pending changes and one at the last step's snapshot)
    assert pg.settings()["prefix_caching"] is False
    shot(page, "settings.png", tmp_path_factory)
