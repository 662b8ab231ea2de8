"""The package's floors: every import (module-level or inside a function) goes to a lower floor or
stays in its own room, and no modules import each other in a circle.

The floor map is the architecture in one table: a new room must be placed here, and an import
that runs back up fails with the edge that does it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import gradloc_track

PACKAGE = Path(gradloc_track.__file__).parent

FLOORS: dict[str, int] = {
    # 0: utilities that know nothing of the others
    "_optional": 0, "_moved": 0, "protocols": 0, "grouping": 0, "traffic": 0, "tensor_memory": 0,
    "text": 0, "_lazy": 0, "optim_unwrap": 0, "units": 0,
    # 1: configs and the fused norms
    "config": 1, "norms": 1,
    # 2: the computations and the destinations, independent of each other
    "clip": 2, "spikes": 2, "trackers": 2, "adamc": 2,
    # 3: the localizer (reads a SpikeContext)
    "localizer": 3,
    # 4: what a spike leaves behind; what a run dir is
    "artifacts": 4, "run_dirs": 4,
    # 5: the monitor that runs them all; readers of what they wrote; the console
    "monitor": 5, "data": 5, "report": 5, "console": 5,
    # 6: the front doors and the ledger across runs
    "integrations": 6, "ledger": 6,
    # 7: applications
    "demo": 7, "cli": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports (``from x import y`` counts ``x.y`` when that is a module)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in MODULES else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's own __init__


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in MODULES} - {None}
    assert rooms <= set(FLOORS), f"place these rooms in FLOORS: {sorted(rooms - set(FLOORS))}"


def test_no_import_runs_up_or_sideways():
    bad = []
    for src, targets in GRAPH.items():
        a = _room(src)
        for dst in targets:
            b = _room(dst)
            if a is None or b is None or a == b:
                continue
            if FLOORS[b] >= FLOORS[a]:
                bad.append(f"{src} (floor {FLOORS[a]}) imports {dst} (floor {FLOORS[b]})")
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    """Tarjan's strongly connected components over module imports (package ``__init__`` re-exports left out)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if MODULES[w].name == "__init__.py":
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index and MODULES[v].name != "__init__.py":
            visit(v)
    assert not circles, circles


def test_the_checker_sees_function_level_imports():
    """The monitor imports the localizer only inside a function (on a spike): still an edge."""
    assert "gradloc_track.localizer" in GRAPH["gradloc_track.monitor.responder"]
