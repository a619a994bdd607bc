"""The engine's layers, as the tree shows them: no module imports from a layer above its own, and no import
cycle between modules (function-level imports included). Read from the source with `ast`, nothing imported.

    foundation  errors, presets, config, stats, knobs   what every layer shares: settings, results, errors
    runtime/    members, vocab, rows, packed KV, demo models, Ray members
    shaping/    chat templates, tools, constraints, the Request and its Reply
    algorithm/  alignment, aggregation, decision, the decoding round
    engine/     the scheduler, the Ensemble facade, the lazy holder
    doors       cli/, server/, bench, eval/ (and the package's public face, __init__ / __main__)
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "safe_engine"
LAYERS = {
    "errors": 0,
    "presets": 0,
    "config": 0,
    "stats": 0,
    "knobs": 0,
    "runtime": 1,
    "shaping": 2,
    "algorithm": 3,
    "engine": 4,
    "cli": 5,
    "server": 5,
    "bench": 5,
    "eval": 5,
    "__init__": 6,
    "__main__": 6,
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The safe_engine modules `path` imports, anywhere in it, resolved to dotted names."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]  # resolved to the module below
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n == "safe_engine" or n.startswith("safe_engine.")}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for target in _imports(path):
            while target not in modules and "." in target:  # `from .x import name`: the module is x
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS["__init__"] if len(parts) == 1 else LAYERS[parts[1]]


def test_every_module_has_a_layer():
    assert all(_layer(m) >= 0 for m in _graph())


def test_no_import_runs_back_up_a_layer():
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m, targets in _graph().items()
        for t in targets
        if _layer(t) > _layer(m) and not t.endswith("__init__")
    ]
    assert upward == []


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's __init__ that re-exports its own modules is not a cycle of the code
    assert [c for c in cycles if not _reexport(c)] == []


def _reexport(cycle: str) -> bool:
    nodes = cycle.split(" -> ")
    return any(b.startswith(a + ".") for a, b in itertools.pairwise(nodes))


def test_the_checker_sees_imports():
    """Guard against a checker that finds nothing: known edges are there."""
    graph = _graph()
    assert "safe_engine.runtime.members" in graph["safe_engine.algorithm.decoding"]
    assert "safe_engine.shaping.request" in graph["safe_engine.engine.ensemble"]
    assert "safe_engine.server.app" in graph["safe_engine.cli.serve"]  # a function-level import counts
