"""Packaging: every code folder is in pyproject's explicit package list, nothing shadows the stdlib,
and the pure layers import without torch."""

from __future__ import annotations

import os
import subprocess
import sys

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_code_folder_is_a_listed_package():
    setup = _pyproject()
    mapping, packages = setup["package-dir"], set(setup["packages"])
    for package, folder in mapping.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if not any(f.endswith(".py") for f in filenames):
                continue
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            name = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            assert name in packages, f"{dirpath} holds Python code but {name} is not in pyproject packages"


def test_operator_folder_does_not_shadow_stdlib():
    assert not os.path.exists(os.path.join(ROOT, "operator", "__init__.py"))
    # From the repo root (cwd on sys.path, as `python -c` does), the stdlib module must still win.
    code = "import operator, collections; assert hasattr(operator, 'itemgetter'); print(operator.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "site-packages" not in out.stdout and ROOT not in out.stdout


def test_scheduling_layer_imports_without_torch():
    code = (
        "import sys; import kvserve.runtime.core.scheduler, kvserve.runtime.core.kv_cache_manager, "
        "kvserve.runtime.core.block_pool, kvserve.runtime.core.outputs, kvserve.runtime.request, kvserve.runtime; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
