"""Every tab of the playground in a real headless Chromium at 1600x1200: nothing clipped, nothing empty.

Each tab gets a screenshot (a temporary folder; docs/tabs/ with UPDATE_SCREENSHOTS=1) and a JavaScript check
that every text of every visible plotly chart (tick labels, titles, legend, annotations, bar labels) lies
inside its chart. Uses a tiny random model so the ablation and comparison runs take seconds.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest

from engine.measure import QUALITY_SPECS
from playground.results import SHIPPED_RESULTS
from tests.conftest import serve_app, wait_until
from tests.test_e2e_browser import BROWSER_MARKS, CHROMIUM, DOCS, FLAGS

pytestmark = BROWSER_MARKS

# Text that sticks out of its chart, a bar label cut by the plot area, a chart that does not fill its box:
# [chart index, text, why].
OVERFLOWING_TEXT = """() => {
  const bad = [];
  const inside = (r, b) => r.left >= b.left - 1 && r.right <= b.right + 1 && r.top >= b.top - 1
                           && r.bottom <= b.bottom + 1;
  document.querySelectorAll('.js-plotly-plot').forEach((plot, i) => {
    const box = plot.getBoundingClientRect();
    if (box.width === 0 || box.height === 0) return;  // on a hidden tab
    const areas = Array.from(plot.querySelectorAll('.nsewdrag')).map(d => d.getBoundingClientRect());
    // drawn while its tab was hidden, a chart kept plotly's default width instead of filling its box
    const svg = plot.querySelector('.main-svg');
    if (svg && svg.getBoundingClientRect().width < box.width - 4) bad.push([i, '', 'narrower than its box']);
    plot.querySelectorAll('svg text').forEach(t => {
      const r = t.getBoundingClientRect();
      if (!t.textContent.trim() || r.width === 0) return;
      if (!inside(r, box)) bad.push([i, t.textContent, 'outside the chart']);
      // a label drawn in a clipped layer (bar text) is cut where it leaves the plot area
      if (t.closest('[clip-path]') && t.closest('.bartext, .textpoint') && !areas.some(a => inside(r, a)))
        bad.push([i, t.textContent, 'cut by the plot area']);
    });
  });
  return bad;
}"""

# gradio's Dataframe draws its rows as a virtual table of divs
TABLE_CELLS = "() => Array.from(document.querySelectorAll('[data-testid^=\"cell-\"]'))" \
              ".filter(c => c.getBoundingClientRect().width > 0).map(c => c.innerText.trim())"
VISIBLE_CHARTS = "() => Array.from(document.querySelectorAll('.js-plotly-plot'))" \
                 ".filter(p => p.getBoundingClientRect().width > 0).length"
LIVE_TITLE = "() => document.querySelector('#chat-live .js-plotly-plot .gtitle')?.textContent || ''"
LIVE_LEGEND = "() => Array.from(document.querySelectorAll('#chat-live .js-plotly-plot .legendtext'))" \
              ".map(t => t.textContent)"
# the configuration changes' labels on each visible chart, and whether each lies inside its plot area
MARKER_LABELS = """(label) => Array.from(document.querySelectorAll('.js-plotly-plot'))
  .filter(p => p.getBoundingClientRect().width > 0).flatMap(plot => {
    const area = plot.querySelector('.nsewdrag').getBoundingClientRect();
    return Array.from(plot.querySelectorAll('.annotation-text')).filter(t => t.textContent === label).map(t => {
      const r = t.getBoundingClientRect();
      return r.left >= area.left - 1 && r.right <= area.right + 1 && r.top >= area.top - 1
             && r.bottom <= area.bottom + 1;
    });
  })"""


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    from engine import LLM
    store = tmp_path_factory.mktemp("store") / "ablation.json"
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=512), store=store) as s:
        yield s


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser.new_page(viewport={"width": 1600, "height": 1200})
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return DOCS / "tabs" if os.environ.get("UPDATE_SCREENSHOTS") else tmp_path_factory.mktemp("tabs")


def visit(page, tab: str, shots: Path, min_charts: int = 0, name: str | None = None) -> None:
    """Open a tab, wait for its charts, screenshot it and fail on any chart text that overflows its chart."""
    page.get_by_role("tab", name=tab).click()
    if min_charts:
        page.wait_for_function(f"() => ({VISIBLE_CHARTS})() >= {min_charts}", timeout=60_000)
    page.wait_for_timeout(1000)  # a dashboard refresh lands and plotly finishes its layout
    with contextlib.suppress(Exception):  # a busy machine: give a resize or a refresh time to land
        page.wait_for_function(f"() => ({OVERFLOWING_TEXT})().length === 0", timeout=20_000)
    shots.mkdir(parents=True, exist_ok=True)
    path = shots / ((name or re.sub(r"\W+", "-", tab.lower()).strip("-")) + ".png")
    page.screenshot(path=str(path), full_page=True)
    assert page.evaluate(OVERFLOWING_TEXT) == [], f"chart text overflows on the {tab} tab (see {path})"


# a visible chart whose box would shrink when gradio mounts its next figure: [title, chart px, box min-height]
CHART_BOXES_KEEP_HEIGHT = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
  .filter(p => p.offsetHeight > 0 && p.querySelector('.main-svg'))
  .map(p => [p.querySelector('.gtitle')?.textContent || '', p.offsetHeight,
             parseFloat(p.closest('.block').style.minHeight) || 0])
  .filter(([, h, min]) => min < h)"""
