"""MoE weights per rank, in one process: a rank reads only its half of every expert from the safetensors
file and places it where the fused expert tensors expect it; transformers 5's stacked expert tensors load to
the same parameters; widths that cannot be split are refused naming the config field."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from kvserve.runtime.models.registry import moe_shape, split_widths
from kvserve.runtime.models.sharding import split_widths_error


class _RecordingSlice:
    def __init__(self, name, sl, reads):
        self.name, self.sl, self.reads = name, sl, reads

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        out = self.sl[index]
        self.reads.append((self.name, tuple(out.shape), tuple(self.sl.get_shape())))
        return out


def _empty_model(model_dir, rank, size):
    from kvserve.runtime.config import load_model_config
    from kvserve.runtime.models.attention_backends import get_attention_backend
    from kvserve.runtime.models.parallel_layers import ParallelContext
    from kvserve.runtime.models.registry import model_class

    mc = load_model_config(model_dir, max_model_len=64)
    with torch.device("meta"):
        model = model_class(mc.architecture)(mc, get_attention_backend("torch"), ParallelContext(rank, size)).float()
    return model.to_empty(device="cpu")


@pytest.mark.parametrize(
    "name, moe_prefix, names",
    [
        ("mixtral_moe", "block_sparse_moe", ("w1", "w3", "w2")),
        ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    ],
)
def test_rank_reads_only_its_half_of_each_expert(tp_model_factory, name, moe_prefix, names):
    from safetensors import safe_open

    model_dir, hf = tp_model_factory(name)
    moe = moe_shape(hf.config)
    (path,) = glob.glob(os.path.join(model_dir, "*.safetensors"))
    width = moe.intermediate_size
    for rank in range(2):
        reads = []
        model = _empty_model(model_dir, rank, 2)
        with safe_open(path, framework="pt") as f:
            model.load_weights((n, _RecordingSlice(n, f.get_slice(n), reads)) for n in f.keys())
            experts = model.layers[0].mlp.experts
            mine = slice(rank * width // 2, (rank + 1) * width // 2)
            for e in range(moe.num_experts):
                gate, up, down = (f.get_tensor(f"model.layers.0.{moe_prefix}.experts.{e}.{n}.weight") for n in names)
                torch.testing.assert_close(experts.gate_up_proj[e], torch.cat([gate[mine], up[mine]]), rtol=0, atol=0)
                torch.testing.assert_close(experts.down_proj[e], down[:, mine], rtol=0, atol=0)
            torch.testing.assert_close(
                model.layers[0].mlp.gate.weight,
                f.get_tensor(f"model.layers.0.{moe_prefix}.gate.weight"),
                rtol=0,
                atol=0,
            )
        expert_reads = [r for r in reads if ".experts." in r[0]]
        assert len(expert_reads) == 3 * moe.num_experts * len(moe.sparse_layers)
        for read_name, got, full in expert_reads:  # half of the intermediate dim, nothing more
            assert got[0] * got[1] * 2 == full[0] * full[1], (read_name, got, full)


def test_transformers5_stacked_expert_tensors_load_identically(tp_model_factory):
    """transformers 5 keeps experts as 3-D `mlp.experts.gate_up_proj` / `down_proj` in memory (its
    state_dict); a checkpoint written that way loads to exactly the per-expert file's parameters."""
    model_dir, hf = tp_model_factory("mixtral_moe")
    stacked = {n: t for n, t in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    for rank in range(2):
        from_file = _empty_model(model_dir, rank, 2)
        from kvserve.runtime.models.loader import iter_safetensors

        from_file.load_weights(iter_safetensors(model_dir, show_progress=False))
        from_stacked = _empty_model(model_dir, rank, 2)
        from_stacked.load_weights(stacked.items())
        for (n, a), (_, b) in zip(from_file.named_parameters(), from_stacked.named_parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_missing_expert_is_named(tp_model_factory):
    model_dir, hf = tp_model_factory("qwen3_moe")
    sd = {n: t for n, t in hf.state_dict().items()}
    sd.pop("model.layers.0.mlp.experts.gate_up_proj")
    for e in range(8):  # all experts' gate/up except expert 5's up
        fused = hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"][e]
        sd[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = fused[:32]
        if e != 5:
            sd[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = fused[32:]
    with pytest.raises(ValueError, match=r"missing 1 weights.*experts\.gate_up_proj#1@5"):
        _empty_model(model_dir, 0, 1).load_weights(sd.items())


def test_split_widths_follow_the_sparse_layers(tp_model_factory):
    _, mixtral = tp_model_factory("mixtral_moe")
    assert split_widths(mixtral.config) == {"intermediate_size": 64}  # every layer sparse: experts' width
    _, qwen = tp_model_factory("qwen3_moe")
    assert moe_shape(qwen.config).sparse_layers == {0}  # layer 1 is in mlp_only_layers
    assert split_widths(qwen.config) == {"intermediate_size": 96, "moe_intermediate_size": 32}
    assert split_widths_error({"intermediate_size": 96, "moe_intermediate_size": 32}, 4) is None
    assert (
        split_widths_error({"intermediate_size": 96, "moe_intermediate_size": 30}, 4)
        == "moe_intermediate_size=30 is not divisible by tensor_parallel_size=4"
    )


def test_llm_rejects_an_unsplittable_expert_width_before_starting_workers(tmp_path):
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime import LLM
    from kvserve.runtime.errors import InvalidParameter
    from kvserve.runtime.models.synthetic import make_random_model_dir

    arch, kwargs = TEST_MODEL_CONFIGS["qwen3_moe"]
    make_random_model_dir(
        str(tmp_path), arch, **dict(kwargs, moe_intermediate_size=33, num_hidden_layers=1, mlp_only_layers=[])
    )
    with pytest.raises(
        InvalidParameter, match="moe_intermediate_size=33 is not divisible by tensor_parallel_size=2"
    ) as err:
        LLM(str(tmp_path), tensor_parallel_size=2, max_model_len=64)
    assert err.value.param == "tensor_parallel_size"
