"""The vLLM peer's venv for `kvserve bench peer`: where it is, whether it can run vllm, and the environment its
processes get (never this project's packages). vLLM is never a kvserve dependency (tools/make_peer_venv.sh)."""

from __future__ import annotations

import os
import subprocess

MAKE_VENV_SCRIPT = "tools/make_peer_venv.sh"


PEER_MISSING_EXIT = 2


def default_peer_venv() -> str:
    return os.environ.get("KVSERVE_PEER_VENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvserve", "peer-venv"
    )


class PeerMissing(Exception):
    """The vLLM peer venv is absent or has no vllm; str() is the one line to print."""


def peer_missing_message(venv: str, why: str) -> str:
    return (
        f"kvserve bench peer: vLLM peer venv not usable at {venv} ({why}); create it with "
        f"{MAKE_VENV_SCRIPT} [DIR] (default {default_peer_venv()}) or pass --peer-venv DIR"
    )


def peer_python(venv: str) -> str:
    """The peer venv's python, after checking that it can find vllm (a spec lookup: no vllm import)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        raise PeerMissing(peer_missing_message(venv, "no bin/python"))
    probe = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=60,
        env=peer_env({}),
    )
    if probe.returncode != 0:
        raise PeerMissing(peer_missing_message(venv, "vllm is not installed there"))
    return python


def peer_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without what would make the peer's python import this project's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env
