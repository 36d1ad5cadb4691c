"""ruff, configured in pyproject.toml: the lint rules and the formatter both hold on the whole tree."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUFF = pathlib.Path(sys.executable).parent / "ruff"


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_is_clean():
    result = _ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = _ruff("format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_reports_a_lint_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    result = _ruff("check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad))
    assert result.returncode != 0 and "F401" in result.stdout
