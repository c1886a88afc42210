"""The Lessons tab: layout and wiring only (the lessons and their runs: playground/lessons.py).

Everyone sees the lesson the presenter runs. The presenter's buttons (Start, Flip now, Stop, Previous, Next)
change the shared engine, so they are not marked `audience`; reading a lesson and its record are everyone's.
"""
from __future__ import annotations

import gradio as gr

from .access import audience
from .course import METRICS, Lesson
from .lesson_record import machine_name, record_folder, record_links, write_record
from .lessons import LessonRunner
from .room import plain

TAB_ID = "lessons"
INTRO = """The course, taught live on this engine: each lesson sets the engine up, starts simulated users, flips
one switch half-way and measures before and after, **now, on this machine**. When the presenter starts a lesson,
everyone's page comes here; go and chat meanwhile (your request shows in the block table), and come back with
**Back to the lesson** at the top. For the room's screen: the [projector view](projector) (a second window: the
lesson in large type, nothing else), and **Join this session** at the top has the address and its QR code."""


LONG = 2000  # a lesson's texts are the project's own files, shown whole (and still escaped)


def look_for(lesson: Lesson) -> str:
    """What to look for and the question for the room: the Lessons tab's and the projector's."""
    return f"**Look for:** {plain(lesson.look_for, LONG)}\n\n**Question for the room:** {plain(lesson.question, LONG)}"


def lesson_text(lesson: Lesson) -> str:
    parts = [f"### {plain(lesson.title)}", plain(lesson.idea, LONG),
             f"**Workload:** {plain(lesson.workload)}, {lesson.users} simulated users · **the switch:** "
             f"{plain(lesson.describe_switch())} · **watch:** the {plain(lesson.chart)} chart",
             f"{look_for(lesson)} (the number: {plain(METRICS[lesson.metric].label)})"]
    if lesson.needs:
        measured = plain(lesson.measured, LONG)
        parts.append(f"**Needs a {lesson.needs.upper()} GPU.** Last measured: {measured}")
    return "\n\n".join(parts)


def build_lessons_tab(pg, runner: LessonRunner, serialised) -> dict:
    """Returns the components the page's clock refreshes and the follow button's target."""
    titles = [(f"{i + 1}. {x.title}", x.slug) for i, x in enumerate(runner.lessons)]
    with gr.Tab("Lessons", id=TAB_ID):
        gr.Markdown(INTRO)
        with gr.Row():
            pick = gr.Dropdown(titles, value=titles[0][1] if titles else None, label="lesson", scale=3,
                               elem_id="lesson-pick")
            start = gr.Button("Start", variant="primary", scale=1, min_width=80, elem_id="lesson-start")
            flip = gr.Button("Flip now", scale=1, min_width=80, elem_id="lesson-flip")
            stop = gr.Button("Stop", scale=1, min_width=80, elem_id="lesson-stop")
            prev = gr.Button("◀ Previous", scale=1, min_width=80, elem_id="lesson-prev")
            nxt = gr.Button("Next ▶", scale=1, min_width=80, elem_id="lesson-next")
        said = gr.Markdown(elem_id="lesson-said")
        phase = gr.Markdown(runner.phase_line(), elem_id="lesson-phase")
        with gr.Row():
            with gr.Column(scale=2):
                text = gr.Markdown(lesson_text(runner.lessons[0]) if runner.lessons else "", elem_id="lesson-text")
                numbers = gr.Markdown(elem_id="lesson-numbers")
            with gr.Column(scale=3):
                plot = gr.Plot(label="the chart to watch", show_label=False)
        with gr.Accordion("The session's record", open=False):
            gr.Markdown("Every lesson finished in this session, its before/after numbers and its chart: one "
                        "self-contained HTML page (and the same as JSON) to hand out.")
            make = gr.Button("Prepare the record", elem_id="lesson-record")
            files = gr.File(label="download", file_count="multiple", interactive=False)
            records = gr.Markdown()
        # the lesson this page has picked, kept for the page's clock: a State as the clock's input, not the dropdown
        # (every input of an event is marked pending at each tick, and a component's marker costs the browser)
        picked = gr.State(pick.value)

    def shown(slug: str | None) -> Lesson | None:
        """What this visitor's tab shows: the running lesson, else the one picked."""
        if runner.run is not None:
            return runner.run.lesson
        try:
            return runner.lessons[runner.index(slug)] if slug else None
        except ValueError:
            return None

    def parts(slug: str | None) -> tuple[str, str, str, dict | None]:
        """The view's phase line, text, numbers and the spec of the lesson's chart (the page's clock sends the
        chart only when it changed)."""
        lesson, run = shown(slug), runner.run
        result = run.result if run is not None else None
        return (runner.phase_line(), lesson_text(lesson) if lesson else "",
                runner.result_table(result) if result else "", runner.chart(lesson))

    def record_line(sent: dict):
        """The session's record, once prepared, on every page (not only the one that pressed Prepare): its links,
        sent to each page once per preparation."""
        prepared = runner.record_files
        if prepared is None or sent.get("record") == prepared[0]:
            return gr.skip()
        sent["record"] = prepared[0]
        return prepared[2]

    @audience
    def view(slug: str | None):
        *words, spec = parts(slug)
        return *words, serialised.payload(spec), slug

    @audience
    def prepare_record():
        done = len(runner.records)
        files = write_record(runner.records, machine_name(runner), record_folder())
        said = (f"The record of {done} lesson(s), on everyone's page: {record_links(files)}" if done else
                "No lesson has finished yet: the record is empty.")
        runner.record_files = (runner.record_files[0] + 1 if runner.record_files else 1, files, said)
        return files, said

    def start_lesson(slug: str | None):
        if not slug:
            return "Pick a lesson first."
        return runner.start(slug)

    pick.change(view, pick, [phase, text, numbers, plot, picked], api_name="lesson_read", postprocess=False,
                show_progress="hidden")
    start.click(start_lesson, pick, said, api_name="lesson_start")
    flip.click(runner.flip, None, said, api_name="lesson_flip")
    stop.click(runner.leave, None, said, api_name="lesson_stop")
    def walk(offset: int):
        said = runner.step(offset)
        return said, runner.run.lesson.slug if runner.run is not None else gr.skip()
    prev.click(lambda: walk(-1), None, [said, pick], api_name="lesson_previous")
    nxt.click(lambda: walk(+1), None, [said, pick], api_name="lesson_next")
    make.click(prepare_record, None, [files, records], api_name="lesson_record")
    return {"parts": parts, "pick": pick, "picked": picked, "outputs": [phase, text, numbers, plot],
            "record": record_line, "record_output": records}
