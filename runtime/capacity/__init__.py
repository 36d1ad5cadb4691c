"""KV-cache capacity: the one model of "how much fits" shared by the runtime and the operator.

The runtime's KV sizing (worker/model_runner.py), the operator's planner (runtime/planner/kv_plan.py) and the
router's index sizing all call these functions, so a plan the operator accepts is exactly what the pod
allocates. Pure Python, no torch: the operator image imports it without the runtime's dependencies
(tests/test_layering.py checks that with import-linter).

Facts kept here, once:
- the dtype table and its aliases (weights, activations and KV cache): bytes per element, torch names,
  FP8 ranges; the kernels, the executor, the CLIs and the CRD's enums (via engine_args) take them from here;
- the KV layout: bytes per token per tensor-parallel rank and per block;
- blocks and tokens for a byte budget, with block 0 reserved as the null block (block tables are padded
  with it; it never holds a token), so usable blocks = blocks - 1;
- the tensor-parallel shape rules and the exact bytes of weights each rank holds;
- which architectures the runtime serves and how an HF config.json maps to a model shape.

One room per concept: dtypes (the dtype vocabulary), support (which models are served), shape (ModelShape),
hf_config (config.json -> ModelShape), tensor_parallel (TP shape rules), weights (weight and LoRA-slot bytes
per rank), kv (KV cache groups, layout, budgets), pipeline (stage layers and per-stage bytes). This module is
their one import surface (`from kvserve.runtime import capacity; capacity.kv_layout(...)`), and the only one the
operator-seams contract lets the operator import.
"""

from __future__ import annotations

from kvserve.runtime.capacity.dtypes import (  # noqa: F401
    DTYPE_ALIASES,
    DTYPE_BYTES,
    FLOAT_DTYPES,
    FP8_ACTIVATION_DTYPE,
    FP8_MAX,
    FP8_SCALE_BYTES,
    KV_CACHE_DTYPES,
    TORCH_DTYPE_NAMES,
    WEIGHT_DTYPES,
    CapacityError,
    activation_dtype,
    canonical_dtype,
    dtype_bytes,
    kv_cache_dtype,
    torch_dtype_name,
    weight_dtype,
)
from kvserve.runtime.capacity.hf_config import (  # noqa: F401
    gemma_layer_types,
    shape_from_hf_config,
)
from kvserve.runtime.capacity.kv import (  # noqa: F401
    NULL_BLOCKS,
    KVCacheGroup,
    KVLayout,
    blocks_per_sequence,
    kv_cache_groups,
    kv_layout,
    layer_group_index,
    layer_windows,
    max_concurrency,
    one_sequence_error,
    shape_kv_cache_groups,
    usable_blocks,
    usable_tokens,
)
from kvserve.runtime.capacity.pipeline import (  # noqa: F401
    kv_tokens_per_rank,
    stage_kv_bytes_per_token_per_rank,
    stage_layer_ranges,
    stage_shape,
    stage_weight_bytes_per_rank,
)
from kvserve.runtime.capacity.shape import (  # noqa: F401
    ModelShape,
)
from kvserve.runtime.capacity.support import (  # noqa: F401
    GEMMA_ARCHITECTURES,
    PIPELINE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    UNSUPPORTED_ROPE_TYPES,
    checkpoint_dtype,
    context_limit,
    unsupported_architecture_error,
    unsupported_config_error,
)
from kvserve.runtime.capacity.tensor_parallel import (  # noqa: F401
    kv_heads_per_rank,
    shape_tp_error,
    tp_shape_error,
    valid_tp_sizes,
)
from kvserve.runtime.capacity.weights import (  # noqa: F401
    lora_slot_bytes_per_rank,
    parameter_groups_per_rank,
    parameters_per_rank,
    weight_bytes_per_rank,
)
