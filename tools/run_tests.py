"""`make test`: the tests that drive the app on a local port (marked `served`: mostly waiting on a page or a stream)
in a second pytest beside the rest, each lane's torch on one thread; either lane's failure fails the run. Why, and
what the lanes hold: docs/testing.md, "Two lanes".

    python tools/run_tests.py [pytest arguments...]     # what `make test` runs
    python tools/run_tests.py --one-lane [...]          # one pytest, everything in order, torch's own threads

Arguments go to both lanes; `-m EXPR` is joined to each lane's own mark (`make test-fast` is `-m "not slow"`).
A run that chooses its own tests by name (`-k`, a path, a test id) is one pytest, as asked.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

NO_TESTS = 5  # pytest's exit code when a lane collected nothing


def selects_tests(args: list[str]) -> bool:
    """-k, or a path or test id (an option's own value, `--durations 20`, is neither)."""
    return any(a == "-k" or a.startswith("-k=") or os.path.exists(a.split("::")[0]) for a in args)


def split_marks(args: list[str]) -> tuple[list[str], str | None]:
    """The arguments without their `-m EXPR` (or `-m=EXPR`), and EXPR (None without one)."""
    rest, marks, i = [], None, 0
    while i < len(args):
        if args[i] == "-m" and i + 1 < len(args):
            marks, i = args[i + 1], i + 2
            continue
        if args[i].startswith("-m="):
            marks = args[i][3:]
        else:
            rest.append(args[i])
        i += 1
    return rest, marks


def lane(marks: str | None, second: bool) -> list[str]:
    own = "lane2" if second else "not lane2"
    return ["-m", f"({marks}) and {own}" if marks else own]


def pytest(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", *args]


def main(argv: list[str]) -> int:
    one_lane = "--one-lane" in argv
    args = [a for a in argv if a != "--one-lane"]
    if one_lane or selects_tests(args) or (os.cpu_count() or 1) < 2:
        return subprocess.call(pytest(args))
    args, marks = split_marks(args)

    env = dict(os.environ, WATCHLLM_TEST_THREADS="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryFile("w+") as report:
        print("run_tests: the served tests and a few files (tests/conftest.py, SECOND_LANE_FILES) run in a second "
              "lane beside the others; its report follows", flush=True)
        start = time.monotonic()
        second = subprocess.Popen(pytest([*args, *lane(marks, second=True)]), env=env, stdout=report,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        ended: list[float] = []  # when the second lane ended: it may end long before the first
        watcher = threading.Thread(target=lambda: (second.wait(), ended.append(time.monotonic())), daemon=True)
        watcher.start()
        try:
            rest = subprocess.call(pytest([*args, *lane(marks, second=False)]), env=env)
            rest_s = time.monotonic() - start
            if second.poll() is None:
                print("run_tests: waiting for the second lane", flush=True)
            second_rc = second.wait()
            watcher.join()
        except BaseException:  # Ctrl-C (or any error here): the second lane and its browsers go too
            os.killpg(second.pid, signal.SIGTERM)
            second.wait()
            raise
        second_s = ended[0] - start
        report.seek(0)
        print("\n----- the second lane -----", flush=True)
        sys.stdout.write(report.read())
    print(f"run_tests: the other lane took {rest_s:.0f} s, the second lane {second_s:.0f} s "
          f"(exit codes {rest}, {second_rc})", flush=True)
    return combined(rest, second_rc)


def combined(*codes: int) -> int:
    """The run's exit code from its lanes': the first failure's (a lane killed by a signal has a negative code,
    still a failure), else 0; a lane that collected nothing counts only when neither did."""
    ran = [c for c in codes if c != NO_TESTS]
    failed = [c for c in ran if c != 0]
    return abs(failed[0]) if failed else (0 if ran else NO_TESTS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
