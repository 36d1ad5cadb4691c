"""`/v1/load_lora_adapter` from a model-source URI: `lora_path` may be a local directory (as in vLLM) or any
URI kvserve's model sources understand -- hf://ORG/NAME[@REV], s3://BUCKET/PREFIX, file:///PATH.

A remote adapter is downloaded by the API server that took the request, on a pool thread (never the event
loop, never the engine core's step loop or its utility thread, which answers /v1/models meanwhile), with
the same resumable, verified, atomic download as `kvserve download --adapter` (runtime/sources), into
`--lora-download-dir`/<cache key of the URI>; the engine core then loads that directory like a local one.
A URI already downloaded there is reused. Credentials come from the server's environment (HF_TOKEN,
HF_ENDPOINT, AWS_*), as for the init containers. pvc:// is refused: a claim is mounted by the operator at
start-up, not at run time.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from kvserve.runtime.lora.errors import LoraRequestError
from kvserve.runtime.sources import download, uri

FIELD = "lora_path"
# A few at once: one slow download must not hold back another adapter's, and each is network-bound.
_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvserve-lora-download")


def default_download_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kvserve", "lora")


async def local_path(lora_path: str, download_dir: str | None) -> str:
    """The local directory to load `lora_path` from, downloading a remote URI first. LoraRequestError naming
    `lora_path` for a bad URI, a pvc:// one, or a failed download."""
    if "://" not in lora_path:
        return lora_path  # a local directory, as vLLM takes it (the core checks that it exists)
    try:
        source = uri.parse(lora_path, field=FIELD)
    except uri.SourceError as exc:
        raise LoraRequestError(400, FIELD, "invalid_lora_path", str(exc)) from None
    if source.scheme == "file":
        return source.path
    if source.scheme == "pvc":
        raise LoraRequestError(
            400,
            FIELD,
            "invalid_lora_path",
            f"{FIELD}: {lora_path!r}: a pvc:// claim is mounted at pod start-up (spec.adapters), not at run "
            "time; give the mounted folder as a path or file:///PATH",
        )
    dest = os.path.join(download_dir or default_download_dir(), uri.cache_key(source))
    loop = asyncio.get_running_loop()
    try:
        result = await loop.run_in_executor(_pool, lambda: download.download(source, dest, adapter=True))
    except uri.FetchError as exc:
        # Retryable (a dropped connection, a 5xx): the store is at fault, try again; else (not found,
        # forbidden): the request is.
        status = 503 if exc.retryable else 400
        raise LoraRequestError(status, FIELD, "lora_download_failed", f"{FIELD}: {lora_path}: {exc}") from None
    return str(result.dest)
