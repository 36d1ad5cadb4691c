"""Build a model from a local Hugging Face directory: config.json + one or more *.safetensors files, or a GGUF
file's prepared directory (runtime/gguf_model_dir.py), whose weights come dequantised from the file."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from kvserve.runtime import gguf_model_dir
from kvserve.runtime.config import ModelConfig, read_config_json
from kvserve.runtime.models import fp8, gguf_weights, pipeline_stage
from kvserve.runtime.models.llama import LlamaForCausalLM
from kvserve.runtime.models.moe import convert_experts_to_fp8
from kvserve.runtime.models.parallel_layers import SINGLE, ColumnParallelLinear, ParallelContext, RowParallelLinear
from kvserve.runtime.models.registry import model_class

logger = logging.getLogger("kvserve.loader")


def iter_safetensors(model_dir: str, show_progress: bool = True, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every checkpoint tensor; lazy=True yields safetensors slices instead (`get_slice`:
    indexing one reads only those bytes), so a tensor-parallel rank reads just its shard."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (kvserve loads safetensors only)")
    bar = None
    if show_progress and len(files) > 1:
        from tqdm import tqdm

        bar = tqdm(total=len(files), desc="Loading safetensors shards", unit="shard")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def build_meta_model(model_config: ModelConfig, attention_backend, parallel: ParallelContext = SINGLE):
    """The model (this rank's shard) on the meta device: every parameter with its final shape and dtype,
    no memory, no random init."""
    dtype = getattr(torch, model_config.dtype)
    with torch.device("meta"):
        model = model_class(model_config.architecture)(model_config, attention_backend, parallel).to(dtype)
        if model_config.weight_dtype == "fp8":  # decoder linears only: embeddings and the LM head stay 16-bit
            fp8.convert_linears(model.layers, (ColumnParallelLinear, RowParallelLinear))
            convert_experts_to_fp8(model.layers)
    return model


def weight_bytes(model) -> int:
    """Bytes of parameters and weight buffers (fp8 scales), the rotary tables excluded."""
    rotary = {id(getattr(model.rotary, "cos", None)), id(getattr(model.rotary, "sin", None))}
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if id(t) not in rotary)


def load_model(
    model_config: ModelConfig,
    attention_backend,
    device: str,
    parallel: ParallelContext = SINGLE,
    *,
    load_format: str,  # EngineArgs.load_format, resolved into EngineConfig (no second default here)
) -> LlamaForCausalLM:
    """The model, or with a tensor-parallel `parallel` this rank's shard of it (only the shard is allocated
    and only the shard's bytes are read from the safetensors files). load_format "dummy": random weights,
    no checkpoint read (init_dummy_weights)."""
    # Built on the meta device, then allocated once in the target dtype and filled from the checkpoint;
    # the rotary tables carry no checkpoint values, so they are recomputed.
    stage = parallel.stage  # pipeline parallelism: only this stage's layers are allocated and read
    model = build_meta_model(model_config, attention_backend, parallel)
    if stage is not None:
        pipeline_stage.prune_to_stage(model, stage)
    model = model.to_empty(device=device)
    model.rotary.build(device)
    if load_format == "dummy":
        init_dummy_weights(model, seed=parallel.rank)
    else:
        gguf = gguf_model_dir.gguf_file(model_config.model_dir)
        if gguf is not None:  # a GGUF model's prepared directory: the weights are the file's, dequantised here
            config = read_config_json(model_config.model_dir)  # written from the file's header when prepared
            weights = gguf_weights.iter_gguf(gguf, show_progress=parallel.rank == 0, config=config)
        else:
            weights = iter_safetensors(
                model_config.model_dir, show_progress=parallel.rank == 0, lazy=parallel.size > 1 or stage is not None
            )
        if stage is not None:
            weights = ((name, src) for name, src in weights if pipeline_stage.owns_weight(name, model, stage))
        model.load_weights(weights)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    rank = f" (tensor-parallel rank {parallel.rank}/{parallel.size})" if parallel.size > 1 else ""
    if stage is not None:
        rank += f" (pipeline stage {stage.index}/{stage.size}: layers {stage.layers.start}-{stage.layers.stop - 1})"
    logger.info(
        "loaded %s from %s%s: %.1fM parameters%s, %.1f MiB of weights (%s), %s",
        model_config.architecture,
        model_config.model_dir,
        " (dummy: random weights)" if load_format == "dummy" else "",
        num_params / 1e6,
        rank,
        weight_bytes(model) / 2**20,
        model_config.weight_dtype,
        device,
    )
    if stage is not None:
        return pipeline_stage.PipelineStageModel(model, stage, getattr(torch, model_config.dtype))
    return model


@torch.no_grad()
def init_dummy_weights(model, seed: int = 0) -> None:
    """Random weights in place on the model's device, for benchmarking a shape without its checkpoint
    (vLLM's load_format="dummy"): matrices N(0, 0.02), RMSNorm scales 1 (Gemma's offset form 0), biases 0;
    fp8 linears N(0, 1) codes with per-row scale 0.02, i.e. the same N(0, 0.02) weights."""
    gen = None
    for module in model.modules():
        is_norm = type(module).__name__.endswith("RMSNorm")
        offset_norm = type(module).__name__.startswith("Gemma")
        for name, param in module.named_parameters(recurse=False):
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
            if is_norm:
                param.fill_(0.0 if offset_norm else 1.0)
            elif name == "bias":
                param.zero_()
            elif param.dtype == fp8.FP8_DTYPE:  # no normal_ for float8: fill a float32 copy, row block by block
                for rows in param.view(-1, param.shape[-1]).split(1024):
                    codes = torch.empty(rows.shape, dtype=torch.float32, device=rows.device).normal_(generator=gen)
                    rows.copy_(codes.clamp_(-fp8.FP8_MAX, fp8.FP8_MAX).to(rows.dtype))
            else:
                param.normal_(0.0, 0.02, generator=gen)
        for name, buffer in module.named_buffers(recurse=False):
            if name.endswith("_scale"):  # fp8 per-row weight scales
                buffer.fill_(0.02)
