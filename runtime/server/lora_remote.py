"""LoRA registry calls across the API-server / engine-core boundary (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, and the authoritative list behind `/v1/models`).

The engine core runs them on a utility thread beside its step loop (runtime/engine/core_utilities.py). This
is the API server's side: `call` goes through the CoreClient (the core in its own process) or, with
`--inprocess-engine`, straight to the in-process core's registry on a pool thread. `served_adapters` is
this server's view; a name it does not know is checked with the core before a 404 (`resolve`), so an
adapter loaded through another API server of the group is accepted at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve.runtime.engine.core_messages import UtilityResult
from kvserve.runtime.engine.core_utilities import run_utility
from kvserve.runtime.lora.errors import LoraRequestError

logger = logging.getLogger("kvserve.lora")

# vLLM's switch for the load/unload routes (its envs.py: "1" or "true", any case); kvserve also has
# `kvserve serve --allow-runtime-lora-updating`.
ENV_SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
CALL_TIMEOUT_S = 600.0  # a load reads the adapter's files: bounded, but generous for network filesystems


def runtime_updating_allowed(allow_flag: bool) -> bool:
    return allow_flag or os.environ.get(ENV_SWITCH, "0").strip().lower() in ("1", "true")


_local_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-lora-load")


def _client(state: Any) -> Any:
    return state.engine.engine  # AsyncEngine -> its EngineClient (CoreClient or LLMEngine)


def served_adapters(state: Any) -> dict[str, str]:
    """This API server's view of the served adapters (name -> directory)."""
    from kvserve.runtime.engine.core_client import CoreClient

    if state.engine is None:
        return dict(state.lora_modules)
    client = _client(state)
    if isinstance(client, CoreClient):
        return dict(client.lora_adapters)
    registry = client.core.lora_registry
    return registry.adapters() if registry is not None else {}


async def call(state: Any, method: str, *args: Any) -> dict[str, str]:
    """One registry call, answered by the engine core; LoraRequestError when refused."""
    from kvserve.runtime.engine.core_client import CoreClient

    client = _client(state)
    if not isinstance(client, CoreClient):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_local_pool, run_utility, client.core, method, list(args))
    future = client.call_utility(method, list(args))
    state.engine._wake()  # the engine thread reads the core's answer: have it look now, not after its idle wait
    try:
        result: UtilityResult = await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise LoraRequestError(504, None, "timeout", f"the engine core did not answer {method} in time") from None
    if result.status:
        raise LoraRequestError(result.status, result.param, result.code or "error", result.message)
    client.lora_adapters = dict(result.value)
    return dict(result.value)


async def resolve(state: Any, name: str) -> bool:
    """Whether `name` is a served adapter: this server's view, else the core's (an adapter just loaded
    through another API server of the group)."""
    if name in served_adapters(state):
        return True
    if state.engine is None or not state.lora_enabled:
        return False
    return name in await call(state, "list_lora_adapters")
