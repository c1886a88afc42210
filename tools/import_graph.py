"""The project's own import graph, drawn from every import statement (module level, inside functions, and under
TYPE_CHECKING alike: an import a reader has to follow is an arrow), with its circles between files and between
folders, and the arrows that point up a layer (LAYER). tests/test_imports.py runs the same checks.

    python tools/import_graph.py          # prints the circles and the upward arrows; exit 1 when there are any
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "playground", "server", "viz")
# who may import whom, by the first part(s) of a module's name: an arrow from a name on the left to one on the right
# is upward (forbidden) when the right one's layer is higher
LAYER = {"app": 5, "tools": 5, "playground": 4, "server": 4, "viz": 3, "engine.bench": 3, "engine.measure": 2,
         "engine": 1}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            out[module_name(path)] = path
    out["app"] = ROOT / "app.py"
    return out


def resolve(current: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, wherever the import statement sits."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, is_package, node.level, node.module)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # a module is not said to import its own package's __init__ (python runs it first anyway)
    return {t for t in found if not name.startswith(t + ".")}


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts with more than one member (Tarjan's algorithm)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    sys.setrecursionlimit(10_000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def folder(name: str) -> str:
    """A module's folder: engine.attention.sdpa -> engine.attention; engine.engine -> engine."""
    parts = name.split(".")
    path = ROOT.joinpath(*parts)
    return name if path.is_dir() else ".".join(parts[:-1]) or name


def folder_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            fa, fb = folder(a), folder(b)
            # a folder's own modules may import its subfolders' (a package is built from its parts); the arrow that
            # matters is one running back up from a subfolder, or between sibling folders
            if fa != fb and not fb.startswith(fa + "."):
                out[fa].add(fb)
    return out


def layer(name: str) -> int:
    for prefix in sorted(LAYER, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return LAYER[prefix]
    return 0


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows to a higher layer, and any arrow into engine.bench from outside it."""
    bad = []
    for a, targets in edges.items():
        for b in targets:
            into_bench = b.startswith("engine.bench") and not a.startswith("engine.bench") and layer(a) != 5
            if layer(b) > layer(a) or into_bench:
                bad.append((a, b))
    return sorted(bad)


def main() -> int:
    edges = graph()
    files, folders, up = cycles(edges), cycles(folder_graph(edges)), upward(edges)
    for part in files:
        print("file circle:", " <-> ".join(part))
    for part in folders:
        print("folder circle:", " <-> ".join(part))
    for a, b in up:
        print(f"upward arrow: {a} -> {b}")
    print(f"{len(edges)} modules; {len(files)} file circles, {len(folders)} folder circles, {len(up)} upward arrows")
    return 1 if files or folders or up else 0


if __name__ == "__main__":
    raise SystemExit(main())
