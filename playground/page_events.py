"""How a page's own events run, set once for the whole page after its events are registered: one pass, one rule
for every tab's events (an event never says so itself).
"""
from __future__ import annotations

import gradio as gr


def quiet_progress(demo: gr.Blocks, marker: gr.State) -> None:
    """On `marker`'s page (the main page, or one added with Blocks.route), every event registered so far:

    - one that shows no progress, and every load (its outputs are on tabs not shown yet), marks only `marker` as
      pending: at every status change of any event on the page, twice a tick, gradio's frontend finds every
      component any event ever marked and copies its properties (docs/measurements.md, "The room in Chromium").
      What a visitor starts (a button's spinner) keeps its progress.
    - a timer's tick that comes while the last is on its way runs as soon as that one is back (gradio's default for
      a timer drops it, so a round trip just over the period doubled how soon a page agreed with the engine).
    """
    for fn in demo.fns.values():
        if fn.page != marker.page:
            continue
        if any(event == "tick" for _, event in fn.targets):
            fn.trigger_mode = "always_last"
        loads = all(event == "load" for _, event in fn.targets)
        if (fn.show_progress == "hidden" or loads) and fn.show_progress_on is None and fn.outputs:
            fn.show_progress_on = [marker]
