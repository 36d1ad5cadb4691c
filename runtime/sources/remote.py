"""What a backend (hub, S3, local folder) hands the downloader: a listing with what each file must be, and a
byte stream from an offset (which is how a restarted download resumes)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the model's root
    size: int  # bytes; always checked
    sha256: str | None = None  # hex, where the source publishes it (hub LFS oid, S3 ChecksumSHA256)
    git_sha1: str | None = None  # hub git-blob oid of a non-LFS file
    etag: str | None = None  # S3: every ranged GET carries IfMatch, so a replaced object fails, not mixes


@dataclass(frozen=True)
class Listing:
    commit: str  # what the revision resolved to (hub commit; S3: a digest of keys and ETags)
    files: list[RemoteFile]


class Backend(Protocol):
    def listing(self) -> Listing: ...

    def stream(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        """(the offset the data really starts at -- 0 when the server ignored the range --, chunks)."""
        ...

    def read_file(self, path: str) -> bytes:
        """One small file (config.json) without listing anything."""
        ...
