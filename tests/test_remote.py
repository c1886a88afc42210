"""Watching another server, and loading one: the playground attached to a second app launched here (its
/metrics parsed, its chat streamed), and `bench serve` against that app.

The watched app runs a tiny random model as `python app.py` launches it; the watcher is a Playground over another
tiny engine, so every number it draws must have come over HTTP. Expected replies come from a third LLM over the
same weights (LLM.generate), never from the API itself.
"""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.llm import chat_token_ids
from playground.room import plain
from tests.conftest import serve_app, wait_until

pytestmark = pytest.mark.served  # the app on a local port: `make test` runs it beside the rest

httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("gradio")

MODEL = "tiny-remote"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def watched(tiny_models, tmp_path_factory):
    """(url, Playground) of the app being watched, launched as main() launches it."""
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN, max_num_seqs=8),
                   tmp_path_factory.mktemp("watched") / "ablation.json", MODEL) as (url, pg):
        yield url.rstrip("/"), pg


@pytest.fixture()
def watcher(tiny_models, tmp_path):
    """A playground of its own (another tiny engine), to attach to the watched app."""
    from playground import Playground
    pg = Playground(LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN), store=tmp_path / "ablation.json")
    try:
        yield pg
    finally:
        pg.detach()
        pg.service.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_models):
    return LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN)


def scraped(url: str) -> dict[str, float]:
    """The watched app's own counters (summed over label sets), by prometheus_client's parser."""
    out: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_idle(pg) -> None:
    assert wait_until(lambda: not pg.service.snapshot().num_running and not pg.service.snapshot().num_waiting,
                      timeout_s=60.0, poll_s=0.1), "timed out waiting for the watched engine to go idle"


def trace(fig: dict, name: str) -> dict:
    return next(t for t in fig["data"] if t.get("name") == name)


def numbers(values) -> list[float]:
    return [v for v in values if v is not None]


