"""End to end: LLM(..., attention_backend="triton") under the Triton interpreter gives the torch backend's
greedy tokens (two random-weight configs and the pretrained stories260K), incl. chunked prefill, prefix
hits, mixed decode+prefill steps and an fp8 KV cache. Kept tiny: the interpreter runs every launch in numpy."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from kvserve_testing import STORIES_DIR  # noqa: E402

from kvserve.runtime import LLM, SamplingParams  # noqa: E402

STORIES = str(STORIES_DIR)
MAX_NEW = 6


def _prompts(seed: int, vocab: int):
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]  # 20 shared tokens: one full block of 16 cached
    return [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 13, 30)] + [[5], [7, 9, 11]]


def _generate(model_dir, prompts, backend, **kw):
    llm = LLM(
        model_dir, max_model_len=128, num_kv_blocks=48, block_size=16, attention_backend=backend, device="cpu", **kw
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.models.synthetic import make_random_model_dir

    def build(name):
        arch, kwargs = TEST_MODEL_CONFIGS[name]
        out = str(tmp_path_factory.mktemp(name))
        make_random_model_dir(out, arch, seed=1234, dtype="float32", **kwargs)
        return out

    return build


@pytest.mark.parametrize(
    "name,kw",
    [
        ("llama_gqa", dict(max_num_batched_tokens=24)),  # chunked prefill: extends over a cached prefix
        ("qwen2_qkv_bias", dict()),
    ],
    ids=["llama_gqa-chunked", "qwen2_qkv_bias"],
)
def test_triton_backend_matches_torch(random_model, name, kw):
    model_dir = random_model(name)
    prompts = _prompts(3, 512)
    expected = _generate(model_dir, prompts, "torch", **kw)
    got = _generate(model_dir, prompts, "triton", **kw)
    assert got == expected


def test_triton_backend_sliding_window_and_softcap(tmp_path):
    """Gemma 2 (window 12, attention softcap) in chunks of 24: the sliding KV group's out-of-window blocks are
    freed to null while the kernels run; a shared 20-token prefix hits through the window rule."""
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.models.synthetic import make_random_model_dir

    arch, kwargs = TEST_MODEL_CONFIGS["gemma2_sliding"]
    model_dir = str(tmp_path)
    make_random_model_dir(model_dir, arch, seed=1234, **dict(kwargs, num_hidden_layers=2))  # 1 sliding, 1 global
    prompts = _prompts(3, 512)[1:3]  # 33 and 50 tokens
    expected = _generate(model_dir, prompts, "torch", max_num_batched_tokens=24)
    got = _generate(model_dir, prompts, "triton", max_num_batched_tokens=24)
    assert got == expected


class _ReferenceBackend:
    """kvserve.kernels' pure-torch references as an attention backend (slow; any cache dtype)."""

    name = "kernels_ref"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        from kvserve.kernels import paged_attention_ref, store_kv_cache_ref

        store_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping, meta.k_scale, meta.v_scale)
        return paged_attention_ref(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            scale,
            meta.k_scale,
            meta.v_scale,
        )


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_triton_fp8_kv_cache(random_model, kv_cache_dtype):
    """FP8 KV through the engine, against the kernels' torch references wired in as a backend (the torch
    backend cannot store fp8 on CPU: index_copy_ has no float8 CPU kernel)."""
    from kvserve.runtime.models.attention_backends import register_attention_backend

    register_attention_backend("kernels_ref", _ReferenceBackend)
    model_dir = random_model("llama_gqa")
    prompts = _prompts(4, 512)[:3]
    kw = dict(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=24)
    assert _generate(model_dir, prompts, "triton", **kw) == _generate(model_dir, prompts, "kernels_ref", **kw)


def test_triton_backend_stories260k():
    prompts = _prompts(5, 512)[1:3]  # 33 and 50 tokens: crosses blocks, prefix hit on the second
    assert _generate(STORIES, prompts, "triton") == _generate(STORIES, prompts, "torch")
