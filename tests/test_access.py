"""Who may change the shared engine: the presenter gate, public mode, and what the room is told.

The gate is tested the way an attacker would go at it: every event function of the built page is called without
the presenter's secret (named ones through gradio_client, every one through its server function), and the engine
must be as it was."""
from __future__ import annotations

import json
import time
import types

import pytest

from engine import LLM
from playground import access as access_mod
from playground.access import OPEN, PUBLIC, TOKEN, Access, Seats, decide_mode, presenter_functions
from playground.identity import Who
from playground.room import Room, describe_changes, plain
from tests.conftest import serve_app

pytestmark = pytest.mark.served  # the app on a local port: `make test` runs it beside the rest

SECRET = "correct horse battery staple"


@pytest.mark.parametrize("host, share, token, spaces, mode", [
    ("127.0.0.1", False, None, False, OPEN),
    ("localhost", False, None, False, OPEN),
    ("::1", False, None, False, OPEN),
    ("0.0.0.0", False, None, False, PUBLIC),
    ("192.168.1.5", False, None, False, PUBLIC),
    ("127.0.0.1", True, None, False, PUBLIC),  # --share: a public link
    ("127.0.0.1", False, None, True, PUBLIC),  # on Spaces
    ("0.0.0.0", True, SECRET, True, TOKEN),
    ("127.0.0.1", False, SECRET, False, TOKEN),
])
def test_the_mode_follows_where_the_page_listens(host, share, token, spaces, mode):
    assert decide_mode(host, share, token, spaces) == mode


def fake_request(session="tab-1", headers=None, host="192.0.2.10"):
    return types.SimpleNamespace(session_hash=session, headers=headers or {}, client=types.SimpleNamespace(host=host))


def test_only_the_right_token_makes_a_presenter():
    gate = Access(TOKEN, SECRET)
    for tab in ("tab-1", "tab-2"):
        assert gate.admit(None, fake_request(tab))  # each page is issued its visitor id as it loads
    assert not gate.visitor(fake_request()).presenter
    assert "not the presenter token" in gate.unlock("guess", fake_request())
    assert "is taken only 1 s later" in gate.unlock(SECRET, fake_request())  # too soon after a wrong one: unchecked
    gate.guesses.succeeded(gate.who(fake_request()))  # (as if its delay had passed)
    assert not gate.visitor(fake_request()).presenter
    assert gate.unlock(SECRET, fake_request("tab-1")).startswith("Unlocked")
    assert gate.visitor(fake_request("tab-1")).presenter
    assert not gate.visitor(fake_request("tab-2")).presenter  # another visitor is not unlocked by this one
    assert gate.visitor(fake_request("tab-2", {"x-presenter-token": SECRET})).presenter  # a script's header
    assert not gate.visitor(fake_request("tab-3", {"x-presenter-token": SECRET[:-1]})).presenter
    # a page the server never issued an id to cannot unlock, and its guess is not even compared
    checked = gate.guesses.checked
    assert "no visitor id" in gate.unlock(SECRET, fake_request("invented-hash"))
    assert gate.guesses.checked == checked
    gate.forget(fake_request("tab-1"))
    assert not gate.visitor(fake_request("tab-1")).presenter


def test_a_wrong_header_is_one_guess_per_call_and_then_held_back():
    gate = Access(TOKEN, SECRET)
    request = fake_request("script", {"x-presenter-token": "guess"})
    for _ in range(3):  # the gate and the handler ask again within one call: decided once
        assert not gate.visitor(request).presenter
    assert gate.guesses.checked == 1
    again = fake_request("script", {"x-presenter-token": SECRET})  # the right token, too soon after a wrong one
    visitor = gate.visitor(again)
    assert not visitor.presenter and "after a wrong presenter token" in visitor.note
    with pytest.raises(access_mod.Refused, match="is taken only 1 s later"):
        gate.require_presenter("pause", fake_request("script", {"x-presenter-token": SECRET}))
    assert gate.guesses.checked == 1
    # the API's header is the same guess, from the same source (the address: an API client has no visitor id)
    api = types.SimpleNamespace(headers={"x-presenter-token": SECRET}, client=types.SimpleNamespace(host="192.0.2.10"))
    assert gate.api_share(api) is not None and gate.guesses.checked == 1
    assert Access(TOKEN, SECRET).api_share(api) is None  # from a source with no wrong guess: the presenter's