# ---- parsing vLLM's metrics ------------------------------------------------------------------------------------

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 700.0
vllm:generation_tokens_total{engine="1",model_name="m"} 300.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.7
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="4000"} 1.0
"""


def test_vllm_metrics_are_summed_over_engines_and_counters_read_by_their_total():
    from playground.remote import history_sample, parse_metrics
    r = parse_metrics(VLLM_TEXT, now=10.0)
    assert (r.num_running, r.num_waiting, r.kv_usage) == (5, 4, pytest.approx(0.375))
    assert (r.prefix_cache_queries, r.prefix_cache_hits, r.generation_tokens) == (1000, 250, 1000)
    assert r.requests_finished == 7 and r.num_gpu_blocks == 8000 and r.ttft_count == 7
    ttft = 'seconds_{}{{engine="0",model_name="m"}} {}'
    later = parse_metrics(VLLM_TEXT.replace(ttft.format("count", 7.0), ttft.format("count", 9.0))
                          .replace(ttft.format("sum", 0.7), ttft.format("sum", 1.3)), now=11.0)
    h = history_sample(2, later, r)
    assert h.ttft_s == pytest.approx(0.3) and h.tpot_s is None  # (1.3 - 0.7) / (9 - 7); no ITL histogram here
    assert h.kv_blocks_used == 3000 and h.generation_tokens_total == 1000


@pytest.mark.parametrize("text,problem", [("this is not { prometheus", "not Prometheus text"),
                                          ("# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 1.0\n",
                                           "no vLLM metrics")])
def test_text_that_is_not_vllm_metrics_is_refused_by_name(text, problem):
    from playground.remote import parse_metrics
    with pytest.raises(ValueError, match=problem):
        parse_metrics(text)


# ---- attaching to what is not a vLLM-style server --------------------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /metrics without vLLM's names; everything else 404
        body = b"# TYPE up gauge\nup 1.0\n" if self.path == "/metrics" else b"nothing here"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def plain_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_attaching_to_nothing_or_to_a_server_without_vllm_metrics_says_why_and_the_page_keeps_the_local_engine(
        watcher, plain_server, monkeypatch, caplog):
    """A wrong address is refused, and the page keeps its local engine. Every failure to reach a metrics endpoint
    reads the same and takes as long (the page is nobody's port scanner); the reason goes to the server's log.
    Credentials in the address are never shown."""
    from playground import watching
    from playground.page_client import free_port
    monkeypatch.setattr(watching, "ATTACH_FAILS_AFTER_S", 1.0)
    closed = f"http://127.0.0.1:{free_port()}"
    for url, problem in [(closed, "no answer from"), (plain_server.replace("http://", "http://user:pw@"),
                                                      "no vLLM metrics")]:
        started = time.monotonic()
        note = watcher.attach(url)
        assert time.monotonic() - started >= 1.0
        assert note.startswith("⚠️") and watching.ATTACH_FAILED in note and problem not in note, note
        assert "user" not in note and "pw" not in note and "user" not in watcher.status()
        assert problem in caplog.text and "pw@" not in caplog.text
        assert watcher.remote is None and watching.ATTACH_FAILED in watcher.status()
        assert watcher.dashboard().blocks["layout"]["title"]  # still the local engine's block table
    for url, problem in [("", "no URL given"), ("ftp://user:pw@example", "not an http")]:  # nothing fetched
        note = watcher.attach(url)
        assert note.startswith("⚠️") and problem in note and "pw" not in note, note
    history, _ = list(watcher.chat("Hello", [], 0.0, 4))[-1]
    assert history[-1]["role"] == "assistant" and not history[-1]["content"].startswith("⚠️")  # local chat works


# ---- attached to a second app ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_dashboard_attached_to_a_second_app_draws_its_metrics_and_they_move(watched, watcher):
    url, remote_pg = watched
    wait_idle(remote_pg)
    note = watcher.attach(url + "/v1")  # the API's address works as well as the server's root
    assert note.startswith("Attached to " + plain(url)) and MODEL in note
    before = scraped(url)["vllm:generation_tokens_total"]
    local_before = watcher.service.snapshot().generation_tokens_total
    watcher.remote.poll_s = 0.2
    body = {"model": MODEL, "prompt": "Watch me from afar", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    remote_pg.service.pause()  # held in step mode, the request is seen running by the scrapes
    try:
        reply = []
        sender = threading.Thread(target=lambda: reply.append(httpx.post(url + "/v1/completions", json=body,
                                                                         timeout=120)))
        sender.start()
        assert wait_until(lambda: remote_pg.service.engine.has_unfinished(), timeout_s=30.0,
                          poll_s=0.1), "timed out waiting for the request to arrive"
        remote_pg.service.step_once()  # its prefill: now it runs and holds blocks, until the engine resumes
        assert wait_until(lambda: watcher.remote.latest.num_running == 1, timeout_s=30.0,
                          poll_s=0.1), "timed out waiting for a scrape that sees it running"
        assert watcher.remote.latest.kv_usage > 0
    finally:
        remote_pg.service.resume()
    sender.join(120)
    assert reply[0].json()["usage"]["completion_tokens"] == 40
    wait_idle(remote_pg)
    polls = watcher.remote.polls
    assert wait_until(lambda: watcher.remote.polls >= polls + 2, timeout_s=30.0,
                      poll_s=0.1), "timed out waiting for two scrapes after the request"
    latest = watcher.remote.history[-1]
    assert latest.generation_tokens_total - before == 40  # the watched app's count, over HTTP
    assert latest.generation_tokens_total == remote_pg.service.snapshot().generation_tokens_total
    assert watcher.service.snapshot().generation_tokens_total == local_before  # nothing ran here

    figs = watcher.dashboard()
    assert max(numbers(trace(figs.throughput, "tokens/s")["y"])) > 0
    assert max(numbers(trace(figs.queues, "running")["y"])) == 1
    assert max(numbers(trace(figs.throughput, "TTFT (ms)")["y"])) > 0
    assert "not available when attached to a remote server" in json.dumps(figs.blocks).replace("<br>", " ")
    total = remote_pg.service.snapshot().kv_blocks_total  # vllm:cache_config_info carried the pool's size
    assert figs.memory["data"][0]["y"][0] == "KV cache (blocks)" and f"/ {total}" in figs.memory["data"][0]["text"][0]
    status = watcher.status()
    assert plain(url) in status and f"generated {latest.generation_tokens_total} tokens" in status


def test_the_chat_through_an_attached_app_streams_its_reply(watched, watcher, reference):
    url, remote_pg = watched
    watcher.attach(url)
    finished = scraped(url).get("vllm:request_success_total", 0)
    # each update as the page gets it (the chat changes its last message in place, as the local chat does)
    updates = [(h[-1]["role"], h[-1]["content"], info)
               for h, info in watcher.chat("Tell me about paged attention.", [], 0.0, 12)]
    replies = [content for role, content, _ in updates if role == "assistant"]
    expected = reference.generate([chat_token_ids(reference.tokenizer, [{"role": "user", "content":
                                   "Tell me about paged attention."}])], SamplingParams(temperature=0, max_tokens=12))
    assert replies[-1] == expected[0].text  # the watched app's greedy reply, over HTTP
    assert len(set(replies)) > 2  # it arrived piece by piece
    assert all(a == b[:len(a)] for a, b in zip(replies, replies[1:]))  # each update extends the last
    assert plain(url) in updates[-1][2] and "12 tokens" in updates[-1][2]
    assert wait_until(lambda: scraped(url).get("vllm:request_success_total", 0) == finished + 1, timeout_s=30.0,
                      poll_s=0.1), "timed out waiting for the remote's count"
    view, polling = watcher.chat_view(None)
    assert "not available when attached" in json.dumps(view.blocks).replace("<br>", " ") and not polling


def test_what_needs_this_engine_says_so_while_attached_and_works_again_after_detaching(watched, watcher):
    url, _ = watched
    import app
    local = app.intro(watcher)
    assert "runs **tiny-llama" in local and "Attached" not in local  # the model this machine's engine runs
    watcher.attach(url)
    # the header says the chat and the charts are another server's now, not this machine's model
    assert f"**Attached to {url}**" in app.intro(watcher).replace("\\", "")
    assert "this form shows the engine in this process" in watcher.settings_note()
    for note in (watcher.pause(), watcher.step(), watcher.resume(), watcher.restart(),
                 watcher.apply_settings(max_num_seqs=3), watcher.start_traffic("fixed-16", 2)):
        assert "not available when attached to a remote server" in note, note
    with pytest.raises(ValueError, match="not available when attached"):
        watcher.ablate("ablation", quick=True)
    assert watcher.settings()["max_num_seqs"] != 3 and not watcher.service.paused
    assert watcher.detach().startswith("Detached")
    assert app.intro(watcher) == local
    assert "not available" not in json.dumps(watcher.dashboard().blocks)
    assert not watcher.status().startswith("**attached") and "detached the page from" in watcher.status()
    assert watcher.pause().startswith("Paused") and watcher.resume() == "Running."


# ---- a page that only watches (`python app.py --attach URL`) --------------------------------------------------

@pytest.mark.slow
def test_a_watch_only_page_loads_no_model_chats_with_the_watched_server_and_only_the_presenter_re_attaches(
        watched, reference):
    """The Watcher has no engine (no `llm`, no `service`): a page that touched one would fail to build. Public mode:
    the audience chats and watches; attaching elsewhere is the presenter's; the page has no API of its own."""
    from gradio_client import Client

    import app
    from playground.access import PUBLIC, Access
    from playground.page_client import free_port, reply_text
    from playground.watching import Watcher
    url, remote_pg = watched
    said = []
    with pytest.raises(ValueError, match="no answer from"):  # nothing there: asked again, then given up, said each time
        Watcher.connect(f"http://127.0.0.1:{free_port()}", say=said.append, retry_s=0.2, give_up_s=0.5)
    assert said and all("asking again in" in line for line in said)
    with pytest.raises(ValueError, match="not an http"):
        Watcher.connect("ftp://example", say=said.append)
    watcher = Watcher.connect(url, say=said.append)
    assert not hasattr(watcher, "llm") and not hasattr(watcher, "service")
    port = free_port()
    demo = app.launch(watcher, "", access=Access(PUBLIC), server_name="127.0.0.1", server_port=port,
                      prevent_thread_lock=True, quiet=True)
    try:
        page = f"http://127.0.0.1:{port}"
        endpoints = set(httpx.get(page + "/gradio_api/info", timeout=30).json()["named_endpoints"])
        assert {"/chat", "/dashboard", "/attach", "/detach"} <= endpoints
        assert not endpoints & {"/apply_settings", "/restart", "/traffic", "/pause", "/lesson_start"}  # no engine
        assert httpx.get(page + "/v1/models", timeout=30).status_code == 404  # the watched server serves the API
        client = Client(page, verbose=False)
        for name, args in (("/attach", ["http://127.0.0.1:9"]), ("/detach", [])):
            with pytest.raises(Exception, match="Only the presenter may"):
                client.predict(*args, api_name=name)
        assert watcher.remote.url == url and watcher.room.latest() is None
        header = app.intro(watcher)
        assert plain(url) in header and "No model runs on this machine" in header
        assert MODEL not in header and MODEL in app.intro(watcher, presenter=True)  # the remote's words: presenter
        history, stats = client.predict("Tell me about paged attention.", [], 0.0, 12, api_name="/chat")
        asked = [{"role": "user", "content": "Tell me about paged attention."}]
        expected = reference.generate([chat_token_ids(reference.tokenizer, asked)],
                                      SamplingParams(temperature=0, max_tokens=12))
        assert reply_text(history) == expected[0].text and "12 tokens" in stats  # the watched app's reply
        status, *_, shown_header = client.predict(api_name="/dashboard")  # what every visitor's clock gets
        assert status.startswith(f"**attached to {plain(url)}**") and shown_header == header
        assert "only watches" in watcher.detach() and watcher.remote.url == url  # nothing local to go back to
    finally:
        demo.close()
        watcher.close()


def test_attach_on_the_command_line_refuses_what_would_configure_a_local_engine(monkeypatch, capsys):
    import app
    monkeypatch.setattr("sys.argv", ["app.py", "--attach", "http://127.0.0.1:9", "--set", "max_num_seqs=2"])
    with pytest.raises(SystemExit):
        app.main()
    assert "--attach watches another server and loads no model here: --set" in capsys.readouterr().err


@pytest.mark.slow
def test_a_watched_server_that_goes_away_is_reported_and_the_page_keeps_running(tiny_models, watcher, tmp_path):
    import app
    from playground import Playground
    from playground.page_client import free_port
    pg = Playground(LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN), store=tmp_path / "a.json")
    port = free_port()
    demo = app.launch(pg, MODEL, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        assert watcher.attach(f"http://127.0.0.1:{port}").startswith("Attached")
    finally:
        demo.close()
        pg.service.shutdown()
    assert wait_until(lambda: watcher.remote.error is not None, timeout_s=30.0,
                      poll_s=0.1), "timed out waiting for a failed scrape"
    assert "no answer from" in watcher.status()
    assert watcher.dashboard().queues  # the charts still draw what was scraped
    history, _ = list(watcher.chat("still there?", [], 0.0, 4))[-1]
    assert history[-1]["content"].startswith("⚠️ cannot talk to")


# ---- attach is no SSRF tool: bounded, silent about what it read, the same for every kind of unreachable ---------

SECRET_PAGE = b"internal admin page: password=hunter2\n"


class _Hostile(http.server.BaseHTTPRequestHandler):
    """/slow trickles a byte every 0.3 s; /big is 3 MB of Prometheus text; /secret a 200 with an internal page."""
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        if self.path.startswith("/slow"):
            try:
                for _ in range(60):
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.3)
            except BrokenPipeError:  # the fetch gave up, as it should
                pass
        elif self.path.startswith("/big"):
            self.wfile.write(b'vllm:num_requests_running{engine="0"} 1.0\n' * 80_000)
        else:
            self.wfile.write(SECRET_PAGE)

    def log_message(self, *args):
        pass


