"""A LoRA adapter split for tensor parallelism (lora/tp_shard.py) computes, on every rank, exactly what that
rank's shard of the adapter-merged model computes: each rank of a t-way split is built in this one process
(no collectives: the row-parallel layers return their partial sums), once with the base weights plus the
rank's adapter share, once with peft's merged weights (W + scaling * B A) loaded by the ordinary loader.
Column-parallel layers (the fused qkv_proj, gate_up_proj) must give the rank's output rows; row-parallel ones
(o_proj, down_proj) the rank's partial product x_r W'_r^T, which the all-reduce sums (so the scaling is in it
once, not t times).
GQA 8 query / 2 KV heads at t=2 splits the KV heads; at t=4 each KV head is replicated on two ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

peft = pytest.importorskip("peft")

from kvserve.runtime import capacity  # noqa: E402
from kvserve.runtime.config import LoraConfig, load_model_config  # noqa: E402
from kvserve.runtime.models.attention_backends import get_attention_backend  # noqa: E402
from kvserve.runtime.models.loader import load_model  # noqa: E402
from kvserve.runtime.models.parallel_layers import ParallelContext  # noqa: E402


class _PartialSums(ParallelContext):
    """A rank of a t-way group without the group: all_reduce leaves this rank's partial sum."""

    def all_reduce(self, x):
        return x


@pytest.fixture(scope="module")
def dirs(model_factory, tmp_path_factory):
    from kvserve_testing import make_peft_adapter

    model_dir, hf_model = model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("lora-tp-shard")
    adapter = make_peft_adapter(hf_model, str(root / "a"), r=4, alpha=8, seed=5)
    merged = adapter.merge_and_unload()
    merged.save_pretrained(str(root / "merged"))
    return model_dir, str(root / "a"), str(root / "merged")


@pytest.mark.parametrize("t", [2, 4])
def test_every_rank_computes_its_share_of_the_merged_model(dirs, t):
    from kvserve.runtime.lora.engine_hooks import build_manager

    model_dir, adapter_dir, merged_dir = dirs
    backend = get_attention_backend("torch")
    gen = torch.Generator().manual_seed(0)
    for rank in range(t):
        parallel = _PartialSums(rank=rank, size=t)
        base = load_model(load_model_config(model_dir, "float32"), backend, "cpu", parallel, load_format="auto")
        merged = load_model(load_model_config(merged_dir, "float32"), backend, "cpu", parallel, load_format="auto")
        manager = build_manager(base, LoraConfig((("a", adapter_dir),), 1, 4, 1), torch.float32, torch.device("cpu"))
        manager.token_slots = torch.full((5,), manager.activate("a"), dtype=torch.long)
        # The slot memory this rank allocated is what the planner takes off its KV budget
        allocated = sum(x.numel() * x.element_size() for s in manager.slots.values() for x in (s.a, s.b))
        assert allocated == capacity.lora_slot_bytes_per_rank(base.config.shape, 1, 4, "float32", t)
        with torch.no_grad():
            for i, (ours, ref) in enumerate(zip(base.layers, merged.layers)):
                for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj", "mlp.down_proj"):
                    module = ours.get_submodule(name)
                    x = torch.randn(5, module.weight.shape[1], generator=gen)  # o/down: this rank's input slice
                    got, want = module(x), ref.get_submodule(name)(x)
                    assert not torch.allclose(got, F.linear(x, module.weight), atol=1e-3)  # the delta is there
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank} layer {i} {name}")


def test_adapter_of_another_shape_is_refused_by_name():
    """Every rank and the engine core check an adapter against the full (unsharded) shapes: a B with other
    output features would otherwise be sliced quietly into a wrong share."""
    from kvserve.runtime.lora.adapter import LoraAdapter, LoraLoadError
    from kvserve.runtime.lora.manager import check_adapter

    shapes = {(0, "k_proj"): (64, 16)}
    ok = LoraAdapter("x", 4, 1.0, {(0, "k_proj"): (torch.zeros(4, 64), torch.zeros(16, 4))})
    check_adapter(ok, shapes)
    wide = LoraAdapter("x", 4, 1.0, {(0, "k_proj"): (torch.zeros(4, 64), torch.zeros(32, 4))})
    with pytest.raises(LoraLoadError, match=r"layer 0 k_proj: lora_A \(4, 64\) / lora_B \(32, 4\) do not fit"):
        check_adapter(wide, shapes)
    with pytest.raises(LoraLoadError, match="no such module"):
        check_adapter(LoraAdapter("x", 4, 1.0, {(1, "k_proj"): ok.weights[(0, "k_proj")]}), shapes)
