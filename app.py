"""The playground: chat with the real engine while live charts show its insides.

    python app.py [--model PATH_OR_ID] [--preset NAME] [--share]

Layout and wiring only; what each control does lives in playground/handlers.py, the charts in viz/.
Respects GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (Hugging Face Spaces binds 0.0.0.0:7860).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
from gradio.components.plot import PlotData

from engine import LLM
from engine.bench import Cancelled, compare_report, load_feature_preset
from engine.config import BUILT_SWITCHES, NOT_YET_BUILT
from playground.features_tab import build_features_tab
from playground.handlers import Playground, feature_presets, workloads
from playground.tables import ABLATION_HEADERS, COMPARE_HEADERS, ablation_table, compare_table
from viz.figures import ablation_figure, compare_figure, placeholder_figure, to_json

INTRO = """# Watch an LLM inference engine work
A real engine (paged KV cache, continuous batching, prefix caching) runs **SmolLM2-135M** on this machine.
Chat with it, put it under load, switch features off, and watch what changes."""

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
}


class SerialisedFigures:
    """Each figure spec serialised to JSON once, however many tabs show it."""

    def __init__(self, keep: int = 16) -> None:
        self._by_id: dict[int, tuple[object, PlotData]] = {}
        self.keep = keep

    def __call__(self, spec: dict | None) -> PlotData | None:
        if spec is None:
            return None
        hit = self._by_id.get(id(spec))
        if hit is None or hit[0] is not spec:
            if len(self._by_id) >= self.keep:
                self._by_id.pop(next(iter(self._by_id)))
            hit = self._by_id[id(spec)] = (spec, PlotData(type="plotly", plot=to_json(spec)))
        return hit[1]


# A chart drawn while its tab was hidden keeps plotly's default width (700 px) until the window resizes: resize
# when a tab opens. A shown label makes gradio force a 100 px top margin; each chart carries its own title.
RESIZE_CHARTS = "() => { setTimeout(() => window.dispatchEvent(new Event('resize')), 50); }"


def chart(label: str, empty: str | None = None) -> gr.Plot:
    """`empty`: what the chart says before it has anything to show."""
    value = PlotData(type="plotly", plot=to_json(placeholder_figure(empty))) if empty else None
    return gr.Plot(value, label=label, show_label=False)


NO_ABLATION = "Press Run ablation: the full engine, then each switch off in turn, measured on this machine"
PLOT_LABELS = {"blocks": "KV block table", "queues": "scheduler queues", "prefix": "prefix cache",
               "throughput": "throughput", "memory": "memory"}


def build_app(pg: Playground) -> gr.Blocks:
    serialised = SerialisedFigures()

    with gr.Blocks(title="watch-llm playground") as demo:
        gr.Markdown(INTRO)
        status = gr.Markdown(pg.status())
        with gr.Tabs() as tabs:
            with gr.Tab("Chat"):
                chatbot = gr.Chatbot(label="Chat with the engine", height=420)
                with gr.Row():
                    msg = gr.Textbox(placeholder="Type a message and press Enter", scale=5, show_label=False)
                    send = gr.Button("Send", variant="primary", scale=1)
                    stop = gr.Button("Stop", scale=1)
                    clear = gr.Button("Clear", scale=1, elem_id="clear-chat")
                with gr.Row():
                    temperature = gr.Slider(0, 1.5, value=0.7, step=0.05, label="temperature")
                    max_tokens = gr.Slider(8, 512, value=200, step=8, label="max tokens")
                reply_info = gr.Markdown()
            with gr.Tab("Dashboard"):
                gr.Markdown("Live view of the engine, refreshed every second (figures are shared by all tabs).")
                plots = {}
                for row in (("blocks", "queues"), ("prefix", "throughput"), ("memory",)):
                    with gr.Row():
                        for key in row:
                            with gr.Column():
                                plots[key] = chart(PLOT_LABELS[key])
                                gr.Markdown(HELP[key])
                with gr.Accordion("Traffic generator: put the engine under load", open=False):
                    with gr.Row():
                        traffic_workload = gr.Dropdown(workloads(), value="shared-system-prompt", label="workload")
                        traffic_users = gr.Slider(1, 64, value=16, step=1, label="concurrent users")
                        traffic_go = gr.Button("Launch users")
                    traffic_out = gr.Markdown()
            with gr.Tab("Engine settings"):
                gr.Markdown("An idle engine applies a change at once; a busy one at its next step boundary. Pool or "
                            "paging changes rebuild the KV pool: running requests are re-prefilled, nothing is lost. "
                            "Only the fields you change are sent; an empty size is chosen by the engine.")
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
                             "max_model_len": gr.Number(label="max_model_len (tokens per request)", precision=0)}
                with gr.Row():
                    apply = gr.Button("Apply", variant="primary")
                    reset = gr.Button("Reset to defaults")
                    restart = gr.Button("Restart the engine")
                settings_out = gr.Markdown()
                settings_note = gr.Markdown()
                loaded = gr.State({})  # what this tab's form was loaded with: Apply sends only what differs
            with gr.Tab("What is each feature worth?"):
                gr.Markdown("Runs a workload through the full engine, then with each switch off in turn, on this "
                            "machine. The live engine pauses meanwhile so the numbers are clean.")
                with gr.Row():
                    ablate_workload = gr.Dropdown(workloads(), value="ablation", label="workload")
                    ablate_quick = gr.Checkbox(value=True, label="quick (a quarter of the requests)")
                    ablate_go = gr.Button("Run ablation", variant="primary")
                    ablate_cancel = gr.Button("Cancel")
                ablate_note = gr.Markdown()
                ablate_plot = chart("tokens/s per configuration", NO_ABLATION)
                ablate_table = gr.Dataframe(ablation_table([]), headers=ABLATION_HEADERS, label="results")
            build_features_tab(pg, serialised)
            with gr.Tab("Compare two configurations"):
                with gr.Row():
                    cmp_workload = gr.Dropdown(workloads(), value="mixed-lengths", label="workload")
                    cmp_a = gr.Dropdown(feature_presets(), value="naive", label="A (preset, or type flags)",
                                        allow_custom_value=True)
                    cmp_b = gr.Dropdown(feature_presets(), value="full", label="B (preset, or type flags)",
                                        allow_custom_value=True)
                    cmp_quick = gr.Checkbox(value=True, label="quick")
                    cmp_go = gr.Button("Compare", variant="primary")
                    cmp_cancel = gr.Button("Cancel")
                cmp_plot = chart("side by side", "Press Compare: both configurations run the workload, side by side")
                cmp_table = gr.Dataframe({"headers": COMPARE_HEADERS, "data": []}, headers=COMPARE_HEADERS,
                                         label="the numbers")
                cmp_note = gr.Markdown()
            with gr.Tab("Step mode"):
                gr.Markdown("Pause the engine and advance one step at a time: read what the scheduler decided.")
                with gr.Row():
                    pause_btn = gr.Button("Pause")
                    step_btn = gr.Button("Step", variant="primary")
                    resume_btn = gr.Button("Resume")
                with gr.Row():
                    step_text = gr.Markdown()
                    step_blocks = chart("KV block table after the step",
                                        "Press Pause, then Step: the block table after each step shows here")

        # ---- wiring ----
        tabs.select(None, None, None, js=RESIZE_CHARTS)
        chat_inputs = [msg, chatbot, temperature, max_tokens]
        chat_event = msg.submit(pg.chat, chat_inputs, [chatbot, reply_info], concurrency_limit=16, api_name="chat")
        send_event = send.click(pg.chat, chat_inputs, [chatbot, reply_info], concurrency_limit=16,
                                api_visibility="undocumented", api_name="send")
        for ev in (chat_event, send_event):
            ev.then(lambda: "", None, msg)
        stop.click(None, None, None, cancels=[chat_event, send_event])
        # a fresh conversation: nothing of the old one is sent again (a reply still streaming is stopped)
        clear.click(lambda: ([], ""), None, [chatbot, reply_info], cancels=[chat_event, send_event])

        def refresh():
            f = pg.dashboard()
            return pg.status(), *map(serialised, (f.blocks, f.queues, f.prefix, f.throughput, f.memory))
        timer = gr.Timer(1.0)
        dash_outputs = [status, *(plots[k] for k in ("blocks", "queues", "prefix", "throughput", "memory"))]
        timer.tick(refresh, None, dash_outputs, concurrency_limit=4, show_progress="hidden", api_name="dashboard")

        def do_traffic(workload, users, progress=gr.Progress()):
            return pg.traffic(workload, users, lambda f, d: progress(f, desc=d))
        traffic_go.click(do_traffic, [traffic_workload, traffic_users], traffic_out, concurrency_limit=2)

        setting_inputs = list(switches.values()) + list(sizes.values())
        names = list(switches) + list(sizes)

        def load_settings():
            cfg, hints = pg.settings(), pg.settings_hints()
            fields = [gr.update(value=cfg[n], info=hints[n], placeholder=hints[n]) if n in hints else cfg[n]
                      for n in names]
            return *fields, cfg, pg.settings_note()
        form_outputs = [*setting_inputs, loaded, settings_note]

        def do_apply(loaded_values, *values):
            return pg.apply_settings(loaded_values, **dict(zip(names, values)))
        apply.click(do_apply, [loaded, *setting_inputs], settings_out, api_name="apply_settings").then(
            load_settings, None, form_outputs)
        reset.click(pg.reset_settings, None, settings_out).then(load_settings, None, form_outputs)
        restart.click(pg.restart, None, settings_out).then(load_settings, None, form_outputs)

        def do_ablate(workload, quick, progress=gr.Progress()):
            try:
                rows = pg.ablate(workload, quick, lambda f, d: progress(f, desc=d))
            except (ValueError, Cancelled) as exc:
                return gr.skip(), gr.skip(), f"⚠️ {exc}"
            return serialised(ablation_figure(rows)), ablation_table(rows), ""

        def last_ablation():
            rows = pg.last_ablation()
            return serialised(ablation_figure(rows) if rows else placeholder_figure(NO_ABLATION)), ablation_table(rows)
        ablate_go.click(do_ablate, [ablate_workload, ablate_quick], [ablate_plot, ablate_table, ablate_note])
        ablate_cancel.click(pg.cancel_measurement, None, ablate_note)
        cmp_cancel.click(pg.cancel_measurement, None, cmp_note)

        def do_compare(workload, a, b, quick, progress=gr.Progress(track_tqdm=False)):
            try:
                result = pg.compare(workload, a, b, quick, lambda f, d: progress(f, desc=d))
            except (ValueError, Cancelled) as exc:
                return gr.skip(), gr.skip(), f"⚠️ {exc}"
            report = compare_report(result)
            return serialised(compare_figure(result)), compare_table(report), "\n\n".join(report.notes)
        cmp_go.click(do_compare, [cmp_workload, cmp_a, cmp_b, cmp_quick], [cmp_plot, cmp_table, cmp_note],
                     api_name="compare")

        pause_btn.click(lambda: (pg.pause(), serialised(pg.dashboard().blocks)), None, [step_text, step_blocks])
        resume_btn.click(pg.resume, None, step_text)

        def do_step():
            text = pg.step()
            return text, serialised(pg.dashboard().blocks)
        step_btn.click(do_step, None, [step_text, step_blocks])

        demo.load(load_settings, None, form_outputs, api_name="settings").then(
            last_ablation, None, [ablate_plot, ablate_table])
    return demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--preset", default=None, help="a feature preset from presets/features/ (e.g. naive)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    parser.add_argument("--share", action="store_true", help="a public gradio.live link (Colab)")
    args = parser.parse_args()
    fields = load_feature_preset(args.preset) if args.preset else {}
    pg = Playground(LLM(args.model, **{"device": args.device, **fields}))
    demo = build_app(pg)
    demo.queue(default_concurrency_limit=8).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), share=args.share)


if __name__ == "__main__":
    main()
