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
_QWEN3 = dict(architecture="Qwen3ForCausalLM", qk_norm=True)
_QWEN3_MOE = dict(architecture="Qwen3MoeForCausalLM", qk_norm=True, experts_per_token=8, num_experts=128)
# Gemma: tied embeddings, four norms per layer, every other layer (Gemma 2) or 5 of 6 (Gemma 3) sliding.
_GEMMA2 = dict(architecture="Gemma2ForCausalLM", tie_word_embeddings=True, num_layer_norms=4, sliding_window=4096)
_GEMMA3 = dict(architecture="Gemma3ForCausalLM", tie_word_embeddings=True, num_layer_norms=4, qk_norm=True)


# Performance and price, for the fleet planner's roofline step-time model (operator/fleet.py) when no
# calibration from the GPU itself is given. Peak FLOPs: dense (no 2:4 sparsity) BF16 tensor-core TFLOPS and
# memory bandwidth from NVIDIA's datasheets for the SXM/PCIe variant named by `product` (the A10G has no
# public datasheet: 70 TFLOPS is the figure commonly quoted for it). Prices are indicative on-demand USD per
# GPU-hour: AWS us-east-1 list prices of the smallest instance with that GPU divided by its GPU count (g5, g6,
# g6e, p4d, p4de, p5, p5en, p6-b200), as the author knew them in 2025, not re-checked online; they only rank
# candidates, so override them with `kvserve plan --gpu-price GPU=USD` (or spec.gpu.usdPerGpuHour) for your own
# contract.
PRICE_SOURCE = (
    "indicative AWS us-east-1 on-demand list prices per GPU-hour (2025), not re-checked; override --gpu-price "
    "or spec.gpu.usdPerGpuHour"
)


@dataclass(frozen=True)
class GPU:
    memory_mib: int
    product: str  # GPU Feature Discovery `nvidia.com/gpu.product` label value
    peak_bf16_tflops: float = 0.0  # dense
    memory_bandwidth_gb_s: float = 0.0
    usd_per_gpu_hour: float = 0.0

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
    "mistral-7b": ModelShape(
        32, 32, 8, 128, 4096, 7_248_023_552, 32768, 14336, 32768, architecture="MistralForCausalLM"
    ),
    "mixtral-8x7b": ModelShape(
        32,
        32,
        8,
        128,
        4096,
        46_702_792_704,
        32768,
        14336,
        32000,
        experts_per_token=2,
        num_experts=8,
        architecture="MixtralForCausalLM",
    ),
    "qwen2.5-7b": ModelShape(28, 28, 4, 128, 3584, 7_615_616_512, 32768, 18944, 152064, **_QWEN2),
    "qwen2.5-14b": ModelShape(48, 40, 8, 128, 5120, 14_770_033_664, 32768, 13824, 152064, **_QWEN2),
    "qwen2.5-32b": ModelShape(64, 40, 8, 128, 5120, 32_763_876_352, 32768, 27648, 152064, **_QWEN2),
    "qwen2.5-72b": ModelShape(80, 64, 8, 128, 8192, 72_706_203_648, 32768, 29568, 152064, **_QWEN2),
    # Qwen3: explicit head_dim 128 (q width 32 x 128 = hidden for 8B, 64 x 128 != 5120 for 32B), QK-norm.
    "qwen3-8b": ModelShape(36, 32, 8, 128, 4096, 8_190_735_360, 40960, 12288, 151936, **_QWEN3),
    "qwen3-32b": ModelShape(64, 64, 8, 128, 5120, 32_762_123_264, 40960, 25600, 151936, **_QWEN3),
    # MoE: intermediate_size is each expert's width (moe_intermediate_size); no dense layers.
    "qwen3-30b-a3b": ModelShape(48, 32, 4, 128, 2048, 30_532_122_624, 40960, 768, 151936, **_QWEN3_MOE),
    "qwen3-235b-a22b": ModelShape(94, 64, 4, 128, 4096, 235_093_634_560, 40960, 1536, 151936, **_QWEN3_MOE),
    # Gemma 2: 1:1 sliding (even layers) / global, window 4096, 8K positions.
    "gemma-2-2b": ModelShape(26, 8, 4, 256, 2304, 2_614_341_888, 8192, 9216, 256000, num_sliding_layers=13, **_GEMMA2),
    "gemma-2-9b": ModelShape(
        42, 16, 8, 256, 3584, 9_241_705_984, 8192, 14336, 256000, num_sliding_layers=21, **_GEMMA2
    ),
    "gemma-2-27b": ModelShape(
        46, 32, 16, 128, 4608, 27_227_128_320, 8192, 36864, 256000, num_sliding_layers=23, **_GEMMA2
    ),
    # Gemma 3 text-only checkpoint (Gemma3ForCausalLM): 22 of 26 layers slide over 512 tokens. The 4B/12B/27B
    # checkpoints are multimodal (Gemma3ForConditionalGeneration), which the runtime does not load.
    "gemma-3-1b": ModelShape(
        26, 4, 1, 256, 1152, 999_885_952, 32768, 6912, 262144, num_sliding_layers=22, sliding_window=512, **_GEMMA3
    ),
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
    "gemma-2-2b-it": "gemma-2-2b",
    "gemma-2-9b-it": "gemma-2-9b",
    "gemma-2-27b-it": "gemma-2-27b",
    "gemma-3-1b-it": "gemma-3-1b",
    "gemma-3-1b-pt": "gemma-3-1b",
}

GPUS: dict[str, GPU] = {
    "a10g": GPU(23028, "NVIDIA-A10G", 70.0, 600.0, 1.006),
    "l4": GPU(23034, "NVIDIA-L4", 121.0, 300.0, 0.805),
    "l40s": GPU(46068, "NVIDIA-L40S", 362.0, 864.0, 1.861),
    "a100-40gb": GPU(40960, "NVIDIA-A100-SXM4-40GB", 312.0, 1555.0, 4.10),
    "a100-80gb": GPU(81920, "NVIDIA-A100-SXM4-80GB", 312.0, 2039.0, 5.12),
    "h100-80gb": GPU(81559, "NVIDIA-H100-80GB-HBM3", 989.0, 3350.0, 6.88),
    "h200-141gb": GPU(143771, "NVIDIA-H200", 989.0, 4800.0, 7.91),
    "b200": GPU(183359, "NVIDIA-B200", 2250.0, 8000.0, 14.24),
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