# scrolled to the page's end, every frame for `ms` milliseconds: the positions it moved to by itself
SCROLL_HELD = """async (ms) => {
  window.scrollTo(0, document.documentElement.scrollHeight);
  await new Promise(r => requestAnimationFrame(r));
  const at = window.scrollY, moved = [], t0 = performance.now();
  while (performance.now() - t0 < ms) {
    await new Promise(r => requestAnimationFrame(r));
    if (window.scrollY < at - 100) moved.push(Math.round(window.scrollY));
  }
  return at > 0 ? moved : ['the page does not scroll: nothing checked'];
}"""
USER_MESSAGES = "() => Array.from(document.querySelectorAll('[data-testid=\"user\"]')).map(e => e.innerText.trim())"


def test_every_tab_readable_at_1600x1200(served, page, shots):
    url, pg = served
    page.goto(url)
    page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)

    box = page.get_by_placeholder("Type a message and press Enter")
    box.fill("Hello")
    box.press("Enter")
    page.get_by_text("finished:").wait_for(timeout=60_000)
    # the live view beside the chat followed this tab's request to its end
    page.wait_for_function(f"() => ({LIVE_TITLE})().endsWith('finished, blocks freed')", timeout=30_000)
    first = re.search(r"Your request (\S+):", page.evaluate(LIVE_TITLE)).group(1)
    # the status line above the tabs keeps time on every tab, the Dashboard never opened
    page.wait_for_function("() => /steps done: [1-9]/.test(document.body.innerText)", timeout=30_000)
    page.locator("#clear-chat").click()
    page.wait_for_function("() => !document.querySelector('[data-testid=\"bot\"]')", timeout=30_000)

    # mid-reply, held in step mode: the view shows this tab's request, bright among the others, while it streams
    pg.service.pause()
    box.fill("Tell me about the sea")
    box.press("Enter")
    page.get_by_text("queued: the engine is paused").wait_for(timeout=30_000)
    # the message left the box as it was sent: Enter again sends nothing, and a message typed meanwhile waits in
    # the box for this reply to end (one reply at a time per tab)
    assert box.input_value() == ""
    box.press("Enter")
    box.fill("And the mountains")
    box.press("Enter")
    page.get_by_text("your reply is still on its way").wait_for(timeout=30_000)
    assert box.input_value() == "And the mountains"
    assert page.evaluate(USER_MESSAGES) == ["Tell me about the sea"]
    box.fill("")
    for _ in range(3):
        pg.service.step_once()
    page.wait_for_function(f"() => /^Your request \\S+: \\d+ of \\d+ blocks, decoding/.test(({LIVE_TITLE})())",
                           timeout=30_000)
    rid = re.search(r"Your request (\S+):", page.evaluate(LIVE_TITLE)).group(1)
    assert rid != first and f"your request {rid}" in page.evaluate(LIVE_LEGEND)
    assert "running **1**" not in page.inner_text("#chat-live")  # markdown rendered, not shown raw
    assert re.search(r"running 1 · waiting 0 · [\d.]+ tokens/s", page.inner_text("#chat-live"))
    visit(page, "Chat", shots, min_charts=1, name="chat-live-view")
    pg.service.resume()
    page.get_by_text("finished:").wait_for(timeout=60_000)
    page.wait_for_function(f"() => ({LIVE_TITLE})() === 'Your request {rid}: finished, blocks freed'",
                           timeout=30_000)
    page.locator("#clear-chat").click()
    page.wait_for_function("() => !document.querySelector('[data-testid=\"bot\"]')", timeout=30_000)

    # many requests at once, held in step mode: the block table's legend must stay readable
    page.get_by_role("tab", name="Step mode").click()
    page.get_by_role("button", name="Pause").click()
    page.get_by_text("Paused: the engine waits").wait_for(timeout=30_000)
    page.get_by_role("tab", name="Dashboard").click()
    page.get_by_role("button", name="Launch users").click()  # 16 users for 120 s (its section is open)
    assert wait_until(lambda: len(pg.service.engine.requests) >= 16, timeout_s=30.0,
                      poll_s=0.1), "the 16 launched users' requests never reached the engine"
    page.get_by_text("16 users from 'shared-system-prompt'").wait_for(timeout=30_000)
    assert re.search(r"[█░]{30} \d+%", page.inner_text("body"))  # the run's progress bar
    page.get_by_role("tab", name="Step mode").click()
    for _ in range(30):  # the step's token budget admits a few prompts a step: step until most users run
        page.get_by_role("button", name="Step", exact=True).click()
        page.get_by_text("After the step:").wait_for(timeout=30_000)
        page.wait_for_timeout(200)
        if len(pg.service.snapshot().running) >= 10:
            break
    page.wait_for_timeout(1500)  # the last step's heading lands
    heading = page.evaluate("() => Array.from(document.querySelectorAll('h3')).map(h => h.innerText)"
                            ".find(t => /^Step \\d+/.test(t)) || ''")
    step = int(re.search(r"Step (\d+)", heading).group(1))
    # the heading and the status line count steps the same way
    page.wait_for_function(f"() => document.body.innerText.includes('steps done: {step}')", timeout=30_000)
    assert "traffic: 16 users" in page.inner_text("body")  # every tab's status line says the load is on
    visit(page, "Step mode", shots, min_charts=1)
    visit(page, "Dashboard", shots, min_charts=5)
    legend = page.evaluate("() => Array.from(Array.from(document.querySelectorAll('.js-plotly-plot'))"
                           ".find(p => p.querySelector('.gtitle')?.textContent.startsWith('KV pool:')"
                           " && p.getBoundingClientRect().width > 0).querySelectorAll('.legendtext'))"
                           ".map(t => t.textContent)")
    assert any("other requests" in t for t in legend) and "free" in legend, legend
    page.get_by_role("tab", name="Step mode").click()
    page.get_by_role("button", name="Resume").click()
    page.get_by_role("tab", name="Dashboard").click()
    page.wait_for_function("() => /requests sent \\d+ · done [1-9]/.test(document.body.innerText)", timeout=120_000)
    # scrolled down to the traffic controls while the charts refresh under load, the page stays where it is (gradio
    # mounts a fresh, empty plot for each figure: the page used to shrink for a moment and jump back to the top)
    assert page.evaluate(CHART_BOXES_KEEP_HEIGHT) == [], "a chart's box is shorter than its chart"
    assert page.evaluate(SCROLL_HELD, 4000) == [], "the page scrolled by itself while the charts refreshed"
    page.get_by_role("button", name="Stop users").click()
    # (Stop lets the replies in flight finish: under the whole suite's load that took over 30 s once)
    page.wait_for_function("() => document.body.innerText.includes('stopped · 16 users from')", timeout=90_000)
    assert not pg.traffic.running

    visit(page, "Engine settings", shots)

    page.get_by_role("tab", name="What is each feature worth?").click()
    page.get_by_role("button", name="Run ablation").click()
    page.wait_for_function(f"() => ({TABLE_CELLS})().includes('full engine')", timeout=180_000)
    visit(page, "What is each feature worth?", shots, min_charts=1)
    headers = page.evaluate("() => Array.from(document.querySelectorAll('table th'))"
                            ".filter(th => th.getBoundingClientRect().width > 0).map(th => th.innerText.trim())")
    assert "configuration" in headers and "tok/s" in headers, headers

    page.get_by_role("tab", name="Compare two configurations").click()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_text("identical output").wait_for(timeout=180_000)
    visit(page, "Compare two configurations", shots, min_charts=1)
    cells = page.evaluate(TABLE_CELLS)
    assert "naive" in cells and "full" in cells, cells
    assert not [c for c in cells if re.fullmatch(r"-?\d+\.\d{5,}", c)], cells  # no raw floats

    # a switch flipped in Engine settings: a labelled marker on every time-series chart, inside its plot area,
    # and the prefix chart says caching is off instead of staying empty
    page.get_by_role("tab", name="Engine settings").click()
    page.get_by_label("prefix_caching").uncheck()
    page.get_by_role("button", name="Apply").click()
    page.get_by_text("Applied: prefix_caching=False").wait_for(timeout=30_000)
    list(pg.service.stream("hi", __import__("engine").SamplingParams(max_tokens=8)))
    page.get_by_role("tab", name="Dashboard").click()
    page.wait_for_function("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                           ".some(p => p.textContent.includes('prefix caching is off'))", timeout=30_000)
    page.wait_for_function(f"() => ({MARKER_LABELS})('prefix_caching off').length === 3", timeout=30_000)
    visit(page, "Dashboard", shots, min_charts=5, name="dashboard-prefix-caching-off")
    assert page.evaluate(MARKER_LABELS, "prefix_caching off") == [True, True, True]


VISIBLE_TRACES = "() => Array.from(document.querySelectorAll('.js-plotly-plot'))" \
                 ".filter(p => p.getBoundingClientRect().width > 0).map(p => (p.data || []).length)"


def test_the_engine_feature_by_feature_tab(served, page, shots):
    """Before anything is measured here, the repository's shipped results are drawn, with where and when they
    were measured. Then each Run button measures its
    experiment on the tiny model (quick presets), and the four charts stay readable, now marked as this machine's;
    the concurrency selector redraws."""
    url, pg = served
    tab = "The engine, feature by feature"
    page.goto(url)
    page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)
    visit(page, tab, shots, min_charts=3, name="features-before")
    assert page.get_by_text("Shipped results: measured on").is_visible()
    # the shipped rows, drawn before any run: quality's two panels of bars and of goals; memory's 2 layouts x the
    # KV dtypes the shipped sweep has x 3 panels
    kv_dtypes = {row["kv_cache_dtype"] for row in json.loads(SHIPPED_RESULTS.read_text())["memory"]}
    assert page.evaluate(VISIBLE_TRACES) == [1, 4, 3, 2 * len(kv_dtypes) * 3]
    assert page.get_by_text("(shipped with the repository)").count() == 4
    assert page.get_by_text("No results yet").count() == 0
    measured_here = "() => (document.body.innerText.match(/measured on this machine/g) || []).length"
    for done, (button, cell) in enumerate((("Run cumulative ablation", "+ KV cache"),
                                           ("Run quality against fp32", "float32, int8 weights"),
                                           ("Run concurrency sweep", "reference"), ("Run memory sweep", "contiguous")),
                                          start=1):
        if button == "Run quality against fp32":  # two precisions are enough to draw both panels (quicker)
            for spec in QUALITY_SPECS:
                if spec not in ("quantization=int8", "kv_cache_dtype=int8"):
                    page.get_by_label(spec, exact=True).uncheck()
        if button in ("Run concurrency sweep", "Run memory sweep"):  # one request a run is enough to draw them
            page.get_by_label("workload", exact=True).nth(1 if button == "Run concurrency sweep" else 2).click()
            page.get_by_role("option", name="single-stream", exact=True).click()
        page.get_by_role("button", name=button).click()  # the shipped rows' cells are there already: wait for the
        page.wait_for_function(f"() => ({measured_here})() >= {done}", timeout=300_000)  # run's own note
        assert cell in page.evaluate(TABLE_CELLS)
    assert not pg.service.paused and pg.measurement is None
    visit(page, tab, shots, min_charts=3, name="features")
    # cumulative bars; quality's two panels of bars and of goals; 3 concurrencies; 2 layouts x 2 KV dtypes x 3 panels
    assert page.evaluate(VISIBLE_TRACES) == [1, 4, 3, 12]
    assert page.get_by_text("measured on this machine").count() == 4
    page.get_by_label("1", exact=True).check()
    page.wait_for_function(f"() => ({VISIBLE_TRACES})()[2] === 1", timeout=30_000)
    visit(page, tab, shots, min_charts=3, name="features-concurrency-1")


