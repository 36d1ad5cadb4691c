"""Load one LoRA adapter in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors).

Every problem is a LoraLoadError naming the field, so the server can answer 4xx instead of crashing.
Scaling follows PEFT: lora_alpha / r, or lora_alpha / sqrt(r) when use_rslora is set.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraLoadError(ValueError):
    """Bad adapter: the message names the file or field (served as HTTP 400)."""


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # (layer index, HF module name) -> (A [rank, in], B [out, rank])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    # Content hash of config + weights: the identity prefix caching keys on (a reload under the same name
    # with different weights gets a different identity, so stale KV blocks are never reused).
    identity: str = ""


def load_peft_adapter(name: str, path: str, max_rank: int, model_modules: set[str] | None = None) -> LoraAdapter:
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise LoraLoadError(f"adapter {name!r}: missing {os.path.basename(p)} in {path}")
    try:
        with open(config_path, "rb") as f:
            raw_config = f.read()
        config = json.loads(raw_config)
    except (OSError, ValueError) as e:
        raise LoraLoadError(f"adapter {name!r}: adapter_config.json is not valid JSON ({e})") from e
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoraLoadError(f"adapter {name!r}: adapter_config.json field 'r' must be a positive integer")
    if rank > max_rank:
        raise LoraLoadError(f"adapter {name!r}: rank r={rank} is above --max-lora-rank={max_rank}")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    for t in targets:
        short = t.split(".")[-1]
        if short not in SUPPORTED_TARGETS or (model_modules is not None and short not in model_modules):
            known = sorted(model_modules) if model_modules is not None else list(SUPPORTED_TARGETS)
            raise LoraLoadError(
                f"adapter {name!r}: target module {t!r} (adapter_config.json target_modules) is not in this "
                f"model {known}"
            )
    try:
        from safetensors.torch import load_file

        tensors = load_file(weights_path)
    except Exception as e:  # safetensors raises several types for a truncated/corrupt file
        raise LoraLoadError(f"adapter {name!r}: adapter_model.safetensors is corrupt ({e})") from e
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            continue
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_TARGETS:
            raise LoraLoadError(f"adapter {name!r}: tensor {key!r} targets unsupported module {module!r}")
        parts.setdefault((layer, module), {})[ab] = t
    weights = {}
    for k, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoraLoadError(f"adapter {name!r}: layer {k[0]} {k[1]} has lora_A or lora_B missing")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoraLoadError(
                f"adapter {name!r}: layer {k[0]} {k[1]} shapes {tuple(a.shape)}/{tuple(b.shape)} != r={rank}"
            )
        weights[k] = (a, b)
    if not weights:
        raise LoraLoadError(f"adapter {name!r}: adapter_model.safetensors holds no lora_A/lora_B weights")
    h = hashlib.sha256(raw_config)
    for k in sorted(weights):
        for t in weights[k]:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return LoraAdapter(name=name, rank=rank, scaling=float(scaling), weights=weights, identity=h.hexdigest()[:32])