def test_on_a_space_its_owner_logged_in_is_the_presenter(monkeypatch):
    import time
    monkeypatch.setenv("SPACE_ID", "alice/watch-llm")
    monkeypatch.delenv("SPACE_AUTHOR_NAME", raising=False)
    monkeypatch.delenv(access_mod.TOKEN_ENV, raising=False)
    gate = Access.for_launch("0.0.0.0", False, owner_presents=True)
    assert gate.mode == PUBLIC and gate.owner == "alice" and "log in with Hugging Face as alice" in gate.how_to_unlock()

    def logged_in(user, expires_in=600.0):
        raw = types.SimpleNamespace(session={"oauth_info": {"userinfo": {"preferred_username": user},
                                                            "expires_at": time.time() + expires_in}})
        return types.SimpleNamespace(session_hash="tab", headers={}, request=raw)
    assert gate.visitor(logged_in("alice")).presenter
    assert not gate.visitor(logged_in("mallory")).presenter
    assert not gate.visitor(logged_in("alice", expires_in=-1)).presenter  # an expired login is no login
    assert not gate.visitor(fake_request()).presenter
    assert Access.for_launch("0.0.0.0", False).owner is None  # only when asked for
    monkeypatch.delenv("SPACE_ID")
    assert Access.for_launch("0.0.0.0", False, owner_presents=True).owner is None  # not on a Space


def test_public_mode_has_no_presenter_and_open_mode_only_presenters():
    public = Access(PUBLIC)
    assert not public.visitor(fake_request(headers={"x-presenter-token": ""})).presenter
    assert "Public mode" in public.unlock(SECRET, fake_request())
    assert not public.visitor(fake_request()).presenter
    assert Access(OPEN).visitor(fake_request()).presenter and Access(OPEN).visitor(None).presenter
    with pytest.raises(ValueError, match="token mode needs"):
        Access(TOKEN, "")


def test_a_gated_function_refuses_before_it_runs(monkeypatch):
    gate, ran = Access(PUBLIC), []

    def change():
        ran.append(1)
        return "changed"

    def stream():
        ran.append(1)
        yield "changed"
    monkeypatch.setattr(access_mod, "current_request", lambda: fake_request())
    with pytest.raises(RuntimeError, match="Only the presenter may"):
        gate.gated(change, "change", RuntimeError)()
    with pytest.raises(RuntimeError, match="Only the presenter may"):
        list(gate.gated(stream, "stream", RuntimeError)())
    assert not ran and gate.refusals == 2
    assert Access(OPEN).gated(change, "change", RuntimeError)() == "changed"


def test_visitors_text_shows_as_text_not_markdown():
    hostile = "# THE WORKSHOP IS CANCELLED [click here](http://example.com) ![x](http://e/x.png) <b>hi</b>\n## two"
    shown = plain(hostile)
    assert "\n" not in shown and len(plain("x" * 1000)) <= 200
    for mark in ("#", "[", "]", "(", ")", "<", ">", "!"):
        assert all(shown[i - 1] == "\\" for i, c in enumerate(shown) if c == mark)
    markdown_it = pytest.importorskip("markdown_it")  # gradio's own dependency, through rich
    html = markdown_it.MarkdownIt().render(shown)
    assert "<h1" not in html and "<a " not in html and "<img" not in html and "<b>" not in html


