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


def test_the_engine_does_not_know_how_it_is_replaced():
    """engine/engine.py runs one configuration: neither it nor any part it imports reaches what replaces it (the
    Reconfiguration its owner keeps, the service, LLM), and it keeps no forwards to it; swap_core is its one way in."""
    from engine.engine import LLMEngine
    edges, reached, todo = import_graph.graph(), set(), ["engine.engine"]
    while todo:  # the package's __init__ is left out: it is the public face, run first anyway, not a part
        for name in edges[todo.pop()] - reached - {"engine"}:
            reached.add(name)
            todo.append(name)
    assert reached and not reached & {"engine.reconfigure", "engine.service", "engine.llm"}
    assert not [name for name in ("reconfig", "update_config", "apply_pending", "use") if hasattr(LLMEngine, name)]
    assert callable(LLMEngine.swap_core)


def test_the_checker_sees_what_it_is_meant_to():
    """A circle, an upward arrow and an import of the command line, made up, are each found."""
    edges = {"engine.a": {"engine.b"}, "engine.b": {"engine.a"}, "engine.c": {"playground.x"},
             "playground.y": {"engine.bench.cli"}, "playground.x": set()}
    assert import_graph.cycles(edges) == [["engine.a", "engine.b"]]
    assert set(import_graph.upward(edges)) == {("engine.c", "playground.x"), ("playground.y", "engine.bench.cli")}
