"""The package's shape (docs/architecture.md): no import cycle, stages that import only the stages
below them, no module over 500 lines.

Imports are read from the source (``ast``), every one of them: a function-level import or one under
``if TYPE_CHECKING:`` that closes a cycle is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ort_trainer"
MAX_LINES = 500

# The graph package's stages, lowest first: a stage imports only its own modules and lower stages.
GRAPH_STAGES = [
    ("names", "onnx_graph", "cache", "job"),  # shared names, ONNX helpers, the cache, the job and its types
    ("export",),  # torch -> forward program / ONNX: export, guard, traced program, op record, input checks
    ("passes",),  # graph rewrites (they know ONNX and the names only)
    ("gradient",),  # the GradientSource seam and its two sources (they run the passes)
    ("optimizer",),  # the optimizer graph and its plan
    ("pipeline",),  # sees every stage below through the job's source
    ("eval_graphs",),  # the eval graphs of the training graphs, or built alone
    ("shapes",),  # which graphs serve which input shapes
]
# What the graph package may use from the rest of ort_trainer: nothing above it.
GRAPH_MAY_IMPORT = {"ort_trainer._logging", "ort_trainer._temporaries", "ort_trainer._version",
                    "ort_trainer.model_desc", "ort_trainer.optim.config",
                    "ort_trainer._cache_root",
                    "ort_trainer.kernels",  # (the kernel library, below everything: _logging and _cache_root only)
                    "ort_trainer.kernels.standard_ctc",  # (its CTC operator in standard ONNX operators: onnx only)
                    "ort_trainer.kernels.standard_lstm"}  # (its LSTM layers as ONNX's LSTM: onnx only)
# Outside the graph package: module -> modules it must not import (directly).
FORBIDDEN = {
    "ort_trainer.sessions": {"ort_trainer.engine", "ort_trainer.update", "ort_trainer.trainer"},
    "ort_trainer.update": {"ort_trainer.engine", "ort_trainer.trainer"},
    "ort_trainer.engine": {"ort_trainer.trainer"},
}


def modules() -> dict[str, Path]:
    """``{dotted name: path}`` of every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, every import statement counted."""
    edges = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # a submodule by name, else a name defined in ``module`` (a package's ``__init__``)
                candidates = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in mods and "." in candidate:
                    candidate = candidate.rpartition(".")[0]
                if candidate in mods and candidate != name:
                    targets.add(candidate)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def graph_stage(module: str) -> int | None:
    """The rank of a module of ``ort_trainer.graph`` in ``GRAPH_STAGES`` (None: the package itself)."""
    parts = module.split(".")
    if parts[:2] != ["ort_trainer", "graph"] or len(parts) == 2:
        return None
    for rank, stage in enumerate(GRAPH_STAGES):
        if parts[2] in stage:
            return rank
    raise AssertionError(f"{module} is in no stage of GRAPH_STAGES: add it to docs/architecture.md and here")


def test_the_cycle_finder_finds_cycles():
    # a lazy import closing a loop is one: the finder sees edges only, however they were written
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_and_type_checking_imports_count(tmp_path, monkeypatch):
    package = tmp_path / "ort_trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from .high import g  # dodges a cycle at import time\n")
    (package / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import low\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    assert cycles(imports(modules())) == [["ort_trainer.high", "ort_trainer.low"]]


def test_no_import_cycles():
    found = cycles(imports(modules()))
    assert not found, "import cycles (lazy and TYPE_CHECKING imports count): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_graph_stages_import_only_lower_stages():
    edges = imports(modules())
    upward = []
    for module, targets in edges.items():
        if not module.startswith("ort_trainer.graph"):
            continue
        for target in targets:
            if target.startswith("ort_trainer.graph"):
                a, b = graph_stage(module), graph_stage(target)
                if a is not None and b is not None and b > a:
                    upward.append(f"{module} -> {target}")
            elif target not in GRAPH_MAY_IMPORT:
                upward.append(f"{module} -> {target} (outside the graph package)")
    assert not upward, "imports that climb a stage: " + ", ".join(sorted(upward))


def test_forbidden_imports_outside_the_graph_package():
    edges = imports(modules())
    wrong = [f"{m} -> {t}" for m, banned in FORBIDDEN.items() for t in edges[m] if t in banned]
    wrong += [f"{m} -> {t}" for m, ts in edges.items() if m.startswith("ort_trainer.comm")
              for t in ts if t in {"ort_trainer.distributed", "ort_trainer.trainer"}]
    assert not wrong, ", ".join(wrong)


def test_graph_package_top_level_stays_small():
    top = sorted(p.stem for p in (PACKAGE / "graph").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 8, f"graph/ has {len(top)} modules at its top level: {top}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES}): split it"


def test_every_package_directory_is_installed():
    # find_packages (setup.py) skips a directory without __init__.py: its modules would be missing
    # from an installed wheel while an editable install still finds them
    missing = [str(d.relative_to(PACKAGE.parent)) for d in PACKAGE.rglob("*") if d.is_dir()
               and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not missing, f"package directories without __init__.py: {missing}"
