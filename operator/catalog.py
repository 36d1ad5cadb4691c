"""Built-in model and GPU catalogs: what the planner needs to size KV cache without a hub at reconcile time.

Model shapes are copied from each model's Hugging Face `config.json` (num_hidden_layers, num_attention_heads,
num_key_value_heads, hidden_size / num_attention_heads, max_position_embeddings) and the parameter count from
the safetensors index. GPU memory is the total `nvidia-smi` reports (MiB), which is also what GPU Feature
Discovery publishes in the `nvidia.com/gpu.memory` node label; `product` is GFD's `nvidia.com/gpu.product`
label value for the common SXM/PCIe variant (override it in the spec for other variants).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.runtime.capacity import ModelShape

MiB = 1024 * 1024
GiB = 1024 * MiB
_QWEN2 = dict(architecture="Qwen2ForCausalLM", attention_bias=True)


@dataclass(frozen=True)
class GPU:
    memory_mib: int
    product: str  # GPU Feature Discovery `nvidia.com/gpu.product` label value

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MiB


MODELS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape(32, 32, 8, 128, 4096, 8_030_261_248, 8192, 14336, 128256),
    "llama-3.1-8b": ModelShape(32, 32, 8, 128, 4096, 8_030_261_248, 131072, 14336, 128256),
    "llama-3-70b": ModelShape(80, 64, 8, 128, 8192, 70_553_706_496, 8192, 28672, 128256),
    "llama-3.1-70b": ModelShape(80, 64, 8, 128, 8192, 70_553_706_496, 131072, 28672, 128256),
    "llama-3.1-405b": ModelShape(126, 128, 8, 128, 16384, 405_853_388_800, 131072, 53248, 128256),
    "llama-2-7b": ModelShape(32, 32, 32, 128, 4096, 6_738_415_616, 4096, 11008, 32000),
    "llama-2-13b": ModelShape(40, 40, 40, 128, 5120, 13_015_864_320, 4096, 13824, 32000),
    "llama-2-70b": ModelShape(80, 64, 8, 128, 8192, 68_976_648_192, 4096, 28672, 32000),
    # v0.2/v0.3 shape (no sliding window).
    "mistral-7b": ModelShape(32, 32, 8, 128, 4096, 7_248_023_552, 32768, 14336, 32768,
                             architecture="MistralForCausalLM"),
    "mixtral-8x7b": ModelShape(32, 32, 8, 128, 4096, 46_702_792_704, 32768, 14336, 32000, experts_per_token=2,
                               num_experts=8, architecture="MixtralForCausalLM"),
    "qwen2.5-7b": ModelShape(28, 28, 4, 128, 3584, 7_615_616_512, 32768, 18944, 152064, **_QWEN2),
    "qwen2.5-14b": ModelShape(48, 40, 8, 128, 5120, 14_770_033_664, 32768, 13824, 152064, **_QWEN2),
    "qwen2.5-32b": ModelShape(64, 40, 8, 128, 5120, 32_763_876_352, 32768, 27648, 152064, **_QWEN2),
    "qwen2.5-72b": ModelShape(80, 64, 8, 128, 8192, 72_706_203_648, 32768, 29568, 152064, **_QWEN2),
}

MODEL_ALIASES: dict[str, str] = {
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b",
    "meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama-3.1-70b": "llama-3.1-70b",
    "meta-llama-3.1-405b": "llama-3.1-405b",
    "llama-2-7b-hf": "llama-2-7b",
    "llama-2-13b-hf": "llama-2-13b",
    "llama-2-70b-hf": "llama-2-70b",
    "mistral-7b-v0.3": "mistral-7b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
}

GPUS: dict[str, GPU] = {
    "a10g": GPU(23028, "NVIDIA-A10G"),
    "l4": GPU(23034, "NVIDIA-L4"),
    "l40s": GPU(46068, "NVIDIA-L40S"),
    "a100-40gb": GPU(40960, "NVIDIA-A100-SXM4-40GB"),
    "a100-80gb": GPU(81920, "NVIDIA-A100-SXM4-80GB"),
    "h100-80gb": GPU(81559, "NVIDIA-H100-80GB-HBM3"),
    "h200-141gb": GPU(143771, "NVIDIA-H200"),
    "b200": GPU(183359, "NVIDIA-B200"),
}

GPU_ALIASES: dict[str, str] = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb"}


def _key(name: str) -> str:
    return name.strip().lower().rsplit("/", 1)[-1].removesuffix("-instruct").removesuffix("-hf")


def lookup_model(name: str) -> ModelShape | None:
    key = _key(name)
    key = MODEL_ALIASES.get(key, key)
    return MODELS.get(key)


def lookup_gpu(name: str) -> GPU | None:
    """Accepts a catalog key (`a100-80gb`) or a GFD product label (`NVIDIA-A100-SXM4-80GB`)."""
    key = name.strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    for gpu in GPUS.values():
        if gpu.product.lower() == key:
            return gpu
    return None


def gpu_key(name: str) -> str | None:
    gpu = lookup_gpu(name)
    return next((k for k, v in GPUS.items() if v == gpu), None)
