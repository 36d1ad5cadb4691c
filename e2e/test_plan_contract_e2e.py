"""The capacity contract end to end on this machine: plan the stories260K shape on a made-up GPU with a
budget of a few MiB, render the pod, run `kvserve serve` with exactly the rendered engine args (model path,
host and port swapped for local ones), and read the pod's real capacity from /metrics. Then the same pod
with a budget one block short: it exits non-zero and leaves the one-line termination message the operator
turns into a `RuntimeRejectedPlan` condition."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from kvserve_testing import STORIES_DIR

from kvserve.operator import render
from kvserve.operator import spec as spec_mod
from kvserve.runtime import capacity
from kvserve.runtime.server.termination import PLAN_REJECTED_PREFIX
from tests.server.conftest import free_port

STORIES = STORIES_DIR
pytestmark = pytest.mark.timeout(180)

SHAPE_KEYS = {
    "num_layers": "numLayers",
    "num_attention_heads": "numAttentionHeads",
    "num_kv_heads": "numKeyValueHeads",
    "head_dim": "headDim",
    "hidden_size": "hiddenSize",
    "num_parameters": "numParameters",
    "max_position_embeddings": "maxPositionEmbeddings",
    "intermediate_size": "intermediateSize",
    "vocab_size": "vocabSize",
    "architecture": "architecture",
    "tie_word_embeddings": "tieWordEmbeddings",
}


def stories_spec() -> dict:
    shape = capacity.shape_from_hf_config(json.loads((STORIES / "config.json").read_text()))
    return {
        "model": {
            "name": "stories260k",
            "uri": "file:///models/stories260K",
            "dtype": "float32",
            "shape": {camel: getattr(shape, snake) for snake, camel in SHAPE_KEYS.items()},
        },
        # 1 GiB x 0.1 = 102.4 MiB budget; 96 MiB reserved for activations: ~6 MiB of weights + KV.
        "gpu": {"memoryMiB": 1024, "product": "made-up-gpu"},
        "engine": {
            "gpuMemoryUtilization": 0.1,
            "activationReserveMiB": 96,
            "runtimeOverheadMiB": 0,
            "maxModelLen": 256,
            "maxNumSeqs": 8,
            "maxNumBatchedTokens": 256,
        },
    }


def local_command(command: list[str], port: int) -> list[str]:
    """The rendered container command with only the model path, host and port changed."""
    args = list(command)
    args[2] = str(STORIES)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    assert args[:2] == ["kvserve", "serve"]
    return [sys.executable, "-m", "kvserve.cli.main", *args[1:]]


def start(cmd: list[str], env: dict) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    return proc, log


@pytest.fixture
def resolved():
    r = spec_mod.resolve(stories_spec())
    assert r.plan.fits, r.plan.message
    assert r.plan.kv_cache_bytes_per_gpu < 8 * 2**20  # a budget of a few MiB
    return r


def test_served_capacity_equals_the_plan(resolved, tmp_path):
    command = render.render(resolved, "stories", "default")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    port = free_port()
    env = {**os.environ, "KVSERVE_TERMINATION_LOG": str(tmp_path / "termination-log")}
    proc, log = start(local_command(command, port), env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "server exited:\n" + "".join(log)
            assert time.monotonic() < deadline, "server never became healthy:\n" + "".join(log)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        served = re.search(r"^kvserve:kv_capacity_tokens\{[^}]*\} (\S+)$", metrics, re.M)
        assert served, metrics[:2000]
        assert float(served.group(1)) == resolved.plan.kv_tokens
        info = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1\.0$", metrics, re.M).group(1)
        assert f'num_gpu_blocks="{resolved.plan.num_blocks_per_gpu}"' in info
        text = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=30,
            json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        ).json()
        assert text["choices"][0]["text"].strip()
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_budget_one_block_short_is_rejected_with_a_termination_message(resolved, tmp_path):
    command = render.render(resolved, "stories", "default")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    layout = capacity.kv_layout(resolved.model, "float32", "auto", 16, 1)
    one_sequence = layout.budget_for_blocks(capacity.blocks_per_sequence(256, 16) + capacity.NULL_BLOCKS)
    command[command.index("--kv-cache-bytes") + 1] = str(one_sequence - layout.bytes_per_block)
    log_path = tmp_path / "termination-log"
    proc, log = start(local_command(command, free_port()), {**os.environ, "KVSERVE_TERMINATION_LOG": str(log_path)})
    assert proc.wait(120) == 1, "".join(log)
    message = log_path.read_text().strip()
    assert message.startswith(PLAN_REJECTED_PREFIX) and "max_model_len=256" in message, message
    assert "\n" not in message
