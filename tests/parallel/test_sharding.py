"""The per-rank split, checked in one process (no workers): head/vocab partitions, unsplittable shapes
rejected before any process starts, and shard loading that reads only the rank's rows/columns from the
safetensors file (through get_slice) and places them where the fused layers expect them."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from kvserve.runtime.capacity import tp_shape_error
from kvserve.runtime.models.sharding import shard_spec


def test_kv_heads_follow_query_heads():
    # split: 8 q / 4 kv over 2 ranks -> 2 kv heads each
    assert [shard_spec(8, 4, 128, 512, r, 2).kv_head_ids for r in range(2)] == [(0, 1), (2, 3)]
    # replicated: 8 q / 2 kv over 4 ranks -> ranks 0,1 read kv 0; ranks 2,3 read kv 1
    assert [shard_spec(8, 2, 128, 512, r, 4).kv_head_ids for r in range(4)] == [(0,), (0,), (1,), (1,)]
    # MQA over 2 ranks: both keep the single head
    assert [shard_spec(4, 1, 128, 512, r, 2).kv_head_ids for r in range(2)] == [(0,), (0,)]
    # every rank's query heads map onto its local KV heads with one uniform GQA ratio
    for heads, kv, t in [(8, 4, 2), (8, 2, 4), (32, 8, 4), (32, 8, 8), (4, 1, 4), (64, 8, 16)]:
        group = heads // kv
        for r in range(t):
            s = shard_spec(heads, kv, 4096, 1000, r, t)
            local_group = s.num_heads // s.num_kv_heads
            for i in range(s.num_heads):
                assert s.kv_head_ids[i // local_group] == (s.q_head_start + i) // group


def test_vocab_is_padded_to_equal_shards():
    a, b, c = (shard_spec(6, 3, 12, 1001, r, 3) for r in range(3))
    assert a.vocab_per_rank == b.vocab_per_rank == c.vocab_per_rank == 334
    assert (a.vocab_start, a.vocab_end, c.vocab_start, c.vocab_end) == (0, 334, 668, 1001)


def test_unsplittable_shapes_are_named():
    assert "num_key_value_heads=3" in tp_shape_error(6, 3, 192, 2)
    assert "(valid: [1, 3, 6])" in tp_shape_error(6, 3, 192, 2)
    assert "num_attention_heads=4" in tp_shape_error(4, 4, 128, 3)
    assert "intermediate_size=130" in tp_shape_error(4, 2, 130, 4)
    assert tp_shape_error(4, 4, 128, 1) is None


def test_llm_rejects_an_unsplittable_tp_size_before_starting_workers(tp_model_factory):
    from kvserve.runtime import LLM
    from kvserve.runtime.errors import InvalidParameter

    model_dir, _ = tp_model_factory("llama_gqa")  # 8 heads
    with pytest.raises(
        InvalidParameter, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"
    ) as err:
        LLM(model_dir, tensor_parallel_size=3, max_model_len=64)
    assert err.value.param == "tensor_parallel_size"


class _RecordingSlice:
    """Wraps a safetensors slice and records the shape of every read."""

    def __init__(self, name, sl, reads):
        self.name, self.sl, self.reads = name, sl, reads

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        out = self.sl[index]
        self.reads.append((self.name, tuple(out.shape), tuple(self.sl.get_shape())))
        return out


def _load_rank(model_dir, rank, size, reads):
    from safetensors import safe_open

    from kvserve.runtime.config import load_model_config
    from kvserve.runtime.models.attention_backends import get_attention_backend
    from kvserve.runtime.models.llama import LlamaForCausalLM
    from kvserve.runtime.models.parallel_layers import ParallelContext

    mc = load_model_config(model_dir, max_model_len=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(mc, get_attention_backend("torch"), ParallelContext(rank, size)).float()
    model = model.to_empty(device="cpu")
    (path,) = glob.glob(os.path.join(model_dir, "*.safetensors"))
    with safe_open(path, framework="pt") as f:
        model.load_weights((n, _RecordingSlice(n, f.get_slice(n), reads)) for n in f.keys())
    return model


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_qkv_bias", "llama_tied_mqa"])
def test_rank_loads_only_its_shard_into_the_fused_layout(tp_model_factory, name):
    model_dir, hf = tp_model_factory(name)
    cfg = hf.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sd = hf.state_dict()
    for rank in range(2):
        reads = []
        model = _load_rank(model_dir, rank, 2, reads)
        s = model.shard
        for name_, got, full in reads:  # no sharded matrix is read whole; only norms/biases replicated
            if name_.endswith("norm.weight") or "layernorm" in name_ or name_.endswith("o_proj.bias"):
                assert got == full
            elif ("k_proj" in name_ or "v_proj" in name_) and cfg.num_key_value_heads < 2:
                assert got == full  # the replicated KV head is the whole (1-head) projection
            else:
                assert got[0] * got[-1] < full[0] * full[-1], (name_, got, full)
        attn = model.layers[0].self_attn
        qkv = attn.qkv_proj.weight
        q_rows = slice(s.q_head_start * hd, (s.q_head_start + s.num_heads) * hd)
        torch.testing.assert_close(
            qkv[: attn.q_size], sd["model.layers.0.self_attn.q_proj.weight"][q_rows], rtol=0, atol=0
        )
        for j, proj in enumerate(("k_proj", "v_proj")):
            want = torch.cat(
                [sd[f"model.layers.0.self_attn.{proj}.weight"][h * hd : (h + 1) * hd] for h in s.kv_head_ids]
            )
            start = attn.q_size + j * attn.kv_size
            torch.testing.assert_close(qkv[start : start + attn.kv_size], want, rtol=0, atol=0)
        if attn.qkv_proj.bias is not None:
            torch.testing.assert_close(
                attn.qkv_proj.bias[: attn.q_size], sd["model.layers.0.self_attn.q_proj.bias"][q_rows], rtol=0, atol=0
            )
        torch.testing.assert_close(
            attn.o_proj.weight, sd["model.layers.0.self_attn.o_proj.weight"][:, q_rows], rtol=0, atol=0
        )
        inter = slice(s.intermediate_start, s.intermediate_start + s.intermediate_size)
        mlp = model.layers[1].mlp
        torch.testing.assert_close(
            mlp.gate_up_proj.weight[s.intermediate_size :],
            sd["model.layers.1.mlp.up_proj.weight"][inter],
            rtol=0,
            atol=0,
        )
        torch.testing.assert_close(
            mlp.down_proj.weight, sd["model.layers.1.mlp.down_proj.weight"][:, inter], rtol=0, atol=0
        )
        vocab = slice(s.vocab_start, s.vocab_end)
        torch.testing.assert_close(model.embed_tokens.weight, sd["model.embed_tokens.weight"][vocab], rtol=0, atol=0)
        if model.lm_head is not None:
            torch.testing.assert_close(model.lm_head.weight, sd["lm_head.weight"][vocab], rtol=0, atol=0)
