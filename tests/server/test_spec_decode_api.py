"""Speculative decoding through the OpenAI server, the engine core in its own process (as `kvserve serve`
runs it): greedy completions equal the offline engine's without drafts, and /metrics carries vLLM's
spec-decode counters, parsed as Prometheus text."""

from __future__ import annotations

import httpx
import pytest
from kvserve_testing import STORIES_DIR
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import LiveServer

STORIES = str(STORIES_DIR)
ENGINE = dict(max_model_len=256, kv_cache_bytes=8 << 20, seed=0)
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
PROMPTS = ["Tom had a red ball. Tom had a red ball. Tom had a", "Once upon a time, there was a girl named Lily. Lily"]


@pytest.fixture(scope="module")
def spec_server():
    from kvserve.runtime.engine.core_client import CoreClient

    srv = LiveServer(CoreClient.from_kwargs(STORIES, speculative_config=SPEC, **ENGINE), model_dir=STORIES)
    yield srv
    srv.stop()


def test_greedy_completions_equal_plain_decoding_and_metrics_count_drafts(spec_server):
    from kvserve.runtime import LLM, SamplingParams

    plain = LLM(STORIES, **ENGINE).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    with httpx.Client(base_url=spec_server.base_url, timeout=60) as client:
        for prompt, expected in zip(PROMPTS, plain):
            body = {"model": spec_server.model, "prompt": prompt, "max_tokens": 60, "temperature": 0}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected.outputs[0].text
        spec_server.wait_idle()
        text = client.get("/metrics").text
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:spec_decode")
    }
    drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
    drafted = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted
    per_pos = {pos: v for (name, pos), v in samples.items() if name.endswith("per_pos_total")}
    assert sum(per_pos.values()) == accepted and per_pos["0"] >= per_pos.get("1", 0)
