"""Sleep mode on one rank (vLLM's --enable-sleep-mode): free the accelerator without stopping the process, and
wake in a fraction of a cold start.

- level 1: the KV cache is freed and the weights move to host memory (on a CPU device they are host memory
  already and stay where they are); wake copies them back and allocates a fresh KV cache.
- level 2: the KV cache and the weights are freed; wake reads the weights again from the checkpoint (the same
  load as at start-up, CPU prepacking included) -- for a replica whose weights will change, or whose host
  memory is needed elsewhere.

Decode CUDA graphs point into the KV cache, so they are dropped with it and captured again on wake. The engine
core only calls this with no request in flight (engine/sleep_control.py), so no step runs against a freed
cache, and it resets the prefix cache on wake: the blocks it names were freed. A fresh zeroed KV cache and the
same weights make the next greedy answers token-identical to those before the sleep.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from kvserve.runtime.config import SLEEP_LEVELS
from kvserve.runtime.models.loader import load_model

logger = logging.getLogger("kvserve.runner")


def _release_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sleep(runner: Any, level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if runner.sleep_level:
        return  # asleep already (vLLM: a second /sleep is a no-op)
    runner.decode_graphs = None  # they hold the KV cache's addresses
    runner.kv_caches = []
    if level == 2:
        runner.model = None
        runner.greedy_head = None  # it holds the LM head's weight and its bf16 copy
    elif runner.device.type != "cpu":
        runner.model.to("cpu")
    runner.sleep_level = level
    _release_device_memory(runner.device)
    logger.info("asleep at level %d: KV cache freed, weights %s", level, "dropped" if level == 2 else "in host memory")


def wake_up(runner: Any) -> None:
    level = runner.sleep_level
    if not level:
        return
    config = runner.config
    if level == 2:
        runner.model = load_model(
            config.model, runner.attention, config.device, runner.parallel, load_format=config.load_format
        )
        runner._pack_weights()
    elif runner.device.type != "cpu":
        runner.model.to(runner.device)
    runner.kv_caches = runner._allocate_kv_cache(runner.num_blocks)
    if config.cuda_graph_sizes:
        runner._capture_decode_graphs()
    runner._sync_for_timing()
    runner.sleep_level = 0
    logger.info("awake (from level %d)", level)
