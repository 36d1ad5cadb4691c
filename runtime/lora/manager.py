"""Device slots for resident adapters plus an LRU of host-memory adapters (--max-loras / --max-cpu-loras),
and forward hooks that add the batched delta after each base linear (additive: the base layers and their
CPU fast path are untouched). A row-parallel layer (kvserve's o_proj / down_proj) takes its delta through
`lora_delta` instead, before its all-reduce (models/parallel_layers.RowParallelLinear).

Under tensor parallelism each rank's manager keeps only its share of every adapter (`shard`: lora/tp_shard.py);
adapters are checked against the model's full (unsharded) shapes, so every rank accepts or refuses the same
adapter."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from kvserve.runtime.lora.adapter import LoraAdapter, LoraLoadError
from kvserve.runtime.lora.batched import LoraSlots, lora_delta

Key = tuple[int, str]  # (layer index, HF target module name)
Shard = Callable[[Key, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def check_adapter(adapter: LoraAdapter, shapes: dict[Key, tuple[int, int]]) -> None:
    """LoraLoadError naming the first adapter weight this model has no module for (a layer index past the
    model's layers, or a target the layer lacks: such a weight would otherwise be silently ignored), or whose
    A [r, in] / B [out, r] do not fit the module's full (in, out) features."""
    targets = sorted({t for _, t in shapes})
    for key in sorted(adapter.weights):
        layer, target = key
        if key not in shapes:
            raise LoraLoadError(
                f"adapter {adapter.name!r}: layer {layer} {target}: this model has no such module "
                f"({len({k[0] for k in shapes})} layers, targets {targets})"
            )
        a, b = adapter.weights[key]
        fan_in, fan_out = shapes[key]
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoraLoadError(
                f"adapter {adapter.name!r}: layer {layer} {target}: lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)} do not fit the model's {target} ({fan_in} in, {fan_out} out features)"
            )


class LoraManager:
    def __init__(
        self,
        modules: dict[Key, nn.Linear],
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        fused: list[tuple[nn.Module, int, list[tuple[str, int, int]]]] = (),
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        shard: Shard | None = None,
        full_shapes: dict[Key, tuple[int, int]] | None = None,
    ):
        """modules: (layer, target) -> a base linear of that one target (HF layout), or a RowParallelLinear.
        fused: (module, layer, [(target, in_features, out_features), ...]) for a fused projection (kvserve's
        qkv_proj / gate_up_proj): its delta is the per-target deltas concatenated in the fused output order.
        Features are this rank's; shard(key, A, B) -> this rank's (A, B) (None: whole), full_shapes the
        model's unsharded (in, out) per key (None: the local ones)."""
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max(max_cpu_loras, max_loras)
        self.shard = shard
        self.cpu: OrderedDict[str, LoraAdapter] = OrderedDict()  # name -> adapter, LRU order
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident name -> device slot, LRU order
        self.token_slots: torch.Tensor | None = None  # set per forward: [tokens] slot index, -1 = base
        self.slots: dict[tuple[int, str], LoraSlots] = {}
        for key, mod in modules.items():
            w = mod.weight
            # The activation dtype when given (under --dtype fp8 the weight is fp8; the delta is not)
            slot_dtype, slot_device = dtype or w.dtype, device or w.device
            self.slots[key] = LoraSlots(max_loras, max_rank, w.shape[1], w.shape[0], slot_dtype, slot_device)
            if hasattr(mod, "lora_delta"):  # row-parallel: the delta joins the partial sums before the reduce
                mod.lora_delta = self._delta(key)
            else:
                mod.register_forward_hook(self._hook(key))
        for mod, layer, parts in fused:
            for target, fan_in, fan_out in parts:
                self.slots[(layer, target)] = LoraSlots(max_loras, max_rank, fan_in, fan_out, dtype, device)
            mod.register_forward_hook(self._fused_hook([(layer, t, o) for t, _, o in parts]))
        local = {k: (s.a.shape[2], s.b.shape[1]) for k, s in self.slots.items()}
        self.full_shapes: dict[Key, tuple[int, int]] = dict(full_shapes) if full_shapes is not None else local

    def _delta(self, key):
        def delta(x: torch.Tensor) -> torch.Tensor | None:
            if self.token_slots is None:
                return None
            return lora_delta(x.reshape(-1, x.shape[-1]), self.token_slots, self.slots[key])

        return delta

    def _hook(self, key):
        def hook(module, args, output):
            if self.token_slots is None:
                return output
            x = args[0]
            d = lora_delta(x.reshape(-1, x.shape[-1]), self.token_slots, self.slots[key])
            return output if d is None else output + d.reshape(output.shape)

        return hook

    def _fused_hook(self, parts: list[tuple[int, str, int]]):
        def hook(module, args, output):
            if self.token_slots is None:
                return output
            x = args[0].reshape(-1, args[0].shape[-1])
            deltas = [lora_delta(x, self.token_slots, self.slots[(layer, t)]) for layer, t, _ in parts]
            if all(d is None for d in deltas):
                return output
            full = [x.new_zeros(x.shape[0], o) if d is None else d for d, (_, _, o) in zip(deltas, parts)]
            return output + torch.cat(full, dim=-1).reshape(output.shape)

        return hook

    @property
    def targets(self) -> set[str]:
        """The target modules this model has slots for (a sparse MoE block's experts have none)."""
        return {target for _, target in self.slots}

    def check(self, adapter: LoraAdapter) -> None:
        check_adapter(adapter, self.full_shapes)

    def add(self, adapter: LoraAdapter) -> None:
        """Keep (this rank's share, under tensor parallelism) in host memory (LRU evicts the oldest
        non-resident one past --max-cpu-loras). The adapter must have passed check()."""
        if self.shard is not None:
            adapter = replace(adapter, weights={k: self.shard(k, a, b) for k, (a, b) in adapter.weights.items()})
        if adapter.name in self.slot_of:  # reload under the same name: refresh the device copy
            self._write(self.slot_of[adapter.name], adapter)
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        while len(self.cpu) > self.max_cpu_loras:
            victim = next((n for n in self.cpu if n not in self.slot_of), None)
            if victim is None:
                break
            del self.cpu[victim]

    def remove(self, name: str) -> None:
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            for s in self.slots.values():
                s.clear(slot)
        self.cpu.pop(name, None)

    def activate(self, name: str, pinned: set[str] = frozenset()) -> int:
        """Slot for `name`, loading it into a free or least-recently-used slot not in `pinned` (the
        adapters the current step uses). The scheduler guarantees at most max_loras per step."""
        if name in self.slot_of:
            self.slot_of.move_to_end(name)
            self.cpu.move_to_end(name)
            return self.slot_of[name]
        used = set(self.slot_of.values())
        free = [i for i in range(self.max_loras) if i not in used]
        if free:
            slot = free[0]
        else:
            victim = next((n for n in self.slot_of if n not in pinned), None)
            if victim is None:
                raise RuntimeError("more distinct adapters in one step than --max-loras")
            slot = self.slot_of.pop(victim)
        self._write(slot, self.cpu[name])
        self.slot_of[name] = slot
        return slot

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        for key, s in self.slots.items():
            ab = adapter.weights.get(key)
            if ab is None:
                s.clear(slot)
            else:
                s.set(slot, ab[0], ab[1], adapter.scaling)
