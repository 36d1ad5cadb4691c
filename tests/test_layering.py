"""Layering contracts (pyproject's [tool.importlinter]) checked by import-linter on a staged copy of the tree.

import-linter's graph builder (grimp) cannot walk setuptools' editable namespace mapping, so the code folders
are copied under a plain `kvserve/` package in a temp dir (operator/ gets an __init__.py there: inside
`kvserve/` it cannot shadow the stdlib). A control run injects one forbidden import and must fail.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "kernels", "operator", "cli")


def _stage(tmp_path: pathlib.Path) -> pathlib.Path:
    pkg = tmp_path / "kvserve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, pkg / folder, ignore=shutil.ignore_patterns("__pycache__"))
        (pkg / folder / "__init__.py").touch()
    return pkg


def _lint(staged_root: pathlib.Path) -> subprocess.CompletedProcess:
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(staged_root)}
    return subprocess.run([str(lint), "--no-cache", str(ROOT / "pyproject.toml")], cwd=staged_root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layering_contracts_hold(tmp_path):
    _stage(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_forbidden_import_breaks_the_contract(tmp_path):
    pkg = _stage(tmp_path)
    planner = pkg / "operator" / "planner.py"
    planner.write_text(planner.read_text() + "\nfrom kvserve.runtime.worker import kv_sizing  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0 and "operator-seams" not in result.stderr
    assert "BROKEN" in result.stdout and "kvserve.runtime.worker" in result.stdout


def test_operator_modules_import_without_torch():
    code = ("import sys; import kvserve.operator.planner, kvserve.operator.render, kvserve.operator.spec, "
            "kvserve.operator.status, kvserve.cli.plan; "
            "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
