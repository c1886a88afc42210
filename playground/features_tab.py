"""The "engine, feature by feature" tab: layout and wiring only. Running, storing, loading and what each section
shows live in playground/features.py (FeatureExperiments); figures in viz/figures.py."""
from __future__ import annotations

from collections.abc import Callable

import gradio as gr
from gradio.components.plot import PlotData

from engine.measure import FEATURES, QUALITY_SPECS, Cancelled
from engine.workloads import list_workloads

from .access import audience
from .features import CONCURRENCY_LEVELS, DEFAULT_WORKLOADS, EXPERIMENTS, NAMES, FeatureExperiments
from .handlers import Playground
from .quality import KV_GOAL, WEIGHT_GOALS

TAB = "The engine, feature by feature"
INTRO = """The course draws these with illustrative numbers; here every bar is **measured on the real engine**.
What to look for: the KV cache is the big step and each later feature multiplies on top of it (or does not, on
this workload); quantization's speed comes at a cost in quality, scored against fp32 right under it; a feature's
worth depends on load (speculation pays with one request at a time and fades when the
batch is full); and memory decides how many requests fit at once. The live engine pauses while a run measures
(every tab says so, with time left); Cancel stops it."""
SECTIONS = {
    "cumulative": ("1. The engine, feature by feature",
                   "Everything off (the naive loop), then each feature added back in the course's order: "
                   + ", ".join(f.name for f in FEATURES) + "."),
    "quality": ("2. What each precision costs in quality",
                "Quantization's row above is what a smaller precision buys in tokens/s; this is its price. Each "
                "precision's engine reads the same text (prose, code and dialogue) as the fp32 engine, teacher-"
                "forced: how often both pick the same next token (top-1 agreement), how far the text's own token "
                "logprobs move, and its perplexity. The project's goals: "
                + "; ".join(f"{g.what}: {g.describe()}" for g in (*WEIGHT_GOALS.values(), KV_GOAL))
                + "; a combination has none. Cancel stops it between two precisions."),
    "concurrency": ("3. What each feature is worth under load",
                    "The full engine, then each feature off in turn, at 1, 8 and 32 requests at a time. A bar is "
                    "the full engine's tokens/s over the engine's without that feature: above 1x it helps."),
    "memory": ("4. Memory is still the constraint",
               "Each KV pool size, paged and contiguous: how many requests fit at once, how often one is preempted "
               "(its blocks taken back, recomputed later), and what that does to tokens/s."),
}
# column widths for the page's width, no scrolling, long cells wrapped: tables.QUALITY_HEADERS, CUMULATIVE_HEADERS
COLUMN_WIDTHS = {"quality": ["22%", "11%", "10%", "9%", "9%", "14%", "11%", "14%"],
                 "cumulative": ["15%", "6%", "8%", "6%", "6%", "6%", "6%", "8%", "7%", "8%", "12%", "12%"]}
ALL_LEVELS = "all"
LEVEL_CHOICES = [ALL_LEVELS, *map(str, CONCURRENCY_LEVELS)]


def _level(choice: str | None) -> int | None:
    return None if choice in (None, ALL_LEVELS) else int(choice)


def build_features_tab(pg: Playground, serialised: Callable[[dict | None], PlotData | None]) -> gr.Tab:
    """serialised: app.py's shared figure serialiser (spec -> PlotData, each spec serialised once)."""
    experiments = FeatureExperiments(pg)
    outputs: dict[str, tuple] = {}
    inputs: dict[str, list] = {}
    with gr.Tab(TAB) as tab:
        gr.Markdown(INTRO)
        shipped_note = gr.Markdown(experiments.shipped()[1])
        for kind in EXPERIMENTS:
            heading, text = SECTIONS[kind]
            gr.Markdown(f"### {heading}\n{text}")
            with gr.Row():
                if kind == "quality":  # no workload: a fixed text, and the precisions to score
                    inputs[kind] = [gr.CheckboxGroup(list(QUALITY_SPECS), value=list(QUALITY_SPECS), scale=4,
                                                     label="precisions to score against fp32 (fewer: quicker)")]
                else:
                    inputs[kind] = [gr.Dropdown(list_workloads(), value=DEFAULT_WORKLOADS[kind], label="workload"),
                                    gr.Checkbox(value=True, label="quick (a quarter of the requests)")]
                go = gr.Button(f"Run {NAMES[kind]}", variant="primary")
                cancel = gr.Button("Cancel")
            if kind == "concurrency":
                level = gr.Radio(LEVEL_CHOICES, value=ALL_LEVELS, label="concurrency (requests at a time)")
                inputs[kind].append(level)
            view = experiments.view(kind)
            status = gr.Markdown()
            plot = gr.Plot(serialised(view.figure), show_label=False)
            source = gr.Markdown(view.source)
            table = gr.Dataframe(view.table, headers=view.table["headers"], label=f"the numbers: {NAMES[kind]}",
                                 **({"wrap": True, "column_widths": COLUMN_WIDTHS[kind]} if kind in COLUMN_WIDTHS
                                    else {}))
            outputs[kind] = (plot, table, source, status)
            # the bar over the chart only: on every output it covered the source line and the table with copies
            go.click(_runner(experiments, serialised, kind), inputs[kind], list(outputs[kind]), show_progress_on=plot)
            cancel.click(pg.cancel_measurement, None, status)

    @audience
    def show(kind: str, choice: str | None = None) -> tuple:
        view = experiments.view(kind, _level(choice))
        return serialised(view.figure), view.table, view.source

    # another session (or a restart) may have measured since this page was built: read the store again
    @audience
    def refresh(choice: str) -> tuple:
        return (experiments.shipped()[1], *(o for kind in EXPERIMENTS for o in show(kind, choice)))
    tab.select(refresh, [level], [shipped_note, *(o for kind in EXPERIMENTS for o in outputs[kind][:3])])
    level.change(audience(lambda choice: show("concurrency", choice)[0]), level, outputs["concurrency"][0])
    return tab


def _runner(experiments: FeatureExperiments, serialised: Callable, kind: str) -> Callable:
    """The Run button's handler for one experiment (gradio finds gr.Progress by its default, so one per shape)."""
    def run(progress: gr.Progress, choice: str | None, *asked) -> tuple:
        try:
            if kind == "quality":  # asked: the precisions to score
                experiments.run_quality(asked[0], lambda f, d: progress(f, desc=d))
            else:  # asked: the workload, and quick
                experiments.run(kind, asked[0], bool(asked[1]), lambda f, d: progress(f, desc=d))
        except (ValueError, Cancelled) as exc:
            return gr.skip(), gr.skip(), gr.skip(), f"⚠️ {exc}"
        view = experiments.view(kind, _level(choice))
        return serialised(view.figure), view.table, view.source, ""

    if kind == "concurrency":
        def run_at(workload: str, quick: bool, choice: str, progress=gr.Progress()) -> tuple:
            return run(progress, choice, workload, quick)
        return run_at

    if kind == "quality":
        def run_specs(specs: list[str], progress=gr.Progress()) -> tuple:
            return run(progress, None, specs)
        return run_specs

    def run_one(workload: str, quick: bool, progress=gr.Progress()) -> tuple:
        return run(progress, None, workload, quick)
    return run_one
