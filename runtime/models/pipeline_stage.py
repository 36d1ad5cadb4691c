"""Pipeline parallelism, model side: one stage's share of a Llama-shaped model and its forward.

A stage owns a contiguous range of decoder layers (capacity.stage_layer_ranges decides which); the first stage
also owns the embedding, the last the final norm and the LM head (a tied head keeps its own copy of the
embedding there: stages share no memory). The model class is the single-stage one, built on the meta device
as always and pruned here before anything is allocated (`prune_to_stage`), so a stage allocates and reads
only its own parameters, and parameter names stay the checkpoint's (`layers.17.mlp...`).

`PipelineStageModel` wraps the pruned model with the runner-facing interface of the unwrapped one
(`forward(input_ids, positions, kv_caches, meta)`, `compute_logits`, `shard`, `parallel`): a stage other
than the first receives the hidden states (and, on the fused CPU path, the separately carried residual
stream) from the previous stage instead of embedding, runs its layers over its own KV cache, and sends the
result on; only the last stage normalises and computes logits (the others answer None, as a tensor-parallel
rank > 0 does, so the runner returns no tokens from them). The layers run exactly the calls the single-stage
forward makes, in the same order, on the same values, so the output is bit-identical to one stage.

The single-stage forward in llama.py is untouched: with pipeline_parallel_size 1 nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Architectures whose model class is LlamaForCausalLM-shaped (embed_tokens, layers, norm, lm_head; one KV
# cache group). Gemma's per-layer KV cache groups and sandwich norms are not staged yet.
PIPELINE_MODEL_CLASSES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage. prev_rank / next_rank: the global ranks this rank receives from / sends to (the
    rank with the same tensor-parallel rank in the neighbouring stage), None at the ends."""

    index: int
    size: int
    layers: range  # global decoder-layer indices this stage owns
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1


class MissingLayer(nn.Module):
    """Stands in for a decoder layer another stage owns: no parameters, never called."""

    def forward(self, *args, **kwargs):  # pragma: no cover - a bug if reached
        raise RuntimeError("this decoder layer lives on another pipeline stage")


def prune_to_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Drop (on the meta model, before allocation) every module this stage does not own."""
    for i in range(len(model.layers)):
        if i not in stage.layers:
            model.layers[i] = MissingLayer()
    tied = model.lm_head is None
    if not stage.first and not (stage.last and tied):
        model.embed_tokens = None
    if not stage.last:
        model.norm = None
        model.lm_head = None


def owns_weight(hf_name: str, model: nn.Module, stage: PipelineStage) -> bool:
    """Whether a checkpoint tensor belongs to this stage (the loader skips the others without reading them)."""
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        return int(name.split(".", 2)[1]) in stage.layers
    if name.startswith("embed_tokens."):
        return model.embed_tokens is not None
    if name.startswith(("norm.", "lm_head.")):
        return stage.last
    return True


class PipelineStageModel(nn.Module):
    def __init__(self, model: nn.Module, stage: PipelineStage, dtype: torch.dtype):
        super().__init__()
        cls = type(model)
        if not any(c.__name__ in PIPELINE_MODEL_CLASSES for c in cls.__mro__):
            raise ValueError(f"pipeline parallelism does not support {cls.__name__} yet")
        self.model = model
        self.stage = stage
        self.dtype = dtype
        # What the runner and rank_info read from a model.
        self.config, self.shard, self.parallel, self.rotary = model.config, model.shard, model.parallel, model.rotary
        self.hidden_size = model.config.hf_config.hidden_size
        # The same modules as model.layers[i], in local order (a plain tuple: registered once, under model.).
        self.stage_layers = tuple(model.layers[i] for i in stage.layers)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        m, stage = self.model, self.stage
        if stage.first:
            x, residual = m.embed_tokens(input_ids), None
        else:
            x, residual = self._recv(positions.shape[0], positions.device, m.fused_cpu_ops)
        if m.fused_cpu_ops and x.is_cpu:  # llama.LlamaForCausalLM.forward's fused branch, over this stage's layers
            for layer, kv_cache in zip(self.stage_layers, kv_caches):
                x, residual = layer.forward_fused(x, residual, positions, m.rotary, kv_cache, meta)
            if not stage.last:
                return self._send(x, residual)
            return m.norm.forward_fused(x, residual) if residual is not None else m.norm.forward_fused(x)
        for layer, kv_cache in zip(self.stage_layers, kv_caches):
            x = layer(x, positions, m.rotary, kv_cache, meta)
        if not stage.last:
            return self._send(x, None)
        return m.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits on the last stage (tensor-parallel rank 0 of it); None elsewhere."""
        return self.model.compute_logits(hidden) if self.stage.last else None

    # -- activations between stages ---------------------------------------------------------------------
    def _send(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """One message per step: [tokens, hidden], or [2, tokens, hidden] with the residual stream (the fused
        CPU path carries it separately; the next stage's first norm adds it, as the next layer here would)."""
        import torch.distributed as dist

        payload = x.contiguous() if residual is None else torch.stack((x, residual))
        dist.send(payload, dst=self.stage.next_rank)
        return x

    def _recv(self, num_tokens: int, device, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch.distributed as dist

        # Both sides decide `fused` from the same config on the same device type, so the shapes agree.
        carries_residual = fused and device.type == "cpu"
        shape = (2, num_tokens, self.hidden_size) if carries_residual else (num_tokens, self.hidden_size)
        buf = torch.empty(shape, dtype=self.dtype, device=device)
        dist.recv(buf, src=self.stage.prev_rank)
        return (buf[0], buf[1]) if carries_residual else (buf, None)
