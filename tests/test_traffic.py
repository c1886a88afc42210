"""The traffic generator: simulated users over a fake service (fast, exact counts) and over the live engine while
the configuration changes, the pool is rebuilt, requests are refused and the engine restarts."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from engine import LLM
from engine.request import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.workloads import WorkloadRequest
from playground import Playground
from playground.traffic import SIMULATED_PRIORITY, TrafficGenerator, progress_bar
from tests.conftest import assert_all_blocks_free

FAST = (0.01, 0.03)  # think time in the tests: short, but long enough that users interleave


def request(prompt: list[int], max_tokens: int = 3) -> WorkloadRequest:
    return WorkloadRequest(prompt, SamplingParams(max_tokens=max_tokens), 0.0, "test")


class FakeService:
    """Answers each request with `max_tokens` outputs after `delay` s; refuses prompts starting with 0; `hold` keeps
    every reply waiting (a paused engine)."""

    def __init__(self, delay: float = 0.02, hold: bool = False) -> None:
        self.delay, self.hold = delay, hold
        self.submitted: list[str] = []
        self.max_tokens: list[int] = []  # of each request accepted
        self.aborted: list[str] = []
        self.priorities: list[int] = []  # each request's, as sent
        self.streams: dict[str, queue.Queue] = {}
        self._ids = iter(range(10**9))
        self._lock = threading.Lock()

    def submit(self, prompt: list[int], params: SamplingParams, sink=None, priority: int = 0
               ) -> tuple[str, queue.Queue]:
        self.priorities.append(priority)
        if prompt[0] == 0:
            raise ValueError("prompt has 600 tokens but max_model_len is 512")
        with self._lock:
            rid = str(next(self._ids))
            self.submitted.append(rid)
            self.max_tokens.append(params.max_tokens)
        q = self.streams[rid] = sink if sink is not None else queue.Queue()  # as EngineService: the caller's sink
        if not self.hold:
            threading.Thread(target=self._answer, args=(rid, q, params.max_tokens), daemon=True).start()
        return rid, q

    def _answer(self, rid: str, q: queue.Queue, n: int) -> None:
        for i in range(1, n + 1):
            time.sleep(self.delay / n)
            q.put(output(rid, i, finished=i == n))

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def fail_all(self, reason: str) -> None:
        """What EngineService does to open streams when its thread stops (a restart)."""
        for rid, q in self.streams.items():
            q.put(output(rid, 0, finished=True, error=reason))


def output(rid: str, n: int, finished: bool, error: str | None = None) -> RequestOutput:
    return RequestOutput(rid, None, [], "", list(range(n)), finished, ("error" if error else "length") if finished
                         else None, RequestMetrics(time.perf_counter()), error=error)


def test_users_keep_sending_until_the_duration_ends():
    service = FakeService()
    gen = TrafficGenerator(lambda: service, think_s=FAST)
    gen.start("w", [request([1, 2]), request([3, 4], max_tokens=5)], num_users=3, duration_s=0.6)
    time.sleep(0.3)
    mid = gen.status()
    assert mid.running and not mid.stopping and 0 < mid.fraction < 1 and mid.requests_done > 0
    end = gen.wait(timeout=10)
    assert not end.running and not end.stopped and end.fraction == 1.0 and end.users_waiting == 0
    assert end.requests_done >= 3 * 3  # each of 3 users went round several times (each turn ~0.04 s)
    assert end.requests_sent == end.requests_done == len(service.submitted)
    assert end.requests_refused == end.requests_failed == end.requests_stopped == 0
    assert end.tokens == sum(service.max_tokens) and {3, 5} <= set(service.max_tokens)
    assert set(service.priorities) == {SIMULATED_PRIORITY} and SIMULATED_PRIORITY > 0  # behind people's
    bar, state, counts = end.describe().split("\n\n")
    assert bar == f"`{'█' * 30}` 100%" and state.startswith("**done** · 3 users from 'w' · ")
    assert f"done **{end.requests_done}**" in counts
    assert mid.describe().startswith(f"`{progress_bar(mid.fraction)}`") and progress_bar(0.5, 4) == "██░░"


def test_user_i_walks_the_workload_from_request_i():
    service, sent = FakeService(), []
    real_submit = service.submit
    service.submit = lambda prompt, params, **kw: (sent.append(prompt[0]), real_submit(prompt, params, **kw))[1]
    gen = TrafficGenerator(lambda: service, think_s=FAST)
    gen.start("w", [request([i + 1]) for i in range(5)], num_users=2, duration_s=0)
    status = gen.wait(timeout=10)
    assert sorted(sent) == [1, 2] and status.requests_done == 2  # duration 0: each user once


def test_refused_requests_are_counted_and_the_run_goes_on():
    service = FakeService()
    gen = TrafficGenerator(lambda: service, think_s=FAST)
    gen.start("w", [request([0, 1]), request([1, 2])], num_users=2, duration_s=0.4)
    status = gen.wait(timeout=10)
    assert status.requests_refused >= 2 and status.requests_done >= 2  # user 0 is always refused, user 1 never
    assert "max_model_len is 512" in status.last_problem and "⚠️ last refused" in status.describe()
    assert status.requests_sent == status.requests_refused + status.requests_done


def test_stop_aborts_the_replies_in_flight_on_their_own_engine():
    held = FakeService(hold=True)  # a paused engine: no reply ever comes
    gen = TrafficGenerator(lambda: held, think_s=FAST)
    gen.start("w", [request([1])], num_users=4, duration_s=60)
    deadline = time.monotonic() + 5
    while gen.status().users_waiting < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(ValueError, match="already running"):
        gen.start("w", [request([1])], num_users=1, duration_s=1)
    assert gen.stop()
    status = gen.wait(timeout=5)
    assert not status.running and status.stopped and status.requests_stopped == 4 and status.requests_failed == 0
    assert "\n\n**stopped** · 4 users" in status.describe() and "4 cut short by Stop" in status.describe()
    assert status.fraction < 0.2 and gen.status().elapsed_s == status.elapsed_s  # the clock stopped with the run
    assert sorted(held.aborted) == sorted(held.submitted)
    assert not gen.stop()  # nothing left to stop


def test_a_restarted_engine_fails_its_streams_and_the_users_move_to_the_new_one():
    old, new = FakeService(hold=True), FakeService()
    current = [old]
    gen = TrafficGenerator(lambda: current[0], think_s=FAST)
    gen.start("w", [request([1])], num_users=3, duration_s=0.8)
    deadline = time.monotonic() + 5
    while gen.status().users_waiting < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    current[0] = new  # Playground.restart: a new service, then the old one's streams end with an error
    old.fail_all("the engine was shut down (restarted)")
    status = gen.wait(timeout=10)
    assert status.requests_failed == 3 and "restarted" in status.last_problem
    assert status.requests_done >= 3 and len(new.submitted) == status.requests_done


def test_bad_arguments_are_refused():
    gen = TrafficGenerator(lambda: FakeService())
    for users, duration, requests in ((0, 10, [request([1])]), (2, -1, [request([1])]), (2, 10, [])):
        with pytest.raises(ValueError):
            gen.start("w", requests, users, duration)
    assert gen.status() is None and not gen.running


@pytest.fixture(scope="module")
def pg(tiny_models, tmp_path_factory):
    playground = Playground(LLM(tiny_models["llama"][0], max_model_len=512),
                            store=tmp_path_factory.mktemp("store") / "ablation.json")
    playground.traffic.think_s = (0.05, 0.2)
    yield playground
    playground.traffic.stop()
    playground.service.shutdown()


@pytest.mark.slow
def test_a_run_survives_switches_pool_rebuilds_and_refusals(pg):
    # long-document: 8 chats and a 1,500-token document that max_model_len=512 refuses every time
    assert pg.start_traffic("long-document", 9, 6) == ""
    assert "already running" in pg.start_traffic("long-document", 2, 5)
    assert (pg.traffic.status().num_users, pg.traffic.status().running) == (9, True)
    assert "traffic:" in pg.status()  # every tab's status line says the load is on
    deadline = time.monotonic() + 30
    while pg.traffic.status().requests_done < 2:
        assert time.monotonic() < deadline, pg.traffic.status()
        time.sleep(0.05)
    for change in ({"prefix_caching": False}, {"num_kv_blocks": 96}, {"block_size": 8},
                   {"continuous_batching": False}, {"max_num_seqs": 3}):
        assert "Applied" in pg.apply_settings(None, **change), change  # now, or at the next step boundary
        time.sleep(0.3)
    status = pg.traffic.wait(timeout=120)
    assert not status.running and pg.service.alive
    assert status.requests_refused >= 1 and "max_model_len" in status.last_problem
    assert status.requests_failed == 0 and status.requests_done >= 8
    applied = [c.changes for c in pg.service.config_changes if not c.error]
    assert {"num_kv_blocks": 96} in applied and {"block_size": 8} in applied  # the pool was rebuilt under load
    pg.service.pause()
    assert_all_blocks_free(pg.service.engine)
    pg.service.resume()
    assert "Applied" in pg.reset_settings()


def test_a_run_survives_an_engine_restart_and_stop_frees_everything(pg):
    assert pg.start_traffic("mixed-lengths", 6, 60) == ""
    while pg.traffic.status().users_waiting == 0:
        time.sleep(0.05)
    assert pg.restart().startswith("Engine restarted")
    done = pg.traffic.status().requests_done
    deadline = time.monotonic() + 60
    while pg.traffic.status().requests_done < done + 2:  # replies from the new engine
        assert time.monotonic() < deadline, pg.traffic.status()
        time.sleep(0.05)
    pg.stop_traffic()
    status = pg.traffic.status()
    assert status.stopped and (status.num_users, status.workload) == (6, "mixed-lengths")
    assert not status.running and status.requests_failed >= 1 and "restarted" in status.last_problem
    assert status.requests_refused == 0  # a user whose turn came mid-restart waited for the new engine
    assert "traffic:" not in pg.status() and pg.stop_traffic() == "No traffic is running."
    pg.service.pause()
    for _ in range(50):  # the aborts land at the next step
        pg.service.step_once()
        if not pg.service.engine.has_unfinished():
            break
    assert_all_blocks_free(pg.service.engine)
    pg.service.resume()


def test_watching_a_one_shot_run_ends_with_its_last_status(pg):
    assert pg.start_traffic("mixed-lengths", 5, 0) == ""
    seen = list(pg.watch_traffic(every_s=0.05))
    assert seen[-1].requests_done == 5 and not seen[-1].running and seen[-1].fraction == 1.0
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(seen, seen[1:]))
    assert pg.start_traffic("no-such-workload", 5, 0).startswith("⚠️ unknown workload")


def test_a_live_runs_token_count_is_what_the_engine_generated(pg):
    """The users' replies are counted on the engine's thread as they come (each user's thread wakes only when its
    reply ends): every token the engine made for them is counted once."""
    before = pg.service.engine.counters().generation_tokens_total
    assert pg.start_traffic("mixed-lengths", 6, 0) == ""
    status = pg.traffic.wait(timeout=120)
    assert not status.running and status.requests_done == 6 and status.requests_failed == 0
    assert status.tokens == pg.service.engine.counters().generation_tokens_total - before > 0


def test_a_person_goes_before_the_simulated_users_on_the_live_engine(tiny_models, tmp_path):
    """Simulated users fill every seat; a person's request (priority 0, as the page's chat and the API send) is
    read in the very next step, alone, and the users carry on after it."""
    from engine import LLM
    from playground import Playground
    pg = Playground(LLM(tiny_models["llama"][0], max_model_len=256, max_num_seqs=2), store=tmp_path / "a.json")
    try:
        assert pg.start_traffic("long-document", 4, 60) == ""
        deadline = time.monotonic() + 30
        while pg.service.snapshot().num_running < 2:
            assert time.monotonic() < deadline, "the users never filled the seats"
            time.sleep(0.05)
        pg.service.pause()
        rid, q = pg.service.submit(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=4))
        pg.service.step_once()
        step = pg.service.engine.steps[-1]
        assert [e.request_id for e in step.entries] == [rid] and len(step.preempted) == 1
        pg.service.step_once()
        assert len(pg.service.engine.steps[-1].entries) >= 2  # its first token is out: the users are back
    finally:
        pg.service.resume()
        pg.traffic.stop()
        pg.traffic.wait(timeout=10)
        pg.service.shutdown()
