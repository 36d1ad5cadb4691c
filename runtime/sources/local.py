"""file:// as a download source: copy a model folder (a mounted volume, a pre-staged disk) into a cache with
the same staging, verification and completion marker as a remote source -- the way to pre-warm a cache."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

from kvserve.runtime.sources.remote import Listing, RemoteFile
from kvserve.runtime.sources.uri import FetchError, ModelURI, wanted

CHUNK_BYTES = 1 << 20


class LocalBackend:
    def __init__(self, source: ModelURI):
        self.source, self.root = source, source.path

    def listing(self) -> Listing:
        if not os.path.isdir(self.root):
            raise FetchError(f"file://{self.root}: not a directory")
        files = [
            RemoteFile(path=name, size=os.path.getsize(os.path.join(self.root, name)))
            for name in sorted(os.listdir(self.root))
            if os.path.isfile(os.path.join(self.root, name)) and wanted(name)
        ]
        identity = "\n".join(f"{f.path} {f.size} {os.path.getmtime(os.path.join(self.root, f.path))}" for f in files)
        return Listing(commit=hashlib.sha256(identity.encode()).hexdigest()[:40], files=files)

    def stream(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        def chunks() -> Iterator[bytes]:
            with open(os.path.join(self.root, file.path), "rb") as f:
                f.seek(offset)
                while chunk := f.read(CHUNK_BYTES):
                    yield chunk

        return offset, chunks()

    def read_file(self, path: str) -> bytes:
        try:
            with open(os.path.join(self.root, path), "rb") as f:
                return f.read()
        except OSError as exc:
            raise FetchError(f"file://{self.root}/{path}: {exc.strerror}") from exc
