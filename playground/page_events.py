"""How a page's own events run, set once for the whole page after its events are registered (quiet_progress): what
they mark pending. An event never says so itself: one pass, one rule for every tab's events.
"""
from __future__ import annotations

import gradio as gr


def quiet_progress(demo: gr.Blocks, marker: gr.State) -> None:
    """On `marker`'s page (the main page, or one added with Blocks.route), every event registered so far that shows
    no progress, and every load, marks only `marker` as pending. gradio's frontend keeps each component any event
    ever marked and, at every status change of any event on the page (each tick's pending and done), finds each of
    them in the page's tree and copies its properties: a page that had loaded the lesson view, the remote tab and
    the tab trackers paid that for each of their outputs, twice a tick (docs/measurements.md, "The room in
    Chromium"). The page's own loads go the same way (their outputs are on tabs not shown yet); what a visitor
    starts (a button's spinner) keeps its progress."""
    for fn in demo.fns.values():
        if fn.page != marker.page:
            continue
        loads = all(event == "load" for _, event in fn.targets)
        if (fn.show_progress == "hidden" or loads) and fn.show_progress_on is None and fn.outputs:
            fn.show_progress_on = [marker]
