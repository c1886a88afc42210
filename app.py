"""The playground: chat with the real engine while live charts show its insides.

    python app.py [--model PATH_OR_ID] [--preset NAME] [--set KEY=VALUE] [--attach URL] [--share]
                  [--presenter-token SECRET] [--public] [--api-key KEY]

Layout and wiring only, one small builder per tab: what each control does lives in playground/, the charts in
viz/. Adding a tab is one line in build_app. The same server answers OpenAI's API (/v1/models, /v1/completions,
/v1/chat/completions) and Prometheus (/metrics) from server/, on the same engine.
Respects GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (Hugging Face Spaces binds 0.0.0.0:7860).

Who may change the engine (playground/access.py): on 127.0.0.1 with no token, everyone (a desk). With
--presenter-token (or WATCH_LLM_PRESENTER_TOKEN), whoever enters it on the page; everyone else chats and watches.
Off loopback, with --share or on Spaces and no token: public mode, nobody changes the shared engine.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# gradio's queue recomputes its monitoring summary (a pandas groupby over its last 10,000 events) after every event
# by default: with 30 tabs polling, a quarter of the server's GIL time, growing with the events recorded. Nothing
# reads it unless the monitoring page is on; it is then refreshed every 1,000 events.
os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "1000")

import gradio as gr
from gradio.components.plot import PlotData

from engine import LLM
from engine.bench import Cancelled, compare_report, load_feature_preset, parse_assignments
from engine.config import (
    BUILT_SWITCHES,
    KV_CACHE_DTYPES,
    NOT_YET_BUILT,
    WEIGHT_FIELDS,
)
from engine.host import EngineHost
from engine.quant.format import INT4_GROUP_SIZES, QUANTIZATION_SCHEMES
from engine.service import DEFAULT_MAX_WAITING_REQUESTS
from playground.access import OPEN, OWNER_ENV, PUBLIC, TOKEN, TOKEN_ENV, Access, Seats, audience, presenter_controls
from playground.chat import ChatSession
from playground.features_tab import build_features_tab
from playground.handlers import Playground, feature_presets, workloads
from playground.lessons_tab import TAB_ID as LESSONS_TAB
from playground.lessons_tab import build_lessons_tab
from playground.remote_tab import build_remote_tab
from playground.room import plain
from playground.serialised import SerialisedFigures
from playground.settings import NO_QUANTIZATION, form_value
from playground.tables import ABLATION_HEADERS, COMPARE_HEADERS, ablation_table, compare_table
from playground.watching import Watcher
from server import OpenAIApi, served_model_name
from viz.figures import ablation_figure, compare_figure, placeholder_figure, to_json

INTRO = """# Watch an LLM inference engine work
A real engine (paged KV cache, continuous batching, prefix caching, chunked prefill, speculative decoding,
int8 / int4 quantization) runs **{model}** on this machine. Chat with it, put it under load, switch
features off, and watch what changes."""


WATCH_INTRO = """# Watch an LLM inference server work
This page watches **{url}** (its OpenAI API and vLLM's metrics): chat with it and watch its queues, KV cache,
prefix cache and throughput live. No model runs on this machine."""


def intro(pg: Playground | Watcher) -> str:
    """The page's header: which model this machine's engine runs, and, while the page is attached to another
    server, that the chat and the dashboard show that server instead."""
    if not pg.local:
        remote = pg.remote
        return (WATCH_INTRO.format(url=plain(remote.url, 120))
                + (f" It serves **{plain(remote.model, 80)}**." if remote.model else ""))
    text = INTRO.format(model=plain(model_label(pg.llm.config.model), 80))
    if (remote := pg.remote) is not None:
        text += (f"\n\n**Attached to {plain(remote.url, 120)}**" + (f" ({plain(remote.model, 80)})" if remote.model
                 else "") + ": the chat and the dashboard show that server; the other tabs are this machine's engine.")
    return text


def model_label(model: str | None) -> str:
    """A model as the header names it: the hub id's or folder's last part, a GGUF file's stem."""
    name = Path(served_model_name(model).rstrip("/")).name
    return name[:-5] if name.endswith(".gguf") else name

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


# A chart drawn while its tab was hidden keeps plotly's default width (700 px) until the window resizes: resize
# when a tab opens. A shown label makes gradio force a 100 px top margin; each chart carries its own title.
RESIZE_CHARTS = "() => { setTimeout(() => window.dispatchEvent(new Event('resize')), 50); }"


def chart(label: str, empty: str | None = None) -> gr.Plot:
    """`empty`: what the chart says before it has anything to show."""
    value = PlotData(type="plotly", plot=to_json(placeholder_figure(empty))) if empty else None
    return gr.Plot(value, label=label, show_label=False)


NO_ABLATION = "Press Run ablation: the full engine, then each switch off in turn, measured on this machine"
NO_CHAT_VIEW = "Send a message: your request's KV blocks light up here"
PLOT_LABELS = {"blocks": "KV block table", "queues": "scheduler queues", "prefix": "prefix cache",
               "throughput": "throughput", "memory": "memory"}


WATCHED_CHATS = 64  # a watched server's seats are not known here: it is usually a bigger machine than this one


def chat_seats(pg: Playground | Watcher) -> int:
    """How many chats the page streams at once: as many as the engine has seats (and a few waiting), not gradio's
    default; the page's chat and the API's share that limit."""
    return max(16, pg.service.config_view().resolved["max_num_seqs"] + 4) if pg.local else WATCHED_CHATS


def build_chat_tab(pg: Playground | Watcher, serialised: SerialisedFigures, access: Access) -> None:
    with gr.Tab("Chat"):
        # copied per tab; the chat sets its request id in place, the live view (another event) reads it at once
        session = gr.State(ChatSession())
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Chat with the engine", height=420)
                with gr.Row():
                    msg = gr.Textbox(placeholder="Type a message and press Enter", scale=5, show_label=False)
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

    @audience
    def chat(message, history, temperature_value, max_tokens_value, s: ChatSession):
        if not (message and message.strip()):  # an empty box sent (Enter pressed twice): nothing changes
            yield gr.skip(), gr.skip()
            return
        visitor = access.visitor()  # the audience's share of the engine is bounded; the presenter's is not
        key = None if visitor.presenter else (visitor.session or "anonymous")
        yield from pg.chat(message, history, temperature_value, max_tokens_value, s, audience=key)

    seats = chat_seats(pg)
    # On the page (gradio's ChatInterface does the same): the message moves from the box to the tab's state at
    # once, so the box is empty while the reply streams and Enter again sends nothing; then the chat reads it from
    # the state. A message typed while this tab's reply is still on its way stays in the box, unsent (one reply at
    # a time per tab: two would stream into one history). The live view's timer starts here, before the chat: the
    # page applies a trigger's updates in order, and a timer started beside the streaming chat only ran once the
    # reply had ended.
    @audience
    def take(message, s: ChatSession):
        if not (message and message.strip()):
            return gr.skip(), "", gr.skip(), gr.skip()
        if s.expecting():
            return gr.skip(), "", gr.skip(), "⏳ your reply is still on its way: press Stop, or send this after it"
        pg.chat_sent(s)
        return "", message, gr.Timer(active=True), ""

    taken = gr.on([msg.submit, send.click], take, [msg, session], [msg, pending, live, reply_info], queue=False,
                  show_progress="hidden", api_visibility="private")
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
        s.handled = s.sent  # a chat cancelled before it started never counts itself handled: the next may be sent
        return "⏹ stopped: the reply ends here, and its KV blocks went back to the pool"

    @audience
    def cleared(s: ChatSession):
        s.handled = s.sent
        return [], ""
    # the reply keeps what had streamed; the chat's own cleanup aborts its request and frees its blocks
    stop.click(stopped, session, reply_info, cancels=[chat_event, api_event])
    # a fresh conversation: nothing of the old one is sent again (a reply still streaming is stopped)
    clear.click(cleared, session, [chatbot, reply_info], cancels=[chat_event, api_event])


def build_dashboard_tab(pg: Playground | Watcher, serialised: SerialisedFigures) -> list[gr.Plot]:
    """The live charts (returned, for the page's clock to refresh) and, for this machine's engine, the traffic
    generator."""
    with gr.Tab("Dashboard"):
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
            return [plots[k] for k in ("blocks", "queues", "prefix", "throughput", "memory")]
        with gr.Accordion("Traffic generator: put the engine under load", open=True):
            gr.Markdown("Simulated users each send a request from the workload, wait for the reply, think for a "
                        "moment (0.5-3 s) and send the next, until the time is up or you press Stop. Flip switches "
                        "in Engine settings meanwhile and watch the charts' markers. Duration 0: each user once.")
            with gr.Row():
                workload = gr.Dropdown(workloads(), value="shared-system-prompt", label="workload")
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
    return [plots[k] for k in ("blocks", "queues", "prefix", "throughput", "memory")]


WEIGHT_DTYPES = ("float32", "bfloat16")  # what the form offers; LLM(dtype=...) and the API take any EngineConfig dtype
WEIGHTS_HELP = {
    "quantization": "int8 / int4: weight-only; w8a8: int8 weights and activations",
    "quantization_group_size": "int4 only: input features per scale (must divide each layer)",
    "quantize_lm_head": "the LM head too (unticked: it keeps the dtype)",
    "dtype": "CPU: bf16 is fast only with bf16 instructions (docs/measurements.md: kernels)",
    "quantization_smoothing": "calibrated at load over a text: each projection's input channels rescaled before "
                              "rounding (SmoothQuant / AWQ); a slower load, no slower steps",
    "quantization_gptq": "calibrated at load: weights rounded by GPTQ instead of to the nearest level; the slowest "
                         "load (docs/measurements.md: quality), no slower steps",
}


def build_settings_tab(pg: Playground, serialised: SerialisedFigures) -> None:
    with gr.Tab("Engine settings"):
        gr.Markdown("An idle engine applies a change at once; a busy one at its next step boundary. Pool or "
                    "paging changes rebuild the KV pool: running requests are re-prefilled, nothing is lost. "
                    "A change of the weights rebuilds the model (below). Only the fields you change are sent; an "
                    "empty size is chosen by the engine. Each change applied is marked on the Dashboard's "
                    "time-series charts.")
        with gr.Row():
            switches = {s: gr.Checkbox(label=s) for s in BUILT_SWITCHES}
        with gr.Row():
            for s in NOT_YET_BUILT:
                gr.Checkbox(label=f"{s} (not built yet)", value=False, interactive=False)
        with gr.Row():
            sizes = {"block_size": gr.Dropdown([1, 2, 4, 8, 16, 32, 64, 128, 256], label="block_size"),
                     "num_kv_blocks": gr.Number(label="num_kv_blocks (pool size)", precision=0),
                     "max_num_seqs": gr.Number(label="max_num_seqs", precision=0),
                     "max_num_batched_tokens": gr.Number(label="max_num_batched_tokens", precision=0),
                     "max_model_len": gr.Number(label="max_model_len (tokens per request)", precision=0),
                     "kv_cache_dtype": gr.Dropdown(list(KV_CACHE_DTYPES), label="kv_cache_dtype"),
                     "kv_cache_smoothing": gr.Checkbox(label="kv_cache_smoothing (int8 KV: keys rescaled)")}
        now = {k: form_value(k, v) for k, v in pg.settings().items()}  # also what an API call leaves out means
        with gr.Row(elem_id="weights"):
            dtypes = list(dict.fromkeys([*WEIGHT_DTYPES, now["dtype"]]))  # the running one, even if not offered
            weights = {
                "quantization": gr.Dropdown([NO_QUANTIZATION, *QUANTIZATION_SCHEMES], value=now["quantization"],
                                            label="quantization (weights)", info=WEIGHTS_HELP["quantization"], scale=2),
                "quantization_group_size": gr.Dropdown(list(INT4_GROUP_SIZES), value=now["quantization_group_size"],
                                                       label="int4 group size",
                                                       info=WEIGHTS_HELP["quantization_group_size"], scale=2),
                "quantize_lm_head": gr.Checkbox(value=now["quantize_lm_head"], label="quantize_lm_head",
                                                info=WEIGHTS_HELP["quantize_lm_head"]),
                "dtype": gr.Dropdown(dtypes, value=now["dtype"], label="dtype", info=WEIGHTS_HELP["dtype"], scale=2)}
        with gr.Row(elem_id="calibration"):
            for name in WEIGHT_FIELDS:  # the calibration switches, and any weight switch added to EngineConfig later
                if name not in weights and isinstance(now[name], bool):
                    weights[name] = gr.Checkbox(value=now[name], label=name, info=WEIGHTS_HELP.get(name))
        weights_note = gr.Markdown(pg.weights_note())
        with gr.Row():
            apply = gr.Button("Apply", variant="primary")
            reset = gr.Button("Reset to defaults")
            restart = gr.Button("Restart the engine")
        settings_out = gr.Markdown()
        settings_note = gr.Markdown()
        loaded = gr.State({})  # what this tab's form was loaded with: Apply sends only what differs

    inputs = list(switches.values()) + list(sizes.values()) + list(weights.values())
    names = list(switches) + list(sizes) + list(weights)
    for name, component in zip(names, inputs):
        component.elem_id = f"setting-{name}"  # the field each input sets, for scripts and tests

    @audience
    def load_settings():
        cfg, hints = pg.settings(), pg.settings_hints()
        fields = [gr.update(value=cfg[n], info=hints[n], placeholder=hints[n]) if n in hints else form_value(n, cfg[n])
                  for n in names]
        return *fields, cfg, pg.settings_note(), pg.weights_note()
    form = [*inputs, loaded, settings_note, weights_note]

    # gradio hands a gr.Progress only to a positional parameter: it comes first, the form's values after it
    def do_apply(progress=gr.Progress(), *args):
        loaded_values, *values = args
        return pg.apply_settings(loaded_values, lambda f, d: progress(f, desc=d), **dict(zip(names, values)))

    def do_reset(progress=gr.Progress()):
        return pg.reset_settings(lambda f, d: progress(f, desc=d))
    # a rebuild's bar over the weights' note, next to the controls (the empty message line shows none)
    apply.click(do_apply, [loaded, *inputs], settings_out, api_name="apply_settings",
                show_progress_on=weights_note).then(load_settings, None, form)
    reset.click(do_reset, None, settings_out, show_progress_on=weights_note).then(load_settings, None, form)
    def do_restart(progress=gr.Progress()):
        return pg.restart(progress=lambda f, d: progress(f, desc=d))
    restart.click(do_restart, None, settings_out, api_name="restart", show_progress_on=weights_note) \
        .then(load_settings, None, form)
    gr.on(None, load_settings, None, form, api_name="settings")  # on page load


def build_ablation_tab(pg: Playground, serialised: SerialisedFigures) -> None:
    with gr.Tab("What is each feature worth?"):
        gr.Markdown("Runs a workload through the full engine, then with each switch off in turn, on this "
                    "machine. The live engine pauses meanwhile so the numbers are clean.")
        with gr.Row():
            workload = gr.Dropdown(workloads(), value="ablation", label="workload")
            quick = gr.Checkbox(value=True, label="quick (a quarter of the requests)")
            go = gr.Button("Run ablation", variant="primary")
            cancel = gr.Button("Cancel")
        full_note = gr.Markdown()
        note = gr.Markdown()
        plot = chart("tokens/s per configuration", NO_ABLATION)
        table = gr.Dataframe(ablation_table([]), headers=ABLATION_HEADERS, label="results")

    def do_ablate(workload_name, quick_run, progress=gr.Progress()):
        try:
            rows = pg.ablate(workload_name, quick_run, lambda f, d: progress(f, desc=d))
        except (ValueError, Cancelled) as exc:
            return gr.skip(), gr.skip(), f"⚠️ {exc}"
        return serialised(ablation_figure(rows)), ablation_table(rows), ""

    @audience
    def last_ablation():
        rows = pg.last_ablation()
        return (serialised(ablation_figure(rows) if rows else placeholder_figure(NO_ABLATION)), ablation_table(rows),
                pg.full_engine_note())
    go.click(do_ablate, [workload, quick], [plot, table, note])
    cancel.click(pg.cancel_measurement, None, note)
    # on page load: the last results, kept across restarts, and what "full engine" means against the live one
    gr.on(None, last_ablation, None, [plot, table, full_note])


def build_compare_tab(pg: Playground, serialised: SerialisedFigures) -> None:
    with gr.Tab("Compare two configurations"):
        with gr.Row():
            workload = gr.Dropdown(workloads(), value="mixed-lengths", label="workload")
            a = gr.Dropdown(feature_presets(), value="naive", label="A (preset, or type flags)",
                            allow_custom_value=True)
            b = gr.Dropdown(feature_presets(), value="full", label="B (preset, or type flags)",
                            allow_custom_value=True)
            quick = gr.Checkbox(value=True, label="quick")
            go = gr.Button("Compare", variant="primary")
            cancel = gr.Button("Cancel")
        plot = chart("side by side", "Press Compare: both configurations run the workload, side by side")
        # shown once there are numbers: twelve empty columns squeezed their headers out of sight; wrapped, so that
        # all twelve fit the page's width instead of the last ones scrolling out of view
        table = gr.Dataframe({"headers": COMPARE_HEADERS, "data": []}, headers=COMPARE_HEADERS, label="the numbers",
                             visible=False, wrap=True)
        note = gr.Markdown()

    def do_compare(workload_name, spec_a, spec_b, quick_run, progress=gr.Progress(track_tqdm=False)):
        try:
            result = pg.compare(workload_name, spec_a, spec_b, quick_run, lambda f, d: progress(f, desc=d))
        except (ValueError, Cancelled) as exc:
            return gr.skip(), gr.skip(), f"⚠️ {exc}"
        report = compare_report(result)
        return (serialised(compare_figure(result)), gr.Dataframe(compare_table(report), visible=True),
                "\n\n".join(report.notes))
    go.click(do_compare, [workload, a, b, quick], [plot, table, note], api_name="compare")
    cancel.click(pg.cancel_measurement, None, note)


def build_step_tab(pg: Playground, serialised: SerialisedFigures) -> None:
    with gr.Tab("Step mode"):
        gr.Markdown("Pause the engine and advance one step at a time: read what the scheduler decided.")
        with gr.Row():
            pause = gr.Button("Pause")
            step = gr.Button("Step", variant="primary")
            resume = gr.Button("Resume")
        with gr.Row():
            text = gr.Markdown()
            blocks = chart("KV block table after the step",
                           "Press Pause, then Step: the block table after each step shows here")

    def pause_engine():
        return pg.pause(), serialised(pg.dashboard().blocks)

    def step_engine():
        return pg.step(), serialised(pg.dashboard().blocks)
    pause.click(pause_engine, None, [text, blocks], api_name="pause")
    resume.click(pg.resume, None, text, api_name="resume")
    step.click(step_engine, None, [text, blocks], api_name="step")


def build_app(pg: Playground, access: Access | None = None) -> gr.Blocks:
    """Each tab is one builder, `build_x_tab(pg, serialised)`, that puts every component it makes (states too)
    inside its own gr.Tab: one placed among the tabs themselves shifts their labels. A timer inside a tab ticks
    only once that tab has been opened, so the page's clock (status line and dashboard) lives out here.
    `access`: who may change the engine (default: everyone, a desk); every event not marked `audience` is the
    presenter's, checked on the server (access.guard, last)."""
    access = access or Access()
    serialised = SerialisedFigures()  # every figure turned into JSON once, for every tab
    with gr.Blocks(title="watch-llm playground") as demo:
        header = gr.Markdown(intro(pg))
        role = build_presenter_box(access)
        status = gr.Markdown(pg.status(), elem_id="status")
        back = gr.Button("Back to the lesson", visible=False, size="sm", elem_id="lesson-back")
        clock = gr.Timer(1.0)
        # the lesson run this visitor's page last followed to the Lessons tab, and whether its back button shows
        seen = gr.State({"run": 0, "back": False})
        with gr.Tabs() as tabs:
            build_chat_tab(pg, serialised, access)
            plots = build_dashboard_tab(pg, serialised)
            lesson = build_lessons_tab(pg, pg.lessons, serialised)
            build_settings_tab(pg, serialised)
            build_ablation_tab(pg, serialised)
            build_features_tab(pg, serialised)
            build_compare_tab(pg, serialised)
            build_step_tab(pg, serialised)
            build_remote_tab(pg, serialised)
        tabs.select(None, None, None, js=RESIZE_CHARTS)

        @audience
        def refresh(picked: str | None, followed: dict):
            f = pg.dashboard()
            run = pg.lessons.run
            # a lesson the presenter started brings every page to it, once; a visitor may then step away, and
            # "Back to the lesson" (shown while one is open) brings them back
            follow = run is not None and run.run_id != followed["run"]
            show_back = run is not None
            now = {"run": run.run_id if follow else followed["run"], "back": show_back}
            return (pg.status(), *map(serialised.payload, (f.blocks, f.queues, f.prefix, f.throughput, f.memory)),
                    *lesson["view"](picked), gr.Tabs(selected=LESSONS_TAB) if follow else gr.skip(), now,
                    gr.Button(visible=show_back) if show_back != followed["back"] else gr.skip(), intro(pg))
        clock.tick(refresh, [lesson["pick"], seen], [status, *plots, *lesson["outputs"], tabs, seen, back, header],
                   concurrency_limit=4, show_progress="hidden", api_name="dashboard", postprocess=False)
        back.click(audience(lambda: gr.Tabs(selected=LESSONS_TAB)), None, tabs, api_name="back_to_lesson",
                   show_progress="hidden")
        wire_roles(demo, access, role)
    access.guard(demo, gr.Error)  # last: every event registered above, gated unless marked audience
    return demo


def build_watch_app(watcher: Watcher, access: Access | None = None) -> gr.Blocks:
    """A page that only watches another server (`--attach URL`): the chat, the dashboard and the Remote server
    tab, with the same roles as build_app (attaching it elsewhere is the presenter's)."""
    access = access or Access()
    serialised = SerialisedFigures()
    with gr.Blocks(title="watch-llm: watching a server") as demo:
        header = gr.Markdown(intro(watcher))
        role = build_presenter_box(access)
        status = gr.Markdown(watcher.status(), elem_id="status")
        clock = gr.Timer(1.0)
        with gr.Tabs() as tabs:
            build_chat_tab(watcher, serialised, access)
            plots = build_dashboard_tab(watcher, serialised)
            build_remote_tab(watcher, serialised)
        tabs.select(None, None, None, js=RESIZE_CHARTS)

        @audience
        def refresh():
            f = watcher.dashboard()
            return (watcher.status(), *map(serialised.payload, (f.blocks, f.queues, f.prefix, f.throughput, f.memory)),
                    intro(watcher))
        clock.tick(refresh, None, [status, *plots, header], concurrency_limit=4, show_progress="hidden",
                   api_name="dashboard", postprocess=False)
        wire_roles(demo, access, role)
    access.guard(demo, gr.Error)
    return demo


def build_presenter_box(access: Access) -> dict:
    """The visitor's role line and, in token mode, where the presenter enters the token."""
    parts = {"banner": gr.Markdown(visible=access.mode != OPEN, elem_id="role-banner")}
    # a Space with `hf_oauth: true` (which sets OAUTH_CLIENT_ID): its owner logs in to present. Elsewhere gradio's
    # login button needs this machine logged in to the hub, so it is left out
    if access.owner and access.mode != OPEN and os.environ.get("OAUTH_CLIENT_ID"):
        gr.LoginButton()
    if access.mode == TOKEN:
        with gr.Accordion("Presenter", open=False, elem_id="presenter-box"):
            with gr.Row():
                parts["token"] = gr.Textbox(type="password", label="presenter token", scale=4,
                                            placeholder="the secret the app was started with",
                                            elem_id="presenter-token")
                parts["unlock"] = gr.Button("Unlock", variant="primary", scale=1, min_width=80)
            parts["unlock_note"] = gr.Markdown()
    return parts


def wire_roles(demo: gr.Blocks, access: Access, role: dict) -> None:
    """On page load (and after an unlock): the visitor's role, and the presenter's buttons locked for the
    audience. Locking is what the page shows; the server's gate (access.guard) is what protects."""
    if access.mode == OPEN:
        return
    controls = presenter_controls(demo)

    def view(note: str = ""):
        visitor = access.visitor()
        return (access.banner(visitor), *(gr.update(interactive=visitor.presenter) for _ in controls)) \
            + ((note,) if "unlock_note" in role else ())

    outputs = [role["banner"], *controls, *([role["unlock_note"]] if "unlock_note" in role else [])]
    demo.load(audience(lambda: view()), None, outputs, api_visibility="private")
    demo.unload(audience(lambda: access.forget()))
    if "unlock" in role:
        def unlock(token: str):
            return view(access.unlock(token))
        # one unlock at a time, a wrong token answering a second late: guessing the token is slow
        unlock_click = role["unlock"].click(audience(unlock), role["token"], outputs, concurrency_limit=1,
                                            concurrency_id="unlock", api_name="unlock")
        unlock_enter = role["token"].submit(audience(unlock), role["token"], outputs, concurrency_limit=1,
                                            concurrency_id="unlock", api_visibility="private")
        for ev in (unlock_click, unlock_enter):
            ev.then(audience(lambda: ""), None, role["token"])


def launch(pg: Playground | Watcher, model_name: str, access: Access | None = None, api_key: str | None = None,
           **launch_kwargs) -> gr.Blocks:
    """The page and the OpenAI-compatible API on one server: the API's routes go into gradio's own FastAPI app,
    ahead of gradio's, so `share`, the queue and everything else of gradio's launch() keep working.
    `access`: who may change the engine (default: decided from where it listens, as main() does).
    `api_key`: required as `Authorization: Bearer` on /v1/* (None: the API is open).
    A Watcher's page has no API of its own: the watched server serves it."""
    if access is None:
        access = Access.for_launch(launch_kwargs.get("server_name"), bool(launch_kwargs.get("share")))
    if not pg.local:
        demo = build_watch_app(pg, access)
        calm_queue(demo.queue(default_concurrency_limit=8))
        demo.launch(**launch_kwargs)
        return demo
    demo = build_app(pg, access)
    # the live service, even after a restart
    api = OpenAIApi(lambda: pg.service, pg.llm.tokenizer, model_name, api_key=api_key, seats=pg.seats,
                    uncapped=access.presents_api)  # the API's audience gets the page's fair shares
    pg.stat_listeners.append(api.metrics.record)
    calm_queue(demo.queue(default_concurrency_limit=8))
    demo.launch(app_kwargs={"routes": api.routes()}, **launch_kwargs)
    return demo


QUEUE_POLL_S = 0.02  # gradio's queue checks for work every 1 ms (progress every 10 ms) when idle


def calm_queue(demo: gr.Blocks) -> None:
    """Let gradio's queue poll every 20 ms instead of every 1 ms. Each wake-up takes the GIL from the engine
    thread and a core from its matmul threads: on 2 cores the HTTP API streamed ~13-45% fewer tokens/s than
    LLM.generate with the same engine (`python -m engine.bench serve-overhead`). A page event starts <= 20 ms
    later; gradio itself polls every 50 ms on Windows."""
    queue = getattr(demo, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, 5 * QUEUE_POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--preset", default=None, help="a feature preset from presets/features/ (e.g. naive)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    parser.add_argument("--share", action="store_true", help="a public gradio.live link (Colab)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name the API answers to (default: --model, or the embedded model's hub id)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="requests allowed to wait for the engine; beyond, new ones are refused as busy "
                             "(the API answers 429)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="any EngineConfig field, e.g. --set max_num_seqs=8 (repeatable, or comma-separated)")
    parser.add_argument("--presenter-token", default=None, metavar="SECRET",
                        help=f"who enters it on the page steers the engine; everyone else chats and watches "
                             f"(default: ${TOKEN_ENV}; README: Running a workshop)")
    parser.add_argument("--public", action="store_true",
                        help="public mode even on 127.0.0.1: nobody may change the shared engine (without a token; "
                             "the default off loopback, with --share and on Spaces)")
    parser.add_argument("--space-owner-presents", action="store_true", default=None,
                        help=f"on a Space with `hf_oauth: true`: its owner, logged in with Hugging Face, is the "
                             f"presenter (default: ${OWNER_ENV}=1)")
    parser.add_argument("--audience-replies", type=int, default=2, metavar="N",
                        help="replies each audience member may have on their way at once (public and token modes)")
    parser.add_argument("--audience-max-tokens", type=int, default=256, metavar="N",
                        help="the longest reply an audience member may ask for (public and token modes)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1/* (default: $VLLM_API_KEY, as vLLM)")
    parser.add_argument("--lesson-seconds", type=float, default=None, metavar="S",
                        help="every lesson's before and after phases this long (a rehearsal, a short workshop; "
                             "default: each lesson's own)")
    parser.add_argument("--attach", default=None, metavar="URL",
                        help="only watch another server (OpenAI API + vLLM's /metrics, e.g. vllm serve): the chat and "
                             "the dashboard's charts, no model loaded here (docs/api.md: Watch a vLLM deployment)")
    args = parser.parse_args()
    try:
        fields = {**(load_feature_preset(args.preset) if args.preset else {}), **parse_assignments(args.settings)}
    except ValueError as exc:
        parser.error(str(exc))
    server_name = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    access = Access.for_launch(server_name, args.share or args.public, args.presenter_token,
                               args.space_owner_presents)
    print(f"Access: {ROLE_LINES[access.mode]}", flush=True)
    try:
        seats = Seats(args.audience_replies, args.audience_max_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    if args.attach:
        watch(args, parser, access, seats, server_name)
        return
    print(f"Loading {args.model or 'SmolLM2-135M-Instruct (the embedded GGUF)'}: the first time, the checkpoint is "
          f"converted once (about 30 s); then seconds", flush=True)
    started = time.perf_counter()
    host = EngineHost()  # the engine steps on this, the main thread (engine/host.py says why); the page serves
    pg = Playground(LLM(args.model, **{"device": args.device, **fields}),  # from gradio's threads
                    max_waiting_requests=args.max_waiting_requests, runner=host.run)
    kernels = pg.service.snapshot().kernels
    print(f"Loaded in {time.perf_counter() - started:.0f} s: {pg.service.snapshot().precision} on the "
          f"{kernels.get('weights_kernel', '?')}; attention: {kernels.get('attention', '?')}. Building the page…",
          flush=True)
    pg.seats = seats
    if args.lesson_seconds is not None:
        if args.lesson_seconds <= 0:
            parser.error(f"--lesson-seconds must be > 0, got {args.lesson_seconds}")
        pg.lessons.seconds = args.lesson_seconds
    demo = launch(pg, args.served_model_name or served_model_name(args.model), access=access,
                  api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None, server_name=server_name,
                  server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), share=args.share,
                  prevent_thread_lock=True)
    try:
        host.serve()  # until Ctrl-C
    except KeyboardInterrupt:
        print("Stopping: the page and the API close.", flush=True)
    finally:
        demo.close()


def watch(args, parser: argparse.ArgumentParser, access: Access, seats: Seats, server_name: str) -> None:
    """`--attach URL`: a page that only watches that server; no model is loaded (a server still starting is asked
    again until it answers)."""
    local = [flag for flag, given in (("--model", args.model), ("--preset", args.preset), ("--set", args.settings),
                                       ("--api-key", args.api_key), ("--lesson-seconds", args.lesson_seconds))
             if given]
    if local:
        parser.error(f"--attach watches another server and loads no model here: {', '.join(local)} would configure "
                     f"an engine this page does not run (to run one and attach it later, start without --attach and "
                     f"use the Remote server tab)")
    try:
        watcher = Watcher.connect(args.attach, say=lambda line: print(line, flush=True))
    except ValueError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        return
    watcher.seats = seats
    print(f"Watching {watcher.remote.url}" + (f" ({watcher.remote.model})" if watcher.remote.model else "")
          + ": no model is loaded here.", flush=True)
    demo = launch(watcher, "", access=access, server_name=server_name,
                  server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), share=args.share,
                  prevent_thread_lock=True)
    try:
        demo.block_thread()  # until Ctrl-C
    finally:
        watcher.close()


ROLE_LINES = {OPEN: "everyone at this page may change the engine (it listens on this machine only)",
              TOKEN: "presenter mode: whoever enters the presenter token steers; everyone else chats and watches",
              PUBLIC: "public mode: nobody may change the shared engine (give --presenter-token to steer it)"}


if __name__ == "__main__":
    main()
