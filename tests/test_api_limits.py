"""The API as a public server meets it: an API key, and every hostile request refused with a 4xx in OpenAI's shape
while another stream keeps going (server/hostile.py is the suite; its timings are printed by the command, never
asserted here)."""
from __future__ import annotations

import pytest

from engine import LLM
from server import hostile
from server.limits import ApiLimits, bearer_ok, check_encodable, check_prompt_size, check_stop, longest_token_chars
from server.protocol import ApiError
from tests.conftest import serve_app

pytestmark = pytest.mark.served  # the app on a local port: `make test` runs it beside the rest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=256), tmp_path_factory.mktemp("api") / "a.json",
                   "tiny", api_key=KEY) as (url, pg):
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