def test_the_weights_change_from_the_settings_tab(served, page, shots):
    """The weights' controls are there with what runs; int4 with the LM head in int8 chosen and applied rebuilds the
    model, says so, and every tab's status line shows the new precision. Back to none afterwards, for the other
    tests."""
    url, pg = served
    page.goto(url)
    page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)
    page.get_by_role("tab", name="Engine settings").click()
    for label in ("quantization (weights)", "int4 group size", "quantize_lm_head", "dtype"):
        assert page.get_by_label(label, exact=True).is_visible(), label
    page.get_by_text("Weights: float32.").wait_for(timeout=30_000)
    quantized = "float32, int4 weights (groups of 32), the LM head int8"
    for choice in ("int4", "none"):
        page.get_by_label("quantization (weights)", exact=True).click()
        page.get_by_role("option", name=choice, exact=True).click()
        if choice == "int4":
            page.get_by_label("quantize_lm_head", exact=True).click()
            page.locator("#setting-quantize_lm_head").get_by_role("option", name="int8", exact=True).click()
        page.get_by_role("button", name="Apply").click()
        precision = quantized if choice == "int4" else "float32"
        page.get_by_text(f"Rebuilt the engine for {precision}: weights loaded in").wait_for(timeout=120_000)
        if choice == "int4":
            assert pg.llm.engine.model.weight_format.head_scheme == "int8"
            page.get_by_text(f"Weights: {quantized}.").wait_for(timeout=30_000)
            page.wait_for_function(f"() => document.body.innerText.includes('running · {quantized}')",
                                   timeout=30_000)
            visit(page, "Engine settings", shots, name="engine-settings-int4")
    assert pg.llm.engine.model.weight_format.quantization is None and pg.service.alive


