"""/metrics under saturation, and 100+ concurrent streams with 20% dropped mid-stream: every KV block is
free again afterwards and the streams that stayed got exactly the offline engine's text."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.runtime import SamplingParams
from kvserve.runtime.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from tests.server.conftest import LiveServer, make_engine

pytestmark = pytest.mark.timeout(180)


def scrape(base_url: str) -> dict[str, dict]:
    """{family name: {(sample name, sorted labels): value}}; raises if the exposition does not parse."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    return families


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    for (name, lbls), v in families[family].items():
        if (sample is None or name == sample) and all(dict(lbls).get(k) == str(x) for k, x in labels.items()):
            return v
    raise KeyError(f"{family} {sample} {labels}")


def buckets(families: dict, family: str) -> list[float]:
    return sorted(
        float(dict(lbls)["le"])
        for (name, lbls) in families[family]
        if name.endswith("_bucket") and dict(lbls)["le"] != "+Inf"
    )


def test_metrics_names_buckets_and_saturation(demo_model_dir):
    srv = LiveServer(make_engine(demo_model_dir, max_num_seqs=2), served_model_names=["sat-model"])
    try:
        families = scrape(srv.base_url)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens",
            "vllm:generation_tokens",
            "vllm:num_preemptions",
            "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits",
            "vllm:request_success",
            "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens",
            "vllm:cache_config_info",
        ):
            assert name in families, name
        assert buckets(families, "vllm:time_to_first_token_seconds") == TTFT_BUCKETS
        assert buckets(families, "vllm:inter_token_latency_seconds") == ITL_BUCKETS
        assert buckets(families, "vllm:e2e_request_latency_seconds") == REQUEST_LATENCY_BUCKETS
        assert value(families, "vllm:num_requests_waiting", model_name="sat-model", engine="0") == 0

        # Saturate: 2 running seats, 10 requests -> a queue forms; watch it through /metrics.
        async def load() -> tuple[list[float], list]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                tasks = [
                    asyncio.ensure_future(
                        client.post(
                            "/v1/completions",
                            json={"prompt": f"saturate {i}", "max_tokens": 48, "ignore_eos": True, "temperature": 0},
                        )
                    )
                    for i in range(10)
                ]
                waiting_seen = []
                while not all(t.done() for t in tasks):
                    f = scrape(srv.base_url)
                    waiting_seen.append(value(f, "vllm:num_requests_waiting"))
                    await asyncio.sleep(0.05)
                return waiting_seen, [t.result() for t in tasks]

        waiting_seen, responses = asyncio.run(load())
        assert all(r.status_code == 200 for r in responses)
        assert max(waiting_seen) > 0, waiting_seen
        srv.wait_idle()
        families = scrape(srv.base_url)
        assert value(families, "vllm:num_requests_waiting") == 0
        assert value(families, "vllm:num_requests_running") == 0
        assert value(families, "vllm:kv_cache_usage_perc") == 0
        assert value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 10
        assert value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 480
        assert value(families, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 10
        assert value(families, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") >= 10 * 40
        assert value(families, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 10
        assert value(families, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_sum") > 0
        assert value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") > 0
    finally:
        srv.stop()


def test_100_streams_20_percent_dropped_frees_every_block(server, offline_llm):
    num_streams, drop_every = 110, 5  # 22 dropped
    prompts = [f"Stream number {i % 11} walks to the harbour" for i in range(num_streams)]
    max_tokens = 24
    expected = {
        p: o.outputs[0].text
        for p, o in zip(
            sorted(set(prompts)),
            offline_llm.generate(
                sorted(set(prompts)), SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
            ),
        )
    }

    async def one(client, i: int):
        stream = await client.completions.create(
            model=server.model, prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True
        )
        text, chunks = "", 0
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text
            if i % drop_every == 0 and chunks >= 3:
                await stream.close()  # the client goes away mid-stream
                return i, None
        return i, text

    async def run_all():
        client = server.async_openai()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(num_streams))), 150)
        finally:
            await client.close()

    before = scrape(server.base_url)
    results = asyncio.run(run_all())
    dropped = [i for i, text in results if text is None]
    assert len(dropped) == num_streams // drop_every
    for i, text in results:
        if text is not None:
            assert text == expected[prompts[i]], i
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert stats.kv_cache_usage == 0 and stats.num_requests_running == 0 and stats.num_requests_waiting == 0
    families = scrape(server.base_url)
    assert value(families, "vllm:kv_cache_usage_perc") == 0
    assert value(families, "kvserve:num_kv_blocks_free") == value(families, "kvserve:num_kv_blocks_total")
    # the kept streams all finished; the dropped ones were (almost always) aborted before finishing
    finished = sum(
        value(f, "vllm:request_success", "vllm:request_success_total", finished_reason=r)
        - value(before, "vllm:request_success", "vllm:request_success_total", finished_reason=r)
        if any(dict(lbl).get("finished_reason") == r for (_, lbl) in before["vllm:request_success"])
        else value(f, "vllm:request_success", "vllm:request_success_total", finished_reason=r)
        for f in [families]
        for r in ("length", "stop")
        if any(dict(lbl).get("finished_reason") == r for (_, lbl) in families["vllm:request_success"])
    )
    assert num_streams - len(dropped) <= finished < num_streams


def test_non_streaming_client_timeout_aborts_request(server):
    engine = server.state.engine
    server.wait_idle()
    generated_before = engine.stats.generation_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + "/v1/completions",
            timeout=0.3,
            json={"prompt": "long", "max_tokens": 1500, "ignore_eos": True},
        )
    # 1500 tokens take several seconds to generate; the abort must land well before that
    deadline = time.monotonic() + 2
    while engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_in_flight == 0
    stats = server.wait_idle(2)
    assert stats.generation_tokens - generated_before < 1500
    assert stats.num_free_blocks == stats.num_total_blocks
