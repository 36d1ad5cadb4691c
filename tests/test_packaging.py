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


def test_no_code_folder_shadows_an_installed_package():
    # `python -m pytest`, `python -c` and `python -m kvserve...` from a checkout put the repo root first on
    # sys.path, so a folder there named like an installed distribution's module wins over it. transformers
    # 5.25 requires the PyPI `kernels` package and imports it; a top-level `kernels/` broke every
    # `import peft` from the repo root (CI, stop 33). Our kernels therefore live in kvkernels/.
    from importlib.metadata import packages_distributions

    installed = packages_distributions()
    for folder in _pyproject()["package-dir"].values():
        if os.path.exists(os.path.join(ROOT, folder, "__init__.py")):
            assert folder not in installed, f"{folder}/ shadows {installed[folder]}'s top-level module"


def test_transformers_imports_from_the_repo_root():
    code = "import transformers.modeling_utils, transformers.integrations.hub_kernels"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)


def test_the_server_extra_is_light():
    """Issue 26: users who only serve install `.[server]`: the runtime and the HTTP stack, without test, operator,
    benchmark or Triton dependencies (Triton's bindings are what print nanobind's leak lines at exit)."""
    import re

    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]

    def closure(name: str) -> set[str]:
        out: set[str] = set()
        for req in extras[name]:
            own = re.fullmatch(r"kvserve\[([a-z,]+)\]", req)
            if own:
                for sub in own.group(1).split(","):
                    out |= closure(sub)
            else:
                out.add(re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0].lower())
        return out

    served = closure("server")
    assert {"torch", "fastapi", "uvicorn", "xgrammar"} <= served
    heavy = {"pytest", "kopf", "kubernetes", "triton", "moto", "peft", "matplotlib", "openai", "hypothesis"}
    assert not served & heavy, served & heavy
    assert "kopf" in closure("dev")  # the check sees through kvserve[...] self-references
