"""The room holds against a client that lies: shares keyed by what the server issued, not by session hashes,
headers or addresses a client invents; a bounded queue; token guesses slowed while the presenter still unlocks.

Served on loopback in token mode. Distinct clients on one machine come from their own loopback addresses
(127.0.0.2, 127.0.0.3, ...), which is what the server sees as their address."""
from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from engine import LLM
from playground import page_client
from playground.access import TOKEN, Access
from tests.conftest import serve_app, wait_until

pytestmark = [pytest.mark.served, pytest.mark.slow]

SECRET = "a long and unguessable presenter token"


@pytest.fixture(scope="module")
def room(tiny_models, tmp_path_factory):
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=512), access=Access(TOKEN, SECRET),
                   store=tmp_path_factory.mktemp("store") / "ablation.json", with_demo=True) as served:
        yield served


def from_address(source: str, **kwargs) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30, **kwargs)


def join(http: httpx.Client, url: str, fn_index: int, data: list, session: str | None = None) -> httpx.Response:
    """A raw queue/join, as a script sends it: any session hash it likes."""
    return http.post(url + "gradio_api/queue/join", json={
        "data": data, "fn_index": fn_index, "session_hash": session or uuid.uuid4().hex[:11], "event_data": None,
        "trigger_id": None})


def fn_ids(url: str) -> dict[str, int]:
    config = httpx.get(url + "config", timeout=30).json()
    return {d["api_name"]: d["id"] for d in config["dependencies"] if d.get("api_name")}


def test_fresh_session_hashes_are_one_visitor(room):
    """One script inventing a new session hash per call had 19 replies running at once: now every call without an
    issued visitor id is its address's, which has one visitor's share. A page that loaded (and so holds an id)
    from another address keeps its own share meanwhile."""
    url, pg, _ = room
    chat = fn_ids(url)["chat"]
    pg.service.pause()  # every reply stays in flight while the next calls come
    try:
        with from_address("127.0.0.5") as script:
            answers = [join(script, url, chat, ["hi", [], 0.0, 64, None]) for _ in range(12)]
        # each joined (to be seated or refused in the chat itself) or was refused at once, past its queue's bound
        assert all(a.status_code == 200 or (a.status_code == 429 and "at most 8 each" in a.text) for a in answers)
        assert wait_until(lambda: pg.seats.from_address("127.0.0.5") == pg.seats.per_visitor)
        time.sleep(0.5)
        assert pg.seats.in_flight("ip:127.0.0.5") == pg.seats.per_visitor == 2
        # the API from the same address, whatever it claims in X-Forwarded-For, is the same visitor: no share left
        with from_address("127.0.0.5") as api:
            spoofed = [api.post(url + "v1/completions", json={"prompt": "hi", "max_tokens": 4},
                                headers={"X-Forwarded-For": f"10.9.8.{i}", "Forwarded": f"for=10.9.9.{i}"})
                       for i in range(6)]
        assert [r.status_code for r in spoofed] == [429] * 6
        # a real page elsewhere is served
        page = page_client.Session(url, fn_ids(url))
        assert page.load()
        reply = page.stream("chat", ["hello", [], 0.0, 8, None])
        pg.service.resume()
        assert page_client.reply_text(list(reply)[-1][0])
    finally:
        pg.service.resume()
    assert wait_until(lambda: pg.seats.from_address("127.0.0.5") == 0)


