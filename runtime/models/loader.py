"""Build a model from a local Hugging Face directory: config.json + one or more *.safetensors files."""
from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import torch

from kvserve.runtime.config import ModelConfig
from kvserve.runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger("kvserve.loader")


def iter_safetensors(model_dir: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
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
                yield name, f.get_tensor(name)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def load_model(model_config: ModelConfig, attention_backend, device: str) -> LlamaForCausalLM:
    dtype = getattr(torch, model_config.dtype)
    # Built on the meta device (no memory, no random init), then allocated once in the target dtype and
    # filled from the checkpoint; the rotary tables carry no checkpoint values, so they are recomputed.
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config, attention_backend).to(dtype)
    model = model.to_empty(device=device)
    model.rotary.build(device)
    model.load_weights(iter_safetensors(model_config.model_dir))
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s from %s: %.1fM parameters, %s, %s", model_config.architecture, model_config.model_dir,
                num_params / 1e6, model_config.dtype, device)
    return model
