"""The playground's handlers called directly, and the app driven through gradio_client on a real port."""
from __future__ import annotations

import inspect
import json
import re
import threading
import time

import pytest

from engine import LLM, EngineConfig, SamplingParams, measure
from engine.config import WEIGHT_FIELDS
from playground import Playground, conversation
from playground.chat import ChatSession
from playground.identity import Who
from playground.measurements import Measurement
from playground.serialised import SerialisedFigures
from playground.stepmode import describe_step, plural
from playground.tables import COMPARE_HEADERS, ablation_table, compare_table
from tests.conftest import serve_app


@pytest.fixture(scope="module")
def pg(tiny_models, tmp_path_factory):
    playground = Playground(LLM(tiny_models["llama"][0], max_model_len=512),
                            store=tmp_path_factory.mktemp("store") / "ablation.json")
    yield playground
    playground.service.shutdown()


def test_chat_streams_a_reply_with_its_stats(pg, monkeypatch):
    # streamed as the tokens come: several updates. Tokens made within one frame (FRAME_S) go out together, and a
    # fast CPU makes this tiny model's 12 tokens within one, so each step here takes at least half a frame
    from playground.chat import FRAME_S
    engine, step = pg.service.engine, pg.service.engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(FRAME_S / 2), step())[1])
    updates = list(pg.chat("Hello there", [], temperature=0.0, max_tokens=12))
    assert len(updates) >= 3
    history, stats = updates[-1]
    assert history[0] == {"role": "user", "content": "Hello there"}
    assert history[1]["role"] == "assistant" and history[1]["content"]
    contents = [h[1]["content"] for h, _ in updates if len(h) == 2]
    assert all(b.startswith(a) for a, b in zip(contents, contents[1:]))  # streamed text only grows
    assert "TTFT" in stats and "prefix cache" in stats and "finished: length" in stats


def test_the_rooms_streaming_replies_slow_their_frames_together():
    """Sixteen replies streaming at once are sent less often each, so that the room's updates stay within
    ROOM_FRAMES_PER_S; one alone (or a few) at FRAME_S; the count goes back down when a stream ends, even by an
    error."""
    from playground.chat import FRAME_S, ROOM_FRAMES_PER_S, FrameRate
    frames = FrameRate()
    assert frames.interval() == FRAME_S
    with frames:
        assert frames.interval() == FRAME_S
    streams = [FrameRate.__enter__(frames) for _ in range(16)]
    assert frames.interval() == pytest.approx(16 / ROOM_FRAMES_PER_S) and frames.interval() > FRAME_S
    for _ in streams:
        frames.__exit__(None, None, None)
    with pytest.raises(RuntimeError), frames:
        raise RuntimeError("a stream cut")
    assert frames.streaming == 0 and frames.interval() == FRAME_S


def test_a_reply_reaches_the_page_at_most_once_a_frame_and_every_step_shows(pg):
    """Each update re-renders the whole reply in every browser showing it: at most one per FRAME_S (the tiny model
    makes a token every few ms: one per token was ~100 updates for this reply), the newest text each time, and the
    end always shown. Held in step mode, each step's token still reaches the page (nothing is withheld)."""
    from playground.chat import FRAME_S
    start = time.monotonic()
    updates = list(pg.chat("Hello there", [], temperature=0.0, max_tokens=96))
    took = time.monotonic() - start
    assert len(updates) <= took / FRAME_S + 2, (len(updates), took)
    assert updates[-1][0][-1]["content"] == pg.replies[-1] and "finished: length" in updates[-1][1]

    pg.pause()
    try:
        seen, stream = [], pg.chat("Hello again", [], temperature=0.0, max_tokens=4)
        reader = threading.Thread(target=lambda: seen.extend(stream), daemon=True)
        reader.start()
        deadline = time.monotonic() + 10  # submitted ("queued") before the first step, or that step has nothing to run
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        for step in range(1, 5):  # one token a step: its own update, however soon after the last it comes
            pg.service.step_once()
            deadline = time.monotonic() + 10
            while len(seen) < 1 + step and time.monotonic() < deadline:  # after the "queued" note
                time.sleep(0.01)
            assert len(seen) == 1 + step, (step, seen)
        assert "finished: length" in seen[-1][1]
        reader.join(10)
    finally:
        pg.resume()


def test_second_turn_reuses_the_conversation_prefix(pg):
    history, _ = list(pg.chat("Tell me a story about a cat and a long winter night", [], 0.0, 16))[-1]
    hits = pg.service.snapshot().prefix_cache_hits
    list(pg.chat("And then?", history, 0.0, 8))
    assert pg.service.snapshot().prefix_cache_hits - hits >= 16  # the first turn's blocks serve the second's prompt


def test_empty_and_too_long_messages(pg):
    assert list(pg.chat("   ", [], 0.0, 8)) == [([], "")]
    history, _ = list(pg.chat("word " * 600, [], 0.0, 8))[-1]  # longer than the context could hold: unread
    assert history[-1]["role"] == "assistant" and "at most 2,048 characters" in history[-1]["content"]
    assert len(history[0]["content"]) < 300  # the page does not send the paste back whole
    history, _ = list(pg.chat("x " * 1000, [], 0.0, 8))[-1]  # short enough to read, too many tokens to fit
    assert history[-1]["role"] == "assistant" and "max_model_len" in history[-1]["content"]
    assert pg.service.alive


def test_the_message_box_stays_a_few_lines_tall_so_a_refusal_under_it_shows(pg):
    """A pasted page grew the box past the screen, and the refusal beside it (the limit, named) sat below it."""
    import gradio as gr

    import app
    demo = app.build_app(pg)
    box = next(b for b in demo.blocks.values() if isinstance(b, gr.Textbox)
               and b.placeholder == "Type a message and press Enter")
    assert box.max_lines is not None and box.max_lines <= 8


