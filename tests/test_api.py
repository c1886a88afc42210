"""The OpenAI-compatible API and /metrics, on the app launched as `python app.py` launches it (tiny random model).

Driven by the official `openai` client where it can be, by httpx where a test needs raw bytes or a disconnect.
Expected outputs come from a second LLM over the same weights (LLM.generate), never from the API itself.
"""
from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.llm import chat_token_ids
from tests.conftest import serve_app

pytestmark = pytest.mark.served  # the app on a local port: `make test` runs it beside the rest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the workshop."}]
PROMPT = "The engine batches requests because"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    """(base url, Playground): the page, the API and the metrics on one local port, as main() launches them."""
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN),
                   tmp_path_factory.mktemp("api") / "ablation.json", MODEL) as (url, pg):
        yield url.rstrip("/"), pg


@pytest.fixture(scope="module")
def reference(tiny_models):
    """The same weights outside the server: what the API's answers must equal."""
    return LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def http():
    """One keep-alive HTTP client for the many short requests (a connection each costs more than the request)."""
    with httpx.Client() as client:
        yield client


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    return chat_token_ids(llm.tokenizer, messages)


def wait_until_idle_and_free(pg, timeout_s: float = 10.0) -> None:
    """Every request gone and every KV block back in the pool, as the engine's snapshot shows it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = pg.service.snapshot()
        if not snap.running and not snap.waiting and snap.kv_blocks_used == 0 and not pg.service.engine.requests:
            break
        time.sleep(0.02)
    snap = pg.service.snapshot()
    assert not snap.running and not snap.waiting, (snap.running, snap.waiting)
    assert snap.kv_blocks_used == 0 and all(rc == 0 for rc in snap.block_ref_counts)
    assert not snap.block_tables


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: (name, sorted labels) -> value."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def sample(m: dict, name: str, **labels) -> float:
    labels = {"model_name": MODEL, "engine": "0", **labels}
    return m[(name, tuple(sorted(labels.items())))]


# ---- the official client ---------------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == MAX_MODEL_LEN


def test_greedy_chat_and_completion_equal_llm_generate(client, reference):
    greedy = SamplingParams(temperature=0, max_tokens=10)
    expected_chat = reference.generate([chat_ids(reference, HELLO)], greedy)[0]
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=10)
    assert chat.choices[0].message.content == expected_chat.text and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == expected_chat.finish_reason
    assert chat.usage.prompt_tokens == len(expected_chat.prompt_token_ids)
    assert chat.usage.completion_tokens == len(expected_chat.token_ids)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert chat.object == "chat.completion" and chat.model == MODEL and chat.id.startswith("chatcmpl-")

    expected = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0]
    completion = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=10)
    assert completion.choices[0].text == expected.text and completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(expected.prompt_token_ids), 10)
    # the same through max_completion_tokens, and a prompt given as token ids
    again = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_completion_tokens=10)
    assert again.choices[0].message.content == expected_chat.text
    by_ids = client.completions.create(model=MODEL, prompt=expected.prompt_token_ids, temperature=0, max_tokens=10)
    assert by_ids.choices[0].text == expected.text


def test_streams_add_up_to_the_reply_and_usage_counts_the_tokens_streamed(client, reference):
    expected = reference.generate([chat_ids(reference, HELLO)], SamplingParams(temperature=0, max_tokens=12,
                                                                               logprobs=0))[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True},
                                                 logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and body[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.usage is None for c in body) and all(c.choices[0].finish_reason is None for c in body[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected.text
    streamed = [t for c in body if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    assert last.usage.completion_tokens == len(streamed) == len(expected.token_ids)
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)

    expected = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == expected.text
    assert pieces[-1].usage.completion_tokens == 8
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, stream=True))
    assert all(p.usage is None for p in plain) and plain[-1].choices[0].finish_reason == "length"


def test_four_concurrent_streams_each_get_their_own_reply(client, reference, server):
    _, pg = server
    prompts = [f"Request number {i} asks about the KV cache." for i in range(4)]
    expected = [o.text for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]
    steps_before = len(pg.service.history)

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16, stream=True)
        return "".join(c.choices[0].text for c in chunks)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(stream, prompts))
    assert got == expected
    assert max(h.num_running for h in list(pg.service.history)[steps_before:]) > 1  # batched in one engine


def test_stop_strings_end_the_reply_before_them_streamed_or_not(client, reference):
    full = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0].text
    # a stop string that starts halfway (first occurring there), so there is text before it to keep
    start = next(i for i in range(len(full) // 2, len(full) - 3) if full.find(full[i:i + 3]) == i)
    stop = full[start:start + 3]
    done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=16, stop=[stop])
    assert done.choices[0].text == full[:start] and done.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=16, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:start]  # never a piece of the stop string


def test_seed_reproduces_the_sampled_reply(client, reference):
    params = dict(temperature=1.0, top_p=0.95, max_tokens=12)
    expected = reference.generate([PROMPT], SamplingParams(**params, seed=1234))[0].text
    first = client.completions.create(model=MODEL, prompt=PROMPT, seed=1234, **params).choices[0].text
    second = client.completions.create(model=MODEL, prompt=PROMPT, seed=1234, **params).choices[0].text
    other = client.completions.create(model=MODEL, prompt=PROMPT, seed=99, **params).choices[0].text
    assert first == second == expected and other != first
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, seed=1234, extra_body={"top_k": 5, "min_p": 0.01},
                                        **params).choices[0].text
    assert sampled == reference.generate([PROMPT], SamplingParams(**params, seed=1234, top_k=5, min_p=0.01))[0].text


def test_logprobs_when_asked_and_only_then(client, reference):
    expected = reference.generate([chat_ids(reference, HELLO)], SamplingParams(temperature=0, max_tokens=6,
                                                                               logprobs=3))[0]
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=6, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for entry, lp in zip(content, expected.logprobs, strict=True):
        assert entry.token == reference.tokenizer.decode([lp.token_id]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in lp.top], abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=2)
    assert plain.choices[0].logprobs is None

    completion = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2)
    lps = completion.choices[0].logprobs
    assert "".join(lps.tokens) == completion.choices[0].text and len(lps.token_logprobs) == 4
    assert all(len(top) <= 2 for top in lps.top_logprobs) and lps.text_offset[0] == 0
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:i]) for i in range(4)]


# ---- bad requests --------------------------------------------------------------------------------------------

TOO_LONG = " ".join(["tokens"] * (MAX_MODEL_LEN + 10))
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


BAD_REQUESTS = [  # (endpoint, body as bytes or dict, expected status, expected param or None)
    (CHAT, b'{"messages": [', 400, None),
    (CHAT, b'[1, 2]', 400, None),
    (CHAT, b'\xff\xfe', 400, None),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, chat_body(messages=[]), 400, "messages"),
    (CHAT, chat_body(messages="hi"), 400, "messages"),
    (CHAT, chat_body(messages=["hi"]), 400, "messages[0]"),
    (CHAT, chat_body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    (CHAT, chat_body(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    (CHAT, chat_body(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content"),
    (CHAT, chat_body(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content"),
    (CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat_body(max_tokens=-3), 400, "max_tokens"),
    (CHAT, chat_body(max_tokens=2.5), 400, "max_tokens"),
    (CHAT, chat_body(max_tokens="2"), 400, "max_tokens"),
    (CHAT, chat_body(max_tokens=None, max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat_body(temperature=-1), 400, "temperature"),
    (CHAT, chat_body(temperature="hot"), 400, "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    (CHAT, chat_body(top_p=0), 400, "top_p"),
    (CHAT, chat_body(top_p=1.5), 400, "top_p"),
    (CHAT, chat_body(top_k=0), 400, "top_k"),
    (CHAT, chat_body(top_k=2.5), 400, "top_k"),
    (CHAT, chat_body(min_p=2), 400, "min_p"),
    (CHAT, chat_body(seed=2**70), 400, "seed"),
    (CHAT, chat_body(stop=[1, 2]), 400, "stop"),
    (CHAT, chat_body(n=2), 400, "n"),
    (CHAT, chat_body(n=0), 400, "n"),
    (CHAT, chat_body(model="gpt-9"), 404, "model"),
    (CHAT, chat_body(messages=[{"role": "user", "content": TOO_LONG}]), 400, "messages"),
    (CHAT, chat_body(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat_body(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    (CHAT, chat_body(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat_body(stream="yes"), 400, "stream"),
    (CHAT, chat_body(presence_penalty=0.5), 400, "presence_penalty"),
    (CHAT, chat_body(ignore_eos="yes"), 400, "ignore_eos"),
    (CHAT, chat_body(ignore_eos=1), 400, "ignore_eos"),
    (CHAT, chat_body(min_tokens=4), 400, "min_tokens"),
    (COMPLETIONS, {"model": MODEL, "max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "", "max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["one", "two"], "max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, 2, 10**9], "max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logprobs": 50}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": TOO_LONG, "max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{p.rsplit('/', 1)[-1]}-{param}" for i, (p, _, _, param) in enumerate(BAD_REQUESTS)])
def test_a_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, http, path, body, status, param):
    url, pg = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["param"] == param
    if isinstance(body, dict) and TOO_LONG in json.dumps(body):
        assert error["code"] == "context_length_exceeded" and "max_model_len" in error["message"]
    good = http.post(url + CHAT, json=chat_body(max_tokens=1), timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1
    assert pg.service.alive


def test_unknown_paths_under_v1_answer_in_openai_form(server):
    response = httpx.get(server[0] + "/v1/embeddings")
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_url"


def test_beyond_the_waiting_bound_the_api_says_429_and_the_chat_says_busy(server, client):
    url, pg = server
    service = pg.service
    bound = service.max_waiting_requests
    service.pause()  # nothing runs: what is submitted waits
    queued = []
    try:
        service.max_waiting_requests = 2
        queued = [service.submit([100 + i, 200, 300], SamplingParams(temperature=0, max_tokens=2)) for i in range(2)]
        response = httpx.post(url + CHAT, json=chat_body(), timeout=30)
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and "busy" in error["message"] and "retry" in error["message"]
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        history, _ = list(pg.chat("Hello?", [], 0.0, 8))[-1]
        assert history[-1]["content"].startswith("⚠️ busy") and "retry" in history[-1]["content"]
    finally:
        service.max_waiting_requests = bound
        service.resume()
    for rid, q in queued:
        assert list(service.follow(rid, q, timeout=60))[-1].finished
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


# ---- disconnects -----------------------------------------------------------------------------------------------

@pytest.fixture()
def finished_reasons(server):
    """The finish reason of every request that ends while the test runs (from the service's stat listeners)."""
    _, pg = server
    wait_until_idle_and_free(pg, timeout_s=60)  # an earlier test's requests end before this one listens
    reasons: list[tuple[str, int]] = []

    def listen(stats):
        reasons.extend((f.finish_reason, f.num_generation_tokens) for f in stats.finished)
    pg.stat_listeners.append(listen)
    yield reasons
    pg.stat_listeners.remove(listen)


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted_and_blocks_freed(server, finished_reasons):
    url, pg = server
    body = chat_body(max_tokens=200, temperature=0, stream=True)
    # held in step mode, 4 steps at a time, so that the reply is still streaming when the client leaves (free
    # running, the tiny model can make all 200 tokens before a busy test process reads its first lines)
    pg.service.pause()
    stepper = threading.Thread(target=lambda: [pg.service.step_once() or time.sleep(0.05) for _ in range(4)])
    try:
        with httpx.stream("POST", url + CHAT, json=body, timeout=60) as response:
            stepper.start()
            data = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data.append(line)
                if len(data) == 4:  # still reading (leaving the loop closes the stream): it holds blocks
                    stepper.join(10)
                    assert pg.service.snapshot().kv_blocks_used > 0 and not finished_reasons
                    break
    finally:
        pg.service.resume()
    closed = time.monotonic()
    wait_until_idle_and_free(pg, timeout_s=5)
    assert time.monotonic() - closed < 5
    assert len(finished_reasons) == 1 and finished_reasons[0][0] == "abort" and finished_reasons[0][1] < 200


def test_a_client_that_gives_up_waiting_has_its_request_aborted(server, finished_reasons):
    url, pg = server
    pg.service.pause()  # the request waits until the client gives up (on a quiet machine 200 tokens take < 1 s)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0}, timeout=1.0)
    finally:
        pg.service.resume()
    wait_until_idle_and_free(pg, timeout_s=5)
    assert [r for r, _ in finished_reasons] == ["abort"]


# ---- metrics -------------------------------------------------------------------------------------------------

def test_metrics_parse_and_move_as_requests_run(server, client):
    url, pg = server
    before = metrics(url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert sample(before, name) >= 0
    # while a stream runs, the gauges show it
    with httpx.stream("POST", url + COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 200, "stream": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        during = metrics(url)
        assert sample(during, "vllm:num_requests_running") == 1
        assert 0 < sample(during, "vllm:kv_cache_usage_perc") <= 1
    wait_until_idle_and_free(pg)
    before = metrics(url)
    prompt = f"Metrics move: {PROMPT} " * 4  # several full KV blocks, for the prefix cache to share
    done = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=7)
    done_again = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=7)
    after = metrics(url)

    def moved(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)
    assert moved("vllm:generation_tokens_total") == 14
    assert moved("vllm:prompt_tokens_total") == done.usage.prompt_tokens + done_again.usage.prompt_tokens
    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 2 * 6
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    # the second prompt found the first one's full blocks in the prefix cache
    assert moved("vllm:prefix_cache_queries_total") == 2 * done.usage.prompt_tokens
    assert moved("vllm:prefix_cache_hits_total") > 0
    assert sample(after, "vllm:num_requests_running") == 0 and sample(after, "vllm:kv_cache_usage_perc") == 0


def test_metrics_of_two_apps_in_one_process_are_their_own(server):
    """Each app has its own registry: a second one starts from zero, whatever the first has counted."""
    from server import OpenAIApi
    url, pg = server
    other = OpenAIApi(lambda: pg.service, pg.llm.tokenizer, "another-name")
    text, content_type = other.metrics.exposition()
    assert content_type.startswith("text/plain")
    samples = {s.name: s.value for f in parser.text_string_to_metric_families(text.decode()) for s in f.samples
               if s.labels.get("model_name") == "another-name"}
    assert samples["vllm:generation_tokens_total"] == 0 and sample(metrics(url), "vllm:generation_tokens_total") > 0


# ---- a hostile burst -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_burst_of_mixed_good_bad_and_abandoned_requests(server):
    """200 requests, 16 at a time: good ones (streamed or not), bad ones, and clients that leave mid-stream or
    give up waiting. No server error, every good one answered in full, and afterwards every block is free."""
    url, pg = server
    rng = random.Random(9)
    bad = [b for _, b, status, _ in BAD_REQUESTS if status == 400 and not isinstance(b, bytes)][:12] + [b"{oops"]
    kinds = rng.choices(["good", "stream", "leave", "give_up", "bad"], weights=[3, 3, 2, 1, 3], k=200)
    statuses: list[int] = []
    failures: list[str] = []

    def fire(i: int, kind: str) -> None:
        body = {"model": MODEL, "prompt": f"burst {i}: {PROMPT}", "max_tokens": rng_tokens[i], "temperature": 0}
        try:
            with httpx.Client(timeout=60) as http:
                if kind == "good":
                    r = http.post(url + COMPLETIONS, json=body)
                    statuses.append(r.status_code)
                    reply = r.json()
                    if reply["choices"][0]["finish_reason"] != "stop" and \
                            reply["usage"]["completion_tokens"] != body["max_tokens"]:
                        failures.append(f"{i}: {r.text}")
                elif kind in ("stream", "leave"):
                    with http.stream("POST", url + CHAT, json={**chat_body(max_tokens=rng_tokens[i] * 3),
                                                                "stream": True}) as r:
                        statuses.append(r.status_code)
                        if kind == "leave":  # the first event, then hang up
                            next(line for line in r.iter_lines() if line)
                        else:
                            lines = [line for line in r.iter_lines() if line]
                            if lines[-1] != "data: [DONE]":
                                failures.append(f"{i}: stream ended with {lines[-1]!r}")
                elif kind == "give_up":
                    try:
                        statuses.append(http.post(url + COMPLETIONS, json={**body, "max_tokens": 100},
                                                  timeout=0.3).status_code)
                    except httpx.TimeoutException:
                        pass
                else:
                    case = bad[i % len(bad)]
                    content = case if isinstance(case, bytes) else json.dumps(case).encode()
                    r = http.post(url + CHAT, content=content, headers={"content-type": "application/json"})
                    statuses.append(r.status_code)
                    if r.status_code != 400 or "error" not in r.json():
                        failures.append(f"{i}: {r.status_code} {r.text}")
        except Exception as exc:  # a transport error is a failure too: the server must answer everything
            failures.append(f"{i} ({kind}): {type(exc).__name__}: {exc}")
    rng_tokens = [rng.randint(1, 4) for _ in kinds]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(fire, range(len(kinds)), kinds))
    assert not failures, failures[:5]
    assert statuses and all(s < 500 for s in statuses), sorted(set(statuses))
    assert kinds.count("leave") > 10 and kinds.count("bad") > 10
    wait_until_idle_and_free(pg, timeout_s=30)
    assert pg.service.alive
    assert threading.active_count() < 200  # no thread left behind per request


def test_metrics_say_prefix_caching_is_off_when_paged_kv_is(tiny_models):
    """Prefix caching asked for over a contiguous KV cache never hits: /metrics says it is not enabled, as the
    Dashboard does (both read the snapshot's effective state)."""
    from engine import LLM
    from server import OpenAIApi
    llm = LLM(tiny_models["llama"][0], num_kv_blocks=16, max_model_len=64, paged_kv=False, prefix_caching=True)
    service = SimpleNamespace(snapshot=llm.engine.snapshot)
    text, _ = OpenAIApi(lambda: service, llm.tokenizer, "contiguous").metrics.exposition()
    [info] = [s for f in parser.text_string_to_metric_families(text.decode()) for s in f.samples
              if s.name == "vllm:cache_config_info"]
    assert info.labels["enable_prefix_caching"] == "False"
    assert llm.engine.snapshot().config["prefix_caching"] is True  # asked for, not running
    on = LLM(tiny_models["llama"][0], num_kv_blocks=16, prefix_caching=True)
    service = SimpleNamespace(snapshot=on.engine.snapshot)
    text, _ = OpenAIApi(lambda: service, on.tokenizer, "paged").metrics.exposition()
    assert 'enable_prefix_caching="True"' in text.decode()

