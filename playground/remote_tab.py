"""The "Remote server" tab: attach the dashboard and the chat to another server, or detach. Layout and wiring
only: what attaching does lives in playground/watching.py and playground/remote.py."""
from __future__ import annotations

from collections.abc import Callable

import gradio as gr
from gradio.components.plot import PlotData

from .access import audience
from .handlers import Playground
from .room import plain
from .watching import Watcher

INTRO = """Point the Dashboard's queue, KV-cache, prefix-cache and throughput charts, and the Chat, at **another
server** that speaks the OpenAI API and publishes vLLM's Prometheus metrics: a vLLM deployment on many GPUs
(`vllm serve MODEL --tensor-parallel-size N`, then attach `http://host:8000`) or another `python app.py`.
While attached, what needs this process's engine (the block table, step mode, settings, the measurements) says it
is not available. Detach to watch the local engine again."""
WATCH_INTRO = """This page watches one server at a time (it was started with `--attach` and loaded no model):
type another address and press Attach to watch that one instead."""


def attached_note(pg: Playground | Watcher) -> str:
    if pg.remote is not None:
        return f"Attached to **{plain(pg.remote.url)}**." + (f" ⚠️ {plain(pg.remote.error)}" if pg.remote.error else "")
    note = "Not attached: the page shows the engine in this process."
    return note + (f"\n\n⚠️ {pg.attach_error}" if pg.attach_error else "")  # escaped when recorded


def build_remote_tab(pg: Playground | Watcher, serialised: Callable[[dict | None], PlotData | None]) -> None:
    with gr.Tab("Remote server"):
        gr.Markdown(INTRO if pg.local else WATCH_INTRO)
        with gr.Row():
            url = gr.Textbox(label="server URL", placeholder="http://127.0.0.1:8000", scale=4,
                             elem_id="remote-url")
            attach = gr.Button("Attach", variant="primary", scale=1, min_width=80)
            detach = gr.Button("Detach", scale=1, min_width=80)
        note = gr.Markdown()

    attach.click(pg.attach, url, note, api_name="attach")
    url.submit(pg.attach, url, note, api_visibility="private")
    detach.click(pg.detach, None, note, api_name="detach")
    @audience
    def on_load() -> tuple:
        # what runs now; while nothing is attached the box is left alone (a fresh page's is empty), so an address
        # typed before a slow page-load answer came back is not wiped
        return (pg.remote.url if pg.remote else gr.skip()), attached_note(pg)
    gr.on(None, on_load, None, [url, note], api_visibility="private")  # on page load