def test_the_page_s_clocks_mark_only_states_pending_and_nothing_sits_among_the_tabs(pg):
    """What a page's events cost its browser: gradio's frontend, at every status change of any event, walks each
    component it ever marked pending (an event's inputs and progress targets) and copies its properties, under a
    layout all of its children, and each marked component runs a timer while pending. So the events that run every
    second (and the form's loads) mark only states, and no layout is an event's output. And a component placed
    among the tabs themselves (not inside one) shifts which tab a click registers: a tab drawn twice."""
    import app
    demo = app.build_app(pg)
    config = demo.get_config_file()
    kinds = {c["id"]: c["type"] for c in config["components"]}
    layouts = {"tabs", "tabitem", "row", "column", "accordion", "group", "form"}
    frequent = {"dashboard", "settings_follow", "chat_view", "settings", "load_settings", "load_settings_1",
                "load_settings_2"}
    seen = set()
    for dep in config["dependencies"]:
        assert not layouts & {kinds[i] for i in dep["outputs"]}, dep["api_name"]
        if dep["api_name"] in frequent:
            seen.add(dep["api_name"])
            marked = (dep["show_progress_on"] or dep["outputs"]) + dep["inputs"]
            assert {kinds[i] for i in marked} <= {"state", "timer"}, dep["api_name"]  # neither draws anything
    assert {"dashboard", "settings_follow", "chat_view", "settings"} <= seen
    assert_one_quiet_marker_a_page_and_every_tick_always_last(config, {"": 10, "projector": 2})

    def children(node):
        return node.get("children", [])
    stack = [config["layout"]]
    while stack:
        node = stack.pop()
        if kinds.get(node["id"]) == "tabs":
            assert {kinds[c["id"]] for c in children(node)} == {"tabitem"}
        stack.extend(children(node))


def assert_one_quiet_marker_a_page_and_every_tick_always_last(config: dict, pages: dict[str, int]) -> None:
    """On each page (path -> how many such events it has at least), every event that shows no progress, and every
    load, marks one state pending, the same for all of them: the page's marker, set by page_events.quiet_progress
    and by no event itself. And every timer's tick on the page runs always_last (a tick arriving while the last is
    pending runs when it is back; gradio's default drops it)."""
    kinds = {c["id"]: c["type"] for c in config["components"]}
    for page, least in pages.items():
        on_page = set(config["page"][page]["dependencies"])
        deps = [dep for dep in config["dependencies"] if dep["id"] in on_page]
        quiet = [dep for dep in deps if dep["backend_fn"] and dep["outputs"]
                 and (dep["show_progress"] == "hidden" or all(event == "load" for _, event in dep["targets"]))]
        assert len(quiet) >= least, page
        marked = {tuple(dep["show_progress_on"] or dep["outputs"]) for dep in quiet}
        assert len(marked) == 1, (page, [(dep["api_name"], dep["show_progress_on"]) for dep in quiet])
        (marker,) = marked.pop()
        assert kinds[marker] == "state" and marker in config["page"][page]["components"]
        ticks = [dep for dep in deps if any(event == "tick" for _, event in dep["targets"])]
        assert ticks, page
        assert {dep["trigger_mode"] for dep in ticks} == {"always_last"}, [(d["api_name"], d["trigger_mode"])
                                                                           for d in ticks]


def test_the_watch_only_page_s_events_follow_the_same_rule():
    """build_watch_app (`--attach URL`) shares the chat tab and has a clock of its own."""
    import app
    from playground.remote import RemoteServer
    from playground.watching import Watcher
    config = app.build_watch_app(Watcher(RemoteServer("http://127.0.0.1:9"))).get_config_file()
    ticks = {dep["api_name"] for dep in config["dependencies"] if any(e == "tick" for _, e in dep["targets"])}
    assert {"dashboard", "chat_view"} <= ticks
    assert_one_quiet_marker_a_page_and_every_tick_always_last(config, {"": 3})


def test_a_value_gradio_refuses_is_one_line_for_the_caller_not_a_traceback(pg):
    """A slider past its range, a malformed chat history: gradio refuses them before the event runs and used to
    print a traceback for each; the caller now gets gradio's reason in an error that prints none."""
    import asyncio

    import gradio as gr
    from gradio.state_holder import SessionState

    import app
    demo = app.build_app(pg)
    app.quiet_input_refusals(demo)
    chat = {f.api_name: f for f in demo.fns.values()}["chat"]
    for inputs, said in ((["hi", [], 99.0, 16, None], "greater than maximum value 1.5"),
                         (["hi", [{"role": "system", "content": "x"}], 0.5, 16, None], "ValidationError")):
        with pytest.raises(gr.Error) as refused:
            asyncio.run(demo.preprocess_data(chat, inputs, SessionState(demo)))
        assert not refused.value.print_exception and said in refused.value.message
    assert asyncio.run(demo.preprocess_data(chat, ["hi", [], 0.5, 16, None], SessionState(demo)))[0] == "hi"


def test_a_refused_message_does_not_poison_the_conversation(pg):
    """A refused 20,000-character message used to stay in what was sent, so every later message was refused."""
    history, _ = list(pg.chat("x" * 20_000, [], 0.0, 8))[-1]
    assert history[-1]["content"].startswith("⚠️")
    history, stats = list(pg.chat("Hello again", history, 0.0, 4))[-1]
    assert not history[-1]["content"].startswith("⚠️") and "finished" in stats
    assert len(history) == 4  # the refused turn stays visible on the page


def test_notes_and_the_turns_they_answer_are_not_sent():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "⚠️ too long"},
               {"role": "user", "content": "while paused"}, {"role": "assistant", "content": "⏳ queued: ..."},
               {"role": "user", "content": [{"type": "text", "text": "parts"}]},
               {"role": "assistant", "content": "fine"}]
    assert conversation.for_model(history) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "parts"}, {"role": "assistant", "content": "fine"}]
    # a reply the engine cut off is sent again as far as it got, without the page's note about the error
    cut = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": f"hel{conversation.ENGINE_ERROR}the engine was restarted]"}]
    assert conversation.for_model(cut)[-1] == {"role": "assistant", "content": "hel"}


def test_a_visitor_s_turn_goes_to_the_page_as_markdown_that_shows_it_as_typed():
    """gradio's Chatbot renders every message as Markdown: a visitor's own `<img onerror>`, `**bold**` and
    `[link](javascript:)` rendered as such in their bubble. The page is sent their turns escaped and hands them back
    as typed; the assistant's reply stays Markdown (tests/test_e2e_tabs.py looks at the bubble in Chromium)."""
    import random

    import gradio as gr

    from playground.live_tabs import shows_visitors_text
    typed = "<img src=x onerror=alert(1)> **bold** [link](javascript:alert(1)) `c` _u_ $$x$$ \\* &amp;\n    code\tx"
    shown = conversation.as_typed(typed)
    # no Markdown or HTML can start: every punctuation mark escaped, the indent and the tab character references
    assert re.fullmatch(r"(\\[!-/:-@\[-`{-~]|&#(32|9);|[A-Za-z0-9 \n])*", shown)
    assert "\n&#32;&#32;&#32;&#32;code&#9;x" in shown
    chars = "ab \t\n\\*_`<>&#;329[]()!$~|-=+.:@"
    for text in ["", *("".join(random.choices(chars, k=random.randint(1, 24))) for _ in range(2000))]:
        assert conversation.typed_text(conversation.as_typed(text)) == text
    chatbot = shows_visitors_text(gr.Chatbot())
    history = [{"role": "user", "content": typed}, {"role": "assistant", "content": "**a reply** in Markdown"}]
    sent = chatbot.postprocess(history)
    assert [m.content[0].text for m in sent.root] == [shown, "**a reply** in Markdown"]
    back = chatbot.preprocess(sent)  # what the next event's handler gets: the text as typed
    assert [conversation.text_of(m["content"]) for m in back] == [typed, "**a reply** in Markdown"]


