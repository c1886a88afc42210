"""What one open page costs its browser: Chromium's CPU and the charts it draws while it sits on one tab.

Launches the app on a free local port (a tiny random Llama by default, so the numbers are the page's, not the
model's), opens it in Debian's headless Chromium at 1600x1200, visits the Dashboard once, goes to TAB, optionally
starts simulated users, and for SECONDS counts the plotly charts mounted anywhere in the page (a hidden tab's
included) and the CPU every Chromium process used. Needs `apt-get install -y chromium` and Python Playwright.

    python tools/page_cost.py --tab Chat --users 4 --seconds 10 [--model PATH] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# every plotly chart added to the page from now on, hidden or not (gradio mounts a fresh one for each value sent)
COUNT_MOUNTS = """() => { window.__mounts = 0; window.__observer?.disconnect();
  window.__observer = new MutationObserver(ms => ms.forEach(m => m.addedNodes.forEach(n => {
    if (n.nodeType === 1 && (n.classList.contains('js-plotly-plot') || n.querySelector('.js-plotly-plot')))
      window.__mounts++; })));
  window.__observer.observe(document.body, {childList: true, subtree: true}); }"""


def chromium_cpu_s() -> float:
    """User + system CPU seconds of every running Chromium process (the load test's /proc reading, per process)."""
    from playground.loadtest import cpu_seconds
    pids = [pid for pid in filter(str.isdigit, os.listdir("/proc")) if "chromium" in _cmdline(pid)]
    return sum(cpu_seconds(int(pid)) or 0.0 for pid in pids)


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # gone meanwhile
        return ""


def tiny_model(folder: str) -> str:
    """The tests' tiny random Llama (tests/conftest.py), saved in `folder`."""
    from tests.conftest import build_tiny_model
    build_tiny_model("llama", folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tab", default="Chat", help="the tab the page sits on (its label)")
    parser.add_argument("--users", type=int, default=0, help="simulated users meanwhile (0: an idle engine)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", help="a model folder (default: a tiny random Llama)")
    args = parser.parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from playwright.sync_api import sync_playwright

    import app
    from engine import LLM
    from playground import Playground
    from playground.page_client import free_port
    from tests.test_e2e_browser import CHROMIUM, FLAGS  # the browser tests' own Chromium and flags

    store = Path(tempfile.mkdtemp()) / "ablation.json"
    pg = Playground(LLM(args.model or tiny_model(tempfile.mkdtemp()), max_model_len=512), store=store)
    port = free_port()
    demo = app.launch(pg, "page-cost", server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                      quiet=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1200})
            page.goto(f"http://127.0.0.1:{port}/")
            page.get_by_text("Watch an LLM inference engine work").wait_for(timeout=60_000)
            page.get_by_role("tab", name="Dashboard").click()  # drawn once, then hidden unless it is TAB
            time.sleep(2)
            page.get_by_role("tab", name=args.tab).click()
            if args.users:
                pg.start_traffic("shared-system-prompt", args.users, args.rounds * (args.seconds + 2) + 30)
            for _ in range(args.rounds):
                time.sleep(2)
                page.evaluate(COUNT_MOUNTS)
                cpu, start = chromium_cpu_s(), time.monotonic()
                time.sleep(args.seconds)
                used, took = chromium_cpu_s() - cpu, time.monotonic() - start
                print(f"tab {args.tab!r}, {args.users} users: {page.evaluate('() => window.__mounts')} charts "
                      f"mounted in {took:.0f} s, Chromium {100 * used / took:.0f}% of a core")
            browser.close()
    finally:
        pg.stop_traffic()
        demo.close()
        pg.service.shutdown()


if __name__ == "__main__":
    main()
