"""Model URIs, pure: parse and validate `spec.model.uri` (+ `spec.model.revision`), and the cache key.

Grammar (kvserve's, not KServe's `hf://org/name:rev`): a revision follows `@`, since `:` is legal in neither
repo ids nor S3 prefixes we want to guess about.
    hf://ORG/NAME[@REVISION]    Hugging Face Hub repo (HF_ENDPOINT for mirrors); REVISION a branch, tag or commit
    s3://BUCKET[/PREFIX]        an S3 or S3-compatible (AWS_ENDPOINT_URL) prefix; PREFIX is a folder, never a
                                string prefix: s3://b/llama does not match s3://b/llama-hf/...
    pvc://CLAIM[/PATH]          a PersistentVolumeClaim mounted read-only (nothing downloaded)
    file:///PATH                a path inside the image or a mounted volume (nothing downloaded)
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass

SCHEMES = ("hf", "s3", "pvc", "file")
REMOTE_SCHEMES = ("hf", "s3")  # fetched by `kvserve download`; pvc/file are mounted as they are
DEFAULT_HF_REVISION = "main"

# What serving needs, matched against top-level file names only: weights in subfolders (original/*.pth,
# onnx/...) and everything else in a repo (READMEs, .bin duplicates, images) stay where they are.
SERVING_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "*.tiktoken",
    "adapter_config.json",  # a PEFT LoRA adapter (`kvserve download --adapter`, spec.adapters)
)
REQUIRED_PATTERNS = ("config.json", "*.safetensors")  # a source without these is not a model we can serve
ADAPTER_REQUIRED_PATTERNS = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's format (docs/lora.md)
WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json")  # left out by --no-weights (the router)

_HF_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HF_RE = re.compile(rf"^hf://(?P<org>{_HF_PART})/(?P<name>{_HF_PART})(?:@(?P<rev>[^\s@]+))?$")
_S3_RE = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>[^\s]*))?$")
_PVC_RE = re.compile(r"^pvc://(?P<claim>[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?)(?:/(?P<path>.*))?$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class FetchError(RuntimeError):
    """Fetching from a source failed. `retryable`: a dropped connection or a 5xx, worth another try from where
    the download stopped; auth and not-found errors are not."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class SourceError(ValueError):
    """A bad model URI or source; `field` names the spec field or CLI argument to fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelURI:
    scheme: str  # one of SCHEMES
    location: str  # hf: "org/name"; s3: bucket; pvc: claim; file: ""
    path: str  # s3: key prefix without slashes at either end; pvc/file: the path; hf: ""
    revision: str | None = None  # hf only (default "main")

    @property
    def remote(self) -> bool:
        return self.scheme in REMOTE_SCHEMES

    def __str__(self) -> str:
        if self.scheme == "hf":
            return f"hf://{self.location}@{self.revision}"
        if self.scheme == "file":
            return f"file://{self.path}"
        return f"{self.scheme}://{self.location}" + (f"/{self.path}" if self.path else "")


def parse(
    uri: str, revision: str | None = None, *, field: str = "spec.model.uri", revision_field: str = "spec.model.revision"
) -> ModelURI:
    """Parse and validate; `revision` is the separate revision setting (spec.model.revision / --revision)."""
    uri = (uri or "").strip()
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in SCHEMES:
        raise SourceError(
            field,
            f"{uri!r} has no supported scheme; use hf://ORG/NAME[@REVISION], "
            "s3://BUCKET/PREFIX, pvc://CLAIM/PATH or file:///PATH",
        )
    if revision is not None and scheme != "hf":
        raise SourceError(revision_field, f"a revision applies to hf:// sources only, not {scheme}://")
    if scheme == "hf":
        m = _HF_RE.match(uri)
        if not m or ".." in uri or "--" in m.group("org") + m.group("name"):
            raise SourceError(
                field,
                f"{uri!r} is not hf://ORG/NAME[@REVISION] (exactly two path parts of letters, digits, '.', '_' or '-')",
            )
        if m.group("rev") and revision and m.group("rev") != revision:
            raise SourceError(
                revision_field, f"{revision!r} contradicts the revision {m.group('rev')!r} in {field}; give it once"
            )
        rev = m.group("rev") or revision or DEFAULT_HF_REVISION
        return ModelURI("hf", f"{m.group('org')}/{m.group('name')}", "", rev)
    if scheme == "s3":
        m = _S3_RE.match(uri)
        if not m:
            raise SourceError(
                field, f"{uri!r} is not s3://BUCKET/PREFIX (bucket: 3-63 lowercase letters, digits, '.' or '-')"
            )
        prefix = (m.group("prefix") or "").strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise SourceError(field, f"{uri!r}: the prefix has an empty, '.' or '..' part")
        return ModelURI("s3", m.group("bucket"), prefix)
    if scheme == "pvc":
        m = _PVC_RE.match(uri)
        if not m:
            raise SourceError(field, f"{uri!r} is not pvc://CLAIM/PATH (CLAIM a lowercase DNS name)")
        return ModelURI("pvc", m.group("claim"), (m.group("path") or "").strip("/"))
    path = uri.removeprefix("file://")
    if not path.startswith("/"):
        raise SourceError(field, f"{uri!r} must be file:///ABSOLUTE/PATH")
    return ModelURI("file", "", path.rstrip("/") or "/")


def cache_key(source: ModelURI) -> str:
    """The cache folder name for a source and revision: readable, then a hash of the exact source so that two
    sources never share a folder (a branch revision names what it pointed to at first download)."""
    ident = str(source)
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    readable = f"{source.location}/{source.path}".strip("/") + (f"@{source.revision}" if source.revision else "")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", readable).strip("-.")[:80]
    return f"{slug}-{digest}"


def wanted(relative_path: str) -> bool:
    """Is this file (path relative to the model's root) one that serving needs?"""
    return "/" not in relative_path and any(fnmatch.fnmatchcase(relative_path, p) for p in SERVING_FILE_PATTERNS)


def is_weight(relative_path: str) -> bool:
    return any(fnmatch.fnmatchcase(relative_path, p) for p in WEIGHT_PATTERNS)


def missing_required(relative_paths: list[str], weights: bool = True, adapter: bool = False) -> list[str]:
    required = ADAPTER_REQUIRED_PATTERNS if adapter else REQUIRED_PATTERNS if weights else ("config.json",)
    return [p for p in required if not any(fnmatch.fnmatchcase(f, p) for f in relative_paths)]