@pytest.fixture()
def hostile_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_fetch_has_a_total_deadline_and_a_size_cap(hostile_server):
    from playground.remote import TooLarge, fetch
    start = time.monotonic()
    with pytest.raises(ValueError, match="no answer from"):
        fetch(hostile_server + "/slow", 1 << 20, deadline_s=1.0)
    assert time.monotonic() - start < 3.0  # not 60 reads of 0.3 s, each under the per-read timeout
    with pytest.raises(TooLarge):
        fetch(hostile_server + "/big", 1 << 20, deadline_s=5.0)


def test_what_a_remote_said_is_never_shown_and_unreachable_reads_the_same(watcher, hostile_server, monkeypatch):
    from playground import watching
    from playground.page_client import free_port
    monkeypatch.setattr(watching, "ATTACH_FAILS_AFTER_S", 0.5)
    note = watcher.attach(hostile_server + "/secret")  # /secret/metrics answers the internal page
    assert note.startswith("⚠️") and "hunter2" not in note and "internal" not in note and "hunter2" not in \
        watcher.status()
    closed_url, missing_url = f"http://127.0.0.1:{free_port()}", "http://no-such-host.invalid:8000"
    closed, missing = watcher.attach(closed_url), watcher.attach(missing_url)
    assert "could not reach a metrics endpoint" in closed
    assert closed.replace(plain(closed_url), "URL") == missing.replace(plain(missing_url), "URL")
    watcher.detach()


