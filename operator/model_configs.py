"""I/O for planning a model outside the catalog: read the credentials Secret, fetch only the model's
config.json from its hf:// or s3:// source, and remember it so the resync does not hit the hub every minute.

A commit-pinned hf:// revision never changes, so its config is kept for the operator's lifetime; anything
else (a branch, an S3 prefix) is re-read after CONFIG_TTL_SECONDS. Failures are not remembered: the next
reconcile (at most one resync later) tries again.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time

from kvserve.operator import kube
from kvserve.operator.spec import SpecError, model_source
from kvserve.runtime.sources import model_config
from kvserve.runtime.sources import uri as source_uri

log = logging.getLogger("kvserve.operator")
CONFIG_TTL_SECONDS = float(os.environ.get("KVSERVE_MODEL_CONFIG_TTL_SECONDS", "600"))
_cache: dict[tuple, tuple[float, dict]] = {}
_cache_lock = threading.Lock()


def credentials(namespace: str, secret_name: str | None) -> dict[str, str]:
    if not secret_name:
        return {}
    secret = kube.get("Secret", namespace, secret_name)
    if secret is None:
        raise SpecError(
            "CredentialsNotFound",
            f"the Secret {secret_name!r} named by spec.model.credentials.secretRef does not exist",
        )
    out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    out.update(secret.get("stringData") or {})  # the emulator (and a create without the API server) keeps it
    return out


def fetch(namespace: str, spec: dict) -> dict:
    """config.json for spec.model's source, with the Secret's credentials. Raises SpecError."""
    model_spec = spec["model"]
    source = model_source(model_spec)
    secret = ((model_spec.get("credentials") or {}).get("secretRef") or {}).get("name")
    creds = credentials(namespace, secret)
    key = (namespace, str(source), secret, tuple(sorted(creds.items())))
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
    pinned = source.scheme == "hf" and source_uri.COMMIT_RE.match(source.revision or "")
    if hit is not None and (pinned or now - hit[0] < CONFIG_TTL_SECONDS):
        return hit[1]
    try:
        config = model_config.fetch_config(source, creds)
    except (source_uri.FetchError, source_uri.SourceError) as exc:
        raise SpecError("ModelConfigUnavailable", f"cannot read the model's config.json to plan it: {exc}") from None
    log.info(
        "%s: planning %s from its config.json (%s)", namespace, source, ", ".join(config.get("architectures") or [])
    )
    with _cache_lock:
        _cache[key] = (now, config)
    return config