def test_distinct_addresses_each_get_their_share_on_the_api(room):
    url, pg, _ = room
    pg.service.pause()
    streams = []
    try:
        for source in ("127.0.0.6", "127.0.0.7"):
            http = from_address(source)
            for _ in range(2):
                s = http.stream("POST", url + "v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
                streams.append((http, s, s.__enter__()))
        assert [r.status_code for _, _, r in streams] == [200] * 4
        with from_address("127.0.0.6") as again:
            assert again.post(url + "v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 429
    finally:
        pg.service.resume()
        for _, s, r in streams:
            r.read()
            s.__exit__(None, None, None)
        for http in {http for http, _, _ in streams}:
            http.close()
    assert wait_until(lambda: not pg.seats._by_address)


def test_a_visitors_queue_is_bounded_and_refused_at_once(room, monkeypatch):
    """Events a visitor has waiting or running are bounded at join: the ninth is refused in a few ms with the
    reason, while an issued visitor elsewhere still gets its events in."""
    url, pg, _ = room
    slow = pg.dashboard

    def dashboard():
        time.sleep(1.5)
        return slow()
    monkeypatch.setattr(pg, "dashboard", dashboard)
    ids = fn_ids(url)
    with from_address("127.0.0.8") as script:
        started = time.perf_counter()
        answers = [join(script, url, ids["dashboard"], [None, {"run": 0, "back": False}, None, 1.0]) for _ in range(14)]
        took = time.perf_counter() - started
    refused = [a for a in answers if a.status_code != 200]
    assert len(refused) == 14 - 8, [a.status_code for a in answers]
    assert all(a.status_code == 429 and "at most 8 each" in a.json()["detail"] for a in refused)
    assert took < 10  # each join answered at once, not after the slow events ahead of it
    page = page_client.Session(url, ids)
    assert page.load()
    assert page.predict("dashboard", [None, {"run": 0, "back": False}, None, 1.0])  # another visitor is not held up


def test_token_guesses_are_slowed_and_the_presenter_unlocks_meanwhile(room):
    """50 wrong presenter tokens through the header (API and page events) from one address: about one a second is
    even compared, and the presenter's Unlock, from a page on the same address, answers at once."""
    url, pg, demo = room
    access = pg.access
    checked = access.guesses.checked
    wrong = {"X-Presenter-Token": "guess"}
    with from_address("127.0.0.9", headers=wrong) as script:
        started = time.perf_counter()
        for i in range(50):
            if i % 2:
                r = script.post(url + "v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert r.status_code in (200, 429)  # an audience request, never the presenter's
            else:
                assert join(script, url, fn_ids(url)["pause"], [], None).status_code == 200
            if i == 25:  # meanwhile, the presenter unlocks from a page on the same network
                page = page_client.Session(url, fn_ids(url), headers=None)
                page.http = from_address("127.0.0.9")
                assert page.load()
                t0 = time.perf_counter()
                said = json.dumps(page.predict("unlock", [SECRET]))
                assert "Unlocked" in said and time.perf_counter() - t0 < 2.0
        elapsed = time.perf_counter() - started
    compared = access.guesses.checked - checked - 1  # less the presenter's right one
    print(f"compared {compared} of 50 wrong tokens in {elapsed:.1f} s; held back {access.guesses.held_back}")
    assert 1 <= compared <= elapsed + 5, (compared, elapsed)
    assert not pg.service.paused  # no wrong token paused the engine
    assert "Paused" in page.predict("pause")[0]
    page.predict("resume")


def test_behind_nginx_each_real_client_gets_its_share_and_spoofing_gains_nothing(tiny_models, tmp_path):
    """A real reverse proxy (Debian's nginx) in front, trusted by its address (--forwarded-allow-ips): distinct
    clients behind it are each themselves; what a client writes into X-Forwarded-For or Forwarded changes nothing;
    a client that goes around the proxy is its own address whatever it claims."""
    from playground.identity import Proxies
    from tests.proxy import Nginx, NginxMissing, client
    proxy_address = "127.0.0.254"
    access = Access(TOKEN, SECRET, proxies=Proxies(proxy_address))
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=512), access=access,
                   store=tmp_path / "ablation.json") as (url, pg):
        try:
            nginx = Nginx(url, forwarded=True, proxy_source=proxy_address)
        except NginxMissing as exc:
            pytest.skip(str(exc))
        with nginx:
            body = {"prompt": "hi", "max_tokens": 2, "stream": True}
            opened = []

            def open_stream(http, headers=None):
                s = http.stream("POST", nginx.url + "v1/completions", json=body, headers=headers or {})
                opened.append((s, s.__enter__()))
                return opened[-1][1].status_code
            pg.service.pause()
            clients = {source: client(source, timeout=30) for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4")}
            try:
                for source in ("127.0.0.2", "127.0.0.3"):  # two real clients: each its own share of 2
                    assert [open_stream(clients[source]) for _ in range(2)] == [200, 200]
                assert open_stream(clients["127.0.0.2"]) == 429
                # a third claims to be others: X-Forwarded-For and Forwarded are appended to, never believed
                spoofs = [{"X-Forwarded-For": f"10.0.0.{i}", "Forwarded": f"for=10.0.1.{i}"} for i in range(5)]
                assert [open_stream(clients["127.0.0.4"], h) for h in spoofs] == [200, 200, 429, 429, 429]
                assert set(pg.seats._by_address) == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
                # around the proxy, from an address it does not trust: its own address, whatever it claims
                clients["direct"] = from_address("127.0.0.5")
                direct = [clients["direct"].stream("POST", url + "v1/completions", json=body,
                                                   headers={"X-Forwarded-For": f"10.0.2.{i}"}) for i in range(3)]
                opened.extend((s, s.__enter__()) for s in direct)
                assert [r.status_code for _, r in opened[-3:]] == [200, 200, 429]
                assert pg.seats.from_address("127.0.0.5") == 2
                # a page through the proxy is issued its visitor id for the real client's address
                page = page_client.Session(nginx.url, fn_ids(nginx.url))
                page.http = client("127.0.0.3", timeout=30)
                assert page.load()
                assert pg.access.ids._sessions[page.hash][1] == "127.0.0.3"
            finally:
                pg.service.resume()
                for s, r in opened:
                    r.read()
                    s.__exit__(None, None, None)
                for http in clients.values():
                    http.close()
            assert wait_until(lambda: not pg.seats._by_address)


def test_the_apis_priority_is_vllms_and_the_audience_cannot_jump_the_queue(room):
    url, pg, _ = room
    ok = httpx.post(url + "v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 3}, timeout=60)
    assert ok.status_code == 200
    ahead = httpx.post(url + "v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": -1}, timeout=60)
    assert ahead.status_code == 400 and ahead.json()["error"]["param"] == "priority"
    for bad in ("high", 1.5, True, 10**12):
        r = httpx.post(url + "v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", bad
    presenter = {"X-Presenter-Token": SECRET}
    first = httpx.post(url + "v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": -1},
                       headers=presenter, timeout=60)
    assert first.status_code == 200  # the presenter may put a request before everyone's