def test_the_room_says_who_changed_what():
    room = Room()
    assert room.latest() is None
    room.note(describe_changes({"prefix_caching": False, "max_num_seqs": 8, "num_kv_blocks": None}))
    assert room.latest().describe().startswith(
        "presenter turned prefix_caching off, set max_num_seqs to 8, set num_kv_blocks to automatic")


def test_seats_bound_each_visitor_and_each_address():
    seats = Seats(per_visitor=2, max_tokens=64, per_address=3)
    a, b = Who("v:a", "192.0.2.1", True), Who("v:b", "192.0.2.1", True)
    stranger = Who("ip:198.51.100.1", "198.51.100.1", False)
    # each reply's priority is how many its address already has on their way: an address's first goes first
    assert [seats.take(a), seats.take(a)] == [0, 1]
    with pytest.raises(ValueError, match="at most 2 at a time for each visitor"):
        seats.take(a)
    seats.take(b)  # another visitor has their own share ...
    with pytest.raises(ValueError, match="at most 3 at a time from one address"):
        seats.take(b)  # ... but their address has had its fill
    assert seats.take(stranger) == 0
    seats.give_back(a)
    seats.take(b)
    for who in (a, b, b, stranger):
        seats.give_back(who)
    assert seats.in_flight("v:a") == seats.in_flight("v:b") == seats.from_address("192.0.2.1") == 0
    unbounded = Seats(per_visitor=1, per_address=0)
    for i in range(50):
        unbounded.take(Who(f"v:{i}", "192.0.2.1", True))


# ---- the page, served, as an anonymous visitor and as the presenter ---------------------------------------------

@pytest.fixture(scope="module")
def public(tiny_models, tmp_path_factory):
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=512), access=Access(TOKEN, SECRET),
                   store=tmp_path_factory.mktemp("store") / "ablation.json", with_demo=True) as served:
        yield served


def engine_state(pg) -> dict:
    return {"config": pg.service.config_view().requested, "paused": pg.service.paused, "remote": pg.remote,
            "traffic": pg.traffic.running, "measurement": pg.measurement, "service": pg.service,
            "precision": pg.service.snapshot().precision, "lesson": pg.lessons.run}


def named_endpoints(url: str) -> dict:
    import httpx
    info = httpx.get(url + "gradio_api/info", timeout=30).json()
    return {**info["named_endpoints"], **info.get("unnamed_endpoints", {})}


@pytest.mark.slow
def test_no_shared_state_endpoint_answers_an_anonymous_visitor(public):
    """Every named endpoint the page has (enumerated from the app, so a new one cannot slip past) is either one the
    audience may call or refused without the token, and nothing shared changes."""
    from gradio_client import Client
    url, pg, demo = public
    demo_fns = list(demo.fns.values())
    gated = {f.api_name for f in demo_fns if getattr(f.fn, "presenter_only", False)}
    allowed = {f.api_name for f in demo_fns if getattr(f.fn, "audience", False)}
    assert not presenter_functions(demo)  # every function is marked one way or the other
    assert {"apply_settings", "restart", "do_reset", "traffic", "stop_traffic", "do_ablate", "compare", "attach",
            "detach", "cancel_measurement", "lesson_start", "lesson_flip", "lesson_stop", "lesson_next",
            "lesson_previous"} <= gated
    assert {"chat", "dashboard", "settings", "chat_view", "unlock", "lesson_read", "lesson_record"} <= allowed
    before = engine_state(pg)
    client = Client(url, verbose=False)
    endpoints = named_endpoints(url)
    tried = 0
    for name, spec in endpoints.items():
        if name.lstrip("/") not in gated:
            continue
        args = [p.get("parameter_default") if p.get("parameter_has_default") else None for p in spec["parameters"]]
        with pytest.raises(Exception, match="Only the presenter may"):
            client.predict(*args, api_name=name)
        tried += 1
    assert tried >= 10
    # the events the client cannot name (private, or unnamed) are refused by their server function too
    for block_fn in demo_fns:
        if getattr(block_fn.fn, "presenter_only", False):
            with pytest.raises(Exception, match="Only the presenter may"):
                result = block_fn.fn(*([None] * len(block_fn.inputs)))
                if hasattr(result, "__next__"):
                    next(result)
    assert engine_state(pg) == before
    assert pg.room.latest() is None  # nothing happened to tell the room


