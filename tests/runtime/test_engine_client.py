"""Every engine AsyncEngine can drive implements the EngineClient seam (runtime/engine/client.py) with the
protocol's exact signatures, so AsyncEngine never has to probe an engine with getattr."""

from __future__ import annotations

import inspect

import pytest

from kvserve.runtime.engine.attached_core_client import AttachedCoreClient
from kvserve.runtime.engine.client import EngineClient
from kvserve.runtime.engine.core_client import CoreClient
from kvserve.runtime.engine.llm_engine import LLMEngine

METHODS = sorted(name for name, value in vars(EngineClient).items() if callable(value) and not name.startswith("_"))
ATTRIBUTES = sorted(EngineClient.__annotations__)


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("engine_class", [LLMEngine, CoreClient, AttachedCoreClient])
def test_engine_implements_the_seam(engine_class):
    assert {"add_request", "abort_request", "step", "notify", "check_health"} <= set(METHODS)
    for name in METHODS:
        assert _params(getattr(engine_class, name)) == _params(getattr(EngineClient, name)), name


def test_in_process_engine_is_an_engine_client(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    engine = LLMEngine.from_kwargs(model_dir, max_model_len=64, num_kv_blocks=16, block_size=8)
    try:
        assert isinstance(engine, EngineClient)
        for name in ATTRIBUTES:
            assert hasattr(engine, name), name
        engine.notify()  # a no-op in process, but part of the seam
        engine.check_health()
    finally:
        engine.shutdown()
