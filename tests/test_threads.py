"""The engine's compute threads (engine/threads.py): with the C++ kernels, their own threads on every usable core it
was given and torch's calls on one; without them torch's threads follow the cores nobody else wants: fewer as soon
as another process keeps wanting a core, back once it has gone for a while, never more than it was given."""
from __future__ import annotations

import torch

from engine import threads


def test_threads_drop_beside_a_busy_process_and_come_back(monkeypatch):
    seen = {"others": 0}
    monkeypatch.setattr(threads, "others_running", lambda: seen["others"])
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    before = torch.get_num_threads()
    try:
        share = threads.CoreShare(most=4)
        clock = iter(range(0, 1000))

        def tick(others: int, times: int = 1) -> int:
            seen["others"] = others
            for _ in range(times):
                share.adjust(now=next(clock) * threads.EVERY_S)
            return share.threads
        assert tick(0, 3) == 4
        assert tick(3) == 4  # one reading is a passing process
        assert tick(3) == 1 and torch.get_num_threads() == 1  # two in a row: the cores left over
        assert "1 of 4 threads (3 other threads want a core)" == share.describe()
        assert tick(1, 3) == 1  # fewer others: back up only after four readings in a row
        assert tick(1) == 3
        assert "3 of 4 threads (1 other thread wants a core)" == share.describe()
        assert tick(0, 4) == 4 and torch.get_num_threads() == 4
        assert tick(9, 2) == 1  # never fewer than one
        torch.set_num_threads(2)  # someone else (a test's fixture) chose a count: left alone while nothing changes
        tick(9, 3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_one_thread_given_is_one_thread_kept_and_the_system_is_read_between_readings_only(monkeypatch):
    calls = []
    monkeypatch.setattr(threads, "others_running", lambda: calls.append(1) or 0)
    threads.CoreShare(most=1).adjust(now=0.0)
    assert not calls  # a test lane's single thread, a GPU's host thread: nothing to decide
    share = threads.CoreShare(most=2)
    for t in (0.0, 0.1, 0.2, 0.3, 0.6):
        share.adjust(now=t)
    assert len(calls) == 2  # at 0.0 and 0.6: every EVERY_S


def test_the_running_threads_are_read_from_linux():
    others = threads.others_running()
    assert others is None or others >= 0
    assert threads.usable_cores() >= 1


def test_settle_takes_the_readings_a_change_waits_for_at_once(monkeypatch):
    """bench closed-loop settles the count before each run, so a run beside busy processes does not spend its first
    second on the threads the quiet run left, nor the next quiet run its first two on one thread."""
    seen = {"others": 1}
    monkeypatch.setattr(threads, "others_running", lambda: seen["others"])
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        share = threads.CoreShare(most=2)
        share.settle(gap_s=0)
        assert share.threads == 1 and torch.get_num_threads() == 1
        seen["others"] = 0
        share.settle(gap_s=0)
        assert share.threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


class _Kernels:
    """A stand-in for the built module: what kernel_threads was asked."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def kernel_threads(self, n: int = -1) -> int:
        self.asked.append(n)
        return n


def test_with_the_kernels_they_keep_every_usable_core_given_and_torch_one(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        kernels = _Kernels()
        cores = threads.KernelThreads(kernels, most=4)
        assert cores.most == cores.threads == 2 and kernels.asked == [2]  # a thread per usable core, at most
        assert threads.KernelThreads(kernels, most=1).threads == 1  # a test lane's one thread stays one
        torch.set_num_threads(2)
        with cores.computing():
            assert torch.get_num_threads() == 1  # torch's own calls in a step: one thread
        assert torch.get_num_threads() == 2  # the stepping thread's own count, after
        assert cores.describe().startswith("2 ")
    finally:
        torch.set_num_threads(before)


def test_a_gpu_or_a_cpu_without_the_kernels_keeps_the_core_share(monkeypatch):
    assert isinstance(threads.compute_threads(torch.device("meta")), threads.CoreShare)
    monkeypatch.setattr(threads.cpu_kernels, "compiled", lambda: None)
    assert isinstance(threads.compute_threads(torch.device("cpu")), threads.CoreShare)
    monkeypatch.setattr(threads.cpu_kernels, "compiled", _Kernels)
    assert isinstance(threads.compute_threads(torch.device("cpu")), threads.KernelThreads)
