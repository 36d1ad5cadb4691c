"""The Executor protocol: everything the engine core may ask of whatever runs the model.

Two implementations: `UniprocExecutor` (executor/uniproc.py) wraps one ModelRunner in the core's own process;
`MultiprocExecutor` (executor/multiproc.py) drives one worker process per rank (tensor x pipeline parallel).
The core holds an `Executor` and calls only what is written here -- no attribute probing -- so a third
executor (another transport, a remote pool) is a class with these members.

The step seam, and where a KV connector plugs in: the core sends one SchedulerOutput per step (`execute`, or
`submit` then `collect` for pipelined micro-batches) and gets one ModelRunnerOutput back. Both carry a KV
connector section: SchedulerOutput.kv_connector lists, per request, the KV to load into its blocks before the
forward and the KV to save after it (core/outputs.py, KVConnectorStep); the answer
ModelRunnerOutput.finished_sending / finished_receiving names the requests whose transfers completed. The host
KV tier (--kv-offloading-size, docs/kv_offload.md) fills the first in the scheduler (core/tier_connector.py),
acts on it in the runner (executor/host_tier.py; every rank, under the multiproc executor: the same
SchedulerOutput reaches all of them) and reports through the second -- vLLM's KVConnectorBase_V1 split into a
scheduler half and a worker half. Prefill/decode disaggregation (--kv-transfer-config) plugs in the same
way: core/pd_connector.py fills KVConnectorStep.pull, executor/kv_pull.py reads the blocks over NIXL and reports
pulls in finished_receiving / failed_receiving and released leases in finished_sending.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.runtime.executor.rank_info import RankInfo
    from kvserve.runtime.lora.registry import AdapterStore


class Executor(Protocol):
    # KV sizing, fixed at start-up: every rank holds the same number of blocks (the smallest any rank found).
    num_blocks: int  # device KV blocks per rank, the null block 0 included
    num_host_blocks: int  # swap-space blocks in host RAM per rank (0: no swap space)
    kv_block_layout: str  # the element order within a KV block (CacheConfig.kv_block_layout)
    kv_cache_bytes: int  # the device KV cache per rank (the largest stage's, with pipeline parallelism)
    # Seconds per start-up phase (runtime/startup_phases.py); the API server exports them once ready.
    startup_phases: dict[str, float]
    # --enable-lora: the adapters the model holds, managed by the core's LoRA registry; None without LoRA.
    lora: AdapterStore | None

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output (the sampling rank's)."""

    def submit(self, sched: SchedulerOutput) -> int:
        """Start one step without waiting for it; returns the handle collect() takes. Steps run in the order
        they were submitted."""

    def collect(self, handle: int) -> ModelRunnerOutput:
        """The output of a submitted step (waits for it)."""

    def is_done(self, handle: int) -> bool:
        """Whether collect(handle) would return without waiting (no I/O beyond a poll)."""

    def check_health(self) -> None:
        """Raise WorkerDiedError if a rank is gone (cheap: no round trip)."""

    def shutdown(self) -> None:
        """Stop every rank (idempotent); the executor is unusable afterwards."""

    def describe_ranks(self) -> list[RankInfo]:
        """What each rank holds, measured there (parameter and KV bytes, layers, heads), in rank order."""

    def sleep(self, level: int) -> None:
        """--enable-sleep-mode, on every rank: free the KV cache; level 1 keeps the weights in host memory, level
        2 drops them (executor/sleep_mode.py). Only with no step in flight; a no-op when asleep."""

    def wake_up(self) -> None:
        """Undo sleep() on every rank (weights back or re-read, a fresh KV cache); a no-op when awake."""


def create_executor(config: EngineConfig) -> Executor:
    """One process per rank when the world has several (this process then only schedules), else the model
    runs here."""
    if config.world_size > 1:
        from kvserve.runtime.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from kvserve.runtime.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
