"""A presenter and an audience member in two browser contexts at once, at 1600x1200, on one token-mode app.

The audience sees the presenter's controls locked and a line saying how to unlock them; the presenter unlocks
with the token, turns prefix caching off, and the audience's status line says so within a few seconds; the
audience still chats. Screenshots go to a temporary folder (docs/ with UPDATE_SCREENSHOTS=1).
"""
from __future__ import annotations

import os
import time

import pytest

from playground.access import TOKEN, Access
from tests.conftest import serve_app
from tests.test_e2e_browser import BROWSER_MARKS, DOCS, open_page

pytestmark = BROWSER_MARKS
SECRET = "workshop-secret-42"
STATUS = "() => document.querySelector('#status')?.innerText || ''"


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    from engine import LLM
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=512), access=Access(TOKEN, SECRET),
                   store=tmp_path_factory.mktemp("store") / "ablation.json") as s:
        yield s





def test_the_audience_watches_the_presenter_steer(served, browser, tmp_path_factory):
    url, pg = served
    shots = DOCS if os.environ.get("UPDATE_SCREENSHOTS") else tmp_path_factory.mktemp("roles")
    audience, presenter = open_page(browser, url), open_page(browser, url)
    for page in (audience, presenter):
        page.get_by_text("Audience").first.wait_for(timeout=30_000)

    # the audience: the engine's controls are shown locked, with how to unlock them
    audience.get_by_role("tab", name="Engine settings").click()
    apply = audience.get_by_role("button", name="Apply", exact=True)
    apply.wait_for(timeout=30_000)
    audience.wait_for_function("() => Array.from(document.querySelectorAll('button'))"
                               ".filter(b => b.innerText.trim() === 'Apply').every(b => b.disabled)", timeout=30_000)
    assert "enter the presenter token" in audience.locator("#role-banner").inner_text()
    audience.screenshot(path=str(shots / "audience-locked.png"), full_page=True)

    # the presenter unlocks (a wrong token first), then turns prefix caching off
    presenter.get_by_text("Presenter", exact=True).first.click()
    box = presenter.locator("#presenter-token input").first
    box.fill("not it")
    presenter.get_by_role("button", name="Unlock").click()
    presenter.get_by_text("That is not the presenter token").wait_for(timeout=30_000)
    time.sleep(1.1)  # a wrong token slows the next from the same visitor by a second (identity.Guesses)
    box.fill(SECRET)
    presenter.get_by_role("button", name="Unlock").click()
    presenter.get_by_text("you steer the shared engine").wait_for(timeout=30_000)
    presenter.wait_for_function("() => document.querySelector('#presenter-token input').value === ''",
                                timeout=10_000)  # the token does not stay in the box
    presenter.get_by_role("tab", name="Engine settings").click()
    presenter.wait_for_function("() => Array.from(document.querySelectorAll('button'))"
                                ".filter(b => b.innerText.trim() === 'Apply').every(b => !b.disabled)",
                                timeout=30_000)
    checkbox = presenter.locator("#setting-prefix_caching input")
    checkbox.wait_for(timeout=30_000)
    presenter.wait_for_function("() => document.querySelector('#setting-prefix_caching input').checked",
                                timeout=30_000)
    checkbox.uncheck()
    presenter.get_by_role("button", name="Apply", exact=True).click()
    presenter.get_by_text("Applied: prefix_caching=False").wait_for(timeout=60_000)
    assert pg.settings()["prefix_caching"] is False
    presenter.screenshot(path=str(shots / "presenter-applied.png"), full_page=True)

    # every attendee's status line says who changed what
    audience.wait_for_function(f"() => ({STATUS})().includes('presenter turned prefix_caching off')",
                               timeout=30_000)
    # and the audience still chats
    audience.get_by_role("tab", name="Chat").click()
    msg = audience.get_by_placeholder("Type a message and press Enter")
    msg.fill("Hello from the back row")
    msg.press("Enter")
    audience.get_by_text("finished:").wait_for(timeout=120_000)
    assert audience.get_by_text("Hello from the back row").count() == 1  # sent once, and it was the message
    audience.screenshot(path=str(shots / "audience-chat.png"), full_page=True)
    # Stop says so beside the reply (the engine held still, so the reply is surely on its way when Stop comes)
    pg.service.pause()
    try:
        msg.fill("Tell me a long story")
        msg.press("Enter")
        audience.get_by_text("queued: the engine is paused").wait_for(timeout=30_000)
        audience.get_by_role("button", name="Send").click()  # the message is still in the box: not sent again
        audience.wait_for_timeout(1500)
        assert audience.get_by_text("Tell me a long story").count() == 1 and len(pg.service.engine.requests) == 1
        audience.get_by_role("button", name="Stop").click()
        audience.get_by_text("stopped: the reply ends here").wait_for(timeout=30_000)
    finally:
        pg.service.resume()
    # the stopped reply's request is aborted once its generator wakes (gradio cannot interrupt a blocked read)
    deadline = time.monotonic() + 60
    while pg.service.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pg.service.paused and pg.service.alive and not pg.service.engine.has_unfinished()