LOOPBACK = types.SimpleNamespace(headers={}, client=types.SimpleNamespace(host="127.0.0.1"))


def settings_args(demo, pg, **changes) -> list:
    """What the settings form sends to apply_settings: each field as the engine has it, `changes` applied."""
    from playground.settings import form_value
    block_fn = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    fields = [c.elem_id.removeprefix("setting-") for c in block_fn.inputs[1:]]  # the first is the form's state
    now = {**pg.settings(), **changes}
    return [form_value(f, now[f]) for f in fields]


@pytest.mark.slow
def test_the_presenter_changes_the_engine_and_the_room_sees_who(public):
    from gradio_client import Client
    url, pg, demo = public
    presenter = Client(url, verbose=False, headers={"X-Presenter-Token": SECRET})
    audience = Client(url, verbose=False)
    out = presenter.predict(*settings_args(demo, pg, prefix_caching=False), api_name="/apply_settings")
    assert out.startswith("Applied") and pg.settings()["prefix_caching"] is False
    status = audience.predict(api_name="/dashboard")[0]
    assert "presenter turned prefix\\_caching off" in status  # escaped as text in the status line's Markdown
    assert presenter.predict(*settings_args(demo, pg, prefix_caching=True),
                             api_name="/apply_settings").startswith("Applied")
    # gradio_client runs no page-load event: it has no visitor id, so its Unlock is refused unchecked (a script
    # sends the header instead), and nothing it sends can be guessed through it
    checked = pg.access.guesses.checked
    assert "no visitor id" in json.dumps(audience.predict(SECRET, api_name="/unlock"))
    assert pg.access.guesses.checked == checked
    # a page (which loads, and is issued its visitor id): a wrong token is refused, the right one unlocks it
    from playground import page_client
    page = page_client.open_sessions(url, 1)[0]
    assert "not the presenter token" in json.dumps(page.predict("unlock", ["nope"]))
    pg.access.guesses.succeeded(pg.access.who(session=page.hash, request=LOOPBACK))  # (its delay)
    with pytest.raises(Exception, match="Only the presenter may"):
        page.predict("pause")
    assert "Unlocked" in json.dumps(page.predict("unlock", [SECRET]))
    assert "Paused" in page.predict("pause")[0]
    assert pg.service.paused
    assert "presenter paused the engine" in audience.predict(api_name="/dashboard")[0]
    assert "Running" in page.predict("resume")[0]
    assert not pg.service.paused
    # another visitor is still audience
    with pytest.raises(Exception, match="Only the presenter may"):
        Client(url, verbose=False).predict(api_name="/pause")


@pytest.mark.slow
def test_an_audience_chat_is_capped_and_answered(public, monkeypatch):
    from gradio_client import Client
    url, pg, _ = public
    with pytest.raises(Exception, match="greater than maximum value 256"):  # the page's slider, checked by gradio
        Client(url, verbose=False).predict("Hello", [], 0.0, 10_000, api_name="/chat")
    history, stats = Client(url, verbose=False).predict("Hello", [], 0.0, 256, api_name="/chat")
    assert history[-1]["role"] == "assistant" and "finished" in stats
    assert not pg.seats._in_flight  # the seat was given back
    # past the page, the handler caps it too, and a visitor past their share is told so in the chat
    asked = []
    submit = pg.service.submit
    monkeypatch.setattr(pg.service, "submit", lambda prompt, params, *a, **kw: (asked.append(params.max_tokens),
                                                                                submit(prompt, params, *a, **kw))[1])
    monkeypatch.setattr(pg.seats, "max_tokens", 6)
    one, two = Who("v:1", "192.0.2.1", True), Who("v:2", "192.0.2.2", True)
    list(pg.chat("Hello", [], 0.0, 500, audience=one))
    assert asked == [6]
    pg.seats.take(one)
    pg.seats.take(one)
    history, _ = list(pg.chat("Hello", [], 0.0, 5, audience=one))[-1]
    assert "at most 2 at a time" in history[-1]["content"] and asked == [6]
    assert list(pg.chat("Hello", [], 0.0, 5, audience=two))[-1][1]  # another visitor is served
    pg.seats.give_back(one)
    pg.seats.give_back(one)


