"""Fixtures: the pretrained tiny model as a private repo on a local hub server (127.0.0.1), and the environment
the downloader reads (HF_ENDPOINT, no telemetry) pointed at it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvserve_testing import STORIES_DIR

from tests.sources.hub_server import HubServer, Repo

REPO_ID, TOKEN = "kvserve-test/stories260K", "hf_test_token"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return STORIES_DIR


@pytest.fixture()
def hub(stories_dir, monkeypatch):
    repo = Repo.from_folder(REPO_ID, str(stories_dir), private=True, token=TOKEN)
    repo.files["README.md"] = b"# not needed for serving\n"  # listed by the hub, never downloaded
    repo.files["original/consolidated.00.safetensors"] = b"nested weights serving does not read"
    with HubServer(repo) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield server


def serving_files(folder: Path) -> dict[str, bytes]:
    """The files of `folder` that serving reads (the original has a README.md too), by name."""
    from kvserve.runtime.sources.uri import wanted

    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and wanted(p.name)}


def subprocess_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **extra}
