"""Layering contracts (pyproject's [tool.importlinter]) checked by import-linter on a staged copy of the tree.

import-linter's graph builder (grimp) cannot walk setuptools' editable namespace mapping, so the code folders
are copied under a plain `kvserve/` package in a temp dir (operator/ gets an __init__.py there: inside
`kvserve/` it cannot shadow the stdlib). A control run injects one forbidden import and must fail.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# kvserve.<name> -> its folder, as pyproject's package-dir maps them (kernels live in kvkernels/: a top-level
# `kernels/` would shadow the PyPI `kernels` package that transformers imports).
FOLDERS = {"runtime": "runtime", "kernels": "kvkernels", "operator": "operator", "cli": "cli"}


def _stage(tmp_path: pathlib.Path) -> pathlib.Path:
    pkg = tmp_path / "kvserve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, folder in FOLDERS.items():
        shutil.copytree(ROOT / folder, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
        (pkg / name / "__init__.py").touch()
    return pkg


def _lint(staged_root: pathlib.Path) -> subprocess.CompletedProcess:
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(staged_root)}
    return subprocess.run(
        [str(lint), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=staged_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_layering_contracts_hold(tmp_path):
    _stage(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_forbidden_import_breaks_the_contract(tmp_path):
    pkg = _stage(tmp_path)
    spec = pkg / "operator" / "spec.py"
    spec.write_text(spec.read_text() + "\nfrom kvserve.runtime.executor import kv_sizing  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0 and "operator-seams" not in result.stderr
    assert "BROKEN" in result.stdout and "kvserve.runtime.executor" in result.stdout


def test_operator_modules_import_without_torch():
    code = (
        "import sys; import kvserve.runtime.planner.kv_plan, kvserve.operator.render, kvserve.operator.spec, "
        "kvserve.operator.status, kvserve.cli.plan; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _import_cycles(staged_root: pathlib.Path, depth: int | None = None) -> list[list[str]]:
    """Strongly connected components (size > 1) of the import graph, function-level imports included: each is
    a set of modules that import each other in a circle. depth: draw the graph between name prefixes of that
    many parts instead of modules -- depth 3 makes every folder under kvserve.<x> one node
    (kvserve.runtime.engine) and leaves each top-level module its own (kvserve.runtime.config)."""
    code = r"""
import json, sys
import grimp
graph = grimp.build_graph("kvserve")
depth = json.loads(sys.argv[1])
node = (lambda m: m) if depth is None else (lambda m: ".".join(m.split(".")[:depth]))
edges = {}
for m in graph.modules:
    for i in graph.find_modules_directly_imported_by(m):
        if i in graph.modules and node(i) != node(m):
            edges.setdefault(node(m), set()).add(node(i))
modules = sorted({node(m) for m in graph.modules})
edges = {m: sorted(edges.get(m, ())) for m in modules}
sys.setrecursionlimit(100000)
index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on_stack.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on_stack.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            out.append(sorted(comp))
for m in modules:
    if m not in index:
        visit(m)
print(json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": str(staged_root)}
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(depth)],
        cwd=staged_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)


def test_no_import_cycle_between_modules(tmp_path):
    _stage(tmp_path)
    assert _import_cycles(tmp_path) == []


def test_an_import_cycle_is_found(tmp_path):
    pkg = _stage(tmp_path)
    errors = pkg / "runtime" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _f():\n    from kvserve.runtime import config  # noqa\n")
    assert any("kvserve.runtime.errors" in cycle for cycle in _import_cycles(tmp_path))


def test_no_import_loop_between_packages(tmp_path):
    """Folders import each other one way only: a loop between packages (engine -> executor -> engine) means
    a feature's files sit on several floors, even when no two modules import each other."""
    _stage(tmp_path)
    assert _import_cycles(tmp_path, depth=3) == []


def test_a_package_loop_is_found(tmp_path):
    """No module-level cycle, but the executor reaching back up into the engine closes a package loop."""
    pkg = _stage(tmp_path)
    kv_sizing = pkg / "runtime" / "executor" / "kv_sizing.py"
    kv_sizing.write_text(
        kv_sizing.read_text() + "\n\ndef _f():\n    from kvserve.runtime.engine import step_log  # noqa\n"
    )
    assert _import_cycles(tmp_path) == []
    cycles = _import_cycles(tmp_path, depth=3)
    assert any({"kvserve.runtime.engine", "kvserve.runtime.executor"} <= set(cycle) for cycle in cycles), cycles