@pytest.mark.slow
def test_the_workshop_loadtest_steers_as_the_presenter_while_the_audience_chats(public):
    """playground.loadtest --workshop in small: audience sessions chat and poll, the presenter flips a switch
    through the page's apply_settings; nothing is refused or lost."""
    from playground import loadtest, page_client
    url, pg, _ = public
    sessions = page_client.open_sessions(url, 3)
    presenter = loadtest.Presenter(url, SECRET)
    before = pg.settings()["prefix_caching"]
    result = loadtest.run_phase(sessions, "workshop smoke", 2, True, 8, duration_s=4.0, presenter=presenter,
                                toggle_s=1.0)
    assert result.toggles >= 1 and not result.tally.errors, result.tally.errors
    assert len(result.chats) >= 2 and all(c.reply for c in result.chats)
    assert pg.settings()["prefix_caching"] == (before if result.toggles % 2 == 0 else not before)
    assert "presenter turned prefix" in pg.status()


@pytest.mark.slow
def test_the_api_gives_the_audience_the_pages_fair_shares(public):
    """In token (and public) mode an API client is audience, as a page visitor is: a reply longer than the cap is
    refused by name, a missing max_tokens becomes the cap, and a client with its share in flight is answered 429
    until one finishes; the presenter token lifts both, and nothing is left held."""
    import httpx
    url, pg, _ = public
    api = url + "v1/completions"
    cap, share = pg.seats.max_tokens, pg.seats.per_visitor
    too_long = httpx.post(api, json={"prompt": "hello", "max_tokens": cap + 1}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert f"above {cap}" in too_long.json()["error"]["message"]
    capped = httpx.post(api, json={"prompt": "hello", "ignore_eos": True}, timeout=120).json()
    assert capped["usage"]["completion_tokens"] == cap
    presenter = {"X-Presenter-Token": SECRET}
    assert httpx.post(api, json={"prompt": "hi", "max_tokens": cap + 1, "ignore_eos": True}, headers=presenter,
                      timeout=120).json()["usage"]["completion_tokens"] == cap + 1
    pg.service.pause()  # hold the streams in flight while the next ones arrive (bounded: share + 1 requests)
    try:
        with httpx.Client(timeout=60) as client:
            streams = [client.stream("POST", api, json={"prompt": "hi", "max_tokens": 2, "stream": True})
                       for _ in range(share)]
            responses = [s.__enter__() for s in streams]
            assert all(r.status_code == 200 for r in responses)
            deadline = time.monotonic() + 10
            while pg.seats.in_flight("ip:127.0.0.1") < share and time.monotonic() < deadline:
                time.sleep(0.05)
            busy = httpx.post(api, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_requests_in_flight"
            with client.stream("POST", api, json={"prompt": "hi", "max_tokens": 2, "stream": True},
                               headers=presenter) as mine:
                assert mine.status_code == 200  # the presenter is not counted
            pg.service.resume()
            for s, r in zip(streams, responses):
                r.read()
                s.__exit__(None, None, None)
    finally:
        pg.service.resume()
    deadline = time.monotonic() + 10
    while pg.seats.in_flight("ip:127.0.0.1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pg.seats.in_flight("ip:127.0.0.1") == 0
