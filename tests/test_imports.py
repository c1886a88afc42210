"""The layers point one way (tools/import_graph.py): no circle between folders, no arrow up a layer, nothing but
its own command line imports engine/bench, and no circle between files."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import import_graph  # noqa: E402


def test_no_circle_between_folders_and_no_arrow_up_a_layer():
    edges = import_graph.graph()
    assert import_graph.cycles(import_graph.folder_graph(edges)) == []
    assert import_graph.upward(edges) == []
    assert import_graph.cycles(edges) == []


def test_the_checker_sees_what_it_is_meant_to():
    """A circle, an upward arrow and an import of the command line, made up, are each found."""
    edges = {"engine.a": {"engine.b"}, "engine.b": {"engine.a"}, "engine.c": {"playground.x"},
             "playground.y": {"engine.bench.cli"}, "playground.x": set()}
    assert import_graph.cycles(edges) == [["engine.a", "engine.b"]]
    assert set(import_graph.upward(edges)) == {("engine.c", "playground.x"), ("playground.y", "engine.bench.cli")}
