"""Pipeline-parallel settings and stage layout, in one process (no workers): the layer split and its override,
the rank layout, the per-stage KV view, what a stage loads from the checkpoint, and the errors (each naming
its field) for settings a pipelined engine refuses before any worker starts."""

from __future__ import annotations

import pytest
from kvserve_testing import TEST_MODEL_CONFIGS

from kvserve.runtime import capacity
from kvserve.runtime.config import make_engine_config
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.executor import kv_sizing, pipeline


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from kvserve.runtime.models.synthetic import make_random_model_dir

    out = {}
    for name, layers in (("llama_gqa", 5), ("llama_tied_mqa", 4), ("gemma2_sliding", 4)):
        arch, kwargs = TEST_MODEL_CONFIGS[name]
        path = str(tmp_path_factory.mktemp(f"ppcfg-{name}"))
        make_random_model_dir(path, arch, seed=1, **dict(kwargs, num_hidden_layers=layers))
        out[name] = path
    return out


def test_balanced_split_override_and_rank_layout(model_dirs, monkeypatch):
    d = model_dirs["llama_gqa"]
    cfg = make_engine_config(d, pipeline_parallel_size=2, tensor_parallel_size=2, max_model_len=64)
    assert cfg.parallel.stage_layers == (range(0, 3), range(3, 5))  # 5 layers: the first stage takes the extra
    assert cfg.world_size == 4 and pipeline.output_rank(cfg) == 2
    assert [pipeline.stage_of(cfg, r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    stages = [pipeline.make_stage(cfg, r) for r in range(4)]
    assert [(s.prev_rank, s.next_rank) for s in stages] == [(None, 2), (None, 3), (0, None), (1, None)]

    explicit = make_engine_config(d, pipeline_parallel_size=2, pipeline_layer_split="1,4", max_model_len=64)
    assert explicit.parallel.stage_layers == (range(0, 1), range(1, 5))
    monkeypatch.setenv("KVSERVE_PP_LAYER_PARTITION", "4,1")  # vLLM's VLLM_PP_LAYER_PARTITION, our name
    assert make_engine_config(d, pipeline_parallel_size=2, max_model_len=64).parallel.stage_layers == (
        range(0, 4),
        range(4, 5),
    )
    # the environment variable is ignored without pipelining; the flag is an error there
    assert make_engine_config(d, max_model_len=64).parallel.stage_layers == ()


def test_stage_kv_view_uses_the_capacity_formula(model_dirs):
    cfg = make_engine_config(
        model_dirs["llama_gqa"], pipeline_parallel_size=2, tensor_parallel_size=2, max_model_len=64
    )
    shape = cfg.model.shape
    for layers in cfg.parallel.stage_layers:
        view = pipeline.stage_engine_config(cfg, layers)
        per_token = capacity.stage_kv_bytes_per_token_per_rank(shape, "float32", "auto", 2, layers)
        assert kv_sizing.layout(view).bytes_per_block == 16 * per_token
        assert view.model.num_layers == len(layers) and view.model.hf_config.num_hidden_layers == 5
    # the whole model's layout is the sum of the stages'
    whole = kv_sizing.layout(cfg).bytes_per_block
    assert whole == sum(
        kv_sizing.layout(pipeline.stage_engine_config(cfg, r)).bytes_per_block for r in cfg.parallel.stage_layers
    )


def test_a_stage_loads_only_its_own_tensors(model_dirs):
    """Build stage 1 of 2 in-process (no collectives run at load) and record which checkpoint tensors the loader
    reads: only layers 2-3, the final norm, and (tied) the embedding as the head."""
    import torch

    from kvserve.runtime.models import loader
    from kvserve.runtime.models.attention_backends import get_attention_backend
    from kvserve.runtime.models.parallel_layers import ParallelContext
    from kvserve.runtime.models.pipeline_stage import PipelineStage, PipelineStageModel

    cfg = make_engine_config(model_dirs["llama_tied_mqa"], pipeline_parallel_size=2, max_model_len=64)
    read: list[str] = []
    real = loader.iter_safetensors

    def recording(*args, **kwargs):
        for name, src in real(*args, **kwargs):
            yield name, _Recorded(name, src, read)

    stage = PipelineStage(index=1, size=2, layers=range(2, 4), prev_rank=0)
    try:
        loader.iter_safetensors = recording
        model = loader.load_model(
            cfg.model, get_attention_backend("torch"), "cpu", ParallelContext(stage=stage), load_format="auto"
        )
    finally:
        loader.iter_safetensors = real
    assert isinstance(model, PipelineStageModel)
    assert sorted({n.split(".")[2] for n in read if n.startswith("model.layers.")}) == ["2", "3"]
    assert "model.norm.weight" in read and "model.embed_tokens.weight" in read  # tied head: its own copy
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in names)
    assert model.compute_logits(torch.zeros(1, 64)) is not None  # the last stage computes logits


class _Recorded:
    """A lazy safetensors slice that records reads of its tensor."""

    def __init__(self, name, src, read):
        self.name, self.src, self.read = name, src, read

    def get_shape(self):
        return self.src.get_shape()

    def __getitem__(self, index):
        self.read.append(self.name)
        return self.src[index]


@pytest.mark.parametrize(
    "name, kwargs, field, message",
    [
        ("llama_gqa", dict(pipeline_parallel_size=6), "pipeline_parallel_size", "exceeds num_hidden_layers=5"),
        ("llama_gqa", dict(pipeline_parallel_size=2, pipeline_layer_split="2,2"), "pipeline_layer_split", "summing"),
        ("llama_gqa", dict(pipeline_parallel_size=2, pipeline_layer_split="2,x"), "pipeline_layer_split", "integers"),
        ("llama_gqa", dict(pipeline_layer_split="2,3"), "pipeline_layer_split", "needs pipeline_parallel_size > 1"),
        (
            "gemma2_sliding",
            dict(pipeline_parallel_size=2),
            "pipeline_parallel_size",
            "does not support Gemma2ForCausalLM",
        ),
        ("llama_gqa", dict(pipeline_parallel_size=2, enable_lora=True), "enable_lora", "pipeline_parallel_size 1"),
    ],
)
def test_refused_settings_name_their_field(model_dirs, name, kwargs, field, message):
    with pytest.raises(InvalidParameter, match=message) as err:
        make_engine_config(model_dirs[name], max_model_len=64, **kwargs)
    assert err.value.param == field