def test_a_long_conversation_drops_its_oldest_turns_instead_of_being_refused(pg):
    turn = [{"role": "user", "content": "tell me more " * 20}, {"role": "assistant", "content": "well " * 60}]
    history = turn * 6  # ~600 tokens: more than max_model_len=512
    with pytest.raises(ValueError, match="max_model_len"):  # what the engine says to the whole conversation
        pg.service.submit(pg.llm.apply_chat_template(conversation.for_model(history)), SamplingParams(max_tokens=8))
    updates = list(pg.chat("And now?", history, 0.0, 8))
    history, stats = updates[-1]
    assert not history[-1]["content"].startswith("⚠️") and "finished" in stats
    assert "too long for max_model_len 512: left out the" in stats and "oldest turns" in stats
    assert len(history) == 14  # trimmed for the model only: the page keeps every turn
    config = {"max_model_len": 512, "kv_cache": True, "paged_kv": True, "num_kv_blocks": 64, "block_size": 16}
    assert conversation.prompt_budget(config, 8) == 504 and conversation.prompt_budget(config, 400) == 384
    assert conversation.prompt_budget({**config, "num_kv_blocks": 16}, 200) == 56  # the pool's 256 tokens


def test_a_chat_sent_while_paused_says_it_is_queued(pg):
    pg.pause()
    try:
        chat = pg.chat("Hello", [], 0.0, 2)
        history, stats = next(chat)
        assert history[-1]["content"].startswith("⏳ queued: the engine is paused (step mode)") and stats == "queued"
        pg.step()
    finally:
        pg.resume()
    history, stats = list(chat)[-1]
    assert history[-1]["content"] and not history[-1]["content"].startswith("⏳") and "finished" in stats


def test_settings_show_the_engine_and_bad_values_keep_it(pg):
    assert pg.settings()["block_size"] == 16 and pg.settings()["prefix_caching"] is True
    assert "Not applied" in pg.apply_settings(block_size=12)
    assert "Applied" in pg.apply_settings(prefix_caching=False, max_num_seqs=8)
    list(pg.chat("hi", [], 0.0, 2))  # a step boundary passes
    assert pg.settings()["prefix_caching"] is False and pg.settings()["max_num_seqs"] == 8
    assert "Applied" in pg.apply_settings(prefix_caching=True, max_num_seqs=64)


def test_a_chat_tells_its_tab_which_request_is_its_own(pg):
    session = ChatSession()
    pg.chat_sent(session)  # the tab starts polling before the chat has a request id
    assert session.expecting() and pg.chat_view(session)[1]
    # 300 tokens: the tiny model's 8 could be done (its stream closed) before the id is looked at
    chat = pg.chat("Hello there", [], 0.0, 300, session)
    history, stats = next(chat)  # the message shows at once; the engine's id is known from here on
    assert history == [{"role": "user", "content": "Hello there"}] and stats == "sent, waiting for the first token"
    rid = session.request_id
    assert rid is not None and pg.service.is_streaming(rid)
    outputs = list(chat)
    assert outputs[-1][0][-1]["content"] == pg.replies[-1] and "finished" in outputs[-1][1]
    assert session.handled == 1 and not session.expecting()
    view, polling = pg.chat_view(session)
    assert not polling and view.request_id == rid  # the reply is done: the tab stops polling
    # a refused message ends its chat too; the live view stops showing the last reply as this tab's and says why
    pg.chat_sent(session)
    history, _ = list(pg.chat("x" * 20_000, [], 0.0, 8, session))[-1]
    assert history[-1]["content"].startswith("⚠️") and session.request_id is None
    view, polling = pg.chat_view(session)
    assert not polling and view.request_id is None and "your last message was refused" in view.summary
    assert "at most 2,048 characters" in view.summary and "step" in view.summary  # the reason, then the engine's
    list(pg.chat("Hello again", [], 0.0, 2, session))  # the next message that goes through clears the note
    view, _ = pg.chat_view(session)
    assert view.request_id == session.request_id != rid and "refused" not in view.summary


def test_a_reply_shown_finished_frees_its_tab_and_seat_before_its_chat_closes(pg):
    """gradio closes a streaming chat only after the page has its last output: a page that shows "finished" and
    sends its next message at once must find the tab free (not "your reply is still on its way") and its seat back."""
    who, neighbour = Who("v:finished", "192.0.2.10", True), Who("v:finished-2", "192.0.2.10", True)
    pg.seats.take(neighbour)  # another tab from the same address holds a seat throughout
    session = ChatSession()
    pg.chat_sent(session)
    chat = pg.chat("Hello there", [], 0.0, 8, session, audience=who)
    for _, stats in chat:  # as gradio does: the generator stays open while its last output goes out
        if "finished" in stats:
            break
    assert not session.expecting() and pg.seats.in_flight(who.key) == 0
    chat.close()  # then gradio closes it: nothing is given back twice
    assert session.handled == 1 and pg.seats.in_flight(who.key) == 0 and pg.seats.from_address(who.address) == 1
    pg.seats.give_back(neighbour)


def test_a_message_is_submitted_as_it_leaves_the_box_and_its_chat_streams_that_request(pg):
    """The event that empties the box submits the message (presubmit); the chat that follows streams that very
    request (no second one), holding the seat presubmit took until the reply ends; a chat for another message (an
    API call) does not take it."""
    from tests.conftest import wait_until
    who = Who("v:presubmit", "192.0.2.9", True)
    session = ChatSession()
    pg.chat_sent(session)
    pg.presubmit("Hello there", [], 0.0, 300, session, audience=who)
    assert wait_until(lambda: session.request_id is not None, 30)  # in the engine before any chat ran
    rid = session.request_id
    assert pg.service.is_streaming(rid) and pg.seats.in_flight(who.key) == 1
    other = list(pg.chat("Something else", [], 0.0, 2))  # not this tab's message: its own request
    assert "finished" in other[-1][1] and session.presubmitted is not None
    outputs = list(pg.chat("Hello there", [], 0.0, 300, session, audience=who))
    assert session.request_id == rid and session.presubmitted is None  # the same request, claimed once
    assert outputs[0][0] == [{"role": "user", "content": "Hello there"}]
    assert outputs[-1][0][-1]["content"] == pg.replies[-1] and "finished" in outputs[-1][1]
    assert pg.seats.in_flight(who.key) == 0 and session.handled == 1


