"""tools/run_tests.py, what `make test` runs: which tests each lane takes, and that either lane's failure fails."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("run_tests", Path(__file__).parent.parent / "tools" / "run_tests.py")
run_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_tests)


def test_the_lanes_split_by_the_second_lanes_mark_joined_to_the_runs_own():
    assert run_tests.split_marks(["--durations=5", "-m", "not slow", "-x"]) == (["--durations=5", "-x"], "not slow")
    assert run_tests.split_marks(["-m=gpu"]) == ([], "gpu")
    assert run_tests.lane(None, second=True) == ["-m", "lane2"]
    assert run_tests.lane("not slow", second=False) == ["-m", "(not slow) and not lane2"]


def test_a_run_that_names_its_tests_is_one_pytest():
    assert run_tests.selects_tests(["-k", "parity"]) and run_tests.selects_tests(["tests/test_api.py::test_x"])
    assert not run_tests.selects_tests(["--durations", "20", "-m", "not slow"])


@pytest.mark.parametrize("codes, expected", [((0, 0), 0), ((1, 0), 1), ((0, 1), 1), ((0, -9), 9), ((5, 0), 0),
                                             ((0, 5), 0), ((5, 5), 5), ((5, 2), 2)])
def test_either_lanes_failure_fails_the_run(codes, expected):
    assert run_tests.combined(*codes) == expected


def test_main_starts_the_second_lane_and_waits_for_it(monkeypatch, capsys):
    started = []

    class Lane:
        pid = 0

        def __init__(self, cmd, env, stdout, **_):
            started.append(("second", cmd[-1], env["WATCHLLM_TEST_THREADS"]))
            stdout.write("the second lane's report\n")

        def wait(self):
            return 1

        def poll(self):
            return 1

    monkeypatch.setattr(run_tests.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(run_tests.subprocess, "Popen", Lane)
    monkeypatch.setattr(run_tests.subprocess, "call", lambda cmd, env: started.append(("first", cmd[-1])) or 0)
    assert run_tests.main(["-m", "not slow"]) == 1  # the second lane failed: so did the run
    assert started == [("second", "(not slow) and lane2", "1"), ("first", "(not slow) and not lane2")]
    assert "the second lane's report" in capsys.readouterr().out