def test_attaching_to_an_address_where_nothing_answers_is_refused_in_the_page(served, page, shots):
    """One message for every way of failing (the reason is in the server's log), and the page keeps watching the
    local engine."""
    url, pg = served
    page.goto(url)
    page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)
    page.get_by_role("tab", name="Remote server").click()
    page.get_by_text("Not attached: the page shows the engine in this process").wait_for(timeout=60_000)
    page.locator("#remote-url input, #remote-url textarea").first.fill("http://127.0.0.1:9")
    page.get_by_role("button", name="Attach").click()
    # shown as text: the address as scheme://host:port, nothing the (absent) server said
    page.get_by_text("could not attach to http://127.0.0.1:9: could not reach a metrics endpoint").first.wait_for(
        timeout=30_000)
    visit(page, "Remote server", shots)
    assert pg.remote is None


# the last user bubble: what Markdown or HTML made in it (elements a plain text never has), and the text it shows
LAST_USER_BUBBLE = """() => {
  const bubble = Array.from(document.querySelectorAll('[data-testid="user"]')).pop();
  if (!bubble) return null;
  const made = bubble.querySelectorAll('img, strong, em, a, code, pre, h1, h2, h3, ul, ol, li, blockquote, table, del, '
                                       + 'hr, script, iframe, svg, .katex');
  return {made: Array.from(made).map(e => e.outerHTML), text: bubble.querySelector('.md, .prose')?.textContent
          ?? bubble.textContent};
}"""


