"""The pod verifies its plan: on CUDA a planned --kv-cache-bytes is checked against the profiled weights +
activations (pure arithmetic here, fed with the numbers torch.cuda would report), and a rejection becomes a
one-line termination message with the prefix the operator recognises."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.runtime.executor import kv_sizing
from kvserve.runtime.server.termination import PLAN_REJECTED_PREFIX, STARTUP_FAILED_PREFIX, termination_message

GiB = 2**30


@dataclasses.dataclass
class _Cache:
    kv_cache_bytes: int | None = 10 * GiB
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9


@dataclasses.dataclass
class _Config:
    cache: _Cache = dataclasses.field(default_factory=_Cache)


def test_a_budget_that_fits_the_device_passes():
    memory = kv_sizing.DeviceMemory(total_bytes=80 * GiB, peak_bytes=60 * GiB, non_torch_bytes=1 * GiB)
    kv_sizing.check_budget_fits_device(_Config(), memory, 19 * GiB)


def test_a_budget_the_device_cannot_hold_is_rejected_with_numbers():
    memory = kv_sizing.DeviceMemory(total_bytes=80 * GiB, peak_bytes=72 * GiB, non_torch_bytes=1 * GiB)
    with pytest.raises(kv_sizing.PlanRejected) as err:
        kv_sizing.check_budget_fits_device(_Config(), memory, 10 * GiB)
    assert err.value.param == "kv_cache_bytes"
    assert "83.00 GiB > 80.00 GiB" in str(err.value) and "activationReserveMiB" in str(err.value)
    message = termination_message(err.value)
    assert message.startswith(PLAN_REJECTED_PREFIX) and "\n" not in message


def test_other_startup_failures_are_not_called_plan_rejections():
    message = termination_message(FileNotFoundError("no *.safetensors weights in /mnt/models"))
    assert message.startswith(STARTUP_FAILED_PREFIX) and "safetensors" in message
    assert len(termination_message(ValueError("x" * 10_000))) == 4096  # the kubelet keeps 4 KiB
