"""The live tabs, Chat and Dashboard: the page of this machine's engine and a watch-only page (watching.py's
Watcher) both show them. Layout and wiring only: what a chat does is playground/chat.py's, the figures viz's."""
from __future__ import annotations

from dataclasses import replace

import gradio as gr
from gradio.components.plot import PlotData

from engine.workloads import list_workloads
from viz.dashboard import CHARTS as DASHBOARD_CHARTS
from viz.figures import placeholder_figure, to_json

from .access import OPEN, Access, audience
from .chat import ChatSession
from .conversation import as_typed, typed_text
from .handlers import Playground
from .identity import NOBODY, Who
from .serialised import SerialisedFigures
from .watching import Watcher

HELP = {
    "blocks": "Every square is one KV block (a fixed number of tokens' keys and values). Colour = the request "
              "that owns it; grey = free; light blue = **cached-free** (no owner, but it still holds a prefix "
              "the next request can reuse). A black outline and a number mark blocks **shared** by several "
              "requests (prefix caching). Hover a block for its request, logical index, ref count and hash.",
    "queues": "Running requests are in the batch; waiting ones wait for a seat (max_num_seqs), token budget or "
              "KV blocks. A red x marks a **preemption**: the pool ran dry and the newest request gave its "
              "blocks back, to be recomputed later.",
    "prefix": "The share of prompt tokens served from the prefix cache (recent window) and the running total. "
              "Chats that share a system prompt push it up; recomputation after a preemption never counts.",
    "throughput": "Tokens generated per second across all requests, with time to first token (TTFT) and time per "
                  "output token (TPOT). Continuous batching keeps tokens/s up as requests come and go.",
    "memory": "KV blocks in use out of the pool, and the device's memory (GPU via NVML, or this process's RAM).",
    "markers": "A dotted line marks each configuration change (Engine settings) on the time-series charts: "
               "before and after side by side. Hover a label for the step and what the change did.",
    "live": "Your reply's request, bright and outlined, among everyone else's (dimmed): watch it take blocks as it "
            "prefills and grows, and give them back when it ends (light blue: cached-free, kept for reuse). A second "
            "turn takes its first blocks back from the first turn's instead of computing them again.",
}


def chart(label: str, empty: str | None = None) -> gr.Plot:
    """`empty`: what the chart says before it has anything to show."""
    value = PlotData(type="plotly", plot=to_json(placeholder_figure(empty))) if empty else None
    return gr.Plot(value, label=label, show_label=False)


NO_CHAT_VIEW = "Send a message: your request's KV blocks light up here"
DASHBOARD_TAB = "dashboard"  # its id, and what track_shown_tab records while a page shows it
PLOT_LABELS = {"blocks": "KV block table", "queues": "scheduler queues", "prefix": "prefix cache",
               "throughput": "throughput", "memory": "memory"}


# the page's CSS (app.serve): a visitor's turn keeps the spaces, tabs and line breaks typed (HTML folds each run of
# them into one space; the Markdown sent keeps them, shows_visitors_text)
VISITORS_TEXT_CSS = '[data-testid="user"] p { white-space: pre-wrap; }'


def shows_visitors_text(chatbot: gr.Chatbot) -> gr.Chatbot:
    """chatbot, its visitors' turns shown as typed: gradio renders every message as Markdown, and a visitor's
    `<img src=x onerror=...>` showed as an image. User turns go out as literal Markdown (conversation.as_typed) and
    come back as typed. (The instance's methods are wrapped: a subclass makes gradio write a .pyi file here.)"""
    postprocess, preprocess = chatbot.postprocess, chatbot.preprocess
    chatbot.postprocess = lambda value: postprocess([_user_turn(m, as_typed) for m in value] if value else value)
    chatbot.preprocess = lambda payload: [_user_turn(m, typed_text) for m in preprocess(payload)]
    return chatbot


