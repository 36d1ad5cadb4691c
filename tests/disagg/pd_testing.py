"""Helpers for the P/D tests: engines with a NixlConnector config, and driving a request to its end."""

from __future__ import annotations

import json
import socket

from kvserve.runtime.engine.llm_engine import LLMEngine
from kvserve.runtime.sampling_params import SamplingParams

ENGINE_KWARGS = dict(num_kv_blocks=64, block_size=16, max_model_len=512, seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transfer_config(role: str, engine_id: str, port: int | None = None, **extra) -> str:
    if port is not None:
        extra.update(side_channel_host="127.0.0.1", side_channel_port=port)
    return json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id, "kv_connector_extra_config": extra}
    )


def engine(model_dir: str, kv_transfer_config: str | None = None, **kwargs) -> LLMEngine:
    return LLMEngine.from_kwargs(model_dir, kv_transfer_config=kv_transfer_config, **{**ENGINE_KWARGS, **kwargs})


def run(eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, *others: LLMEngine, max_steps=5000):
    """Step `eng` (and `others`, e.g. the prefill engine whose lease must see the notification) until the
    request finishes; its final RequestOutput."""
    eng.add_request(rid, prompt, params)
    for _ in range(max_steps):
        done = [o for o in eng.step() if o.finished]
        for other in others:
            if other.has_unfinished_requests():
                other.step()
        if done:
            return done[0]
    raise AssertionError(f"request {rid} did not finish in {max_steps} steps")


def drain(*engines: LLMEngine, max_steps: int = 5000) -> None:
    """Step (all of them, in turn: a pull needs the prefill engine's steps) until no request, lease or pull is
    left."""
    for _ in range(max_steps):
        busy = [e for e in engines if e.has_unfinished_requests()]
        if not busy:
            return
        for e in busy:
            e.step()
    raise AssertionError("engine still busy")


def greedy(max_tokens: int, kv_transfer_params: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_transfer_params=kv_transfer_params)
