"""The course rehearsed in the conditions a room meets it in: alone, beside K processes that each keep a core busy,
or while N page sessions poll the served page every second (the load test's watchers).

    python tools/rehearse_under_load.py [--busy K] [--watchers N] [--model PATH] [--seconds S] --out DIR

Runs `playground.rehearse` in this process on the live engine (with --watchers, the page is served from the same
engine and N sessions poll its dashboard, as browser tabs do), prints its table with each phase's length, and
writes the record and a summary (DIR/summary.json). docs/measurements.md ("The lessons, under load") has runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=0, help="processes that each keep a core busy meanwhile")
    parser.add_argument("--watchers", type=int, default=0, help="page sessions polling the dashboard each second")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seconds", type=float, default=None, help="each phase's own length (default: the lesson's)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("slugs", nargs="*")
    args = parser.parse_args()

    from engine import LLM
    from engine.measure.experiments import busy_processes
    from playground import Playground
    from playground.lesson_record import machine_name, write_record
    from playground.rehearse import rehearsal_table, rehearse

    pg = Playground(LLM(args.model))
    stop, demo, pollers = threading.Event(), None, []
    try:
        with busy_processes(args.busy):  # started, and spinning, before the first lesson
            if args.watchers:
                import app
                from playground import page_client
                from playground.access import TOKEN, Access
                from playground.loadtest import Tally, poll
                port = page_client.free_port()
                demo = app.launch(pg, "rehearsal", access=Access(TOKEN, "rehearsal-presenter"),
                                  server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
                tally = Tally()
                for session in page_client.open_sessions(f"http://127.0.0.1:{port}/", args.watchers):
                    pollers.append(threading.Thread(target=poll, args=(session, "/dashboard", "dashboard_polls",
                                                                       stop, tally), daemon=True))
                    pollers[-1].start()
            started = time.monotonic()
            records = rehearse(pg, args.slugs or None, args.seconds, lambda line: print(line, flush=True))
            took = time.monotonic() - started
    finally:
        stop.set()
        pg.traffic.stop()
        if demo is not None:
            demo.close()
        pg.service.shutdown()
    print(rehearsal_table(records))
    condition = (f"beside {args.busy} busy processes" if args.busy else
                 f"while {args.watchers} sessions poll the page" if args.watchers else "alone")
    print(f"\n{len(records)} lessons finished in {took / 60:.1f} min, {condition}, on {machine_name(pg.lessons)}")
    print("| lesson | before (s) | after (s) | replies at | short of evidence |\n|---|---:|---:|---:|---|")
    for r in records:
        short = "; ".join(f"{k}: {v}" for k, v in r["short"].items()) or "-"
        print(f"| {r['lesson']} | {r['seconds']['before']:.0f} | {r['seconds']['after']:.0f} | {r['scale']:.0%} | "
              f"{short} |")
    write_record(records, machine_name(pg.lessons), args.out)
    summary = {"condition": condition, "minutes": took / 60,
               "lessons": [{k: r[k] for k in ("lesson", "as_expected", "moved", "seconds", "scale", "short",
                                              "probe_tok_s", "before", "after", "spread")} for r in records]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if all(r["as_expected"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