@pytest.mark.parametrize("how", ["stop", "never claimed"])
def test_a_message_submitted_as_it_left_the_box_is_aborted_when_no_chat_comes(pg, how, monkeypatch):
    """Stop (or Clear) before the chat started, or a chat that never comes for it (a closed tab): the request is
    aborted, its blocks freed and its seat given back."""
    from playground import chat as chat_module
    from tests.conftest import wait_until
    monkeypatch.setattr(chat_module, "UNCLAIMED_S", 0.5)
    who = Who("v:dropped", "192.0.2.10", True)
    session = ChatSession()
    pg.presubmit("Tell me a long story", [], 0.0, 400, session, audience=who)
    assert wait_until(lambda: session.request_id is not None, 30)
    rid = session.request_id
    if how == "stop":
        pg.drop_presubmitted(session)
    assert wait_until(lambda: not pg.service.is_streaming(rid), 30)
    assert wait_until(lambda: pg.seats.in_flight(who.key) == 0, 5) and session.presubmitted is None
    assert wait_until(lambda: pg.service.snapshot().kv_blocks_used == 0, 30)


def test_a_message_the_chat_would_refuse_is_not_submitted_as_it_leaves_the_box(pg):
    """Too long, or no seat left: nothing is submitted; the chat says why, as an API call's does."""
    session = ChatSession()
    pg.presubmit("x" * 20_000, [], 0.0, 8, session)
    assert session.presubmitted is None
    who = Who("v:full", "192.0.2.11", True)
    for _ in range(pg.seats.per_visitor):
        pg.seats.take(who)
    try:
        pg.presubmit("Hello", [], 0.0, 8, session, audience=who)
        assert session.presubmitted is None and pg.seats.in_flight(who.key) == pg.seats.per_visitor
        history, _ = list(pg.chat("Hello", [], 0.0, 8, session, audience=who))[-1]
        assert "replies on their way" in history[-1]["content"]
    finally:
        for _ in range(pg.seats.per_visitor):
            pg.seats.give_back(who)


def test_the_live_view_polls_until_it_shows_the_reply_finished(pg):
    """Figures are rebuilt at most once a second: the view drawn just after a reply ends can come from a snapshot in
    which the request still decodes. The tab must poll on until a view shows it finished, not freeze on that one."""
    from viz.dashboard import FigureCache
    session, cache = ChatSession(), pg.figures
    try:
        pg.figures = FigureCache(min_interval_s=3600.0)  # frozen on the first snapshot it draws
        pg.pause()
        pg.chat_sent(session)
        chat = pg.chat("Hello there", [], 0.0, 8, session)
        next(chat)
        pg.service.step_once()  # prefilled: the request is in the snapshot the view draws
        assert pg.chat_view(session)[0].in_snapshot
        pg.resume()
        list(chat)
        view, polling = pg.chat_view(session)  # reply over, but the view still shows it decoding
        assert not pg.service.is_streaming(session.request_id) and view.in_snapshot and polling
        pg.figures = FigureCache(min_interval_s=0.0)
        view, polling = pg.chat_view(session)
        assert not polling and view.blocks["layout"]["title"]["text"].endswith("finished, blocks freed")
    finally:
        pg.figures = cache


def test_a_chat_stopped_while_queued_frees_its_request(pg):
    pg.pause()
    try:
        session = ChatSession()
        chat = pg.chat("Hello", [], 0.0, 8, session)
        assert next(chat)[1] == "queued"
        assert pg.service.is_streaming(session.request_id)
        chat.close()  # Stop pressed, or the tab closed, before the engine ran it
        pg.step()
        assert not pg.service.is_streaming(session.request_id) and not pg.service.engine.has_unfinished()
        assert session.handled == 1
    finally:
        pg.resume()


def test_chat_views_are_shared_and_highlight_each_tabs_own_request(pg):
    pg.pause()
    try:
        sessions = [ChatSession() for _ in range(3)]
        chats = [pg.chat(f"Hello {i}", [], 0.0, 8, s) for i, s in enumerate(sessions)]
        for c in chats:
            next(c)
        pg.step()
        threading.Event().wait(pg.figures.min_interval_s)  # figures are rebuilt at most this often
        builds, view_builds = pg.figures.builds, pg.figures.view_builds
        for _ in range(30):  # thirty ticks of three tabs: the snapshot does not change while paused
            views = [pg.chat_view(s) for s in sessions]
        assert pg.figures.builds - builds <= 1 and pg.figures.view_builds - view_builds <= 3
        for session, (view, polling) in zip(sessions, views):
            assert polling and view.request_id == session.request_id
            mine = [t for t in view.blocks["data"] if t["name"] == f"your request {session.request_id}"]
            assert mine and mine[0]["x"]
        assert pg.service.snapshot().num_running == 3
        for c in chats:
            c.close()
    finally:
        pg.resume()


def test_serialised_figures_turn_each_spec_into_json_once():
    serialised = SerialisedFigures(keep=2)
    a, b, c = ({"data": [], "layout": {"title": {"text": t}}} for t in "abc")
    first = serialised(a)
    assert serialised(a) is first and serialised.serialised == 1  # thirty tabs, one serialisation
    assert json.loads(first.plot) == a and first.type == "plotly"
    assert serialised(None) is None
    equal_but_new = {"data": [], "layout": {"title": {"text": "a"}}}
    assert serialised(equal_but_new) is not first and serialised.serialised == 2  # a rebuilt figure is new
    serialised(b)
    serialised(c)
    assert serialised.serialised == 4 and len(serialised._by_id) == 2  # bounded: the oldest go first
    payload = serialised.payload(c)  # for a polling event gradio does not postprocess: what it would have sent
    assert payload == serialised(c).model_dump() and serialised.payload(c) is payload and serialised.serialised == 4
    assert serialised.payload(None) is None


def test_polls_send_the_shared_payloads_as_gradio_would_without_postprocessing_them(pg):
    """The clock's and the live view's events skip gradio's postprocessing (a worker-thread hop, a model dump and
    a walk for files per plot, per tab): the page gets what postprocessing the PlotData would have given it."""
    import asyncio

    from gradio.state_holder import SessionState

    import app
    demo = app.build_app(pg)
    fns = {fn.api_name: fn for fn in demo.fns.values()}
    assert not fns["dashboard"].postprocess and not fns["chat_view"].postprocess
    interval, pg.figures.min_interval_s = pg.figures.min_interval_s, 3600.0  # the tick's figures are these, however
    try:                                                                      # slowly this machine gets to it
        figures = pg.dashboard()
        returned = list(fns["dashboard"].fn(None, {"run": 0, "back": False}, None, 1.0))
    finally:
        pg.figures.min_interval_s = interval
    serialised = SerialisedFigures()
    plots = [figures.blocks, figures.queues, figures.prefix, figures.throughput, figures.memory]
    state = SessionState(demo)
    # what the clock's event returns: the status, the five charts, the Lessons tab's view (its chart the lesson's
    # own), which tab to show, the followed-lesson state, the back button, the header and the tab shown
    sent = asyncio.run(demo.postprocess_data(fns["dashboard"], returned, state))
    fns["dashboard"].postprocess = True  # the same event as gradio would postprocess it
    unserialised = [returned[0], *map(serialised, plots), *returned[6:]]
    expected = asyncio.run(demo.postprocess_data(fns["dashboard"], unserialised, state))
    assert sent == expected and json.loads(sent[1]["plot"]) == figures.blocks


