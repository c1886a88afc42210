"""`python -m playground.rehearse`: the course run on this machine without a page, lesson after lesson, as the
Lessons tab's Start runs each (the engine put back after each): what each lesson measures here, and how long the
whole course takes. Prints a table; --out also writes the session's record (HTML and JSON)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .course import METRICS, format_value, switch_text
from .lesson_record import machine_name, write_record
from .lessons import LessonRunner

if TYPE_CHECKING:
    from .handlers import Playground
def rehearse(pg: Playground, slugs: Sequence[str] | None = None, seconds: float | None = None,
             say: Callable[[str], None] = print) -> list[dict]:
    """Every lesson (or those named) run in turn, as Start would; the records of those that finished."""
    runner = LessonRunner(pg, seconds=seconds)
    pg.lessons = runner
    for lesson in runner.lessons:
        if slugs and lesson.slug not in slugs:
            continue
        say(f"{lesson.slug}: {runner.start(lesson.slug)}")
        while runner.run is not None and runner.run.active:
            time.sleep(0.5)
        run = runner.run
        say(f"{lesson.slug}: {run.phase}" + (f" ({run.note})" if run.note and run.phase == "failed" else ""))
        runner.leave()
    return runner.records


def rehearsal_table(records: list[dict]) -> str:
    rows = ["| lesson | switch | the number | before | after | as expected |", "|---|---|---|---:|---:|---|"]
    for r in records:
        m = METRICS[r["metric"]]
        before, after = (format_value(m, r[side][r["metric"]]) for side in ("before", "after"))
        rows.append(f"| {r['title']} | {switch_text(r['switch'])} | {m.label} | {before} | {after} "
                    f"| {'yes' if r['as_expected'] else 'no'} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m playground.rehearse", description=__doc__.split("\n")[0])
    parser.add_argument("slugs", nargs="*", help="lessons to run (default: all), e.g. 05-prefix-caching")
    parser.add_argument("--seconds", type=float, default=None, help="each phase this long (default: the lesson's)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the record (HTML and JSON) here")
    args = parser.parse_args(argv)
    from engine import LLM

    from .handlers import Playground
    pg = Playground(LLM(args.model))
    try:
        start = time.monotonic()
        records = rehearse(pg, args.slugs, args.seconds, lambda line: print(line, flush=True))
        took = time.monotonic() - start
    finally:
        pg.traffic.stop()
        pg.service.shutdown()
    print(rehearsal_table(records))
    print(f"\n{len(records)} lessons finished in {took / 60:.1f} min on {machine_name(pg.lessons)}")
    if args.out is not None:
        print("\n".join(write_record(records, machine_name(pg.lessons), args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
