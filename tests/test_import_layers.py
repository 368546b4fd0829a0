"""The import layers hold: no import cycle among ``batchscope`` and ``runtime`` modules,
``batchscope`` never imports ``runtime``, and ``app.py`` (the dashboard) imports only
``batchscope``.

The graph is read from the source files with ``ast``, so it holds every import a module
can make, also those inside functions (imported on first use) that a plain ``import``
would not run. A cycle among those is an import circle all the same: it only waits for
the function to run first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("batchscope", "runtime")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the two packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules that ``path`` (module ``name``) imports anywhere in its source:
    ``from a.b import c`` counts as ``a.b.c`` when that is a module, else as ``a.b``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imports_of(path, name, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_imports_inside_functions():
    """The reader finds a function-level import (the kind that hides a cycle)."""
    graph = import_graph()
    assert "batchscope.storage.records" in graph["batchscope.storage.recorder"]
    assert "runtime.device.process" in graph["runtime.engine.engine"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_project_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, ("import cycle: " + " -> ".join(cycle or [])
                           + "; move what both sides need into a module both can import")


def test_batchscope_never_imports_runtime():
    bad = {name: sorted(t for t in targets if t.split(".")[0] == "runtime")
           for name, targets in import_graph().items() if name.split(".")[0] == "batchscope"}
    bad = {name: targets for name, targets in bad.items() if targets}
    assert not bad, f"batchscope modules import runtime (the dependency goes the other way): {bad}"


def test_the_dashboard_imports_only_batchscope():
    path = ROOT / "app.py"
    modules = project_modules()
    known = set(modules) | {"app"}
    targets = imports_of(path, "app", known)
    assert any(t.startswith("batchscope") for t in targets)
    assert not [t for t in targets if t.split(".")[0] == "runtime"], \
        f"app.py imports runtime modules: {sorted(targets)}"


def test_importing_all_of_batchscope_loads_no_runtime_module():
    """The same rule at run time, in a fresh interpreter: dynamic imports count too."""
    names = sorted(n for n in project_modules() if n.split(".")[0] == "batchscope")
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'runtime'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing batchscope loaded: {out.stdout.strip()}"