def test_a_page_is_sent_each_chart_once_and_the_dashboards_only_while_it_shows_them(pg):
    """gradio mounts a fresh plotly chart for every value sent, equal or not: the clock sends a page a chart only
    when its figure changed since that page last got it, and the dashboard's five only while it shows the Dashboard
    (or to an API client, which has no tabs). Its status line too, only when it changed."""
    import gradio as gr

    import app
    from playground.live_tabs import DASHBOARD_TAB
    demo = app.build_app(pg)
    tick = {fn.api_name: fn for fn in demo.fns.values()}["dashboard"].fn
    plots = slice(1, 6)  # the status line, then the five charts; the Lessons tab's chart is out[9]
    skipped = lambda outputs: [o == gr.skip() for o in outputs]  # noqa: E731
    first = pg.lessons.lessons[0].slug

    def poll(state, tab):
        out = list(tick(first, state, tab, 1.0))
        return out, out[11]  # the followed-lesson state, with what the page was sent

    out, state = poll({"run": 0, "back": False}, None)  # a gradio_client session: every chart, once
    assert not any(skipped(out[plots])) and out[9] is not None and out[9] != gr.skip()
    assert "steps done" in out[0]
    out, state = poll(state, None)  # nothing stepped since: nothing sent again, not even the same status line
    assert all(skipped(out[plots])) and out[9] == gr.skip() and out[0] == gr.skip()
    list(pg.service.stream("hi", SamplingParams(max_tokens=2)))
    time.sleep(pg.figures.min_interval_s)
    out, after = poll(state, "Chat")  # the engine moved, but this page shows Chat: the dashboard's charts wait
    assert all(skipped(out[plots])) and out[9] == gr.skip()  # (no lesson ran: its chart is the same placeholder)
    assert "steps done" in out[0]  # the status line moved with it
    out, after = poll(after, DASHBOARD_TAB)  # opened: the new figures, then nothing until the next change
    assert not any(skipped(out[plots])) and json.loads(out[1]["plot"]) == pg.dashboard().blocks
    assert all(skipped(poll(after, DASHBOARD_TAB)[0][plots]))
    # a fresh page (its own state) is sent everything again
    assert not any(skipped(poll({"run": 0, "back": False}, DASHBOARD_TAB)[0][plots]))


def test_dashboard_figures_are_shared_between_tabs(pg):
    first, second = pg.dashboard(), pg.dashboard()
    assert first is second  # no step in between: built once, served to every tab
    assert "KV pool" in first.blocks["layout"]["title"]["text"]


def test_step_mode_describes_each_decision(pg):
    pg.pause()
    rid, q = pg.service.submit([1000 + i for i in range(40)], SamplingParams(temperature=0, max_tokens=3,
                                                                                ignore_eos=True))
    text = pg.step()
    done = pg.service.snapshot().step
    # the first step is "Step 1", and the status counts the same way
    assert text.startswith(f"### Step {done}: ") and f"steps done: {done}" in pg.status()
    assert f"request **{rid}** prefilled **40 tokens**" in text or "reused from the prefix cache" in text
    assert "its first generated token: `'" in text and "ending `'" in text  # tokens shown as text
    token = pg.llm.tokenizer.decode(q.get(timeout=10).token_ids)
    assert f"`{token!r}`" in text
    text = pg.step()
    assert f"decoded one token each for 1 request: **{rid}** → `'" in text
    assert "1 request" in text.splitlines()[0] and "1 requests" not in text  # grammar
    assert "finished (length)" in pg.step()
    pg.service.update_config(prefix_caching=False)  # a change asked for while paused applies at the next step
    assert "the configuration change applied: prefix_caching=False (applied in place)" in pg.step()
    assert "configuration change" not in pg.step()
    pg.service.update_config(prefix_caching=True)
    pg.resume()
    assert describe_step(pg.service.snapshot()).startswith("### Step")
    assert (plural(1, "token"), plural(2, "token"), plural(0, "request")) == ("1 token", "2 tokens", "0 requests")


@pytest.mark.slow
def test_ablation_and_compare(pg):
    rows = pg.ablate("fixed-16", quick=True)
    assert rows[0].switch is None and rows[0].ratio == 1.0
    assert all(r.same_output_as_full for r in rows if r.throughput_tok_s and r.precision == rows[0].precision)
    assert pg.last_ablation() == rows
    table = ablation_table(rows)  # real headers, not "1 2 3 4 5"; numbers rounded for reading
    assert table["headers"][:3] == ["configuration", "tok/s", "x full engine"]
    assert [r[0] for r in table["data"]] == [r.feature for r in rows] and table["data"][0][2] == "1.00"
    steps = []
    result = pg.compare("fixed-16", "naive", "full", quick=True, progress=lambda f, d: steps.append((f, d)))
    assert result.same_outputs and result.results[1].generated_tokens == 4 * 64
    # the bar advances after each configuration instead of sitting at one value for the whole run
    assert [f for f, _ in steps] == [0.0, 0.5, 1.0] and "running: naive" in steps[0][1]
    table = compare_table(measure.compare_report(result))
    assert table["headers"] == COMPARE_HEADERS and [r[0] for r in table["data"]] == ["naive", "full"]
    cells = [c for r in table["data"] for c in r]
    assert all(isinstance(c, str) and not re.search(r"\.\d{5}", c) for c in cells), cells  # not 5.665796017719589
    assert not pg.service.paused  # the live engine resumed after the measurements


