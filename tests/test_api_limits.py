"""The API as a public server meets it: an API key, and every hostile request refused with a 4xx in OpenAI's shape
while another stream keeps going (server/hostile.py is the suite; its timings are printed by the command, never
asserted here)."""
from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from engine import LLM, SamplingParams
from server import hostile
from server.limits import (
    ApiLimits,
    bearer_ok,
    check_encodable,
    check_prompt_size,
    check_sizes,
    check_stop,
    excerpt,
    longest_token_chars,
)
from server.protocol import ApiError, parse_chat, parse_completion
from tests.conftest import serve_app

pytestmark = pytest.mark.served  # the app on a local port: `make test` runs it beside the rest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
KEY = "sk-test-key"
MAX_MODEL_LEN = 256
HI = [{"role": "user", "content": "hi"}]
SMALL = 2048  # an error body's most bytes: whatever the request held, it is quoted as a short excerpt


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN),
                   tmp_path_factory.mktemp("api") / "a.json", "tiny", api_key=KEY) as (url, pg):
        yield url.rstrip("/"), pg


def test_the_key_guards_v1_and_leaves_metrics_and_health_open(server):
    url, _ = server
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    reply = good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message.content is not None
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics").status_code == 200 and httpx.get(url + "/health").status_code == 200


def test_health_says_when_step_mode_has_paused_the_engine(server):
    url, pg = server
    pg.service.pause()
    try:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_paused"
    finally:
        pg.service.resume()
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.slow
def test_every_abuse_is_refused_with_a_4xx_and_the_stream_beside_it_finishes(server):
    url, pg = server
    out = hostile.run(url, KEY, rounds=1, max_tokens=24)
    wrong = [(r["name"], r["status"], r["code"]) for r in out["results"] if r["status"] != r["expect"]]
    assert not wrong
    assert all(r["code"] and not r["code"].startswith("not JSON") for r in out["results"])  # OpenAI's error shape
    assert {"100,000 stop_token_ids", "logit_bias of 100,000 tokens", "10,000 messages", "a 3 MB model name",
            "a 60,000-character unknown path"} <= {r["name"] for r in out["results"]}
    echoed = [(r["name"], r["bytes"]) for r in out["results"] if r["bytes"] > SMALL]
    assert not echoed  # a 3 MB model name, a 60 KB path: quoted as a short excerpt, never whole
    assert len(out["gaps"]) >= 20 and len(out["baseline_gaps"]) >= 20  # both normal streams ran to the end
    assert pg.service.alive


def test_the_limits_one_by_one():
    assert bearer_ok("Bearer k", "k") and not bearer_ok("Bearer x", "k") and not bearer_ok(None, "k")
    assert not bearer_ok("k", "k")
    with pytest.raises(ApiError, match="not valid Unicode") as caught:
        check_encodable({"messages": [{"role": "user", "content": "ok\ud800"}]})
    assert caught.value.param == "messages[0].content"
    check_encodable({"prompt": "fine ✓ 🙂"})
    with pytest.raises(ApiError, match="at most 32"):
        check_stop(["s"] * 33, ApiLimits())
    check_stop("one", ApiLimits())
    check_stop(None, ApiLimits())
    with pytest.raises(ApiError, match="whatever its tokens"):
        check_prompt_size(256 * 81 + 1, None, 256, 81, "prompt")
    check_prompt_size(256 * 81, None, 256, 81, "prompt")
    with pytest.raises(ApiError, match="257 tokens"):
        check_prompt_size(0, 257, 256, 81, "prompt")


def test_the_character_bound_holds_for_the_longest_token(default_llm):
    """A text of n times the longest token's characters never tokenizes to fewer than n tokens."""
    tok = default_llm.tokenizer
    longest = longest_token_chars(tok)
    worst = max(tok.get_vocab(), key=len)
    text = tok.convert_tokens_to_string([worst]) * 20
    assert len(tok(text, add_special_tokens=False).input_ids) >= len(text) / longest


# ---- every list has a cap, and nothing a client sends comes back whole ----------------------------------------

def _parts(n: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "a"}] * n}]