def _user_turn(message, convert):
    """message with its text converted if it is a user's turn (a dict or gr.ChatMessage)."""
    is_dict = isinstance(message, dict)
    role, content = (message.get("role"), message.get("content")) if is_dict else (
        getattr(message, "role", None), getattr(message, "content", None))
    if role != "user":
        return message
    if isinstance(content, str):
        content = convert(content)
    elif isinstance(content, list):
        content = [{**p, "text": convert(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
                   else p for p in content]
    else:
        return message
    return {**message, "content": content} if is_dict else replace(message, content=content)


WATCHED_CHATS = 64  # a watched server's seats are not known here: it is usually a bigger machine than this one


def chat_seats(pg: Playground | Watcher) -> int:
    """How many chats the page streams at once: the engine's seats and a few waiting, not gradio's default."""
    return max(16, pg.service.config_view().resolved["max_num_seqs"] + 4) if pg.local else WATCHED_CHATS


def build_chat_tab(pg: Playground | Watcher, serialised: SerialisedFigures, access: Access) -> None:
    with gr.Tab("Chat"):
        # copied per tab; the chat sets its request id in place, the live view (another event) reads it at once
        session = gr.State(ChatSession())
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = shows_visitors_text(gr.Chatbot(label="Chat with the engine", height=420))
                with gr.Row():
                    # at most a few lines tall: a pasted page scrolls inside it, and the note under it stays in view
                    msg = gr.Textbox(placeholder="Type a message and press Enter", scale=5, show_label=False,
                                     max_lines=6)
                    # narrow buttons: the chat shares its row with the live view, and the box needs the room
                    send = gr.Button("Send", variant="primary", scale=1, min_width=70)
                    stop = gr.Button("Stop", scale=1, min_width=70)
                    clear = gr.Button("Clear", scale=1, elem_id="clear-chat", min_width=70)
                with gr.Row():
                    temperature = gr.Slider(0, 1.5, value=0.7, step=0.05, label="temperature")
                    # the audience's replies are capped on the server (Seats); the slider says so
                    cap = 512 if access.mode == OPEN else pg.seats.max_tokens
                    max_tokens = gr.Slider(8, cap, value=min(200, cap), step=8, label="max tokens")
                reply_info = gr.Markdown()
            with gr.Column(scale=2, elem_id="chat-live"):
                live_blocks = chart("your request in the KV pool", NO_CHAT_VIEW)
                live_summary = gr.Markdown()
                if pg.local:  # a watched server's blocks are not visible from here
                    gr.Markdown(HELP["live"])
        live = gr.Timer(1.0, active=False)  # polls only while this tab's reply is on its way or streaming
        pending = gr.State("")  # the message sent, moved out of the box (below)
        api_chat = gr.Button(visible=False)  # the chat's API endpoint (below)

    def seated_as() -> Who | None:
        """Whose seat a chat takes: the audience's share of the engine is bounded; the presenter's is not."""
        visitor = access.visitor()
        return None if visitor.presenter else (visitor.who or NOBODY)

    @audience
    def chat(message, history, temperature_value, max_tokens_value, s: ChatSession):
        if not (message and message.strip()):  # an empty box sent (Enter pressed twice): nothing changes
            yield gr.skip(), gr.skip()
            return
        yield from pg.chat(message, history, temperature_value, max_tokens_value, s, audience=seated_as())

    seats = chat_seats(pg)
    # As gradio's ChatInterface does: the message moves from the box to the tab's state at once, so Enter again
    # sends nothing; the same event submits it (ChatHandlers.presubmit). One reply at a time per tab: two would
    # stream into one history. The live view's timer starts here: one started beside the streaming chat only ran
    # once the reply had ended.
    @audience
    def take(message, history, temperature_value, max_tokens_value, s: ChatSession):
        if not (message and message.strip()):
            return gr.skip(), "", gr.skip(), gr.skip()
        if s.expecting():
            return gr.skip(), "", gr.skip(), "⏳ your reply is still on its way: press Stop, or send this after it"
        if why := pg.message_refused(message):  # refused at once, and left in the box to shorten
            return gr.skip(), "", gr.skip(), f"⚠️ {why}"
        pg.chat_sent(s)
        pg.presubmit(message, history, temperature_value, max_tokens_value, s, audience=seated_as())
        return "", message, gr.Timer(active=True), ""

    # a second Enter while the first one's take is on its way runs after it (gradio's default drops it, and the
    # visitor's words sat in the box without the note saying why)
    taken = gr.on([msg.submit, send.click], take, [msg, chatbot, temperature, max_tokens, session],
                  [msg, pending, live, reply_info], queue=False, show_progress="hidden", api_visibility="private",
                  trigger_mode="always_last")
    chat_event = taken.then(chat, [pending, chatbot, temperature, max_tokens, session], [chatbot, reply_info],
                            concurrency_limit=seats, concurrency_id="chat", api_name="page_chat",
                            api_visibility="private")  # named, so that "chat" stays the API's
    # For gradio_client (a state is no API input): the same chat, the message as its first argument, on a button
    # nobody sees; `predict(message, history, temperature, max_tokens, api_name="/chat")` -> (history, stats)
    api_event = api_chat.click(chat, [msg, chatbot, temperature, max_tokens, session], [chatbot, reply_info],
                               concurrency_limit=seats, concurrency_id="chat", api_name="chat")

    @audience
    def refresh_view(s: ChatSession):
        view, polling = pg.chat_view(s)
        return serialised.payload(view.blocks), view.summary, gr.skip() if polling else gr.Timer(active=False)
    live.tick(refresh_view, session, [live_blocks, live_summary, live], concurrency_limit=4, show_progress="hidden",
              api_name="chat_view", postprocess=False)
    @audience
    def stopped(s: ChatSession):
        pg.drop_presubmitted(s)  # Stop before the chat started: its message is not left running
        s.handled = s.sent  # a chat cancelled before it started never counts itself handled: the next may be sent
        return "⏹ stopped: the reply ends here, and its KV blocks went back to the pool"

    @audience
    def cleared(s: ChatSession):
        pg.drop_presubmitted(s)
        s.handled = s.sent
        return [], ""
    # the reply keeps what had streamed; the chat's own cleanup aborts its request and frees its blocks
    stop.click(stopped, session, reply_info, cancels=[chat_event, api_event])
    # a fresh conversation: nothing of the old one is sent again (a reply still streaming is stopped)
    clear.click(cleared, session, [chatbot, reply_info], cancels=[chat_event, api_event])


def build_dashboard_tab(pg: Playground | Watcher, serialised: SerialisedFigures) -> list[gr.Plot]:
    """The live charts (returned, for the page's clock) and, for this machine's engine, the traffic generator."""
    with gr.Tab("Dashboard", id=DASHBOARD_TAB):
        gr.Markdown("Live view of the engine, refreshed every second (figures are shared by all tabs). "
                    + HELP["markers"] if pg.local else "Live view of the watched server, from its /metrics "
                    "scraped every second (figures are shared by all tabs).")
        plots = {}
        for row in (("blocks", "queues"), ("prefix", "throughput"), ("memory",)):
            with gr.Row():
                for key in row:
                    with gr.Column():
                        plots[key] = chart(PLOT_LABELS[key])
                        gr.Markdown(HELP[key])
        if not pg.local:
            return [plots[k] for k in DASHBOARD_CHARTS]
        with gr.Accordion("Traffic generator: put the engine under load", open=True):
            gr.Markdown("Simulated users each send a request from the workload, wait for the reply, think for a "
                        "moment (0.5-3 s) and send the next, until the time is up or you press Stop. Flip switches "
                        "in Engine settings meanwhile and watch the charts' markers. Duration 0: each user once.")
            with gr.Row():
                workload = gr.Dropdown(list_workloads(), value="shared-system-prompt", label="workload")
                users = gr.Slider(1, 64, value=16, step=1, label="concurrent users")
                duration = gr.Slider(0, 600, value=120, step=10, label="duration (s), 0 = each user once")
                go = gr.Button("Launch users", variant="primary")
                halt = gr.Button("Stop users")
            traffic_out = gr.Markdown()

    def launch(workload_name, num_users, duration_s):
        note = pg.start_traffic(workload_name, num_users, duration_s)
        if note and not pg.traffic.running:
            yield note
            return
        for s in pg.watch_traffic():  # the status carries its own progress bar: gradio's would grey it out
            yield (note + "\n\n" if note else "") + s.describe()
    go.click(launch, [workload, users, duration], traffic_out, concurrency_limit=4, show_progress="hidden",
             api_name="traffic")
    halt.click(pg.stop_traffic, None, traffic_out)
    return [plots[k] for k in DASHBOARD_CHARTS]


def timer_period(pg: Playground):
    """A page's timer as its own tick returns it: the room's period when it has changed, else untouched."""
    def period(every: float):
        want = pg.page_period()
        return gr.Timer(want) if want != every else gr.skip()
    return period


def track_shown_tab(demo: gr.Blocks, tabs: gr.Tabs) -> gr.State:
    """The tab a visitor's page shows, as far as the dashboard's charts care: DASHBOARD_TAB, another tab's label, or
    None before the page has said (a gradio_client session, which has no tabs: it is sent every chart)."""
    shown = gr.State(None)

    @audience
    def selected(evt: gr.SelectData) -> str:
        return DASHBOARD_TAB if evt.value == "Dashboard" else str(evt.value)
    tabs.select(selected, None, shown, show_progress="hidden", api_name=False)
    # the page opens on the first tab (Chat): said at load, so the dashboard's charts wait until it is opened
    demo.load(audience(lambda: "Chat"), None, shown, show_progress="hidden", api_name=False)
    return shown


def chart_updates(serialised: SerialisedFigures, figures, sent: dict, shown: str | None) -> list:
    """The dashboard's figures as the page's clock sends them: only to a page showing the Dashboard (or an API
    client), and only those not in `sent` already (updated)."""
    if shown not in (None, DASHBOARD_TAB):
        return [gr.skip() for _ in DASHBOARD_CHARTS]
    return [serialised.unless_sent(getattr(figures, k), k, sent) for k in DASHBOARD_CHARTS]
