"""P/D mode's pure parts: the decision rule, roles from llm-d's label, the legs' bodies, the usage rewrite."""

from __future__ import annotations

import json

import pytest

from kvserve.runtime.router import discovery
from kvserve.runtime.router.config import RouterConfig
from kvserve.runtime.router.pd import (
    BOTH,
    DECODE,
    DECODE_CANDIDATES,
    PREFILL,
    PREFILL_CANDIDATES,
    PDRule,
    SSEUsageRewriter,
    decode_body,
    estimate_prompt_tokens,
    parse_prefill_answer,
    prefill_body,
    prefill_queue,
    rewrite_json_usage,
    role_from_label,
)
from kvserve.runtime.router.replicas import ReplicaSet


def _rule(**kw) -> PDRule:
    c = RouterConfig(**kw)
    return PDRule(c.pd_decider, c.max_local_prefill_length, c.max_prefill_queue, c.remote_prefill_min_uncached_ratio)


def test_dynamos_rule_with_its_defaults():
    rule = _rule()
    assert (rule.max_local_prefill_length, rule.max_prefill_queue) == (1000, 2)  # Dynamo's disagg_router
    assert rule.by_length(500, 500) == (False, "short")
    assert rule.by_length(1000, 1000) == (False, "short")
    assert rule.by_length(1001, 1001) == (True, "long_uncached")
    assert rule.by_length(10_000, 10_000) == (True, "long_uncached")
    # Long, but the decode replica holds all but a short tail: local.
    assert rule.by_length(10_000, 1000) == (False, "cached")
    assert rule.by_length(10_000, 1001) == (True, "long_uncached")  # the ratio rule is off by default
    assert rule.by_queue(1) == (True, "ok") and rule.by_queue(2) == (False, "prefill_saturated")


def test_the_rule_is_configurable():
    ratio = _rule(remote_prefill_min_uncached_ratio=0.7)
    assert ratio.by_length(10_000, 6999) == (False, "cached") and ratio.by_length(10_000, 7000)[0]
    assert _rule(max_local_prefill_length=0).by_length(1, 1) == (True, "long_uncached")
    assert _rule(max_prefill_queue=5).by_queue(4) == (True, "ok")
    always = _rule(pd_decider="always")
    assert always.by_length(1, 0) == (True, "always") and always.by_queue(100) == (True, "ok")
    assert _rule(pd_decider="never").by_length(10**6, 10**6) == (False, "disabled")


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"pd_decider": "sometimes"}, "pd_decider"),
        ({"max_local_prefill_length": -1}, "max_local_prefill_length"),
        ({"remote_prefill_min_uncached_ratio": 1.5}, "remote_prefill_min_uncached_ratio"),
        ({"max_prefill_queue": 0}, "max_prefill_queue"),
    ],
)
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _rule(**kw)


def test_prefill_queue_prefers_the_replicas_own_gauge():
    assert prefill_queue(waiting=3, in_flight=0) == 3
    assert prefill_queue(waiting=0, in_flight=5) == 0  # a fresh scrape says nothing waits
    assert prefill_queue(waiting=None, in_flight=0) == 0
    assert prefill_queue(waiting=None, in_flight=3) == 2  # no scrape: legs beyond the one being worked on


def test_roles_from_llm_d_labels():
    assert role_from_label("prefill") == PREFILL and role_from_label("decode") == DECODE
    assert role_from_label("prefill-decode") == BOTH and role_from_label("both") == BOTH
    assert role_from_label(None) == BOTH and role_from_label("encode") is None
    pods = [
        {"metadata": {"labels": {"llm-d.ai/role": "prefill"}}, "status": {"podIP": "10.0.0.1"}},
        {"metadata": {"labels": {"llm-d.ai/role": "decode"}}, "status": {"podIPs": [{"ip": "fd00::2"}]}},
        {"metadata": {"labels": {"llm-d.ai/role": "encode"}}, "status": {"podIP": "10.0.0.3"}},
        {"metadata": {"labels": {}}, "status": {}},  # not scheduled yet: no IP
    ]
    roles = discovery.roles_from_pods(pods, "llm-d.ai/role")
    assert roles == {"10.0.0.1": PREFILL, "fd00::2": DECODE, "10.0.0.3": None}
    ready = {"http://10.0.0.1:8000", "http://[fd00::2]:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000"}
    kept, draining, by_url = discovery.with_roles(ready, set(), roles)
    assert by_url == {"http://10.0.0.1:8000": PREFILL, "http://[fd00::2]:8000": DECODE, "http://10.0.0.4:8000": BOTH}
    assert kept == set(by_url) and draining == set()  # the encode pod is not routed to


