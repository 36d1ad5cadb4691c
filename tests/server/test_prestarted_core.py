"""A prestarted engine core (engine/core_client.PrestartedCore, issue 43's start chain): started before its config
exists, it serves once handed one, and leaves when none will come (cancelled, or the pipe dropped)."""

from __future__ import annotations

import time

import pytest

from kvserve.runtime.config import make_engine_config
from kvserve.runtime.engine.core_client import CoreClient, PrestartedCore
from kvserve.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)


def test_cancelled_prestart_leaves_at_once():
    prestarted = PrestartedCore()
    started = time.monotonic()
    prestarted.cancel()
    assert not prestarted.proc.is_alive()
    assert time.monotonic() - started < 5
    prestarted.cancel()  # idempotent


def test_pipe_closed_unsent_the_core_leaves_by_itself():
    prestarted = PrestartedCore()
    prestarted._writer.close()  # as when the API server dies before handing over
    prestarted.proc.join(120)  # after its imports it reads EOF
    assert prestarted.proc.exitcode == 0


def test_handed_over_core_serves_and_reports_the_preload(demo_model_dir):
    prestarted = PrestartedCore()
    client = CoreClient(
        make_engine_config(str(demo_model_dir), kv_cache_bytes=8 << 20, max_model_len=512), prestarted=prestarted
    )
    try:
        assert client.proc is prestarted.proc
        prestarted.cancel()  # a no-op once handed over: the client owns the process
        assert client.proc.is_alive()
        assert {"engine_preload", "engine_process_start", "weight_load"} <= set(client.startup_phases)
        assert client.startup_phases["engine_preload"] > 0
        client.add_request("r0", "hello", SamplingParams(max_tokens=4, temperature=0.0))
        outputs = []
        deadline = time.monotonic() + 60
        while client.has_unfinished_requests() and time.monotonic() < deadline:
            outputs += client.step()
        assert outputs and outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    finally:
        client.shutdown()


def test_a_prestarted_core_that_died_is_a_clear_startup_error(demo_model_dir):
    prestarted = PrestartedCore()
    prestarted.proc.kill()
    prestarted.proc.join(10)
    with pytest.raises(RuntimeError, match="engine core process died while starting"):
        CoreClient(
            make_engine_config(str(demo_model_dir), kv_cache_bytes=8 << 20, max_model_len=512), prestarted=prestarted
        )
