"""P/D with per-request features on both legs, each equal to the aggregated engine's tokens: a LoRA adapter
(the prefill engine computes the prompt's KV with it, the decode engine pulls it and decodes with it; the tokens
differ from the base model's, so it is really applied on both sides) and a structured-output grammar."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")

from kvserve_testing import STORIES_DIR  # noqa: E402

from kvserve.runtime.models.synthetic import make_random_adapter_dir  # noqa: E402
from kvserve.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.disagg.pd_testing import drain, engine, free_port, run, transfer_config  # noqa: E402


def _params(lora_name, max_tokens, kv=None):
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, lora_name=lora_name, kv_transfer_params=kv
    )


def test_pd_with_lora_adapter(tmp_path):
    model = str(STORIES_DIR)
    modules = f"a={make_random_adapter_dir(model, str(tmp_path / 'a'), rank=4, seed=1)}"
    lora = dict(
        enable_lora=True, lora_modules=modules, max_loras=1, max_lora_rank=4, dtype="float32", max_model_len=128
    )
    p = engine(model, transfer_config("kv_producer", "prefill-lora", free_port()), **lora)
    d = engine(model, transfer_config("kv_consumer", "decode-lora"), **lora)
    a = engine(model, **lora)
    try:
        prompt = list(range(5, 70))
        ref = run(a, "agg", prompt, _params("a", 10)).outputs[0].token_ids
        base = run(a, "base", prompt, _params(None, 10)).outputs[0].token_ids
        assert ref != base
        first = run(p, "p", prompt, _params("a", 1, {"do_remote_decode": True}))
        out = run(d, "d", prompt, _params("a", 10, first.kv_transfer_params), p)
        assert out.outputs[0].token_ids == ref
        assert d.scheduler.pd.num_pulled_tokens == len(prompt) - 1
        drain(p)
        assert p.scheduler.pd.num_leased_blocks == 0
    finally:
        for e in (p, d, a):
            e.shutdown()


def test_pd_with_structured_output(tmp_path):
    """A grammar on both legs (the proxy forwards the body): the decode engine's constrained tokens equal the
    aggregated engine's."""
    from kvserve.runtime.structured_output.spec import StructuredOutputSpec

    model = str(STORIES_DIR)
    regex = StructuredOutputSpec.from_request(
        "regex", r" (red|big) ball\. Tom had a (red|big) ball\.( Tom had a [a-z]+ ball\.)*", "regex"
    )
    prompt = "Tom had a red ball. Tom had a red ball. Tom had a"

    def params(max_tokens, kv=None):
        return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=regex, kv_transfer_params=kv)

    p = engine(model, transfer_config("kv_producer", "prefill-grammar", free_port()), max_model_len=128)
    d = engine(model, transfer_config("kv_consumer", "decode-grammar"), max_model_len=128)
    a = engine(model, max_model_len=128)
    try:
        ref = run(a, "agg", prompt, params(30)).outputs[0]
        first = run(p, "p", prompt, params(1, {"do_remote_decode": True}))
        out = run(d, "d", prompt, params(30, first.kv_transfer_params), p).outputs[0]
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert ref.text.lstrip().startswith(("red ball.", "big ball."))  # the grammar holds
        assert d.scheduler.pd.num_pulled_tokens > 0
        drain(p)
    finally:
        for e in (p, d, a):
            e.shutdown()
