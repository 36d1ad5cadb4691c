"""LoRA under the tensor-parallel executor: the engine core's registry (lora/registry.py) manages adapters
through `WorkerLoraManagers`, which looks like a LoraManager to it but keeps no weights: every change goes to
every rank's own LoraManager as one LoRA call over the executor's pipes (LoraDescribe / LoraAdd / LoraRemove
in executor/worker_rpc.py: executor/multiproc.py -> tp_worker.py -> `handle` here), so all ranks hold the
same adapters, each its own share (lora/tp_shard.py).

The core reads, checks and hashes an adapter once (on its utility thread, never the step loop) against the
model's full shapes, which the ranks reported at start-up; then, under the registry's lock -- the one the core
holds while a step runs, so a call never interleaves with a step on the pipes -- it sends the adapter's
tensors (pickled once for all ranks). Ranks never read adapter files after start-up, so they cannot end up
with different bytes, and a rank never fails on a bad adapter (a failed rank stops the whole group).
Start-up adapters (--lora-modules) are read by every rank; their content identities must agree.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

from kvserve.runtime.executor.worker_rpc import LoraAdd, LoraDescribe, LoraRemove, WorkerCall
from kvserve.runtime.lora.adapter import LoraAdapter
from kvserve.runtime.lora.manager import Key, check_adapter


@dataclass(frozen=True)
class LoraRankState:
    """A rank's answer to LoraDescribe: what its LoraManager was built for and holds."""

    full_shapes: dict[Key, tuple[int, int]]  # (module, target) -> the unsharded (in, out) features
    identities: dict[str, str]  # loaded adapter name -> content identity
    max_cpu_loras: int


def handle(runner: Any, call: LoraDescribe | LoraAdd | LoraRemove) -> LoraRankState | None:
    """A rank's side of one LoRA executor call (runs between steps, in the worker's loop)."""
    manager = runner.lora
    if isinstance(call, LoraDescribe):
        return LoraRankState(
            dict(manager.full_shapes), {name: a.identity for name, a in manager.cpu.items()}, manager.max_cpu_loras
        )
    if isinstance(call, LoraAdd):
        manager.add(call.adapter)
    else:
        manager.remove(call.name)
    return None


class WorkerLoraManagers:
    """The AdapterStore the registry uses (lora/registry.py: targets, check, add, remove, cpu, max_cpu_loras),
    over every rank's manager. call(WorkerCall) -> one reply per rank (MultiprocExecutor.call)."""

    def __init__(self, call: Callable[[WorkerCall], list]):
        self._call = call
        replies: list[LoraRankState] = call(LoraDescribe())
        first = replies[0]
        for rank, reply in enumerate(replies):
            if reply.identities != first.identities or reply.full_shapes != first.full_shapes:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} loaded other --lora-modules than rank 0 "
                    f"({reply.identities} != {first.identities}): do all nodes have the same files?"
                )
        self.full_shapes: dict[Key, tuple[int, int]] = first.full_shapes
        self.max_cpu_loras: int = first.max_cpu_loras
        # name -> the adapter without its weights (the ranks hold those): its identity keys the prefix cache
        self.cpu: OrderedDict[str, LoraAdapter] = OrderedDict(
            (name, LoraAdapter(name, 0, 0.0, {}, identity)) for name, identity in first.identities.items()
        )

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.full_shapes}

    def check(self, adapter: LoraAdapter) -> None:
        check_adapter(adapter, self.full_shapes)

    def add(self, adapter: LoraAdapter) -> None:
        self._call(LoraAdd(adapter))
        self.cpu[adapter.name] = replace(adapter, weights={})
        self.cpu.move_to_end(adapter.name)

    def remove(self, name: str) -> None:
        self._call(LoraRemove(name))
        self.cpu.pop(name, None)