def test_the_settings_form_shows_what_the_engine_will_run_and_sends_only_edits(pg):
    form = pg.settings()
    assert form["num_kv_blocks"] is None and form["max_model_len"] == 512  # empty: the engine chooses
    auto = pg.service.snapshot().config
    hints = pg.settings_hints()
    assert hints["num_kv_blocks"] == f"empty = automatic: {auto['num_kv_blocks']} blocks"
    assert hints["max_num_batched_tokens"] == f"empty = automatic: {auto['max_num_batched_tokens']} tokens"
    # an idle engine applies at once, and the reloaded form shows it
    pg.apply_settings(form, **{**form, "prefix_caching": False, "num_kv_blocks": 48})
    assert pg.service.config_changes[-1].changes == {"prefix_caching": False, "num_kv_blocks": 48}
    form = pg.settings()
    assert form["prefix_caching"] is False and form["num_kv_blocks"] == 48
    assert pg.service.snapshot().kv_blocks_total == 48
    # a tab loaded before that change edits another field: its stale values are not sent back
    stale = {**form, "prefix_caching": True, "num_kv_blocks": None}
    pg.apply_settings(stale, **{**stale, "max_num_seqs": 9})
    assert pg.service.config_changes[-1].changes == {"max_num_seqs": 9}
    assert pg.settings()["prefix_caching"] is False and pg.settings()["num_kv_blocks"] == 48
    form = pg.settings()
    pg.apply_settings(form, **{**form, "paged_kv": False})
    assert pg.service.config_changes[-1].changes == {"paged_kv": False}
    assert pg.service.snapshot().config["num_kv_blocks"] == 48  # unchecking paged_kv kept the pool
    # contiguous KV in a smaller pool needs a shorter max_model_len, which the form now has
    form = pg.settings()
    assert "contiguous KV reserves max_model_len=512" in pg.apply_settings(form, **{**form, "num_kv_blocks": 16})
    assert "Applied" in pg.apply_settings(form, **{**form, "num_kv_blocks": 16, "max_model_len": 256})
    assert pg.service.snapshot().config["max_model_len"] == 256
    assert "Applied" in pg.reset_settings()
    assert pg.settings() == {"kv_cache": True, "paged_kv": True, "continuous_batching": True,
                             "prefix_caching": True, "chunked_prefill": True, "speculative_decoding": False,
                             "block_size": 16, "num_kv_blocks": None, "max_num_seqs": 64,
                             "max_num_batched_tokens": None, "max_model_len": None, "kv_cache_dtype": "auto",
                             "kv_cache_smoothing": False,
                             # the weights as EngineConfig's defaults, dtype "auto" as the CPU resolves it
                             **{k: getattr(EngineConfig(), k) for k in WEIGHT_FIELDS}, "dtype": "float32"}


def test_a_change_waiting_for_a_step_is_what_the_form_shows(pg):
    pg.pause()
    rid, q = pg.service.submit([1000 + i for i in range(20)], SamplingParams(temperature=0, max_tokens=3,
                                                                            ignore_eos=True))
    pg.step()
    form = pg.settings()
    pg.apply_settings(form, **{**form, "max_num_seqs": 5})
    assert pg.settings()["max_num_seqs"] == 5 and pg.service.config_view().pending == {"max_num_seqs": 5}
    assert "next step boundary" in pg.settings_note()  # and the form says why it shows what does not run yet
    pg.resume()
    while not q.get(timeout=30).finished:
        pass
    pg.reset_settings()
    assert pg.service.config_view().pending == {} and pg.settings_note() == ""


def test_a_refused_pool_is_explained_and_the_engine_keeps_serving(pg):
    msg = pg.apply_settings(None, num_kv_blocks=50_000_000)
    assert "Not applied" in msg and "GB of RAM is available" in msg
    history, stats = list(pg.chat("hi", [], 0.0, 4))[-1]
    assert "finished" in stats and pg.service.alive


def test_restart_and_apply_work_after_the_engine_thread_died(pg, monkeypatch):
    def crash():
        raise RuntimeError("simulated crash")

    def kill_engine():
        monkeypatch.setattr(pg.service.engine, "step", crash)
        history, _ = list(pg.chat("hi", [], 0.0, 4))[-1]
        assert "engine error" in history[-1]["content"] and not pg.service.alive

    kill_engine()
    pg.apply_settings(None, max_num_seqs=7)  # a sane value on a stopped engine brings it back
    from engine.service import RESTARTED
    assert pg.service.alive and pg.service.config_changes[-1].action == RESTARTED
    assert pg.settings()["max_num_seqs"] == 7
    assert "finished" in list(pg.chat("hi", [], 0.0, 4))[-1][1]  # answered by the new engine
    kill_engine()
    real, calls = type(pg.llm).build_engine, []

    def no_room_for_the_last_pool(llm, fields):
        calls.append(fields)
        if len(calls) == 1:
            raise MemoryError("simulated: no room")
        return real(llm, fields)
    monkeypatch.setattr(type(pg.llm), "build_engine", no_room_for_the_last_pool)
    msg = pg.restart()
    assert msg.startswith("Engine restarted with the defaults") and "no room" in msg and calls[-1] == {}
    assert "finished" in list(pg.chat("hi", [], 0.0, 4))[-1][1]


def test_a_measurement_says_why_the_engine_waits_and_can_be_cancelled(pg):
    started, outcome = threading.Event(), {}

    def run():
        try:
            outcome["rows"] = pg.ablate("fixed-16", quick=True, progress=lambda f, d: started.set())
        except measure.Cancelled as exc:
            outcome["cancelled"] = exc
    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(60)
    configurations = len(measure.FEATURES) + 1
    measuring = pg.measurement
    assert pg.service.paused and (measuring.name, measuring.done, measuring.total) == ("ablation", 0, configurations)
    chat = pg.chat("hello", [], 0.0, 4)
    history, stats = next(chat)  # said before the reply waits, not after
    assert history[-1]["content"].startswith("⏳ queued behind a measurement (ablation:") and stats == "queued"
    with pytest.raises(ValueError, match="another measurement is running"):
        pg.compare("fixed-16", "naive", "full")
    assert pg.cancel_measurement().startswith("Cancelling the ablation")
    worker.join(60)
    assert "cancelled" in outcome and pg.measurement is None and not pg.service.paused
    assert "finished" in list(chat)[-1][1]
    assert "paused" not in pg.status()


def test_the_ablation_says_where_the_live_engine_differs_from_its_full_engine(pg):
    note = pg.full_engine_note()
    assert "quantization=int4" in note and "speculative_decoding=True" in note
    assert "The live engine differs: it runs quantization=None" in note and "speculative_decoding=False" in note


def test_a_measurement_estimates_the_time_left():
    m = Measurement("ablation", 5)
    m.started -= 20
    m.report(2, 5, "static batching")
    assert m.describe() == "ablation: 2/5 configurations, ~30 s left"
    m.started, m.reported = m.started - 10, m.reported - 10  # ten seconds into the third: it falls, not climbs
    assert m.describe() == "ablation: 2/5 configurations, ~20 s left"
    m.started, m.reported = m.started - 40, m.reported - 40
    assert m.describe().endswith("almost done (this one runs longer than the mean)")


