"""`kvserve bench peaky` (runtime/bench/peaky.py): its peaky copy really is peaky (most softmax weights of a head
would be subnormal) while the original is flat, and only q_proj / k_proj change."""

from __future__ import annotations

import os


def test_peaky_copy(tmp_path):
    import torch
    from safetensors.torch import load_file

    from kvserve.runtime.bench import peaky
    from kvserve.runtime.models.synthetic import make_random_model_dir

    flat, peaky_dir = str(tmp_path / "flat"), str(tmp_path / "peaky")
    make_random_model_dir(
        flat,
        "LlamaForCausalLM",
        seed=0,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        initializer_range=0.02,
    )
    share = peaky.make_peaky_copy(flat, peaky_dir, qk_scale=25.0)
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (flat, peaky_dir))
    assert share > 0.2
    assert peaky.underflowing_fraction(a, peaky._config(flat)) < 0.01
    for name in a:
        scaled = "q_proj" in name or "k_proj" in name
        assert torch.equal(b[name], a[name] * 25.0 if scaled else a[name]), name