def test_a_visitor_s_own_message_shows_as_text_not_markdown(served, page, monkeypatch):
    """The project's rule: a visitor's text renders as text, not Markdown. gradio's Chatbot renders every message as
    Markdown (with some HTML): this message showed a broken image, bold text and a link in its own bubble. Now the
    bubble holds none of it and shows every character typed, and the model is sent the text as typed."""
    url, pg = served
    sent = []
    template = pg.llm.apply_chat_template
    monkeypatch.setattr(pg.llm, "apply_chat_template", lambda messages, *a, **kw: (
        sent.append([dict(m) for m in messages]), template(messages, *a, **kw))[1])
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(url)
    page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)
    typed = ("# <img src=x onerror=alert(1)> **bold** [link](javascript:alert(1)) `code` _under_ ~~gone~~ "
             "$$x^2$$ a\\*b &amp; <b>tag</b> www.example.com | a | b |")
    box = page.get_by_placeholder("Type a message and press Enter")
    box.fill(typed)
    box.press("Enter")
    page.wait_for_function(f"() => ({LAST_USER_BUBBLE})() !== null", timeout=30_000)
    page.get_by_text("finished:").wait_for(timeout=60_000)
    shown = page.evaluate(LAST_USER_BUBBLE)
    assert shown["made"] == [] and shown["text"].strip() == typed
    assert not dialogs
    # the next turn sends the conversation back from the page: the model reads the first message as it was typed;
    # and the spaces, tabs and line breaks typed show as typed (HTML would fold each run into one space)
    spaced = "And   then?\n    indented\tafter a tab\n\nA new paragraph"
    box.fill(spaced)
    box.press("Enter")
    assert wait_until(lambda: sent and sent[-1][-1]["content"] == spaced, timeout_s=30.0,
                      poll_s=0.1), f"the second turn never reached the model (last sent: {sent[-1:]})"
    assert sent[-1][0] == {"role": "user", "content": typed}
    page.wait_for_function("() => document.querySelectorAll('[data-testid=\"user\"]').length >= 2", timeout=30_000)
    shown = page.evaluate("() => Array.from(document.querySelectorAll('[data-testid=\"user\"]')).pop()"
                          ".querySelector('.md, .prose').innerText")
    assert shown.strip() == spaced
