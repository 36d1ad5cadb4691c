"""Test helpers shared by the suites (tests/ is on pytest's pythonpath; nothing shipped imports this): the
small random-weight model configs the parity tests build, random prompts, and the HF-transformers references
(greedy `generate`, vLLM's logprob-closeness rule)."""

from __future__ import annotations

import pathlib
import random

# The tiny pretrained model (Karpathy's stories260K, MIT) that ships in the repository: real text, 1 MB.
STORIES_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples" / "models" / "stories260K"

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
)

# initializer_range 0.2 (not the default 0.02): peaked logits, so greedy has clear winners and a bug
# cannot hide behind near-ties and repetitive output.
TEST_MODEL_CONFIGS = {
    "llama_gqa": ("LlamaForCausalLM", dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
    "llama3_rope_scaling": (
        "LlamaForCausalLM",
        dict(
            _COMMON,
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2_qkv_bias": ("Qwen2ForCausalLM", dict(_COMMON, num_attention_heads=4, num_key_value_heads=2)),
    "llama_tied_mqa": (
        "LlamaForCausalLM",
        dict(_COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "mistral": ("MistralForCausalLM", dict(_COMMON, num_attention_heads=8, num_key_value_heads=4, sliding_window=4096)),
    # MoE: 4 experts, top-2, routing weights renormalised and kept in fp32.
    "mixtral_moe": (
        "MixtralForCausalLM",
        dict(
            _COMMON,
            intermediate_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            norm_weight_std=0.3,
        ),
    ),
    # QK-norm, head_dim 32 with 4 heads (q width 128 != hidden 64), tied embeddings.
    "qwen3_head_dim": (
        "Qwen3ForCausalLM",
        dict(
            _COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            norm_weight_std=0.3,
        ),
    ),
    # 8 experts, top-2 without renormalisation; layer 1 is dense (mlp_only_layers) with its own width.
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            _COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            norm_weight_std=0.3,
        ),
    ),
    # Sliding layers 0 and 2 (window 12: not a multiple of the 8/16-token blocks), query_pre_attn_scalar
    # != head_dim, attention softcap low enough to bend these scores, final softcap, tied embeddings.
    "gemma2_sliding": (
        "Gemma2ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=12,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            norm_weight_std=0.3,
        ),
    ),
    # 4 layers, sliding_window_pattern 4 (checkpoints: 6): layers 0-2 slide, 3 is global -> 1 full + 3 sliding
    # KV cache groups; MQA, head_dim 32 (q width 128 != hidden), q/k norms, window 20, global RoPE 1e6 with
    # linear x8 scaling, local RoPE 1e4 unscaled.
    "gemma3_sliding": (
        "Gemma3ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            sliding_window_pattern=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=20,
            query_pre_attn_scalar=24,
            norm_weight_std=0.3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
}


def random_prompts(num: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate`, one prompt at a time (no padding), never stopping at EOS -- what
    ignore_eos does. (min_new_tokens would differ: it forbids EOS instead of continuing past it.)"""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # eos_token_id=-1 ("never stop") triggers a warning
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=-1,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def check_logprobs_close(ref_outputs, got_outputs) -> int:
    """vLLM's check_logprobs_close rule for greedy runs with logprobs: at the first differing token each side's
    choice must be in the other's top-N, and the comparison of that sequence stops there. Returns how many
    sequences agree on their first token (callers bound it)."""
    same_first = 0
    for r, g in zip(ref_outputs, got_outputs):
        r, g = r.outputs[0], g.outputs[0]
        same_first += r.token_ids[0] == g.token_ids[0]
        for i, (rt, gt) in enumerate(zip(r.token_ids, g.token_ids)):
            if rt != gt:
                assert rt in g.logprobs[i] and gt in r.logprobs[i], f"token {i}: {rt} vs {gt}"
                break
    return same_first


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(hf_model, out_dir, r: int, alpha: int, seed: int, rslora: bool = False):
    """A random PEFT LoRA adapter on a copy of `hf_model` (all seven targets, B clearly non-zero so the adapter
    changes the tokens), saved to out_dir; returns the peft model (eval mode) for reference outputs."""
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=LORA_TARGETS, use_rslora=rslora, init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(hf_model), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(str(out_dir))
    return model.eval()