def test_replica_set_by_role():
    rs = ReplicaSet()
    rs.set_endpoints({"http://p", "http://d", "http://b"}, roles={"http://p": PREFILL, "http://d": DECODE})
    assert rs.pd_active()
    assert {r.url for r in rs.routable(0.0, DECODE_CANDIDATES)} == {"http://d", "http://b"}
    assert {r.url for r in rs.routable(0.0, PREFILL_CANDIDATES)} == {"http://p", "http://b"}
    assert {r.url for r in rs.ready()} == {"http://d", "http://b"}  # a prefill replica cannot serve alone
    rs.eject("http://p", 0.0, "test")
    assert [r.url for r in rs.routable(0.0, PREFILL_CANDIDATES)] == ["http://b"]
    rs.set_endpoints({"http://d", "http://b"})
    assert not rs.pd_active()


def test_leg_bodies_follow_vllms_toy_proxy():
    client = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3, "n": 2}
    p = prefill_body(client)
    assert p == {
        "prompt": "x",
        "stream": False,
        "n": 2,
        "max_tokens": 1,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert "max_completion_tokens" not in p  # set to 1 only where the client used it
    assert prefill_body({"messages": [], "max_completion_tokens": 50})["max_completion_tokens"] == 1
    assert client["stream"] is True and "kv_transfer_params" not in client  # the client's body is untouched
    params = {"do_remote_prefill": True, "remote_block_ids": [1]}
    assert decode_body(client, params) == {**client, "kv_transfer_params": params}


def test_the_prefill_answer_must_carry_kv_transfer_params():
    answer = parse_prefill_answer(
        json.dumps(
            {"kv_transfer_params": {"remote_block_ids": [1]}, "usage": {"prompt_tokens_details": {"cached_tokens": 3}}}
        ).encode()
    )
    assert answer.kv_transfer_params == {"remote_block_ids": [1]} and answer.cached_tokens == 3
    assert parse_prefill_answer(b'{"kv_transfer_params": {"a": 1}}').cached_tokens is None
    for bad in (b'{"choices": []}', b'{"kv_transfer_params": null}', b'{"kv_transfer_params": {}}'):
        with pytest.raises(ValueError, match="no kv_transfer_params"):
            parse_prefill_answer(bad)
    with pytest.raises(ValueError, match="not JSON"):
        parse_prefill_answer(b"<html>")


def test_usage_rewrite_json_and_sse_split_anywhere():
    doc = {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 9, "x": 1}}}
    out = json.loads(rewrite_json_usage(json.dumps(doc).encode(), 2))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 2, "x": 1}
    assert rewrite_json_usage(b"not json", 2) == b"not json"
    events = [
        b'data: {"choices": [{"text": "a"}], "usage": null}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 9}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for cut in range(1, len(stream)):
        rewriter = SSEUsageRewriter(2)
        out = b"".join([*rewriter.feed(stream[:cut]), *rewriter.feed(stream[cut:]), rewriter.flush()])
        parts = out.split(b"\n\n")
        assert parts[0] + b"\n\n" == events[0] and parts[2] + b"\n\n" == events[2]  # untouched
        assert json.loads(parts[1][6:])["usage"] == {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 2}}


def test_prompt_length_without_a_tokenizer():
    assert estimate_prompt_tokens("/v1/completions", {"prompt": "x" * 400}) == 100
    assert estimate_prompt_tokens("/v1/completions", {"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens("/v1/completions", {"prompt": ["x" * 40, "y"]}) == 10
    chat = {"messages": [{"role": "user", "content": "x" * 80}, {"content": [{"type": "text", "text": "y" * 40}]}]}
    assert estimate_prompt_tokens("/v1/chat/completions", chat) == 30
    assert estimate_prompt_tokens("/v1/completions", {}) == 0 and estimate_prompt_tokens("/v1/completions", []) == 0
