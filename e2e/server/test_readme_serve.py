"""The README's main job on a fresh machine: the `kvserve` console script with no MODEL_DIR and default
engine settings builds the demo model into an empty cache, serves it, answers the official openai client
(chat, streaming), says the weights are random, and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(180)


def test_kvserve_serve_no_args_fresh_cache(tmp_path):
    exe = Path(sys.executable).with_name("kvserve")
    cmd = [str(exe)] if exe.exists() else [shutil.which("kvserve") or "kvserve"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path / "cache"), "KVSERVE_DEFAULT_MODEL": "demo"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*cmd, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        assert list((tmp_path / "cache").glob("demo-*/model.safetensors"))
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        (model,) = client.models.list().data
        assert model.id == "kvserve-demo-random-weights" and model.model_extra["random_weights"] is True
        chunks = list(
            client.chat.completions.create(
                model=model.id, stream=True, max_tokens=8, messages=[{"role": "user", "content": "Hello!"}]
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log = log_path.read_text()
        assert "RANDOM" in log and "draining" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
