"""The projector: the lesson the room is watching, alone and in large type, for a second window the presenter
puts on the room's screen (its title, what to look for and the question, its chart, its before/after numbers).

A page of its own on the same app (gradio's Blocks.route, at /projector): the same server, queue, share link and
gate as the main page, none of its tabs, controls or chat; it only reads what the caller gives (`ProjectorView`).
"""
from __future__ import annotations

import hashlib
import html
from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr
from gradio.components.plot import PlotData
from gradio.context import get_blocks_context

from viz.figures import to_json

from .access import audience
from .lessons_tab import look_for
from .page_events import quiet_progress

PROJECTOR_PATH = "projector"
PLOT_HEIGHT = 560  # px: a chart read from the back of a room; the figure's own height when that is larger
PLOT_FONT = 18  # px, every label of the chart without a size of its own (plotly's default is 12)
PLOT_TITLE_FONT = 26

# Scoped by gradio to the wrapper gr.HTML (its css_template is nested under the component's own id), so none of
# it reaches another page. In rem, so the browser's zoom (Ctrl +) still scales it for a bigger room. Plotly's zoom
# and pan toolbar is left out: nobody at a projector uses it, and it pops up wherever the pointer rests.
TITLE_CSS = "font-size: 3rem; font-weight: 700; line-height: 1.15; margin: 0.5rem 0;"  # on the title's own box
PROJECTOR_CSS = """
padding: 0 1rem;
#projector-phase .prose { font-size: 1.6rem; }
#projector-text .prose { font-size: 1.75rem; line-height: 1.45; }
#projector-numbers .prose { font-size: 1.6rem; }
#projector-numbers table { font-size: 1.6rem; }
#projector-chart .modebar-container { display: none; }
"""


@dataclass(frozen=True)
class ProjectorView:
    """What the projector shows. `title` is plain text (escaped here); `text`, `numbers` and `phase` are Markdown
    the caller has already made safe (room.plain on anything from outside)."""
    title: str
    text: str = ""  # what to look for, and the question for the room
    numbers: str = ""  # the before/after table, once measured
    chart: dict | None = None  # a plotly figure spec (viz.figures)
    phase: str = ""  # one line: where the lesson is (before / after the switch)


WAITING = ProjectorView("Waiting for the presenter to start a lesson")


def projector_figure(spec: dict) -> dict:
    """The chart for a projector: taller and in larger type than on a laptop's page (a copy; the spec is shared
    with every other page)."""
    layout = dict(spec.get("layout") or {})
    layout["height"] = max(PLOT_HEIGHT, layout.get("height") or 0)
    layout["font"] = {**(layout.get("font") or {}), "size": PLOT_FONT}
    title = layout.get("title")
    if isinstance(title, str):
        title = {"text": title}
    if isinstance(title, dict):
        layout["title"] = {**title, "font": {**(title.get("font") or {}), "size": PLOT_TITLE_FONT}}
    return {**spec, "layout": layout}


OUTPUT_KEYS = ("title", "phase", "text", "numbers", "chart")


def projector_values(view: ProjectorView | None, sent: dict) -> tuple:
    """The projector's five values (OUTPUT_KEYS' order) as the page is sent them: gr.skip() for each the window
    already shows. `sent`: that window's record (key -> a digest of what it was sent), updated. A chart sent
    again is mounted afresh by gradio: on a projector, a flicker every second."""
    view = view or WAITING
    chart = (None if view.chart is None
             else PlotData(type="plotly", plot=to_json(projector_figure(view.chart))).model_dump())
    values = (f"<div>{html.escape(view.title)}</div>", view.phase, view.text, view.numbers, chart)
    out = []
    for key, value in zip(OUTPUT_KEYS, values, strict=True):
        digest = hashlib.sha1(repr(value).encode()).hexdigest()
        out.append(gr.skip() if sent.get(key) == digest else value)
        sent[key] = digest
    return tuple(out)


def build_projector(demo: gr.Blocks, parts: Callable[[], ProjectorView | None], every_s: float = 1.0,
                    path: str = PROJECTOR_PATH) -> dict:
    """Adds the projector page to the built page `demo`, at /`path`. Call it before access.guard, last: components
    made after it would land on the projector's page. `parts()`: what to show, asked every `every_s` seconds by
    each open projector window (None: the waiting line)."""
    if get_blocks_context() is not None:
        raise ValueError("build_projector(demo, ...) goes after the `with gr.Blocks() as demo:` block: gradio adds "
                         "a page (Blocks.route) only outside it")
    # with a second page, gradio puts a "Home" bar on top of the main page unless a mounted Navbar tells it not to:
    # "hidden", not False (a component that is not visible is never mounted)
    with demo:
        gr.Navbar(visible="hidden")
    with demo.route("Projector", path, show_in_navbar=False):
        gr.Navbar(visible="hidden")
        # the children sit inside this gr.HTML, so its scoped css_template styles them all
        with gr.HTML(html_template="<div>@children</div>", css_template=PROJECTOR_CSS, js_on_load=None,
                     elem_id="projector", padding=False):
            title = gr.HTML(css_template=TITLE_CSS, js_on_load=None, elem_id="projector-title")
            phase = gr.Markdown(elem_id="projector-phase")
            with gr.Row(equal_height=False):
                with gr.Column(scale=2):
                    text = gr.Markdown(elem_id="projector-text")
                    numbers = gr.Markdown(elem_id="projector-numbers")
                with gr.Column(scale=3):
                    plot = gr.Plot(show_label=False, elem_id="projector-chart")
        sent = gr.State({})  # what this window was sent last
        timer = gr.Timer(every_s)
        outputs = [title, phase, text, numbers, plot, sent]

        @audience
        def show(already: dict):
            now = dict(already)
            return (*projector_values(parts(), now), now)

        # registered inside the route: an event belongs to the page it was registered on. At once when the window
        # opens, then with its own timer (the main page's clock is that page's)
        demo.load(show, sent, outputs, show_progress="hidden", postprocess=False, api_visibility="private")
        timer.tick(show, sent, outputs, concurrency_limit=4, show_progress="hidden", postprocess=False,
                   api_name="projector", api_visibility="private")
    quiet_progress(demo, sent)  # this page's events, as the main page's are
    return {"path": f"/{path}", "outputs": outputs, "timer": timer}


def lesson_view(runner) -> ProjectorView | None:
    """The running lesson of a LessonRunner as the projector shows it (None while none runs)."""
    run = runner.run
    if run is None:
        return None
    return ProjectorView(title=run.lesson.title, text=look_for(run.lesson),
                         numbers=runner.result_table(run.result) if run.result else "",
                         chart=runner.chart(run.lesson), phase=runner.phase_line())
