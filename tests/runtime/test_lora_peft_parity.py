"""Multi-LoRA parity (issue 24): one mixed batch (base + two adapters of different ranks, one rsLoRA, all
seven target modules, non-zero B) decoded greedily in fp32 with kvserve's batched (segmented or gathered) delta
must give exactly the tokens HF transformers + peft give for each row alone. Also: loader 4xx-class errors."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from kvserve.runtime.lora.adapter import LoraLoadError, load_peft_adapter  # noqa: E402
from kvserve.runtime.lora.manager import LoraManager  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _make_adapter(tmp_path, name, r, alpha, rslora, seed):
    base = _tiny_llama()
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, use_rslora=rslora, init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # make B clearly non-zero so the adapter changes the tokens
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    out = tmp_path / name
    model.save_pretrained(out)
    return str(out)


def _greedy(model, ids, steps):
    ids = ids.clone()
    for _ in range(steps):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    return {
        "a1": _make_adapter(tmp, "a1", r=8, alpha=16, rslora=False, seed=1),
        "a2": _make_adapter(tmp, "a2", r=4, alpha=8, rslora=True, seed=2),
    }


def test_mixed_batch_matches_peft(adapters):
    steps = 6
    prompts = torch.tensor([[5, 17, 33, 2], [9, 40, 3, 77], [1, 2, 3, 4]])
    rows = ["a1", None, "a2"]  # one batch: adapter, base, another adapter
    expected = []
    for i, name in enumerate(rows):
        base = _tiny_llama()
        model = base if name is None else peft.PeftModel.from_pretrained(base, adapters[name]).eval()
        with torch.no_grad():
            expected.append(_greedy(model, prompts[i : i + 1], steps)[0])
    expected = torch.stack(expected)

    model = _tiny_llama()
    modules = {
        (i, n): getattr(layer.self_attn if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp, n)
        for i, layer in enumerate(model.model.layers)
        for n in TARGETS
    }
    mgr = LoraManager(modules, max_loras=2, max_rank=8, max_cpu_loras=4)
    for name, path in adapters.items():
        mgr.add(load_peft_adapter(name, path, max_rank=8))
    row_slots = torch.tensor([-1 if n is None else mgr.activate(n, pinned={"a1", "a2"}) for n in rows])
    ids = prompts.clone()
    with torch.no_grad():
        for _ in range(steps):
            mgr.token_slots = row_slots.repeat_interleave(ids.shape[1])
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ids, expected)
    # The adapters really change the output (the test could not pass with a no-op delta).
    assert not torch.equal(expected[0], _greedy(_tiny_llama(), prompts[0:1], steps)[0])
    assert not torch.equal(expected[2], _greedy(_tiny_llama(), prompts[2:3], steps)[0])


def test_loader_errors(adapters, tmp_path):
    with pytest.raises(LoraLoadError, match="max-lora-rank"):
        load_peft_adapter("a1", adapters["a1"], max_rank=4)
    a = load_peft_adapter("a1", adapters["a1"], max_rank=8)
    assert a.rank == 8 and a.scaling == pytest.approx(2.0)
    b = load_peft_adapter("a2", adapters["a2"], max_rank=8)
    assert b.scaling == pytest.approx(8 / 2.0)  # rsLoRA: alpha / sqrt(r)
    assert a.identity != b.identity
    with pytest.raises(LoraLoadError, match="target module"):
        load_peft_adapter("a1", adapters["a1"], max_rank=8, model_modules={"q_proj"})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    (bad / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(LoraLoadError, match="corrupt"):
        load_peft_adapter("bad", str(bad), max_rank=8)
    with pytest.raises(LoraLoadError, match="missing"):
        load_peft_adapter("none", str(tmp_path / "nope"), max_rank=8)


def test_slot_bytes_match_allocated_slots():
    from kvserve.runtime.capacity import lora_slot_bytes_per_rank, shape_from_hf_config
    from kvserve.runtime.lora.batched import LoraSlots

    model = _tiny_llama()
    shape = shape_from_hf_config(model.config.to_dict())
    allocated = 0
    for layer in model.model.layers:
        for n in TARGETS:
            w = getattr(layer.self_attn if n in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, n).weight
            s = LoraSlots(3, 8, w.shape[1], w.shape[0], torch.float32)
            allocated += s.a.numel() * 4 + s.b.numel() * 4
    assert lora_slot_bytes_per_rank(shape, 3, 8, "float32") == allocated
    assert lora_slot_bytes_per_rank(shape, 0, 8, "float32") == 0


@pytest.mark.parametrize("tokens_per_adapter", [1, 2, 4, 9])  # below and above the segmented threshold
def test_lora_delta_both_paths_equal_the_per_token_product(tokens_per_adapter):
    """Each token's delta is scaling * B_slot A_slot x (0 for base tokens, rank tail unused), whether the step
    takes the gathered path (few tokens per adapter) or the segmented one (many), with interleaved rows."""
    from kvserve.runtime.lora import batched

    gen = torch.Generator().manual_seed(0)
    slots = batched.LoraSlots(4, 8, 12, 20, torch.float32)
    ranks = {0: 8, 1: 3, 3: 5}  # slot 2 stays empty: never used
    for slot, r in ranks.items():
        slots.set(slot, torch.randn(r, 12, generator=gen), torch.randn(20, r, generator=gen), scaling=0.5 * (slot + 1))
    per_row = [-1, 0, 1, 3] * tokens_per_adapter + [-1]
    token_slots = torch.tensor(per_row)
    x = torch.randn(len(per_row), 12, generator=gen)
    got = batched.lora_delta(x, token_slots, slots)
    for i, slot in enumerate(per_row):
        want = torch.zeros(20) if slot < 0 else slots.b[slot] @ (slots.a[slot] @ x[i])
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    assert batched.lora_delta(x, torch.full((len(per_row),), -1), slots) is None


def test_engine_mixed_batch_matches_peft(model_factory, tmp_path):
    """The real engine: LLM(enable_lora, lora_modules) runs base + two adapters in one generate() call, on
    kvserve's own model (fused qkv_proj / gate_up_proj), token-identical to HF + peft per row."""

    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.errors import InvalidParameter

    model_dir, hf_model = model_factory("llama_gqa")

    from kvserve_testing import make_peft_adapter

    path_a1, path_a2 = str(tmp_path / "a1"), str(tmp_path / "a2")
    peft_a1 = make_peft_adapter(hf_model, path_a1, r=8, alpha=16, seed=1)
    peft_a2 = make_peft_adapter(hf_model, path_a2, r=4, alpha=8, seed=2, rslora=True)
    prompts = [[5, 17, 33, 2, 8], [9, 40, 3, 77], [1, 2, 3, 4, 5, 6], [5, 17, 33, 2, 8]]
    names = ["a1", None, "a2", None]  # the 4th: a1's prompt on the base model (prefix cache keyed by adapter)
    steps = 6
    refs = {None: hf_model.eval(), "a1": peft_a1, "a2": peft_a2}
    expected = []
    with torch.no_grad():
        for p, n in zip(prompts, names):
            expected.append(_greedy(refs[n], torch.tensor([p]), steps)[0, len(p) :].tolist())
    assert expected[0] != expected[3]  # the adapter changes the tokens: a no-op delta cannot pass

    llm = LLM(
        model_dir,
        max_model_len=64,
        num_kv_blocks=64,
        block_size=16,
        enable_lora=True,
        lora_modules=f"a1={path_a1},a2={path_a2}",
        max_loras=2,
        max_lora_rank=8,
    )
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=names)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    with pytest.raises(InvalidParameter, match="no such LoRA adapter"):
        llm.generate([[1, 2]], params, use_tqdm=False, lora_request="nope")
