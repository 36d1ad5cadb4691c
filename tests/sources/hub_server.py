"""A small Hugging Face Hub-compatible server on 127.0.0.1 for tests: the endpoints huggingface_hub and
kvserve's downloader call (revision, tree, HEAD/GET resolve with Range), private repos behind a Bearer token
with the hub's error codes, and fault switches (stall or drop a file's body after N bytes, ignore Range).
Never sends X-Xet-* headers or xetHash, so every client stays on plain HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object id


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    private: bool = False
    token: str | None = None
    branch: str = "main"

    @property
    def commit(self) -> str:
        h = hashlib.sha1()  # noqa: S324 - a stand-in commit id
        for path in sorted(self.files):
            h.update(path.encode() + b"\0" + hashlib.sha256(self.files[path]).digest())
        return h.hexdigest()

    @classmethod
    def from_folder(cls, repo_id: str, folder: str, **kwargs) -> "Repo":
        files = {}
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read()
        return cls(repo_id, files, **kwargs)


@dataclass
class Faults:
    stall_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the body stalls (once)
    drop_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the socket closes (once)
    ignore_range: bool = False
    release: threading.Event = field(default_factory=threading.Event)


class HubServer:
    def __init__(self, *repos: Repo):
        self.repos = {r.repo_id: r for r in repos}
        self.faults = Faults()
        self.log: list[dict] = []
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.faults.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)

    def requests(self, method: str | None = None, contains: str = "") -> list[dict]:
        with self._lock:
            return [r for r in self.log if (method is None or r["method"] == method) and contains in r["path"]]

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._route(head=True)

            def do_GET(self) -> None:
                self._route(head=False)

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, status: int, obj, headers: dict | None = None, head: bool = False) -> None:
                self._send(
                    status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})}, head
                )

            def _error(self, status: int, code: str, head: bool, extra: dict | None = None) -> None:
                self._json(status, {"error": code}, {"X-Error-Code": code, **(extra or {})}, head)

            def _route(self, head: bool) -> None:
                raw_path, _, _query = self.path.partition("?")
                parts = [urllib.parse.unquote(p) for p in raw_path.split("/")[1:]]
                with server._lock:
                    server.log.append(
                        {
                            "method": self.command,
                            "path": raw_path,
                            "range": self.headers.get("Range"),
                            "authorization": self.headers.get("Authorization"),
                        }
                    )
                if parts[:2] == ["api", "agent-harnesses"]:
                    return self._json(200, {}, head=head)
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    return self._api(parts[2:], head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._resolve(parts, head)
                self._error(404, "NotFound", head)

            def _repo(self, repo_id: str, head: bool) -> Repo | None:
                repo = server.repos.get(repo_id)
                auth = self.headers.get("Authorization", "")
                if repo is None or (repo.private and auth != f"Bearer {repo.token}"):
                    # What the real hub answers for a private repo and a missing/wrong token.
                    self._error(401, "RepoNotFound", head)
                    return None
                return repo

            def _commit(self, repo: Repo, rev: str, head: bool) -> str | None:
                if rev in (repo.branch, repo.commit):
                    return repo.commit
                self._error(404, "RevisionNotFound", head)
                return None

            def _api(self, parts: list[str], head: bool) -> None:
                repo = self._repo("/".join(parts[:2]), head)
                if repo is None:
                    return
                rest = parts[2:]
                if not rest or rest[0] == "revision":
                    commit = self._commit(repo, rest[1] if len(rest) > 1 else repo.branch, head)
                    if commit:
                        self._json(
                            200,
                            {
                                "id": repo.repo_id,
                                "sha": commit,
                                "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                            },
                            head=head,
                        )
                    return
                if rest[0] == "tree" and len(rest) >= 2:
                    if self._commit(repo, rest[1], head):
                        entries = []
                        for path, data in sorted(repo.files.items()):
                            entry = {"type": "file", "path": path, "oid": git_blob_sha1(data), "size": len(data)}
                            if path.endswith(LFS_SUFFIXES):
                                entry["lfs"] = {
                                    "oid": hashlib.sha256(data).hexdigest(),
                                    "size": len(data),
                                    "pointerSize": 134,
                                }
                            entries.append(entry)
                        self._json(200, entries, head=head)
                    return
                self._error(404, "NotFound", head)

            def _resolve(self, parts: list[str], head: bool) -> None:
                repo = self._repo("/".join(parts[:2]), head)
                if repo is None:
                    return
                commit = self._commit(repo, parts[3], head)
                if commit is None:
                    return
                path = "/".join(parts[4:])
                if path not in repo.files:
                    return self._error(404, "EntryNotFound", head, {"X-Repo-Commit": commit})
                data = repo.files[path]
                lfs = path.endswith(LFS_SUFFIXES)
                etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
                headers = {
                    "X-Repo-Commit": commit,
                    "ETag": f'"{etag}"',
                    "Accept-Ranges": "bytes",
                    "Content-Type": "application/octet-stream",
                }
                if lfs:
                    headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
                start, status = 0, 200
                range_header = self.headers.get("Range")
                if range_header and not server.faults.ignore_range:
                    first, _, last = range_header.removeprefix("bytes=").partition("-")
                    start = int(first)
                    end = int(last) if last else len(data) - 1
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                    data, status = data[start : end + 1], 206
                if head:
                    return self._send(status, data, headers, head=True)
                stall = server.faults.stall_after.pop(path, None)
                drop = server.faults.drop_after.pop(path, None)
                cut = stall if stall is not None else drop
                if cut is None:
                    return self._send(status, data, headers)
                self.send_response(status)
                for k, v in {"Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data[:cut])
                self.wfile.flush()
                if stall is not None:
                    server.faults.release.wait(60)  # the client is killed meanwhile (or the server stops)
                self.close_connection = True

        return Handler
