"""s3:// through boto3: list the prefix (a folder: `/` boundary enforced, directory markers skipped), then one
ranged GetObject per file from where the staging copy stopped, each with IfMatch=<ETag> so an object replaced
mid-download fails instead of mixing versions. S3-compatible stores: AWS_ENDPOINT_URL (boto3 >= 1.28).

Multipart ETags are not digests, so sizes are always checked and sha256 only where the object carries a
full-object ChecksumSHA256 (uploaded with ChecksumAlgorithm=SHA256).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterator

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from kvserve.runtime.sources.remote import Listing, RemoteFile
from kvserve.runtime.sources.uri import FetchError, ModelURI, wanted

CHUNK_BYTES = 1 << 20
CREDENTIALS_HINT = (
    "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for S3-compatible "
    "stores) in the Secret named by spec.model.credentials.secretRef"
)
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}
_CREDENTIAL_KEYS = {
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
    "AWS_DEFAULT_REGION": "region_name",
    "AWS_ENDPOINT_URL_S3": "endpoint_url",
    "AWS_ENDPOINT_URL": "endpoint_url",
}


class S3Backend:
    def __init__(self, source: ModelURI, credentials: dict[str, str] | None = None, timeout_s: float = 30.0):
        """`credentials`: Secret keys named like the AWS variables (the operator's path); None: boto3's own
        environment and instance-role chain (the init container, which gets the Secret as env)."""
        self.source = source
        kwargs = {}
        for key, arg in _CREDENTIAL_KEYS.items():  # AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL, as in boto3
            if (credentials or {}).get(key) and arg not in kwargs:
                kwargs[arg] = credentials[key]
        config = Config(
            connect_timeout=timeout_s,
            read_timeout=max(timeout_s, 60.0),
            retries={"max_attempts": 3, "mode": "standard"},
            s3={"addressing_style": os.environ.get("KVSERVE_S3_ADDRESSING_STYLE", "auto")},
        )
        self.client = boto3.client("s3", config=config, **kwargs)
        self.prefix = f"{source.path}/" if source.path else ""

    def _where(self) -> str:
        return f"s3://{self.source.location}/{self.source.path}"

    def _error(self, exc: Exception, what: str) -> FetchError:
        if isinstance(exc, NoCredentialsError):
            return FetchError(f"{self._where()}: {what}: no AWS credentials found ({CREDENTIALS_HINT})")
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH_CODES:
                return FetchError(
                    f"{self._where()}: {what}: {code} (HTTP {status}): the credentials were rejected "
                    f"or may not read this bucket ({CREDENTIALS_HINT})"
                )
            if code in ("NoSuchBucket", "NoSuchKey", "404"):
                return FetchError(f"{self._where()}: {what}: {code}: not found (spec.model.uri)")
            if code in ("PreconditionFailed", "412"):
                return FetchError(
                    f"{self._where()}: {what}: the object changed during the download; the next "
                    "attempt starts it again",
                    retryable=True,
                )
            return FetchError(
                f"{self._where()}: {what}: {code} (HTTP {status}): {err.get('Message', '')}",
                retryable=status is None or status >= 500,
            )
        return FetchError(f"{self._where()}: {what}: {type(exc).__name__}: {exc}", retryable=True)

    def listing(self) -> Listing:
        files = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.source.location, Prefix=self.prefix
            )
            objects = [obj for page in pages for obj in page.get("Contents", [])]
            for obj in sorted(objects, key=lambda o: o["Key"]):
                relative = obj["Key"][len(self.prefix) :]
                if obj["Key"].endswith("/") or not wanted(relative):
                    continue  # directory markers, nested folders and files serving does not read
                head = self.client.head_object(Bucket=self.source.location, Key=obj["Key"], ChecksumMode="ENABLED")
                files.append(
                    RemoteFile(
                        path=relative, size=int(head["ContentLength"]), sha256=_sha256_hex(head), etag=head["ETag"]
                    )
                )
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, "listing") from exc
        identity = "\n".join(f"{f.path} {f.etag} {f.size}" for f in files)
        return Listing(commit=hashlib.sha256(identity.encode()).hexdigest()[:40], files=files)

    def stream(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        kwargs = {"Range": f"bytes={offset}-"} if offset else {}
        if file.etag:
            kwargs["IfMatch"] = file.etag
        try:
            response = self.client.get_object(Bucket=self.source.location, Key=self.prefix + file.path, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, f"GET {file.path}") from exc
        start = offset if response.get("ContentRange") or not offset else 0

        def chunks() -> Iterator[bytes]:
            body = response["Body"]
            try:
                yield from body.iter_chunks(CHUNK_BYTES)
            except (BotoCoreError, OSError) as exc:
                raise FetchError(
                    f"{self._where()}: {file.path}: the transfer broke off: {type(exc).__name__}: {exc}", retryable=True
                ) from exc
            finally:
                body.close()

        return start, chunks()

    def read_file(self, path: str) -> bytes:
        try:  # botocore's read timeout (>= 60 s) applies; connect_timeout is timeout_s
            return self.client.get_object(Bucket=self.source.location, Key=self.prefix + path)["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, f"GET {path}") from exc


def _sha256_hex(head: dict) -> str | None:
    value = head.get("ChecksumSHA256")
    # A multipart upload's checksum is of the parts' checksums ("...-N"), not of the object.
    if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    return base64.b64decode(value).hex()
