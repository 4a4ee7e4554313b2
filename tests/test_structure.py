"""The package's shape: layering, import cycles and function length.

These rules guard the design, not line counts: imports only run downward through the layers;
no two modules import each other (nor any longer cycle); and no function is over 80 lines, so
each does one job that can be read at once. Modules have no line cap: a module is as long as
its one job needs. Everything is read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "deltastore"
MAX_FUNCTION_LINES = 80
"""From ``def`` to the last line, docstring included."""

LAYERS = {
    "errors": 0,
    "progress": 0,
    "gc_pause": 0,
    "format": 1,
    "codecs": 1,
    "storage": 2,
    "trust": 2,
    "hooks": 3,
    "pull": 3,
    "publish": 4,
    "replicate": 4,
    "engines": 5,
    "testing": 6,
    "cli": 7,
}
"""Rank of each top-level room; a module imports only rooms of a lower rank (or its own).
``engines`` (driving inference engines) sits on pull and publish. ``testing`` (servers,
fault proxy, conformance classes) and ``cli`` sit on top: both may use the public API
(``deltastore/__init__.py``), and the CLI's ``emulate`` starts the testing servers."""

# Files other branches are changing right now; the coordinator empties these after merging.
FUNCTION_LENGTH_ALLOWED: dict[str, str] = {}
CYCLE_ALLOWED: dict[str, str] = {}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Internal modules ``name`` imports, at any depth of its code (type-only imports too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in modules else base)
        deps.update(t for t in targets if t in modules and t != name)
    return deps


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _relative(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _long_functions(source: str, where: str) -> dict[str, int]:
    long: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long[f"{where}:{node.name}"] = length
    return long


def test_no_function_over_80_lines() -> None:
    long: dict[str, int] = {}
    for path in _modules().values():
        long.update(_long_functions(path.read_text(), _relative(path)))
    over = {k: v for k, v in long.items() if k not in FUNCTION_LENGTH_ALLOWED}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}; split them by job"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other() -> None:
    graph = _graph()
    pairs = sorted(
        f"{a} <-> {b}"
        for a, deps in graph.items()
        for b in deps
        if a < b and a in graph.get(b, set())
    )
    assert [p for p in pairs if p not in CYCLE_ALLOWED] == []


def test_no_import_cycle() -> None:
    cycles = [" -> ".join(c) for c in _cycles(_graph())]
    assert [c for c in cycles if c not in CYCLE_ALLOWED] == []


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_imports_run_down_the_layers() -> None:
    upward = []
    for module, deps in _graph().items():
        room = _room(module)
        if room is None or room in ("__main__",):
            continue  # the package root is the public API: it may gather from every room
        for dep in deps:
            target = _room(dep)
            if target is None:
                if LAYERS[room] < LAYERS["testing"]:
                    upward.append(f"{module} -> {dep} (the public API)")
                continue
            if target != room and LAYERS[target] >= LAYERS[room]:
                upward.append(f"{module} -> {dep}")
    assert sorted(upward) == []


def test_the_checks_can_fail() -> None:
    """The cycle finder and the function measure see what they are meant to see."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert set(LAYERS) >= {p.name for p in PACKAGE.iterdir() if p.is_dir() and "_" not in p.name}
    long = "def f():\n" + "    x = 1\n" * 80
    assert _long_functions(long, "m.py") == {"m.py:f": 81}
    assert _long_functions(long.replace("    x = 1\n", "", 1), "m.py") == {}
