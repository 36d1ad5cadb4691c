"""hf:// downloads against a local hub server on 127.0.0.1 speaking huggingface_hub's protocol (revision, tree,
resolve with Range), serving examples/models/stories260K as a private repo."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from kvserve.cli.main import main
from kvserve.runtime.sources import download, model_config, uri
from tests.sources.conftest import REPO_ID, TOKEN, serving_files, subprocess_env

pytestmark = pytest.mark.timeout(120)
URI = f"hf://{REPO_ID}"


def _gets(hub, name: str) -> list[dict]:
    return [r for r in hub.requests("GET", "/resolve/") if r["path"].endswith("/" + name)]


def test_download_is_byte_identical_verified_and_fetched_once(hub, stories_dir, tmp_path):
    dest = tmp_path / "cache" / "models" / "stories"
    result = download.download(uri.parse(URI), dest)
    assert serving_files(dest) == serving_files(stories_dir)
    # README.md and original/ stay on the hub; the folder holds the files and the manifest only.
    assert sorted(p.name for p in dest.iterdir()) == sorted([*serving_files(stories_dir), download.MARKER])
    repo = hub.repos[REPO_ID]
    assert result.commit == repo.commit and result.fetched_bytes == result.num_bytes == sum(
        len(b) for b in serving_files(stories_dir).values()
    )
    marker = download.read_marker(dest)
    assert marker["source"] == f"{URI}@main" and marker["commit"] == repo.commit
    assert set(marker["files"]) == set(serving_files(stories_dir))
    # The revision was resolved once, then every file fetched by commit, with the token.
    api = hub.requests("GET", "/api/models/")
    assert api[0]["path"].endswith("/revision/main") and repo.commit in api[1]["path"]
    gets = hub.requests("GET", "/resolve/")
    assert len(gets) == len(marker["files"]) and all(f"/resolve/{repo.commit}/" in r["path"] for r in gets)
    assert {r["authorization"] for r in hub.log} == {f"Bearer {TOKEN}"}
    assert not (dest.parent / download.STAGING_DIR).exists()  # nothing half-done left beside it
    # A second pod on the same cache: nothing is fetched, not even the listing.
    before = len(hub.log)
    again = download.download(uri.parse(URI), dest)
    assert again.fetched_bytes == 0 and len(hub.log) == before


def test_wrong_token_is_a_clear_error_and_the_termination_message(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    log = tmp_path / "termination-log"
    rc = main(["download", URI, "--dest", str(tmp_path / "m"), "--termination-log", str(log)])
    assert rc == 1 and not (tmp_path / "m").exists()
    message = log.read_text()
    assert message.startswith("kvserve: download failed: ") and message.endswith("\n")
    assert "token was rejected" in message and "HF_TOKEN" in message and "secretRef" in message
    assert "token was rejected" in capsys.readouterr().err
    monkeypatch.delenv("HF_TOKEN")
    assert main(["download", URI, "--dest", str(tmp_path / "m"), "--termination-log", str(log)]) == 1
    assert "no token was given" in log.read_text()


def test_a_download_killed_half_way_resumes_with_range_and_is_byte_identical(hub, stories_dir, tmp_path):
    weights = (stories_dir / "model.safetensors").read_bytes()
    cut = len(weights) // 2
    hub.faults.stall_after["model.safetensors"] = cut
    dest = tmp_path / "models" / "stories"
    part = dest.parent / download.STAGING_DIR / dest.name / "model.safetensors.part"
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "download",
        URI,
        "--dest",
        str(dest),
        "--termination-log",
        str(tmp_path / "log"),
    ]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size >= cut):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the download never reached the stall"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # what an evicted or OOM-killed init container gets
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not dest.exists(), "a killed download must not leave a folder that looks like a model"
    assert part.stat().st_size == cut
    second = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert f"resuming at byte {cut}" in second.stderr
    ranged = [r["range"] for r in _gets(hub, "model.safetensors")]
    assert ranged == [None, f"bytes={cut}-"]  # the restart asked only for the rest
    assert serving_files(dest) == serving_files(stories_dir)
    # Files finished before the kill were re-hashed, not fetched again.
    assert len(_gets(hub, "config.json")) == 1


def test_a_damaged_staged_file_is_detected_by_its_sha256_and_fetched_again(hub, stories_dir, tmp_path):
    dest = tmp_path / "m"
    staging = dest.parent / download.STAGING_DIR / dest.name
    download.download(uri.parse(URI), dest)
    # Pretend a crash left a staged copy whose bytes rotted: same size, one byte flipped.
    staging.parent.mkdir()
    dest.rename(staging)
    (staging / download.MARKER).unlink()
    (staging / ".kvserve-source.json").write_text(
        f'{{"source": "{URI}@main", "commit": "{hub.repos[REPO_ID].commit}"}}'
    )
    damaged = bytearray((staging / "model.safetensors").read_bytes())
    damaged[100] ^= 0xFF
    (staging / "model.safetensors").write_bytes(bytes(damaged))
    before = len(_gets(hub, "model.safetensors"))
    result = download.download(uri.parse(URI), dest)
    assert len(_gets(hub, "model.safetensors")) == before + 1
    assert result.fetched_bytes == len(damaged)  # only the damaged file came over the wire again
    assert serving_files(dest) == serving_files(stories_dir)


def test_pods_sharing_a_cache_download_once(hub, stories_dir, tmp_path):
    """Two downloaders on one cache folder: the second waits on the lock and finds the model complete. The
    first one's connection is dropped mid-file too, which it retries in-process from where it stopped."""
    hub.faults.stall_after["model.safetensors"] = 300_000
    dest = tmp_path / "cache" / "models" / "stories"
    results: dict[str, download.Result] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            results[name] = download.download(uri.parse(URI), dest, lock_wait_log_s=0.5)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    part = dest.parent / download.STAGING_DIR / dest.name / "model.safetensors.part"
    deadline = time.monotonic() + 30
    while not (part.exists() and part.stat().st_size >= 300_000):
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.02)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    time.sleep(0.5)
    assert "second" not in results  # waiting for the lock, not downloading beside the first
    hub.faults.release.set()  # the stalled response now ends short: the first retries with Range
    first.join(60)
    second.join(60)
    assert not errors, errors
    assert results["first"].fetched_bytes == results["first"].num_bytes and results["second"].fetched_bytes == 0
    assert [r["range"] for r in _gets(hub, "model.safetensors")] == [None, "bytes=300000-"]
    assert len(hub.requests("GET", "/revision/")) == 1  # the second never even listed the repo
    assert serving_files(dest) == serving_files(stories_dir)


def test_config_json_alone_with_the_secrets_credentials(hub):
    source = uri.parse(URI)
    config = model_config.fetch_config(source, {"HF_TOKEN": TOKEN, "HF_ENDPOINT": hub.url})
    assert config["num_hidden_layers"] == 5 and config["architectures"] == ["LlamaForCausalLM"]
    assert [r["path"] for r in hub.log] == [f"/{REPO_ID}/resolve/main/config.json"]  # nothing else fetched
    with pytest.raises(uri.FetchError, match="token was rejected"):
        model_config.fetch_config(source, {"HF_TOKEN": "hf_wrong", "HF_ENDPOINT": hub.url})
    with pytest.raises(uri.FetchError, match="revision not found"):
        model_config.fetch_config(uri.parse(URI + "@nope"), {"HF_TOKEN": TOKEN, "HF_ENDPOINT": hub.url})


def test_a_repo_without_weights_is_refused_and_leaves_nothing(hub, tmp_path):
    hub.repos[REPO_ID].files.pop("model.safetensors")
    with pytest.raises(uri.FetchError, match=r"found no \*\.safetensors"):
        download.download(uri.parse(URI), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_plan_from_a_hub_config(hub, capsys):
    from kvserve.cli.main import main

    assert main(["plan", "--model-config", URI, "--gpu", "l4", "--max-model-len", "512"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: LlamaForCausalLM, 5 layers, 8 heads / 4 KV heads x 8, hidden 64")
    # KV bytes per token: 2 x 5 layers x 4 KV heads x 8 x 4 bytes (the config.json's float32, as serve loads it)
    assert "1,280 B" in out and "dtype float32" in out
    assert [r["path"] for r in hub.log] == [f"/{REPO_ID}/resolve/main/config.json"]


def test_no_weights_fetches_config_and_tokenizer_only(hub, stories_dir, tmp_path):
    dest = tmp_path / "tokenizer"
    assert main(["download", URI, "--dest", str(dest), "--no-weights", "--termination-log", str(tmp_path / "l")]) == 0
    expected = {k: v for k, v in serving_files(stories_dir).items() if not k.endswith(".safetensors")}
    assert serving_files(dest) == expected and "config.json" in expected and "tokenizer.json" in expected
    assert _gets(hub, "model.safetensors") == []
