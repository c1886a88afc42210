"""EngineService: the engine in a background thread — concurrent streams, aborts, config, step mode, failure."""
from __future__ import annotations

import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.service import EngineService, EngineStopped
from tests.conftest import assert_all_blocks_free
from tests.test_parity import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def service(tiny_models):
    svc = EngineService(LLM(tiny_models["llama"][0], max_model_len=256).engine)
    yield svc
    svc.shutdown()


def test_concurrent_streams_match_offline_generation(tiny_models, service):
    prompts = random_prompts(6, seed=40)
    expected = [o.token_ids for o in LLM(tiny_models["llama"][0], max_model_len=256).generate(prompts, GREEDY)]
    results: dict[int, list] = {}

    def consume(i):
        outs = list(service.stream(prompts[i], GREEDY))
        results[i] = outs

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, outs in results.items():
        assert outs[-1].finished and outs[-1].token_ids == expected[i]
        # each streamed output extends the previous one: what a page shows equals the final text
        texts = [o.text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert [len(o.token_ids) for o in outs] == list(range(1, len(expected[i]) + 1))
    assert len(results) == len(prompts)
    assert max(h.num_running for h in service.history) > 1  # they really were batched together


def test_bad_input_is_raised_to_the_caller_and_the_engine_keeps_serving(service):
    with pytest.raises(ValueError, match="empty prompt"):
        service.submit([], GREEDY)
    outs = list(service.stream(random_prompts(1, seed=41)[0], GREEDY))
    assert outs[-1].finished and len(outs[-1].token_ids) == 12


def test_a_request_sent_after_shutdown_is_told_why_the_engine_stopped(service):
    rid, q = service.submit(random_prompts(1, seed=43)[0], SamplingParams(max_tokens=10_000, ignore_eos=True))
    service.shutdown("the engine was restarted by the presenter")
    last = q.get(timeout=30)
    while not last.finished:
        last = q.get(timeout=30)
    assert last.error == "the engine was restarted by the presenter"
    assert not service.alive and service.stopped_because == "the engine was restarted by the presenter"
    with pytest.raises(EngineStopped, match="stopped: the engine was restarted by the presenter"):
        service.submit([1, 2, 3], GREEDY)


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(service):
    stream = service.stream(random_prompts(1, seed=42)[0], SamplingParams(temperature=0, max_tokens=200,
                                                                            ignore_eos=True))
    next(stream)
    stream.close()  # the stop button / a closed tab
    for _ in range(50):
        if service.snapshot().num_running == 0 and not service.engine.has_unfinished():
            break
        threading.Event().wait(0.05)
    service.pause()
    assert_all_blocks_free(service.engine)


def test_a_request_aborted_while_paused_leaves_the_queues_at_once(service):
    """No step follows an abort while paused (or of the last request): the snapshot must not show it waiting on."""
    service.pause()
    rid, _ = service.submit(random_prompts(1, seed=44)[0], GREEDY)
    assert service.snapshot().waiting == [rid]
    service.abort(rid)
    deadline = time.monotonic() + 10
    while service.snapshot().waiting and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.snapshot().waiting == [] and service.snapshot().num_waiting == 0
    service.resume()


def test_config_change_and_step_mode(service):
    service.update_config(max_num_seqs=3)
    with pytest.raises(ValueError, match="block_size"):
        service.update_config(block_size=3)
    service.pause()
    rid, q = service.submit(random_prompts(1, seed=43)[0], GREEDY)
    snap = service.step_once()
    assert snap.config["max_num_seqs"] == 3
    assert snap.steps[-1].prefills and snap.steps[-1].prefills[0].request_id == rid
    assert q.get(timeout=5).token_ids and q.empty()  # exactly one step ran: one token
    service.step_once()
    assert len(q.get(timeout=5).token_ids) == 2
    service.resume()
    while not (out := q.get(timeout=30)).finished:
        pass
    assert len(out.token_ids) == 12


def test_engine_failure_ends_streams_with_an_error(service, monkeypatch):
    def boom():
        raise RuntimeError("simulated crash")
    service.pause()
    rid, q = service.submit(random_prompts(1, seed=44)[0], GREEDY)
    monkeypatch.setattr(service.engine, "step", boom)
    service.resume()
    out = q.get(timeout=10)
    assert out.finished and out.finish_reason == "error" and "simulated crash" in out.error
    with pytest.raises(RuntimeError, match="stopped"):
        service.submit([5, 6, 7], GREEDY)


def drain(q) -> list:
    outs = [q.get(timeout=30)]
    while not outs[-1].finished:
        outs.append(q.get(timeout=30))
    return outs


def test_a_change_on_an_idle_engine_applies_at_once(service):
    record = service.update_config(max_num_seqs=3, num_kv_blocks=48)
    assert record["changes"] == {"max_num_seqs": 3, "num_kv_blocks": 48} and "error" not in record
    snap = service.snapshot()  # no step has run: the page sees the new pool anyway
    assert snap.config["max_num_seqs"] == 3 and snap.kv_blocks_total == 48
    view = service.config_view()
    assert view.requested["num_kv_blocks"] == 48 and not view.pending


def test_a_change_waiting_for_a_busy_engine_shows_in_the_config_view(service):
    service.pause()
    rid, q = service.submit(random_prompts(1, seed=45)[0], GREEDY)
    service.step_once()
    assert service.update_config(prefix_caching=False) is None  # requests in flight: the next step applies it
    view = service.config_view()
    assert view.pending == {"prefix_caching": False} and view.requested["prefix_caching"] is False
    assert service.snapshot().config["prefix_caching"] is True
    service.step_once()
    assert not service.config_view().pending and service.snapshot().config["prefix_caching"] is False
    service.resume()
    assert len(drain(q)[-1].token_ids) == 12


def test_a_pool_that_cannot_be_built_leaves_the_service_serving(service, monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError("simulated: the allocator said no")
    service.pause()
    rid, q = service.submit(random_prompts(1, seed=46)[0], GREEDY)
    service.step_once()
    monkeypatch.setattr("engine.factory.ModelRunner", no_memory)
    assert service.update_config(num_kv_blocks=32) is None
    service.resume()
    outs = drain(q)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 12 and service.alive
    snap = service.snapshot()
    assert "MemoryError" in snap.last_reconfig["error"] and snap.config["num_kv_blocks"] != 32
    assert "MemoryError" in service.update_config(num_kv_blocks=32)["error"]  # idle: refused at once
    monkeypatch.undo()
    assert "error" not in service.update_config(num_kv_blocks=32)
    assert service.snapshot().kv_blocks_total == 32


def test_every_configuration_change_is_recorded_with_the_time_it_applied(service, monkeypatch):
    """The engine keeps only its last reconfiguration; the service keeps each one, for the charts' markers."""
    before = time.time()
    service.update_config(prefix_caching=False)  # idle: applied at once
    idle = service.config_changes[-1]
    assert idle.changes == {"prefix_caching": False} and idle.action == "applied in place" and idle.error is None
    assert before <= idle.time <= time.time()
    with pytest.raises(ValueError):
        service.update_config(block_size=3)  # refused before it reaches the engine: no change to mark
    assert len(service.config_changes) == 1

    service.pause()
    rid, q = service.submit(random_prompts(1, seed=47)[0], GREEDY)
    service.step_once()
    assert service.update_config(prefix_caching=True, num_kv_blocks=40) is None  # busy: the next step applies it
    assert len(service.config_changes) == 1
    asked = time.time()
    snap = service.step_once()
    busy = service.config_changes[-1]
    assert busy.changes == {"prefix_caching": True, "num_kv_blocks": 40}
    assert busy.action == "re-prefill running requests" and busy.step == snap.steps[-1].step
    assert asked <= busy.time <= service.history[-1].time  # when its step began, before the step's sample
    service.step_once()
    assert len(service.config_changes) == 2  # recorded once, not again at every step

    monkeypatch.setattr("engine.factory.ModelRunner", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room")))
    assert service.update_config(num_kv_blocks=32) is None
    service.step_once()
    failed = service.config_changes[-1]
    assert failed.changes == {"num_kv_blocks": 32} and "MemoryError" in failed.error
    monkeypatch.undo()
    service.resume()
    assert len(drain(q)[-1].token_ids) == 12


def test_follow_streams_a_request_submitted_first(service):
    """A chat needs its request's id before the first token: it submits, then follows."""
    rid, q = service.submit(random_prompts(1, seed=48)[0], GREEDY)
    assert service.is_streaming(rid)
    outs = list(service.follow(rid, q))
    assert [o.request_id for o in outs] == [rid] * 12 and outs[-1].finished
    assert not service.is_streaming(rid)


def test_follow_latest_skips_to_the_newest_output_a_slow_consumer_has_missed(service):
    """A chat behind a busy web server shows the newest text, not every step it missed; the last output (finished)
    always comes through, and the text is the same as when every output is read."""
    prompt = random_prompts(1, seed=49)[0]
    service.pause()
    rid, q = service.submit(prompt, GREEDY)
    for _ in range(5):  # five steps run before the consumer looks
        service.step_once()
    outputs = service.follow(rid, q, latest=True)
    assert len(next(outputs).token_ids) == 5  # the four earlier outputs were skipped
    service.resume()
    rest = list(outputs)
    assert rest[-1].finished and len(rest[-1].token_ids) == 12
    everything = list(service.stream(prompt, GREEDY))
    assert rest[-1].token_ids == everything[-1].token_ids and len(everything) == 12


def test_a_request_submitted_while_paused_shows_as_waiting_at_once(service):
    """Paused (step mode, a measurement), no step refreshes the snapshot: the queue chart and the API's
    vllm:num_requests_waiting still see the request."""
    service.pause()
    rid, q = service.submit(random_prompts(1, seed=50)[0], GREEDY)
    assert service.snapshot().num_waiting == 1 and rid in service.snapshot().requests
    service.resume()
    assert list(service.follow(rid, q))[-1].finished


def test_waiting_bound_refuses_with_busy_and_the_engine_keeps_serving(tiny_models):
    from engine.service import ServiceBusy
    svc = EngineService(LLM(tiny_models["llama"][0], max_model_len=256).engine, max_waiting_requests=2)
    try:
        svc.pause()  # nothing runs: every request submitted waits
        prompts = random_prompts(3, seed=44)
        queued = [svc.submit(p, GREEDY) for p in prompts[:2]]
        with pytest.raises(ServiceBusy, match="busy: 2 requests are already waiting.*retry"):
            svc.submit(prompts[2], GREEDY)
        svc.resume()
        for rid, q in queued:
            assert list(svc.follow(rid, q))[-1].finish_reason == "length"
        assert list(svc.stream(prompts[2], GREEDY))[-1].finish_reason == "length"  # room again
    finally:
        svc.shutdown()
    with pytest.raises(ValueError, match="max_waiting_requests"):
        EngineService(svc.engine, max_waiting_requests=0)


def test_listeners_get_each_steps_tokens_latencies_and_finished_requests(tiny_models):
    """The numbers the metrics endpoint adds up: summed over the steps they equal what the requests did."""
    got, calls = [], []

    def broken(stats):
        calls.append(stats)
        raise RuntimeError("a listener with a bug")
    svc = EngineService(LLM(tiny_models["llama"][0], max_model_len=256).engine, stat_listeners=[broken, got.append])
    try:
        prompts = random_prompts(3, seed=45)
        sink_outputs: list = []

        class ListSink:
            def put(self, out):
                sink_outputs.append(out)
        rid, sink = svc.submit(prompts[0], GREEDY, sink=ListSink())
        outs = [list(svc.stream(p, GREEDY)) for p in prompts[1:]]
        deadline = time.monotonic() + 60
        while not (sink_outputs and sink_outputs[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.02)
        service_alive = svc.alive
    finally:
        svc.shutdown()
    assert service_alive and len(calls) == len(got) > 0  # the broken listener ran every step and stopped nothing
    assert [o.request_id for o in sink_outputs] == [rid] * 12 and len(sink_outputs[-1].token_ids) == 12
    assert all(o[-1].finish_reason == "length" for o in outs)
    assert sum(s.num_generation_tokens for s in got) == 3 * 12
    assert sum(s.num_prompt_tokens for s in got) == sum(len(p) for p in prompts)
    ttfts = [t for s in got for t in s.time_to_first_tokens]
    itls = [t for s in got for t in s.inter_token_latencies]
    assert len(ttfts) == 3 and len(itls) == 3 * 11 and all(t > 0 for t in ttfts + itls)
    finished = [f for s in got for f in s.finished]
    assert sorted((f.finish_reason, f.num_generation_tokens) for f in finished) == [("length", 12)] * 3
    assert all(f.e2e_latency >= 0 for f in finished)


def test_a_host_steps_each_engine_on_its_own_thread_one_after_another(tiny_models):
    """app.py's EngineHost: the engine loop runs on the thread that serves the host (here the test's, as the main
    thread in app.py), a restarted playground's new engine runs there after the old one ended, and stop() returns."""
    from engine.host import EngineHost
    from playground import Playground
    host, ran_on, results = EngineHost(), set(), {}
    pg = Playground(LLM(tiny_models["llama"][0], max_model_len=256), runner=host.run)
    pg.stat_listeners.append(lambda stats: ran_on.add(threading.get_ident()))

    def visitor():  # the page's and the API's side: requests from other threads, a restart between them
        try:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            results["before"] = [o.token_ids for o in pg.service.stream([5, 6, 7, 8], params)][-1]
            first = pg.service
            results["restart"] = pg.restart()
            results["after"] = [o.token_ids for o in pg.service.stream([5, 6, 7, 8], params)][-1]
            results["old alive"], results["new alive"] = first.alive, pg.service.alive
        finally:
            pg.service.shutdown()
            host.stop()
    worker = threading.Thread(target=visitor)
    worker.start()
    deadline = threading.Timer(120, host.stop)  # a test that fails does not hang
    deadline.start()
    host.serve()
    deadline.cancel()
    worker.join(30)
    assert results["restart"].startswith("Engine restarted") and results["before"] == results["after"]
    assert len(results["before"]) == 6 and not results["old alive"] and results["new alive"]
    assert ran_on == {threading.get_ident()}  # every step of both engines, on the host's thread


def test_snapshot_is_taken_at_most_every_interval_while_stepping_and_fresh_once_idle(tiny_models, monkeypatch):
    """Every step adds a history sample from the engine's counters, but the whole snapshot is rebuilt at most every
    SNAPSHOT_INTERVAL_S while the engine steps; the last step before idling leaves a fresh one."""
    from engine import service as service_module
    monkeypatch.setattr(service_module, "SNAPSHOT_INTERVAL_S", 3600.0)  # only the forced refreshes remain
    engine = LLM(tiny_models["llama"][0], max_model_len=256).engine
    snapshots = []
    real = engine.snapshot

    def counted(*args, **kwargs):
        snap = real(*args, **kwargs)
        snapshots.append(snap.step)
        return snap
    monkeypatch.setattr(engine, "snapshot", counted)
    svc = EngineService(engine)
    try:
        prompts = random_prompts(3, seed=44)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        streams = [svc.submit(p, params)[1] for p in prompts]
        for q in streams:
            while not q.get(timeout=60).finished:
                pass
        deadline = time.monotonic() + 30
        while svc.snapshot().step != engine.step_count and time.monotonic() < deadline:
            time.sleep(0.01)
        steps = engine.step_count
        assert steps >= 30
        history = [h for h in svc.history if h.step > 0]
        assert [h.step for h in history] == list(range(1, steps + 1))  # one sample per step, from the counters
        assert history[-1].generation_tokens_total == 90 and history[-1].num_running == 0
        assert len([s for s in snapshots if s > 0]) <= 3  # not once a step: only when the engine went idle
        snap = svc.snapshot()
        assert snap.step == steps and snap.num_running == snap.num_waiting == 0 and snap.generation_tokens_total == 90
        assert snap.kv_blocks_used == 0 and not any(snap.block_ref_counts)  # the page sees every block free
        assert_all_blocks_free(engine)
        counters = engine.counters()  # the same numbers the snapshot gives, field by field
        assert counters.num_preemptions == snap.num_preemptions and counters.kv_blocks_used == snap.kv_blocks_used
        assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (snap.prefix_cache_queries,
                                                                               snap.prefix_cache_hits)
        assert counters.spec_num_drafts == snap.speculation["num_drafts"]
    finally:
        svc.shutdown()


def test_snapshot_keeps_up_while_stepping(tiny_models, monkeypatch):
    """A long run refreshes the snapshot as it goes (what the page polls), not only at its start and end."""
    from engine import service as service_module
    monkeypatch.setattr(service_module, "SNAPSHOT_INTERVAL_S", 0.005)  # the tiny model steps in well under 1 ms
    svc = EngineService(LLM(tiny_models["llama"][0], max_model_len=256).engine)
    try:
        _, q = svc.submit(random_prompts(1, seed=45)[0], SamplingParams(max_tokens=200, ignore_eos=True))
        seen, out = set(), q.get(timeout=60)
        while not out.finished:
            seen.add(svc.snapshot().step)
            out = q.get(timeout=60)
        assert len(seen) >= 2  # the page saw the run move, not only its start and end
    finally:
        svc.shutdown()
