"""What capacity depends on: ModelShape, built from a catalog entry, a spec's overrides or a config.json
(hf_config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What capacity depends on. Built from a catalog entry, a spec's overrides or a config.json."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_parameters: int  # as published (safetensors index); the planner uses the exact per-rank count
    max_position_embeddings: int
    intermediate_size: int  # MLP width (per expert for MoE)
    vocab_size: int
    experts_per_token: int = 1  # MoE top-k; 1 for dense models
    num_experts: int = 0  # 0: dense MLP
    architecture: str = "LlamaForCausalLM"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # Llama's attention_bias also biases o_proj (Qwen2's does not)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    # MoE models whose some layers keep a dense MLP (Qwen3-MoE's mlp_only_layers / decoder_sparse_step):
    num_dense_layers: int = 0
    dense_intermediate_size: int = 0
    # Sliding-window attention (Gemma 2/3): num_sliding_layers layers keep only the last sliding_window
    # tokens' KV; the others attend to the full context. 0/0 for full-attention models.
    sliding_window: int = 0
    num_sliding_layers: int = 0
    num_layer_norms: int = 2  # RMSNorms per decoder layer (Gemma's sandwich norms: 4)
