"""`kvserve bench throughput --model DIR` computes its roofline from DIR's own shape (it used the default
125M shape, printing e.g. "433% of roofline" for a small model)."""

from __future__ import annotations

import json

import pytest

from kvserve.runtime.bench.throughput import DEFAULT_SHAPE, Workload, model_flops, shape_of_model_dir


def write_config(path, **config):
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_shape_comes_from_the_model_config(tmp_path):
    d = write_config(
        tmp_path,
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=172,
        vocab_size=512,
        head_dim=8,
        rope_theta=1e4,
    )
    shape = shape_of_model_dir(d)
    assert shape == dict(
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=172,
        vocab_size=512,
        head_dim=8,
    )
    wl = Workload([[5] * 10], [6])
    assert model_flops(shape, wl) < model_flops(DEFAULT_SHAPE, wl) / 100


def test_nested_text_config_and_default_kv_heads(tmp_path):
    d = write_config(
        tmp_path,
        text_config=dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
        ),
    )
    shape = shape_of_model_dir(d)
    assert shape["hidden_size"] == 32 and shape["num_key_value_heads"] == 4


def test_incomplete_config_is_named(tmp_path):
    with pytest.raises(ValueError, match="intermediate_size"):
        shape_of_model_dir(
            write_config(tmp_path, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
        )


@pytest.mark.parametrize("random_prompts", [False, True])
def test_throughput_prompts_follow_the_flags(model_factory, random_prompts):
    """With a model (the default one, or --model), prompts are chat-templated real text unless --random-prompts;
    the lengths are the workload's either way."""
    from kvserve.runtime.bench import throughput

    model_dir, _ = model_factory("llama_gqa")
    report = throughput.main(
        num_requests=3,
        prompt_range=(8, 16),
        output_range=(2, 4),
        skip_hf=True,
        model_dir=model_dir,
        random_prompts=random_prompts,
        block_size=16,
    )
    assert report["workload"]["prompts"] == ("random token ids" if random_prompts else "chat-templated text")
    assert 24 <= report["workload"]["prompt_tokens"] <= 48 and report["kvserve"]["useful_output_tokens"] >= 6
