"""UniprocExecutor: the Executor (executor/base.py) of a one-rank world, the ModelRunner in the core's process.

submit() runs the step at once (nothing overlaps in one process), so collect() never waits; the micro-batch
loop that uses submit/collect only runs with pipeline parallelism, which is always multiprocess.
"""

from __future__ import annotations

import os

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.runtime.executor.model_runner import ModelRunner
from kvserve.runtime.executor.rank_info import RankInfo, measure_rank


class UniprocExecutor:
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self.num_blocks: int = self.runner.num_blocks
        self.num_host_blocks: int = self.runner.num_host_blocks
        self.kv_block_layout: str = self.runner.kv_block_layout
        self.kv_cache_bytes: int = self.runner.kv_cache_bytes
        self.startup_phases: dict[str, float] = self.runner.startup_phases
        self.lora = self.runner.lora
        self._num_submitted = 0
        self._outputs: dict[int, ModelRunnerOutput] = {}  # submitted, not collected yet

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def submit(self, sched: SchedulerOutput) -> int:
        out = self.execute(sched)
        self._num_submitted += 1
        self._outputs[self._num_submitted] = out
        return self._num_submitted

    def collect(self, handle: int) -> ModelRunnerOutput:
        if handle not in self._outputs:
            raise ValueError(f"batch {handle} was never submitted or was collected already")
        return self._outputs.pop(handle)

    def is_done(self, handle: int) -> bool:
        return handle in self._outputs

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process, so a failure is the step's own exception."""

    def shutdown(self) -> None:
        """The runner's tensors go with the executor; a P/D side channel (a thread, a port) stops here."""
        if self.runner.kv_pull is not None:
            self.runner.kv_pull.shutdown()

    def describe_ranks(self) -> list[RankInfo]:
        return [measure_rank(self.runner, 0, os.getpid())]

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self) -> None:
        self.runner.wake_up()