def test_a_hostile_address_is_never_shown_and_detach_clears_it(watcher):
    note = watcher.attach("# THE WORKSHOP IS CANCELLED [click here](http://example.com)")
    assert note.startswith("⚠️")
    for shown in (note, watcher.status()):
        assert "WORKSHOP" not in shown and "click" not in shown
    note = watcher.attach("http://[click here](http://example.com)")
    assert "click" not in note and "click" not in watcher.status()
    watcher.detach()


def test_a_failing_scrape_backs_off(hostile_server):
    from playground.remote import MAX_POLL_S, RemoteServer
    remote = RemoteServer(hostile_server + "/secret", poll_s=1.0)
    waits = []
    for _ in range(7):
        remote.poll_once()
        waits.append(remote.next_wait_s())
    # one miss is retried at the usual pace (a chart loses one point, not seconds); then each wait doubles
    assert waits[:4] == [1.0, 2.0, 4.0, 8.0] and waits[-1] == MAX_POLL_S and remote.error


# ---- bench serve against the launched app ----------------------------------------------------------------------

def test_bench_serve_prints_a_table_with_sane_numbers(watched, tiny_models, capsys, tmp_path):
    from engine.bench.cli import main
    url, remote_pg = watched
    wait_idle(remote_pg)
    before = scraped(url)
    out_json = tmp_path / "serve.json"
    rc = main(["serve", "--url", url, "--concurrency", "4", "--requests", "8", "--workload", "fixed-16",
               "--max-tokens", "9", "--tokenizer", tiny_models["llama"][0], "--json", str(out_json)])
    captured = capsys.readouterr()
    assert rc == 0, captured
    table = captured.out
    assert "Serving Benchmark Result" in table and "8/8" in captured.err  # the progress bar, on stderr
    data = json.loads(out_json.read_text())  # the numbers the table prints
    assert (data["completed"], data["failed"], data["max_concurrency"]) == (8, 0, 4)
    assert data["total_output_tokens"] == 8 * 9  # ignore_eos: exactly max_tokens each
    after = scraped(url)
    # the bench's token counts are the server's own
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 72
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == data["total_input_tokens"]
    for r in data["requests"]:
        assert r["ok"] and r["output_tokens"] == 9 and r["finish_reason"] == "length"
        assert 0 < r["ttft_s"] <= r["latency_s"] and len(r["itl_s"]) == r["num_chunks"] - 1
    assert 0 < data["ttft_ms"]["median"] <= data["ttft_ms"]["p99"] <= data["e2el_ms"]["p99"]
    assert data["ttft_ms"]["mean"] > 0 and data["tpot_ms"]["mean"] > 0 and data["itl_ms"]["p90"] > 0
    assert data["output_throughput"] == pytest.approx(72 / data["duration_s"])
    assert data["request_throughput"] == pytest.approx(8 / data["duration_s"])


