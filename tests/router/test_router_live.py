"""The router in front of two real kvserve replicas (stories260K): it tokenises exactly as the engine does,
passes outputs through unchanged, and keeps a conversation on the replica that caches its history."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)

SYSTEM = "You are a storyteller who tells short stories about animals. " * 4


def _turns(n: int, turns: int) -> list[list[dict]]:
    out, messages = [], [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages = messages + [{"role": "user", "content": f"Tell me about the cat number {n}, part {t}."}]
        out.append(messages)
        messages = messages + [{"role": "assistant", "content": f"Once upon a time there was cat {n} in a house."}]
    return out


def _prefix_hits(url: str) -> float:
    from kvserve.runtime.router.replica_metrics import parse_metrics

    return parse_metrics(httpx.get(url + "/metrics").text).prefix_cache_hits


def test_router_tokenises_like_the_server(stories_replicas):
    from kvserve.runtime.router.prompt import PromptTokenizer

    replica = stories_replicas[0]
    tok = PromptTokenizer(replica.model_dir)
    messages = _turns(1, 2)[-1]
    served = httpx.post(replica.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert tok.token_ids("/v1/chat/completions", {"messages": messages}) == served
    served = httpx.post(replica.url + "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    assert tok.token_ids("/v1/completions", {"prompt": "Once upon a time"}) == served
    assert tok.token_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.token_ids("/v1/chat/completions", {"messages": "not a list"}) is None  # the replica says 400


def test_conversations_through_the_router(stories_replicas, fakes):
    from kvserve.runtime.router.prompt import PromptTokenizer

    urls = [r.url for r in stories_replicas]
    router = fakes.router(
        urls, tokenizer=PromptTokenizer(stories_replicas[0].model_dir), default_block_size=16, poll_interval_s=0.2
    )
    hits_before = sum(_prefix_hits(u) for u in urls)
    homes: dict[int, set[str]] = {}
    for n in range(4):
        for t, messages in enumerate(_turns(n, 3)):
            body = {"model": "stories", "messages": messages, "max_tokens": 8, "temperature": 0, "stream": t % 2 == 1}
            via_router = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
            direct = httpx.post(urls[0] + "/v1/chat/completions", json=body, timeout=60)
            assert via_router.status_code == 200
            homes.setdefault(n, set()).add(via_router.headers["x-kvserve-endpoint"])
            if body["stream"]:

                def text(resp):
                    import json

                    return "".join(
                        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                        for line in resp.text.splitlines()
                        if line.startswith("data: {") and json.loads(line[6:]).get("choices")
                    )

                assert text(via_router) == text(direct)
            else:
                assert via_router.json()["choices"] == direct.json()["choices"]
    assert all(len(h) == 1 for h in homes.values()), homes
    assert sum(_prefix_hits(u) for u in urls) > hits_before
    # Each replica's index is sized from the capacity the replica itself reports (kvserve:kv_capacity_tokens).
    from kvserve.runtime.router.replica_metrics import parse_metrics

    for url in urls:
        reported = parse_metrics(httpx.get(url + "/metrics").text)
        assert reported.capacity_tokens and reported.block_size == 16
        replica = router.router.replicas.replicas[url]
        assert router.router.replicas.capacity_blocks(replica) == reported.capacity_tokens // 16


def test_pd_mode_in_front_of_real_replicas_answers_token_for_token(stories_replicas, fakes):
    """P/D mode with one replica as the prefill pool and one as the decode pool. Whether the engines hand the
    KV over (kv_transfer_params, remote_prefill) or not (a prefill answer without them: the aggregated
    fallback), the client's greedy tokens equal a direct request's, streamed or not."""
    from kvserve.runtime.router.prompt import PromptTokenizer

    p, d = stories_replicas
    router = fakes.router(
        [],
        prefill=[p.url],
        decode=[d.url],
        tokenizer=PromptTokenizer(p.model_dir),
        default_block_size=16,
        max_local_prefill_length=8,
    )
    for n, stream in ((0, False), (1, True)):
        messages = _turns(n, 1)[0]
        body = {"model": "stories", "messages": messages, "max_tokens": 8, "temperature": 0, "stream": stream}
        via_router = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
        direct = httpx.post(d.url + "/v1/chat/completions", json=body, timeout=60)
        assert via_router.status_code == 200 and via_router.headers["x-kvserve-endpoint"] == d.url
        if stream:
            assert [line for line in via_router.text.splitlines() if '"content"' in line] != []
            assert _stream_text(via_router) == _stream_text(direct)
        else:
            assert via_router.json()["choices"] == direct.json()["choices"]
    remote = router.metric("kvserve_router:pd_requests_total", path="remote_prefill", reason="long_uncached")
    fallback = router.metric("kvserve_router:pd_requests_total", path="fallback", reason="no_kv_transfer_params")
    assert remote + fallback == 2


def _stream_text(resp: httpx.Response) -> str:
    import json

    return "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in resp.text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:]).get("choices")
    )
