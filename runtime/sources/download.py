"""Download a model source into a folder that appears only when it is complete and verified.

Layout beside DEST (same filesystem, so the final rename is atomic):
    PARENT/.kvserve-locks/NAME.lock     flock: pods sharing a cache download a revision once; the others wait
    PARENT/.kvserve-staging/NAME/       files in progress (FILE.part) and done (FILE); kept across restarts
    PARENT/NAME/                        renamed from staging after every file is verified
    PARENT/NAME/.kvserve-complete.json  the manifest (source, commit, size and sha256 per file): completion is
                                        this file, never the folder's existence
A restarted download keeps finished files (re-hashed, not re-fetched) and resumes a .part file with a ranged
request. A staging folder for another commit (a branch that moved) is discarded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.runtime.sources.model_config import backend as open_backend
from kvserve.runtime.sources.remote import Backend, RemoteFile
from kvserve.runtime.sources.uri import FetchError, ModelURI, is_weight, missing_required

log = logging.getLogger("kvserve.download")
MARKER = ".kvserve-complete.json"
STAGING_DIR, LOCKS_DIR = ".kvserve-staging", ".kvserve-locks"
_SOURCE_FILE = ".kvserve-source.json"
MAX_ATTEMPTS = 5  # per file, for retryable failures (dropped connections, 5xx), each resuming where it stopped


@dataclass(frozen=True)
class Result:
    dest: Path
    commit: str
    num_files: int
    num_bytes: int
    fetched_bytes: int  # what this call transferred (0 when the cache already had it)
    seconds: float


def read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _check_existing(dest: Path, source: ModelURI) -> dict | None:
    marker = read_marker(dest)
    if marker is not None and marker.get("source") != str(source):
        raise FetchError(f"{dest} already holds {marker.get('source')!r}, not {str(source)!r}; choose another --dest")
    if marker is None and dest.exists() and any(dest.iterdir()):
        raise FetchError(
            f"{dest} exists but is not a completed kvserve download (no {MARKER}); remove it or choose another --dest"
        )
    return marker


class _Progress:
    def __init__(self, total_bytes: int, interval_s: float):
        self.total, self.interval_s = total_bytes, interval_s
        self.done = self.fetched = 0
        self.started = self.last = time.monotonic()

    def add(self, n: int, fetched: bool = True) -> None:
        self.done += n
        self.fetched += n if fetched else 0
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            rate = self.fetched / max(now - self.started, 1e-9)
            log.info(
                "progress: %s of %s (%.0f%%), %s/s",
                _size(self.done),
                _size(self.total),
                100.0 * self.done / max(self.total, 1),
                _size(int(rate)),
            )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _hashers(file: RemoteFile):
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {file.size}\0".encode()) if file.git_sha1 else None  # noqa: S324 - git's own id
    return sha256, git


def _hash_file(path: Path, file: RemoteFile, upto: int | None = None):
    sha256, git = _hashers(file)
    remaining = upto if upto is not None else os.path.getsize(path)
    with open(path, "rb") as f:
        while remaining > 0 and (chunk := f.read(min(1 << 20, remaining))):
            sha256.update(chunk)
            if git:
                git.update(chunk)
            remaining -= len(chunk)
    return sha256, git


class _Corrupt(FetchError):
    """The bytes are wrong (size or digest): resuming would keep them, so the attempt starts the file over."""


def _verify(file: RemoteFile, size: int, sha256, git) -> None:
    if size != file.size:
        raise _Corrupt(f"{file.path}: got {size} bytes, the source lists {file.size}", retryable=True)
    if file.sha256 and sha256.hexdigest() != file.sha256.lower():
        raise _Corrupt(
            f"{file.path}: sha256 {sha256.hexdigest()} does not match the source's {file.sha256}", retryable=True
        )
    if git and git.hexdigest() != file.git_sha1:
        raise _Corrupt(
            f"{file.path}: git blob id {git.hexdigest()} does not match the source's {file.git_sha1}", retryable=True
        )


def _fetch_file(backend: Backend, file: RemoteFile, staging: Path, progress: _Progress) -> str:
    """Bring staging/FILE to the verified file; returns its sha256 hex."""
    final, part = staging / file.path, staging / (file.path + ".part")
    if final.exists():
        sha256, git = _hash_file(final, file)
        try:
            _verify(file, final.stat().st_size, sha256, git)
            progress.add(file.size, fetched=False)
            return sha256.hexdigest()
        except FetchError:
            final.unlink()  # a stale or damaged copy: fetch it again
    for attempt in range(1, MAX_ATTEMPTS + 1):
        offset = part.stat().st_size if part.exists() else 0
        if offset > file.size:
            part.unlink()
            offset = 0
        sha256, git = _hash_file(part, file) if offset else _hashers(file)
        if offset == file.size and offset:  # killed after the last byte, before the rename: nothing to fetch
            try:
                _verify(file, offset, sha256, git)
            except _Corrupt:
                part.unlink()
                continue
            progress.add(offset, fetched=False)
            os.replace(part, final)
            return sha256.hexdigest()
        try:
            log.info("%s: %s%s", file.path, _size(file.size), f", resuming at byte {offset}" if offset else "")
            start, chunks = backend.stream(file, offset)
            if start != offset:  # the server ignored Range: start over
                log.info("%s: the source ignored the range request; restarting the file", file.path)
                offset, (sha256, git) = 0, _hashers(file)
            progress.add(offset, fetched=False)
            with open(part, "r+b" if offset else "wb") as out:
                out.seek(offset)
                out.truncate()
                for chunk in chunks:
                    out.write(chunk)
                    out.flush()  # a killed process leaves every received byte for the next attempt's Range
                    sha256.update(chunk)
                    if git:
                        git.update(chunk)
                    progress.add(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            _verify(file, part.stat().st_size, sha256, git)
        except FetchError as exc:
            progress.done -= min(progress.done, part.stat().st_size if part.exists() else 0)
            if isinstance(exc, _Corrupt):
                part.unlink(missing_ok=True)  # corrupt: resuming would keep the bad bytes
            if not exc.retryable or attempt == MAX_ATTEMPTS:
                raise
            delay_s = min(2.0 ** (attempt - 1), 30.0)
            log.warning("%s: %s; attempt %d/%d in %.0f s", file.path, exc, attempt + 1, MAX_ATTEMPTS, delay_s)
            time.sleep(delay_s)
            continue
        os.replace(part, final)
        return sha256.hexdigest()
    raise AssertionError("unreachable")


def _lock(lock_path: Path, wait_log_s: float) -> int:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o664)
    waited_since = time.monotonic()
    last_log = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            now = time.monotonic()
            if last_log is None or now - last_log >= wait_log_s:
                log.info(
                    "another process is downloading this model (%s); waiting (%.0f s so far)",
                    lock_path,
                    now - waited_since,
                )
                last_log = now
            time.sleep(0.2)


def download(
    source: ModelURI,
    dest: str | os.PathLike,
    *,
    backend: Backend | None = None,
    progress_interval_s: float = 5.0,
    lock_wait_log_s: float = 30.0,
    on_listing: Callable[[list[RemoteFile]], None] | None = None,
    weights: bool = True,
    adapter: bool = False,
) -> Result:
    """`weights=False`: config and tokenizer files only (what the router reads). `adapter=True`: a PEFT LoRA
    adapter (adapter_config.json + adapter_model.safetensors) instead of a model."""
    dest = Path(os.path.abspath(dest))
    started = time.monotonic()
    marker = _check_existing(dest, source)
    if marker is None:
        fd = _lock(dest.parent / LOCKS_DIR / f"{dest.name}.lock", lock_wait_log_s)
        try:
            marker = _check_existing(dest, source)  # another pod may have finished while we waited
            if marker is None:
                return _download_locked(
                    source,
                    dest,
                    backend or open_backend(source),
                    progress_interval_s,
                    started,
                    on_listing,
                    weights,
                    adapter,
                )
        finally:
            os.close(fd)  # releases the flock
    log.info("%s is already complete at %s (commit %s); nothing to download", source, dest, marker.get("commit"))
    return Result(
        dest,
        marker.get("commit", ""),
        len(marker.get("files", {})),
        sum(f["size"] for f in marker.get("files", {}).values()),
        0,
        time.monotonic() - started,
    )


def _download_locked(
    source: ModelURI,
    dest: Path,
    backend: Backend,
    progress_interval_s: float,
    started: float,
    on_listing,
    weights: bool,
    adapter: bool = False,
) -> Result:
    listing = backend.listing()
    if not weights:
        listing = type(listing)(listing.commit, [f for f in listing.files if not is_weight(f.path)])
    paths = [f.path for f in listing.files]
    missing = missing_required(paths, weights, adapter)
    if missing:
        what = "spec.adapters[].uri the adapter's" if adapter else "spec.model.uri the model's"
        raise FetchError(
            f"{source}: found no {' or '.join(missing)} among the files serving reads "
            f"({', '.join(paths) or 'none'}); is {what} folder?"
        )
    if on_listing:
        on_listing(listing.files)
    staging = dest.parent / STAGING_DIR / dest.name
    identity = {"source": str(source), "commit": listing.commit, **({} if weights else {"weights": False})}
    try:
        previous = json.loads((staging / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        previous = None
    if previous != identity and staging.exists():
        log.info("discarding a staging folder for %s", previous)
        shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    (staging / _SOURCE_FILE).write_text(json.dumps(identity))
    total = sum(f.size for f in listing.files)
    log.info(
        "downloading %s (commit %s): %d files, %s into %s",
        source,
        listing.commit,
        len(listing.files),
        _size(total),
        dest,
    )
    progress = _Progress(total, progress_interval_s)
    digests = {f.path: _fetch_file(backend, f, staging, progress) for f in listing.files}
    for leftover in staging.iterdir():  # files from an earlier listing of the same commit never happen; parts might
        if leftover.name.endswith(".part"):
            leftover.unlink()
    manifest = {
        **identity,
        "files": {f.path: {"size": f.size, "sha256": digests[f.path]} for f in listing.files},
        "completedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (staging / _SOURCE_FILE).unlink()
    with open(staging / MARKER, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    if dest.exists():
        dest.rmdir()  # empty (checked above): e.g. a mount point's pre-created folder
    os.rename(staging, dest)
    _fsync_dir(dest.parent)
    try:
        staging.parent.rmdir()  # only when no other model is being staged beside this one
    except OSError:
        pass
    elapsed = time.monotonic() - started
    log.info(
        "downloaded %s: %d files, %s (%s fetched) in %.1f s to %s",
        source,
        len(listing.files),
        _size(total),
        _size(progress.fetched),
        elapsed,
        dest,
    )
    return Result(dest, listing.commit, len(listing.files), total, progress.fetched, elapsed)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