CAPS = [  # (field, a body with `n` items in it, the cap, the param named)
    ("messages", lambda n: {"messages": HI * n}, 1000, "messages"),
    ("content parts", lambda n: {"messages": _parts(n)}, 100, "messages[0].content"),
    ("prompt token ids", lambda n: {"prompt": [1] * n}, 128 * 1024, "prompt"),
    ("prompt batch of one", lambda n: {"prompt": [[1] * n]}, 128 * 1024, "prompt[0]"),
    ("stop_token_ids", lambda n: {"messages": HI, "stop_token_ids": [1] * n}, 128, "stop_token_ids"),
    ("logit_bias", lambda n: {"messages": HI, "logit_bias": {str(i): 1 for i in range(n)}}, 300, "logit_bias"),
    ("stop", lambda n: {"messages": HI, "stop": ["s"] * n}, 32, "stop"),
]


@pytest.mark.parametrize("name,body,cap,param", CAPS, ids=[c[0] for c in CAPS])
def test_every_list_the_api_reads_has_a_cap_named_in_its_400(name, body, cap, param):
    check_sizes(body(cap), ApiLimits())  # the cap itself is taken
    with pytest.raises(ApiError) as caught:
        check_sizes(body(cap + 1), ApiLimits())
    error = caught.value
    assert error.status == 400 and error.param == param and f"{cap:,}" in error.message and param in error.message


def test_the_caps_are_the_servers_own_setting():
    check_sizes({"messages": HI * 3}, ApiLimits())
    with pytest.raises(ApiError, match="at most 2"):
        check_sizes({"messages": HI * 3}, ApiLimits(max_messages=2))


def test_stop_token_ids_reach_the_sampler_and_other_lists_parse_as_before():
    req = parse_chat({"messages": HI, "stop_token_ids": [7, 9]}, "tiny")
    assert req.sampling_params(3, MAX_MODEL_LEN).stop_token_ids == [7, 9]
    assert parse_completion({"prompt": [[5, 6, 7]]}, "tiny").prompt == [5, 6, 7]


def test_an_excerpt_is_short_and_says_how_long_the_whole_was():
    assert excerpt("gpt-9") == "'gpt-9'" and excerpt(None) == "None" and excerpt([1, 2]) == "[1, 2]"
    huge = excerpt("m" * (3 << 20))
    assert len(huge) < 120 and "3,145,728 characters" in huge and huge.startswith("'mmm")
    many = excerpt(list(range(100_000)))
    assert len(many) < 120 and "100,000 items" in many
    nested = excerpt(json.loads("[" * 900 + "]" * 900))  # bounded depth: no RecursionError, no 900 brackets
    assert len(nested) < 40
    error = ApiError(400, "got " + "x" * 100_000, param="p" * 1000)  # another module's message quoting a value
    assert len(error.message) < 1100 and "characters in all" in error.message and len(error.param) <= 120


def test_text_that_is_not_unicode_is_found_where_it_is():
    with pytest.raises(ApiError) as caught:
        check_encodable({"junk": list(range(100_000)), "messages": [{"role": "user", "content": ["ok", "\ud800"]}]})
    assert caught.value.param == "messages[0].content[1]"
    with pytest.raises(ApiError) as caught:
        check_encodable({"k" * 10_000: {"x": "\udfff"}})
    assert caught.value.param.endswith(".x") and len(caught.value.param) <= 120
    with pytest.raises(ApiError, match="body key"):
        check_encodable({"a\ud800": 1})
    deep = json.loads("[" * 900 + '"\\ud800"' + "]" * 900)  # past the C encoder's recursion: the walk has no limit
    with pytest.raises(ApiError, match="not valid Unicode"):
        check_encodable({"x": deep})
    check_encodable({"x": json.loads("[" * 900 + '"ok 🙂"' + "]" * 900)})


def _raw(url: str, request: bytes) -> bytes:
    """What the server answers to raw bytes, to the end (the request says Connection: close)."""
    host, port = url.removeprefix("http://").split(":")
    data = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        for _ in range(10_000):
            more = sock.recv(65536)
            if not more:
                break
            data += more
    return data


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)


