"""How a page's own events run, set once for the whole page after its events are registered (quiet_progress): what
they mark pending, and what a timer's tick does when the last one is still on its way. An event never says so
itself: one pass, one rule for every tab's events.
"""
from __future__ import annotations

import gradio as gr


def quiet_progress(demo: gr.Blocks, marker: gr.State) -> None:
    """On `marker`'s page (the main page, or one added with Blocks.route), every event registered so far:

    - one that shows no progress, and every load, marks only `marker` as pending. gradio's frontend keeps each
      component any event ever marked and, at every status change of any event on the page (each tick's pending and
      done), finds each of them in the page's tree and copies its properties: a page that had loaded the lesson
      view, the remote tab and the tab trackers paid that for each of their outputs, twice a tick
      (docs/measurements.md, "The room in Chromium"). The page's own loads go the same way (their outputs are on
      tabs not shown yet); what a visitor starts (a button's spinner) keeps its progress.
    - a timer's tick that comes while the last is on its way runs as soon as that one is back (gradio's default for
      a timer drops it): how soon a page agrees with the engine is one period plus one round trip at most, where a
      round trip just over the period had doubled it.
    """
    for fn in demo.fns.values():
        if fn.page != marker.page:
            continue
        if any(event == "tick" for _, event in fn.targets):
            fn.trigger_mode = "always_last"
        loads = all(event == "load" for _, event in fn.targets)
        if (fn.show_progress == "hidden" or loads) and fn.show_progress_on is None and fn.outputs:
            fn.show_progress_on = [marker]
