"""Figure specs serialised to JSON once, however many tabs show them.

Every open tab's timer asks for the same cached specs each second; gradio would otherwise turn each into JSON
again per tab. And a page is sent a figure only once (unless_sent): gradio's plot mounts a fresh plotly chart for
every value it is sent, so under load a page on the Chat tab redrew the hidden dashboard's charts several times a
second (docs/measurements.md, "What one open page costs its browser"). This is the one playground module that
knows gradio's plot payload.
"""
from __future__ import annotations

import itertools

import gradio as gr
from gradio.components.plot import PlotData

from viz.figures import to_json


class SerialisedFigures:
    """spec -> PlotData, keyed by the spec object itself (the caches hand out the same object until they rebuild).
    `keep` bounds what is held: the dashboard's five charts, a view per chatting tab, step mode, ablation, compare."""

    def __init__(self, keep: int = 64) -> None:
        self._by_id: dict[int, tuple[dict, PlotData, dict, int]] = {}
        self.keep = keep
        self.serialised = 0  # how many specs were turned into JSON: the tests count it
        self._serials = itertools.count(1)  # each entry's own number, never reused (an id can be)

    def __call__(self, spec: dict | None) -> PlotData | None:
        """For an event gradio postprocesses (gr.Plot passes a PlotData through)."""
        return None if spec is None else self._get(spec)[1]

    def payload(self, spec: dict | None) -> dict | None:
        """The same, as the dict gradio sends to the page: for a polling event registered with postprocess=False,
        which then skips gradio's per-output work (a worker-thread hop, a model dump, a walk for files) per tab."""
        return None if spec is None else self._get(spec)[2]

    @staticmethod
    def unless_same(value, key: str, sent: dict):
        """`value` for one page's output `key` (a status line, a lesson's text), or gr.skip() where that page was
        sent this very value last time: each update re-renders its Markdown in every browser showing it."""
        if key in sent and sent[key] == value:
            return gr.skip()
        sent[key] = value
        return value

    def unless_sent(self, spec: dict | None, key: str, sent: dict):
        """The payload for the chart `key` of one page, or gr.skip() where that page was sent this very figure last
        time. `sent`: that page's own record (key -> the figure's number), updated here."""
        entry = None if spec is None else self._get(spec)
        serial = None if entry is None else entry[3]
        if key in sent and sent[key] == serial:
            return gr.skip()
        sent[key] = serial
        return None if entry is None else entry[2]

    def _get(self, spec: dict) -> tuple[dict, PlotData, dict, int]:
        hit = self._by_id.get(id(spec))
        if hit is None or hit[0] is not spec:  # the id of a spec since freed may be reused: check identity
            if len(self._by_id) >= self.keep:
                self._by_id.pop(next(iter(self._by_id)))
            data = PlotData(type="plotly", plot=to_json(spec))
            hit = self._by_id[id(spec)] = (spec, data, data.model_dump(), next(self._serials))
            self.serialised += 1
        return hit