@pytest.fixture(scope="module")
def server(tiny_models):
    with serve_app(LLM(tiny_models["llama"][0], max_model_len=512)) as served:
        yield served


@pytest.mark.slow
def test_gradio_client_two_chats_stream_concurrently_and_settings_apply(server):
    from gradio_client import Client
    url, playground = server
    client = Client(url, verbose=False)
    # held until both chats wait in the engine: the tiny model can end a 24-token reply before a second one arrives
    playground.pause()
    try:
        jobs = [client.submit(f"Hello number {i}", [], 0.0, 24, api_name="/chat") for i in range(2)]
        deadline = time.monotonic() + 60
        while playground.service.snapshot().num_waiting < 2 and time.monotonic() < deadline:
            threading.Event().wait(0.05)
    finally:
        playground.resume()
    results = [job.result(timeout=120) for job in jobs]
    for history, stats in results:
        assert history[-1]["role"] == "assistant" and "TTFT" in stats
    assert max(h.num_running for h in playground.service.history) >= 2  # batched together in the engine
    assert "Applied" in client.predict(True, True, True, False, True, False, 16, 64, 32, 2048, 512,
                                       api_name="/apply_settings")
    threading.Event().wait(0.2)
    submitted, submit = [], playground.service.submit
    playground.service.submit = lambda *args, **kw: (out := submit(*args, **kw), submitted.append(out[0]))[0]
    try:
        client.predict("x", [], 0.0, 8, api_name="/chat")
    finally:
        del playground.service.submit
    assert playground.settings()["prefix_caching"] is False and playground.settings()["max_num_seqs"] == 32
    status, *outputs = client.predict(api_name="/dashboard")
    plots = outputs[:5]  # then the Lessons tab's view, which tab to show, and the back-to-the-lesson button
    assert "step" in status and all(p for p in plots) and "No lesson is running" in outputs[5]
    # the chat's live view reads this client's session: its last request is the one highlighted
    plot, summary, _timer = client.predict(api_name="/chat_view")
    spec = json.loads(plot["plot"])
    assert spec["layout"]["title"]["text"] == f"Your request {submitted[0]}: finished, blocks freed"
    assert "running **" in summary and "tokens/s" in summary
    plot, table, note = client.predict("fixed-16", "naive", "full", True, api_name="/compare")
    # the table arrives as an update that also shows it (hidden until it has numbers)
    assert table["visible"] is True and "identical output" in note
    assert plot and [row[0] for row in table["value"]["data"]] == ["naive", "full"]


