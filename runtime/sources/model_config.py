"""A source's backend, and its config.json alone: what the operator plans a non-catalog model from (it never
downloads weights). Torch-free: a seam the operator may import (pyproject's import-linter contracts)."""

from __future__ import annotations

import json

from kvserve.runtime.sources.remote import Backend
from kvserve.runtime.sources.uri import FetchError, ModelURI, SourceError


def backend(source: ModelURI, credentials: dict[str, str] | None = None, timeout_s: float = 30.0) -> Backend:
    """`credentials`: the Secret's keys (HF_TOKEN, HF_ENDPOINT, AWS_*); None: this process's environment.
    `timeout_s`: connect timeout (reads get at least 60 s; the operator passes less, see fetch_config)."""
    if source.scheme == "hf":
        from kvserve.runtime.sources.hub import HubBackend

        creds = credentials or {}
        if credentials is None:
            import os

            creds = {k: os.environ[k] for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT") if k in os.environ}
        return HubBackend(
            source,
            token=creds.get("HF_TOKEN") or creds.get("HUGGING_FACE_HUB_TOKEN"),
            endpoint=creds.get("HF_ENDPOINT"),
            timeout_s=timeout_s,
        )
    if source.scheme == "s3":
        from kvserve.runtime.sources.s3 import S3Backend

        return S3Backend(source, credentials, timeout_s=timeout_s)
    if source.scheme == "file":
        from kvserve.runtime.sources.local import LocalBackend

        return LocalBackend(source)
    raise SourceError(
        "uri",
        f"{source.scheme}:// is mounted, not fetched: the operator mounts the claim read-only "
        "into the engine pod, so there is nothing to download (use file:///PATH for a folder "
        "that is already mounted)",
    )


def fetch_config(source: ModelURI, credentials: dict[str, str] | None = None, timeout_s: float = 10.0) -> dict:
    """The model's config.json as a dict. Raises FetchError (unreachable, auth, missing) or SourceError.
    A short timeout: the operator fetches inside a reconcile, which must not hang on an unreachable hub."""
    raw = backend(source, credentials, timeout_s=timeout_s).read_file("config.json")
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise FetchError(f"{source}: config.json is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise FetchError(f"{source}: config.json is not a JSON object")
    return config