def test_bench_serve_counts_failures_by_message(watched, tiny_models, capsys, tmp_path):
    from engine.bench.cli import main
    url, _ = watched
    rc = main(["serve", "--url", url + "/", "--concurrency", "2", "--requests", "3", "--workload", "fixed-16",
               "--max-tokens", "2", "--model", "no-such-model", "--api", "completions",
               "--tokenizer", tiny_models["llama"][0], "--json", str(tmp_path / "serve.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "serve.json").read_text())
    assert rc == 1 and (data["completed"], data["failed"]) == (0, 3)
    [(reason, count)] = data["failures"].items()  # all three for one reason, the server's own words
    assert count == 3 and reason.startswith("404") and "no-such-model" in reason and reason in out


def test_bench_serve_against_nothing_says_so():
    from engine.bench.cli import main
    from engine.bench.serve import ServeRequest, run_serve
    from playground.page_client import free_port
    with pytest.raises(ValueError, match="cannot reach"):
        run_serve(f"http://127.0.0.1:{free_port()}", [ServeRequest("hi", 2)], 1)
    assert main(["serve", "--url", "localhost:1", "--workload", "copy-edit"]) == 2  # no scheme: refused


def test_ignore_eos_reaches_the_engine_from_the_api():
    from server.protocol import parse_chat, parse_completion
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert parse_chat({**body, "ignore_eos": True}, "m").sampling_params(3, 256).ignore_eos is True
    assert parse_chat(body, "m").sampling_params(3, 256).ignore_eos is False
    assert parse_completion({"prompt": "hi", "ignore_eos": True}, "m").sampling_params(3, 256).ignore_eos is True


def test_vllm_s_null_block_is_left_out_of_the_pool_it_draws():
    """vLLM counts a null block in num_gpu_blocks that kv_cache_usage_perc leaves out: a 6-block pool holding 4 of
    its 5 usable blocks (usage 0.8) is 4 / 5, not 5 / 6; this app's own pool has no such block."""
    from playground.remote import history_sample, parse_metrics, usable_blocks
    text = ('vllm:kv_cache_usage_perc{engine="0"} 0.8\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="6"} 1.0\n')
    reading = parse_metrics(text, now=1.0)
    assert usable_blocks(reading, reserved=1) == 5 and history_sample(1, reading, None, 1).kv_blocks_used == 4
    assert usable_blocks(reading) == 6 and history_sample(1, reading, None).kv_blocks_used == 5
