"""The tabs that change or measure this machine's engine: Engine settings, What is each feature worth?, Compare
two configurations, Step mode. Layout and wiring only: what each does is playground/settings.py's,
measurements.py's and handlers.py's. A watch-only page has none of them."""
from __future__ import annotations

import gradio as gr

from engine.config import FEATURE_SWITCHES, KV_CACHE_DTYPES, WEIGHT_FIELDS
from engine.measure import Cancelled, compare_report, list_feature_presets
from engine.quant.format import INT4_GROUP_SIZES, QUANTIZATION_SCHEMES
from engine.workloads import list_workloads
from viz.figures import placeholder_figure
from viz.result_figures import ablation_figure, compare_figure

from .access import audience
from .handlers import PAGE_PERIOD_S, Playground
from .live_tabs import chart, timer_period
from .serialised import SerialisedFigures
from .settings import LM_HEAD_WORDS, NO_QUANTIZATION, form_value
from .tables import ABLATION_HEADERS, COMPARE_HEADERS, ablation_table, compare_table

ROLE_KEY = "_presenter"  # beside the form's values in its state: whether it was drawn editable (unlocking redraws it)
LOCKED_FORM = ("🔒 Only the presenter can change the engine's settings: this form shows what the shared engine "
               "runs now, kept up to date.")
NO_ABLATION = "Press Run ablation: the full engine, then each switch off in turn, measured on this machine"

WEIGHT_DTYPES = ("float32", "bfloat16")  # what the form offers; LLM(dtype=...) and the API take any EngineConfig dtype
WEIGHTS_HELP = {
    "quantization": "int8 / int4: weight-only; w8a8: int8 weights and activations",
    "quantization_group_size": "int4 only: input features per scale (must divide each layer)",
    "quantize_lm_head": "the LM head: as the weights, kept in the dtype, or a scheme of its own",
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
            switches = {s: gr.Checkbox(label=s) for s in FEATURE_SWITCHES}
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
                "quantize_lm_head": gr.Dropdown([*LM_HEAD_WORDS.values(), *QUANTIZATION_SCHEMES],
                                                value=now["quantize_lm_head"], label="quantize_lm_head",
                                                info=WEIGHTS_HELP["quantize_lm_head"], scale=2),
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
        # in the tab, so it ticks only once the tab is opened: each tick costs every browser showing the form
        # something (docs/measurements.md, "The room in Chromium")
        follow = gr.Timer(PAGE_PERIOD_S)

    inputs = list(switches.values()) + list(sizes.values()) + list(weights.values())
    names = list(switches) + list(sizes) + list(weights)
    for name, component in zip(names, inputs):
        component.elem_id = f"setting-{name}"  # the field each input sets, for scripts and tests

    def field(name: str, cfg: dict, hints: dict, **extra) -> dict:
        """One field of the form as the engine runs now: a size left automatic says what that comes to."""
        if name in hints:
            return gr.update(value=cfg[name], info=hints[name], placeholder=hints[name], **extra)
        return gr.update(value=form_value(name, cfg[name]), **extra)

    def form_notes(changed: str, steer: bool) -> str:
        notes = [changed, pg.settings_note()] + ([] if steer else [LOCKED_FORM])
        return "\n\n".join(n for n in notes if n)

    @audience
    def load_settings(changed: str = ""):
        """The form as the engine runs now, for this visitor: the presenter edits it, everyone else reads it."""
        cfg, hints = pg.settings(), pg.settings_hints()
        steer = pg.access.visitor().presenter
        fields = [field(n, cfg, hints, interactive=steer) for n in names]
        return *fields, {**cfg, ROLE_KEY: steer}, form_notes(changed, steer), pg.weights_note()
    form = [*inputs, loaded, settings_note, weights_note]

    CHANGED = "ℹ️ The engine's configuration changed: the form shows what it runs now."

    period = timer_period(pg)

    @audience
    def follow_engine(shown: dict, every: float):
        """Once a second while the tab is open: the form again when the engine's configuration is no longer the one
        it shows (a lesson, a rebuild, another presenter tab changed it), with the fields that moved."""
        shown = dict(shown or {})
        steered = shown.pop(ROLE_KEY, None)
        cfg, steer = pg.settings(), pg.access.visitor().presenter
        same = cfg == shown
        if not shown or steered != steer:  # a form never drawn, or the visitor's role changed: all of it
            return *load_settings("" if same or not shown else CHANGED), period(every)
        if same:
            return *[gr.skip()] * len(form), period(every)
        # only the fields that moved, and the sizes' hints (what "automatic" comes to moves with the others): every
        # field sent is drawn again in each browser showing the form, and a lesson's change reaches every page at once
        hints = pg.settings_hints()
        fields = [field(n, cfg, hints) if n in hints or cfg[n] != shown.get(n) else gr.skip() for n in names]
        moved_weights = any(cfg[n] != shown.get(n) for n in weights)
        return (*fields, {**cfg, ROLE_KEY: steer}, form_notes(CHANGED, steer),
                pg.weights_note() if moved_weights else gr.skip(), period(every))
    follow.tick(follow_engine, [loaded, follow], [*form, follow], show_progress="hidden", concurrency_limit=4,
                api_name="settings_follow")

    # gradio hands a gr.Progress only to a positional parameter: it comes first, the form's values after it
    def do_apply(progress=gr.Progress(), *args):
        loaded_values, *values = args
        return pg.apply_settings(loaded_values, lambda f, d: progress(f, desc=d), **dict(zip(names, values)))

    def do_reset(progress=gr.Progress()):
        return pg.reset_settings(lambda f, d: progress(f, desc=d))
    # a rebuild's bar over the weights' note (the empty message line shows none); the form's loads show none
    quiet = {"show_progress": "hidden"}
    apply.click(do_apply, [loaded, *inputs], settings_out, api_name="apply_settings",
                show_progress_on=weights_note).then(load_settings, None, form, **quiet)
    reset.click(do_reset, None, settings_out, show_progress_on=weights_note).then(load_settings, None, form, **quiet)
    def do_restart(progress=gr.Progress()):
        return pg.restart(progress=lambda f, d: progress(f, desc=d))
    restart.click(do_restart, None, settings_out, api_name="restart", show_progress_on=weights_note) \
        .then(load_settings, None, form, **quiet)
    gr.on(None, load_settings, None, form, api_name="settings", **quiet)  # on page load


def build_ablation_tab(pg: Playground, serialised: SerialisedFigures) -> None:
    with gr.Tab("What is each feature worth?"):
        gr.Markdown("Runs a workload through the full engine, then with each switch off in turn, on this "
                    "machine. The live engine pauses meanwhile so the numbers are clean.")
        with gr.Row():
            workload = gr.Dropdown(list_workloads(), value="ablation", label="workload")
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
            workload = gr.Dropdown(list_workloads(), value="mixed-lengths", label="workload")
            a = gr.Dropdown(list_feature_presets(), value="naive", label="A (preset, or type flags)",
                            allow_custom_value=True)
            b = gr.Dropdown(list_feature_presets(), value="full", label="B (preset, or type flags)",
                            allow_custom_value=True)
            quick = gr.Checkbox(value=True, label="quick")
            go = gr.Button("Compare", variant="primary")
            cancel = gr.Button("Cancel")
        plot = chart("side by side", "Press Compare: both configurations run the workload, side by side")
        # shown once there are numbers (empty columns squeezed their headers out of sight), wrapped to fit the page
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
