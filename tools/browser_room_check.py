"""A room in Chromium (1600x1200) on this machine: how soon every attendee's page agrees with the engine after a
lesson changes it, and a person's time to first token, idle and while 32 simulated users run.

    python tools/browser_room_check.py            # a presenter and three attendees (token mode), lesson 5
    python tools/browser_room_check.py --one-page # one attendee's page only: the TTFT part

Attendees 1 and 3 watch the Engine settings tab, attendee 2 the Dashboard. The browsers run on the engine's cores,
as they would not in a room: docs/measurements.md ("The room in Chromium") has runs of both forms. Needs Debian's
chromium (/usr/bin/chromium) and playwright.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

CHECKED = "() => document.querySelector('#setting-prefix_caching input')?.checked"
# a chart on screen agrees: the lesson's (every page follows the presenter to it) names the lesson, then draws its
# flip; the Dashboard's prefix chart says "prefix caching is off", then marks the change "prefix_caching on"
CHART = """(want) => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.offsetParent !== null).some(p => {
  const t = p.textContent;
  return want ? t.includes('prefix_caching on') || (t.includes('Prefix caching:') && t.includes('flip'))
              : ['prefix caching is off', 'prefix_caching off', 'Prefix caching:'].some(w => t.includes(w));
})"""
STATUS = "() => document.querySelector('#status')?.innerText || ''"
BOTS = "document.querySelectorAll('[data-testid=\"bot\"]')"


def chromium_cpu_s() -> float:
    """User + system CPU seconds of every running Chromium process (the load test's /proc reading, per process)."""
    from playground.loadtest import cpu_seconds

    def cmdline(pid: str) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:  # gone meanwhile
            return ""
    pids = [pid for pid in filter(str.isdigit, os.listdir("/proc")) if "chromium" in cmdline(pid)]
    return sum(cpu_seconds(int(pid)) or 0.0 for pid in pids)


def ttft(page, text: str) -> float:
    """Seconds from Enter to the reply's first text on the page; then the reply is let finish."""
    box = page.get_by_placeholder("Type a message and press Enter")
    n = page.evaluate(f"() => {BOTS}.length")
    box.fill(text)
    t0 = time.monotonic()
    box.press("Enter")
    page.wait_for_function(f"() => {{ const b = {BOTS}; return b.length > {n} && "
                           f"b[b.length - 1].innerText.trim().length > 0 }}", timeout=120_000, polling=20)
    took = time.monotonic() - t0
    time.sleep(4)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one-page", action="store_true", help="one attendee's page, the TTFT part only")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--replies", type=int, default=3, help="replies timed each side, idle and with the users "
                        "(a median of 3 moves a lot from run to run; the tables in docs/measurements.md say which)")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    import app
    from engine import LLM
    from playground import Playground, page_client
    from playground.access import TOKEN, Access

    pg = Playground(LLM(None))
    port = page_client.free_port()
    url = f"http://127.0.0.1:{port}/"
    demo = app.launch(pg, "room check", access=Access(TOKEN, "room-check"), server_name="127.0.0.1",
                      server_port=port, prevent_thread_lock=True, quiet=True)
    changes: list[tuple[float, bool]] = []  # (when, prefix_caching) as the engine's configuration says

    def watch() -> None:
        last = None
        while True:
            now = pg.service.config_view().requested["prefix_caching"]
            if now != last:
                changes.append((time.monotonic(), now))
                last = now
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium,
                                        args=["--headless", "--no-sandbox", "--disable-gpu"])
            pages = []
            for _ in range(1 if args.one_page else 4):
                page = browser.new_context(viewport={"width": 1600, "height": 1200}).new_page()
                page.goto(url)
                page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=120_000)
                pages.append(page)
            person = pages[0] if args.one_page else pages[1]
            idle = [ttft(person, f"Name a colour, one word. ({i})") for i in range(args.replies)]
            if not args.one_page:
                presenter, attendees = pages[0], pages[1:]
                presenter.get_by_text("Presenter", exact=True).first.click()
                presenter.locator("#presenter-token input").first.fill("room-check")
                presenter.get_by_role("button", name="Unlock").click()
                presenter.get_by_text("you steer the shared engine").wait_for(timeout=30_000)
                for i, page in enumerate(attendees):
                    page.get_by_role("tab", name="Dashboard" if i == 1 else "Engine settings").click()
                time.sleep(3)
                presenter.get_by_role("tab", name="Lessons").click()
                presenter.locator("#lesson-pick input").first.click()
                presenter.get_by_role("option", name="5. Prefix caching").click()
                time.sleep(0.5)
                presenter.locator("#lesson-start").click()

                def agrees(i: int, page, want: bool) -> bool:
                    flipped = "flipped" in page.evaluate(STATUS)  # the room's latest change, on the status line
                    shows = page.evaluate(CHART, want) if i == 1 else page.evaluate(CHECKED) == want
                    return shows and flipped == want

                for want in (False, True):  # the lesson turns prefix caching off, then flips it on
                    deadline = time.monotonic() + 400
                    while not any(v == want for _, v in changes[1:]) and time.monotonic() < deadline:
                        time.sleep(0.02)
                    changed = next(t for t, v in changes[1:] if v == want)
                    seen: dict[int, float] = {}
                    while len(seen) < len(attendees) and time.monotonic() < changed + 30:
                        for i, page in enumerate(attendees):
                            if i not in seen and agrees(i, page, want):
                                seen[i] = time.monotonic() - changed
                        time.sleep(0.05)  # asked 20 times a second: the asking must not take the pages' cores
                    print(f"prefix_caching -> {want}: seconds until each attendee's page agreed (settings form, "
                          f"the chart on screen, settings form; each with its status line): "
                          f"{[round(seen[i], 2) if i in seen else None for i in range(len(attendees))]}",
                          flush=True)
                while pg.lessons.run is not None and pg.lessons.run.active:
                    time.sleep(1)
                person.get_by_role("tab", name="Chat").click()
            why = pg.start_traffic("open-chat", 32, 300)
            assert why == "", why
            time.sleep(10)
            cpu0, own0, wall0 = chromium_cpu_s(), time.process_time(), time.monotonic()
            busy = [ttft(person, f"Name an animal, one word. ({i})") for i in range(args.replies)]
            wall = time.monotonic() - wall0
            print(f"meanwhile, of the machine's {os.cpu_count()} cores: Chromium used "
                  f"{(chromium_cpu_s() - cpu0) / wall:.2f}, the app's process (engine and server) "
                  f"{(time.process_time() - own0) / wall:.2f}", flush=True)
            print(f"a person's TTFT (s), idle: {[round(x, 3) for x in idle]}, with 32 simulated users: "
                  f"{[round(x, 3) for x in busy]}, ratio of medians "
                  f"{statistics.median(busy) / statistics.median(idle):.2f}", flush=True)
            browser.close()
    finally:
        pg.traffic.stop()
        demo.close()
        pg.service.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