def test_step_mode_explains_chunks_and_drafts(tiny_models, monkeypatch):
    import engine.scheduler as scheduler_module
    llm = LLM(tiny_models["llama"][0], max_model_len=512, max_num_batched_tokens=16, speculative_decoding=True,
              num_kv_blocks=64)
    eng = llm.engine
    eng.add_request([1000 + i for i in range(40)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    assert "prefilled **16 tokens** — a chunk: 16/40 prompt tokens done" in describe_step(eng.snapshot())
    while not eng.steps[-1].entries[0].num_new_tokens:
        eng.step()
    monkeypatch.setattr(scheduler_module, "propose_ngram", lambda ids, k, *_: [7] * k)  # drafts that are wrong
    eng.step()
    text = describe_step(eng.snapshot(), llm.tokenizer)
    assert "drafted 2, accepted 0 (speculative decoding: 1 token this step" in text, text

    naive = LLM(tiny_models["llama"][0], max_model_len=512, kv_cache=False).engine
    naive.add_request([1000 + i for i in range(8)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    naive.step()
    naive.step()
    assert "no KV cache: every request recomputes its whole sequence" in describe_step(naive.snapshot())


@pytest.mark.slow
def test_loadtest_sessions_poll_chat_and_count_errors(server):
    """The workshop load in small: open sessions polling the page, some chatting; errors are counted, not lost."""
    from playground import loadtest, page_client
    url, pg = server
    sessions = page_client.open_sessions(url, 3)
    # 96 tokens a reply: a page gets a reply's newest text at most once a frame (chat.FRAME_S), and on a fast host
    # the tiny model's 16 tokens all landed within one (one update, the whole reply)
    result = loadtest.run_phase(sessions, "smoke", 2, True, 96)
    row = result.row()
    assert row["chats"] == 2 and row["sessions"] == 3 and row["errors"] == 0, result.tally.errors
    # (no gap may reach a display frame: several of the tiny model's tokens can land within 1/60 s of each other)
    assert row["dashboard polls/s"] > 0 and row["view polls/s"] > 0 and row["updates"] >= 4
    assert all(c.ttft_s is not None and c.updates >= 2 for c in result.chats)
    # the streamed diffs, put back together over a session's one event stream (shared with its live view's
    # polls), give the text the engine finished with
    # (gradio's Chatbot passes a text message through inspect.cleandoc: stripped, and the lines after the first
    # dedented, which the random model's tabs and spaces after a line break show)
    assert all(c.reply in {inspect.cleandoc(r) for r in pg.replies} for c in result.chats)
    tally, stop = loadtest.Tally(), threading.Event()
    threading.Timer(0.5, stop.set).start()
    loadtest.poll(sessions[0], "/no_such_endpoint", "dashboard_polls", stop, tally)
    assert sum(tally.errors.values()) >= 1 and all(k.startswith("/no_such_endpoint: ") for k in tally.errors)
    assert loadtest.percentile([1.0, 2.0, 3.0, 4.0], 0.95) == 3.0 and loadtest.percentile([], 0.95) is None


def test_loadtest_counts_a_gap_per_step_of_the_reply_on_screen():
    """The echo of the message is not the first token, a stats-only update is no token, and a burst of tokens
    after a stall is one long gap (counted as many gaps of zero, it made the loaded phase's p95 read 0.0000)."""
    from playground.loadtest import ChatTiming
    from playground.page_client import reply_text
    user = {"role": "user", "content": "Hi"}

    def said(text):
        return [user, {"role": "assistant", "content": [{"type": "text", "text": text}]}]
    timing = ChatTiming()
    for t, history in [(0.2, [user]), (0.5, said("Hel")), (0.6, said("Hello")), (0.6, said("Hello")),
                       (3.6, said("Hello,")), (3.6001, said("Hello, w")), (3.6002, said("Hello, wor")),
                       (3.7, said("Hello, world"))]:
        timing.saw(t, reply_text(history))
    assert timing.ttft_s == 0.5 and timing.reply == "Hello, world" and timing.updates == 6
    assert timing.gaps_s == pytest.approx([0.1, 3.0, 0.0998])


def test_the_queue_does_not_recompute_its_monitoring_summary_per_event(pg):
    import app
    demo = app.build_app(pg).queue()
    assert demo._queue.ANAYLTICS_CACHE_FREQUENCY == 1000  # not after every poll of every tab


def test_the_queue_polls_calmly_and_gradio_still_has_the_knobs(pg):
    """calm_queue tolerates a gradio without these attributes; this test is what notices when one renames them."""
    import app
    demo = app.build_app(pg).queue()
    assert demo._queue.sleep_when_free < app.QUEUE_POLL_S  # gradio's own 1 ms
    app.calm_queue(demo)
    assert demo._queue.sleep_when_free == app.QUEUE_POLL_S
    assert demo._queue.progress_update_sleep_when_free >= 5 * app.QUEUE_POLL_S


def test_a_restart_keeps_the_charts_history_marks_itself_and_counts_what_it_ended_as_aborted(pg):
    from engine.service import RESTARTED
    from viz.figures import change_label
    seen = []
    pg.stat_listeners.append(lambda stats: seen.extend(f.finish_reason for f in stats.finished))
    try:
        pg.service.pause()  # a request that cannot finish before the restart ends it
        rid, q = pg.service.submit("Hello there, a long reply please", SamplingParams(max_tokens=64))
        for _ in range(2):
            pg.service.step_once()
        tab, interval = ChatSession(request_id=rid), pg.figures.min_interval_s
        pg.figures.min_interval_s = 0.0  # each view from the snapshot of the moment
        assert re.search(rf"Your request {rid}: \d+ of \d+ blocks", json.dumps(pg.chat_view(tab)[0].blocks))
        old = pg.service
        samples = list(old.history)
        stages = []
        pg.restart(progress=lambda f, d: stages.append(f))
        assert stages == [1 / 3, 2 / 3]  # building with its pool, then warming up
        assert pg.service is not old and list(pg.service.history)[:len(samples)] == samples
        last = pg.service.config_changes[-1]
        assert last.action == RESTARTED and change_label(last) == "engine restarted"
        assert seen.count("abort") == 1  # the one request it ended: /metrics' request_success{...="abort"}
        while not ((out := q.get(timeout=10)).finished or out.error):  # the two steps' tokens, then the end
            pass
        assert out.error
        # the tab's live view no longer shows the request the restart ended as if it were still decoding
        view, _ = pg.chat_view(tab)
        assert f"Your request {rid}: finished, blocks freed" in json.dumps(view.blocks) and not view.in_snapshot
    finally:
        pg.figures.min_interval_s = interval
        pg.stat_listeners.pop()
        pg.service.resume()


def test_the_settings_form_follows_the_engine_and_the_audience_only_reads_it(pg):
    """A change made elsewhere (a lesson, a rebuild, another presenter tab) reaches every open settings form within
    its one-second tick, with the fields that moved; nothing is sent while the form already shows what runs. The
    audience's form is read-only and says who can change it."""
    import gradio as gr

    import app
    from playground.access import TOKEN, Access
    demo = app.build_app(pg)
    block_fn = next(f for f in demo.fns.values() if f.api_name == "settings_follow")
    fields = [getattr(c, "elem_id", None) or "" for c in block_fn.outputs]
    fields = fields[:-1]  # the last output is the form's own timer (faster while a lesson runs)
    shown = block_fn.fn({}, 1.0)[len(fields) - 3]  # the state a fresh form is drawn with
    assert all(o == gr.skip() for o in block_fn.fn(shown, 1.0))
    assert "Applied" in pg.apply_settings(max_num_seqs=7)
    out = block_fn.fn(shown, 1.0)
    assert out[fields.index("setting-max_num_seqs")]["value"] == 7
    assert {k: v for k, v in out[len(fields) - 3].items() if not k.startswith("_")} == pg.settings()
    assert "configuration changed" in out[len(fields) - 2]
    assert out[fields.index("setting-prefix_caching")] == gr.skip()  # what did not move is not drawn again
    assert all(u["interactive"] for u in out if isinstance(u, dict) and "interactive" in u)  # a desk: everyone edits
    pg.access = Access(TOKEN, "secret")  # a visitor of a shared page, not unlocked: the form is drawn again
    out = block_fn.fn(out[len(fields) - 3], 1.0)
    assert not any(u["interactive"] for u in out if isinstance(u, dict) and "interactive" in u)
    assert "Only the presenter can change the engine's settings" in out[len(fields) - 2]


def test_pages_ask_twice_a_second_while_a_lesson_runs(pg, monkeypatch):
    """Every page agrees with a change a lesson makes within a second: while one runs, the page's clock and the
    settings form's tick come twice a second, set by their own ticks; once a second otherwise."""
    from types import SimpleNamespace

    import gradio as gr

    import app
    from playground.handlers import LESSON_PERIOD_S, PAGE_PERIOD_S
    assert pg.lessons.run is None and pg.page_period() == PAGE_PERIOD_S
    monkeypatch.setattr(pg.lessons, "run", SimpleNamespace(active=True))
    assert pg.page_period() == LESSON_PERIOD_S
    monkeypatch.setattr(pg.lessons, "run", SimpleNamespace(active=False))  # done, its result on screen
    assert pg.page_period() == PAGE_PERIOD_S
    monkeypatch.setattr(pg.lessons, "run", None)
    fns = {f.api_name: f for f in app.build_app(pg).fns.values()}
    clock = lambda every: fns["dashboard"].fn(None, {"run": 0, "back": False}, "Chat", every)[-1]  # noqa: E731
    form = lambda every: fns["settings_follow"].fn({}, every)[-1]  # noqa: E731
    for tick in (clock, form):
        assert tick(PAGE_PERIOD_S) == gr.skip()  # already at the room's period: untouched
        monkeypatch.setattr(pg, "page_period", lambda: LESSON_PERIOD_S)
        assert tick(PAGE_PERIOD_S).value == LESSON_PERIOD_S and tick(LESSON_PERIOD_S) == gr.skip()
        monkeypatch.undo()


def test_counters_that_start_again_with_a_new_engine_say_so_everywhere(pg):
    from playground.chat import ChatSession
    session = ChatSession()
    list(pg.chat("Hello", [], 0.0, 4, session))
    replaced, pg.service.replaced_at = pg.service.replaced_at, None  # as the page's first engine (earlier tests
    try:                                                             # in this module rebuilt this one)
        assert "steps done: " in pg.status() and "since the rebuild" not in pg.chat_view(session)[0].summary
    finally:
        pg.service.replaced_at = replaced
    assert pg.restart().startswith("Engine restarted")
    list(pg.chat("Hello again", [], 0.0, 4, session))
    assert "steps done since the rebuild " in pg.status()  # the status line and the chat's live view alike
    assert "since the rebuild " in pg.chat_view(session)[0].summary
