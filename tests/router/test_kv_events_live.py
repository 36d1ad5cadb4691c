"""A router in front of two real kvserve replicas that publish their KV events: prompts sent to a replica
behind the router's back (as another router instance would) are in the router's index as soon as the
replica's events arrive, keyed by the router's own tokenisation, and the router sends the prompt there."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)

STORY = "{} was a little dog who lived in a big house near the sea, once upon a time. "


def test_router_routes_on_real_replicas_events(stories_event_replicas, fakes):
    from kvserve.runtime.router.kv_subscriber import EventEndpoints, EventSource, KVEventSubscriptions
    from kvserve.runtime.router.prompt import PromptTokenizer
    from kvserve.runtime.router.scoring import HashCache

    replicas = stories_event_replicas
    endpoints = EventEndpoints(
        explicit={
            r.url: EventSource(
                r.engine.core.kv_events.publisher.endpoint, r.engine.core.kv_events.publisher.replay_endpoint
            )
            for r in replicas
        },
        topic="kv",
    )
    events = KVEventSubscriptions(endpoints, stale_after_s=5.0, sync_interval_s=0.2)
    tokenizer = PromptTokenizer(replicas[0].model_dir)
    router = fakes.router(
        [r.url for r in replicas], tokenizer=tokenizer, kv_events=events, default_block_size=16, poll_interval_s=0.2
    )
    deadline = time.monotonic() + 20
    while not all(events.index.is_fresh(r.url, time.monotonic()) for r in replicas):
        assert time.monotonic() < deadline, "no heartbeat from the replicas' event streams"
        time.sleep(0.1)
    for round_, target in enumerate([1, 0, 1]):
        prompt = STORY.format(f"Rex{round_}") * 3
        body = {"model": "stories", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        assert httpx.post(replicas[target].url + "/v1/completions", json=body, timeout=60).status_code == 200
        hashes = HashCache(tokenizer.token_ids("/v1/completions", body))(16)
        assert len(hashes) >= 4
        deadline = time.monotonic() + 10
        while events.index.matched_blocks(replicas[target].url, hashes) < len(hashes):
            assert time.monotonic() < deadline, "the replica's events never showed the prompt's blocks"
            time.sleep(0.05)
        assert events.index.matched_blocks(replicas[1 - target].url, hashes) == 0
        resp = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == replicas[target].url
    assert router.metric("kvserve_router:kv_events_fresh", replica=replicas[0].url) == 1
