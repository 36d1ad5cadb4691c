"""s3:// downloads with real boto3 against moto's S3 server (a separate process on 127.0.0.1), reached the way
S3-compatible stores are: AWS_ENDPOINT_URL."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import boto3
import pytest

from kvserve.runtime.sources import download, model_config, uri
from tests.sources.conftest import serving_files

pytestmark = pytest.mark.timeout(120)
BUCKET = "models"


@pytest.fixture(scope="module")
def moto_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "moto_server exited"
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture()
def s3(moto_url, stories_dir, monkeypatch):
    """A bucket holding the tiny model under llama/stories260K/, a sibling prefix that a string match would
    also take, a directory marker and a nested folder; the environment an init container would get."""
    urllib.request.urlopen(urllib.request.Request(moto_url + "/moto-api/reset", method="POST"), timeout=5)
    for key, value in {
        "AWS_ENDPOINT_URL": moto_url,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    for name, data in serving_files(stories_dir).items():
        extra = {"ChecksumAlgorithm": "SHA256"} if name.endswith(".safetensors") else {}
        client.put_object(Bucket=BUCKET, Key=f"llama/stories260K/{name}", Body=data, **extra)
    client.put_object(Bucket=BUCKET, Key="llama/stories260K/", Body=b"")  # a console-made "folder"
    client.put_object(Bucket=BUCKET, Key="llama/stories260K/original/model.safetensors", Body=b"not served")
    client.put_object(Bucket=BUCKET, Key="llama/stories260K-other/config.json", Body=b'{"other": true}')
    return client


def test_download_from_s3_is_byte_identical_and_stays_inside_the_prefix(s3, stories_dir, tmp_path):
    dest = tmp_path / "cache" / "models" / "s"
    listing = []
    result = download.download(uri.parse(f"s3://{BUCKET}/llama/stories260K"), dest, on_listing=listing.extend)
    assert serving_files(dest) == serving_files(stories_dir)
    assert sorted(p.name for p in dest.iterdir()) == sorted([*serving_files(stories_dir), download.MARKER])
    by_path = {f.path: f for f in listing}
    # The object uploaded with a SHA256 checksum is verified against it; all are size-checked.
    import hashlib

    assert (
        by_path["model.safetensors"].sha256
        == hashlib.sha256((stories_dir / "model.safetensors").read_bytes()).hexdigest()
    )
    assert all(f.etag for f in listing)
    assert result.fetched_bytes == result.num_bytes


def test_a_restart_resumes_the_partial_file_with_a_range_request(s3, stories_dir, tmp_path):
    weights = (stories_dir / "model.safetensors").read_bytes()
    source = uri.parse(f"s3://{BUCKET}/llama/stories260K")
    listing = model_config.backend(source).listing()
    dest = tmp_path / "m"
    staging = dest.parent / download.STAGING_DIR / dest.name
    staging.mkdir(parents=True)
    # What a killed init container leaves: the staging folder for this listing, half of the weights.
    (staging / ".kvserve-source.json").write_text(f'{{"source": "{source}", "commit": "{listing.commit}"}}')
    half = len(weights) // 2
    (staging / "model.safetensors.part").write_bytes(weights[:half])
    result = download.download(source, dest)
    assert result.fetched_bytes == result.num_bytes - half  # only the second half crossed the wire
    assert serving_files(dest) == serving_files(stories_dir)


def test_a_replaced_object_invalidates_the_staging_folder(s3, stories_dir, tmp_path):
    source = uri.parse(f"s3://{BUCKET}/llama/stories260K")
    old_commit = model_config.backend(source).listing().commit
    dest = tmp_path / "m"
    staging = dest.parent / download.STAGING_DIR / dest.name
    staging.mkdir(parents=True)
    (staging / ".kvserve-source.json").write_text(f'{{"source": "{source}", "commit": "{old_commit}"}}')
    (staging / "model.safetensors.part").write_bytes(b"bytes of the old object")
    s3.put_object(Bucket=BUCKET, Key="llama/stories260K/tokenizer_config.json", Body=b'{"new": 1}')
    result = download.download(source, dest)
    assert result.commit != old_commit and result.fetched_bytes == result.num_bytes
    assert (dest / "tokenizer_config.json").read_bytes() == b'{"new": 1}'
    assert (dest / "model.safetensors").read_bytes() == (stories_dir / "model.safetensors").read_bytes()


def test_errors_name_the_cause(s3, tmp_path):
    with pytest.raises(uri.FetchError, match="NoSuchBucket"):
        download.download(uri.parse("s3://no-such-bucket/x"), tmp_path / "a")
    with pytest.raises(uri.FetchError, match=r"found no config\.json or \*\.safetensors"):
        download.download(uri.parse(f"s3://{BUCKET}/llama/stories"), tmp_path / "b")  # a string prefix only
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_config_json_with_explicit_credentials_as_the_operator_passes_them(s3, moto_url, monkeypatch):
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)  # the operator's own environment has none of the Secret's values
    creds = {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    config = model_config.fetch_config(uri.parse(f"s3://{BUCKET}/llama/stories260K"), creds)
    assert config["num_key_value_heads"] == 4


def test_a_part_file_killed_after_its_last_byte_is_verified_not_refetched(s3, stories_dir, tmp_path):
    source = uri.parse(f"s3://{BUCKET}/llama/stories260K")
    listing = model_config.backend(source).listing()
    dest = tmp_path / "m"
    staging = dest.parent / download.STAGING_DIR / dest.name
    staging.mkdir(parents=True)
    (staging / ".kvserve-source.json").write_text(f'{{"source": "{source}", "commit": "{listing.commit}"}}')
    weights = (stories_dir / "model.safetensors").read_bytes()
    (staging / "model.safetensors.part").write_bytes(weights)  # complete, not yet renamed
    result = download.download(source, dest)
    assert result.fetched_bytes == result.num_bytes - len(weights)
    assert serving_files(dest) == serving_files(stories_dir)
