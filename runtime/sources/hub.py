"""hf:// through huggingface_hub: the revision is resolved to a commit and the file list (sizes, LFS sha256,
git-blob oids) read with HfApi; each file is then one GET of `/{repo}/resolve/{commit}/{path}` that we stream
ourselves, so a restarted init container resumes with `Range` (huggingface_hub >= 1.18 keeps no partial file
across processes) and every byte lands in the downloader's staging folder rather than in a second HF cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

# huggingface_hub reads these at import. Telemetry: since 1.19 building its user-agent GETs
# {HF_ENDPOINT}/api/agent-harnesses, ignoring endpoint= (so it would leave a mirror for huggingface.co).
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import httpx  # noqa: E402
from huggingface_hub import HfApi, hf_hub_url  # noqa: E402
from huggingface_hub import errors as hf_errors  # noqa: E402
from huggingface_hub.utils import build_hf_headers  # noqa: E402

from kvserve.runtime.sources.remote import Listing, RemoteFile  # noqa: E402
from kvserve.runtime.sources.uri import FetchError, ModelURI, wanted  # noqa: E402

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK_BYTES = 1 << 20
TOKEN_HINT = "check HF_TOKEN in the Secret named by spec.model.credentials.secretRef"
NO_TOKEN_HINT = "no token was given: put HF_TOKEN in a Secret and name it in spec.model.credentials.secretRef"


class HubBackend:
    def __init__(
        self, source: ModelURI, token: str | None = None, endpoint: str | None = None, timeout_s: float = 30.0
    ):
        self.source, self.token = source, token or None
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.timeout = httpx.Timeout(timeout_s, read=max(timeout_s, 60.0))
        self.timeout_s = timeout_s
        self.commit = source.revision

    def _where(self) -> str:
        return f"hf://{self.source.location}@{self.source.revision} ({self.endpoint})"

    def _hint(self) -> str:
        return TOKEN_HINT if self.token else NO_TOKEN_HINT

    def listing(self) -> Listing:
        api = HfApi(endpoint=self.endpoint, token=self.token if self.token else False)
        repo = self.source.location
        try:
            commit = api.model_info(repo, revision=self.source.revision).sha
            tree = list(api.list_repo_tree(repo, revision=commit, recursive=True))
        except Exception as exc:  # noqa: BLE001 - every failure becomes one message naming the cause
            raise _hub_error(exc, self._where(), self._hint()) from exc
        self.commit = commit
        files = []
        for entry in tree:
            if getattr(entry, "size", None) is None or not wanted(entry.path):
                continue  # folders, and files serving does not read
            lfs = getattr(entry, "lfs", None)
            files.append(
                RemoteFile(
                    path=entry.path,
                    size=int(entry.size),
                    sha256=lfs.sha256 if lfs else None,
                    git_sha1=None if lfs else entry.blob_id,
                )
            )
        return Listing(commit=commit, files=sorted(files, key=lambda f: f.path))

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return build_hf_headers(
            token=self.token if self.token else False, headers={"Accept-Encoding": "identity", **(extra or {})}
        )

    def stream(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        url = hf_hub_url(self.source.location, file.path, revision=self.commit, endpoint=self.endpoint)
        headers = self._headers({"Range": f"bytes={offset}-"} if offset else None)
        client = httpx.Client(timeout=self.timeout, follow_redirects=True)  # drops authorization cross-origin
        try:
            response = client.send(client.build_request("GET", url, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            client.close()
            raise FetchError(f"{self._where()}: GET {file.path}: {type(exc).__name__}: {exc}", retryable=True) from exc
        if response.status_code not in (200, 206):
            response.read()
            client.close()
            raise _status_error(response, f"{self._where()}: GET {file.path}", self._hint())
        start = offset if response.status_code == 206 else 0

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.iter_bytes()  # as received: a killed process keeps every byte it got
            except httpx.HTTPError as exc:
                raise FetchError(
                    f"{self._where()}: {file.path}: the transfer broke off: {type(exc).__name__}: {exc}", retryable=True
                ) from exc
            finally:
                response.close()
                client.close()

        return start, chunks()

    def read_file(self, path: str) -> bytes:
        url = hf_hub_url(self.source.location, path, revision=self.source.revision, endpoint=self.endpoint)
        try:
            with httpx.Client(timeout=self.timeout_s, follow_redirects=True) as client:  # small file: one timeout
                response = client.get(url, headers=self._headers())
        except httpx.HTTPError as exc:
            raise FetchError(
                f"{self._where()}: cannot reach the hub: {type(exc).__name__}: {exc}", retryable=True
            ) from exc
        if response.status_code != 200:
            raise _status_error(response, f"{self._where()}: GET {path}", self._hint())
        return response.content


def _status_error(response: httpx.Response, what: str, hint: str) -> FetchError:
    code = response.headers.get("X-Error-Code", "")
    status = response.status_code
    if code == "GatedRepo" or status == 403:
        return FetchError(
            f"{what}: HTTP {status} {code or 'Forbidden'}: the repository is gated or the token may "
            f"not read it; accept its license on the hub with the token's account ({hint})"
        )
    if status == 401 or code == "RepoNotFound":
        return FetchError(
            f"{what}: HTTP {status} {code}: repository not found, or the token was rejected or "
            f"cannot read this private repository ({hint})".replace("  ", " ")
        )
    if code == "RevisionNotFound":
        return FetchError(f"{what}: HTTP {status}: revision not found (spec.model.revision)")
    if code == "EntryNotFound" or status == 404:
        return FetchError(f"{what}: HTTP {status}: no such file in this revision")
    return FetchError(f"{what}: HTTP {status} {response.reason_phrase}", retryable=status >= 500 or status == 429)


def _hub_error(exc: Exception, where: str, hint: str) -> FetchError:
    if isinstance(exc, hf_errors.GatedRepoError):
        return FetchError(
            f"{where}: the repository is gated: accept its license on the hub with the token's account ({hint})"
        )
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return FetchError(f"{where}: revision not found (spec.model.revision)")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return FetchError(
            f"{where}: repository not found, or the token was rejected or cannot read this private repository ({hint})"
        )
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return FetchError(f"{where}: HTTP {status}: the token was rejected ({hint})")
        return FetchError(
            f"{where}: HTTP {status}: {str(exc).splitlines()[0]}",
            retryable=status is None or status >= 500 or status == 429,
        )
    return FetchError(
        f"{where}: cannot reach the hub: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        retryable=True,
    )