def test_refusals_quote_a_short_excerpt_of_what_they_refuse(server):
    url, _ = server
    cases = [("/v1/chat/completions", {"model": "m" * (3 << 20), "messages": HI}, 404, "3,145,728 characters"),
             ("/v1/chat/completions", {"messages": HI, "stop": ["s" * 10_000]}, 400, "10,000 characters"),
             ("/v1/chat/completions", {"messages": HI, "temperature": "t" * (1 << 20)}, 400, "characters in all"),
             ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}] * 50_000}, 400, "50,000 items"),
             ("/v1/chat/completions", {"messages": HI, "stream": True, "stream_options": "o" * (1 << 20)}, 400,
              "1,048,576"),
             ("/v1/completions", {"prompt": ["p" * 100_000] * 20}, 400, "20 prompts")]
    for path, body, status, said in cases:
        r = _post(url, path, body)
        assert r.status_code == status and len(r.content) < SMALL, (status, r.status_code, len(r.content))
        assert said in r.json()["error"]["message"]
    auth = f"Authorization: Bearer {KEY}\r\nConnection: close\r\n\r\n"
    answer = _raw(url, f"GET /v1/{'p' * 60_000} HTTP/1.1\r\nHost: x\r\n{auth}".encode())
    assert answer.startswith(b"HTTP/1.1 404") and len(answer) < SMALL and b"60,004 characters" in answer
    answer = _raw(url, f"GET /v1/{'p' * 100_000} HTTP/1.1\r\nHost: x\r\n{auth}".encode())
    assert answer.startswith(b"HTTP/1.1 400") and len(answer) < SMALL  # past what uvicorn parses as a URL


def test_a_cap_refuses_before_anything_walks_the_body(server):
    """A list past its cap is refused by its length even when something later in the body is also wrong: the
    caps come first, before the walk that looks for text that is not Unicode."""
    url, _ = server
    body = json.dumps({"messages": HI, "stop_token_ids": list(range(100_000)), "x": "\ud800"}).encode()  # escaped
    r = httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "array_above_max_length"
    assert r.json()["error"]["param"] == "stop_token_ids"


def test_stop_token_ids_end_the_reply(server, tiny_models):
    """vLLM's stop_token_ids, once ignored whole (any number taken): now honoured, up to the cap."""
    url, _ = server
    prompt = [101, 2002, 303, 4004]
    reference = LLM(tiny_models["llama"][0], max_model_len=MAX_MODEL_LEN)
    first = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0].token_ids[0]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = _post(url, "/v1/completions", body).json()
    stopped = _post(url, "/v1/completions", {**body, "stop_token_ids": [first]}).json()
    assert plain["choices"][0]["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 6
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] <= 1


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_refused_call_logs_no_traceback(server):
    """400, 401, 404, 413, 415, a client gone mid-body, mid-stream or while waiting: no traceback, no error line
    (uvicorn's access log is off; a refusal is the client's business)."""
    url, pg = server
    host, port = url.removeprefix("http://").split(":")
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "starlette", "fastapi")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        auth = {"authorization": f"Bearer {KEY}"}
        json_auth = {**auth, "content-type": "application/json"}
        assert httpx.post(url + "/v1/completions", content=b"{nope", headers=json_auth).status_code == 400
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(url + "/v1/nothing", headers=auth).status_code == 404
        assert httpx.post(url + "/v1/completions", content=b"{}", headers=auth).status_code == 415
        assert _post(url, "/v1/completions", {"prompt": "x" * (5 << 20)}).status_code == 413
        assert _post(url, "/v1/chat/completions", {"messages": HI * 5000}).status_code == 400
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # gone mid-body
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"prompt\": ".encode())
            time.sleep(0.3)
        with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=30,
                          json={"prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
            next(r.iter_lines())  # gone mid-stream
        pg.service.pause()  # the reply cannot come before the client gives up, however fast the machine
        try:
            with pytest.raises(httpx.TimeoutException):  # gone while waiting for a whole reply
                httpx.post(url + "/v1/completions", headers=auth, timeout=0.3,
                           json={"prompt": "hi", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True})
            time.sleep(1.0)  # the server has noticed every disconnect
        finally:
            pg.service.resume()
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    loud = [(r.name, r.levelname, r.getMessage()[:200]) for r in handler.records
            if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud
