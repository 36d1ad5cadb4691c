"""The downloaded folder is the model: `kvserve serve` on it (a subprocess, as in the pod) gives the same greedy
text as the engine on the original folder."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.runtime.sources import download, uri
from tests.sources.conftest import REPO_ID, subprocess_env

pytestmark = pytest.mark.timeout(180)
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They"]


def test_kvserve_serve_on_the_downloaded_folder_matches_the_original(hub, stories_dir, tmp_path):
    from kvserve.runtime.engine.llm import LLM
    from kvserve.runtime.sampling_params import SamplingParams

    dest = tmp_path / "cache" / "models" / uri.cache_key(uri.parse(f"hf://{REPO_ID}"))
    download.download(uri.parse(f"hf://{REPO_ID}"), dest)
    dest.chmod(0o555)  # the engine mounts the cache read-only
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            str(dest),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--kv-cache-bytes",
            str(8 << 20),
            "--served-model-name",
            "stories",
        ],
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        expected = [
            o.outputs[0].text
            for o in LLM(str(stories_dir), max_model_len=512, kv_cache_bytes=8 << 20).generate(
                PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
            )
        ]
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        got = [
            httpx.post(
                base + "/v1/completions",
                timeout=60,
                json={"model": "stories", "prompt": p, "max_tokens": 24, "temperature": 0},
            ).json()["choices"][0]["text"]
            for p in PROMPTS
        ]
        assert got == expected and all(len(t) > 10 for t in got)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        dest.chmod(0o755)
