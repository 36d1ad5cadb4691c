"""The pure routing core: block hashes shared with the engine, the per-replica LRU index, the scorers, the
replica bookkeeping (ejection, draining, removal) and /metrics parsing."""

from __future__ import annotations

import random

import pytest

from kvserve.runtime.core.block_hash import block_hashes
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.request import Request
from kvserve.runtime.router.config import RouterConfig
from kvserve.runtime.router.prefix_index import PrefixIndex, ReplicaLRU
from kvserve.runtime.router.replica_metrics import parse_metrics
from kvserve.runtime.router.replicas import ReplicaSet
from kvserve.runtime.router.scoring import HashCache, ReplicaView, RequestFeatures, SessionTable, Weights, rank
from kvserve.runtime.sampling_params import SamplingParams

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def test_router_hashes_are_the_engines_prefix_cache_hashes():
    """A prompt the engine has cached is found under the exact hashes the router computes."""
    tokens = list(range(100, 170))  # 4 full blocks of 16 + 6
    kv = KVCacheManager(num_blocks=32, block_size=16)
    req = Request("r", tokens, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, len(tokens)) is not None
    assert block_hashes(tokens, 16) == req.block_hashes and len(req.block_hashes) == 4
    # and a second request with that prefix hits exactly those blocks
    again = Request("s", tokens[:64] + [1, 2, 3], SamplingParams(max_tokens=1))
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == 64 and block_hashes(again.all_token_ids, 16) == again.block_hashes


def test_lru_longest_prefix_and_eviction_order():
    lru = ReplicaLRU(capacity_blocks=6)
    conv = block_hashes(list(range(64)), 16)  # 4 blocks
    lru.record(conv)
    assert lru.matched_blocks(conv) == 4
    assert lru.matched_blocks(block_hashes(list(range(48)) + [999] * 16, 16)) == 3  # diverges in block 4
    assert lru.matched_blocks(block_hashes([7] + list(range(1, 64)), 16)) == 0  # chained: block 0 differs
    other = block_hashes(list(range(1000, 1048)), 16)  # 3 blocks: 7 > 6, the LRU must evict one
    lru.record(other)
    assert len(lru) == 6
    # the oldest prompt loses its tail first, keeping its (more shared) leading blocks
    assert lru.matched_blocks(conv) == 3 and lru.matched_blocks(other) == 3
    lru.resize(2)
    assert len(lru) == 2 and lru.matched_blocks(other) == 2 and lru.matched_blocks(conv) == 0


def test_prompt_longer_than_the_index_keeps_its_head():
    lru = ReplicaLRU(capacity_blocks=3)
    long = block_hashes(list(range(160)), 16)
    lru.record(long)
    assert lru.matched_blocks(long) == 3


def _rank(features, views, index, weights=Weights(), seed=0):
    return rank(features, views, index, weights, random.Random(seed))


def _conversation_index(tokens):
    index = PrefixIndex()
    index.record(A, block_hashes(tokens, 16), 1000)
    return index


def test_prefix_affinity_beats_a_small_load_difference_but_not_saturation():
    history = list(range(320))  # 20 blocks cached on A
    index = _conversation_index(history)
    features = RequestFeatures(hashes_for=HashCache(history + list(range(900, 950))), num_prompt_tokens=370)
    views = [
        ReplicaView(A, in_flight=2, kv_usage=0.2),
        ReplicaView(B, in_flight=0, kv_usage=0.2),
        ReplicaView(C, in_flight=1, kv_usage=0.2),
    ]
    decision = _rank(features, views, index)
    assert decision.urls[0] == A and decision.reason == "prefix"
    assert decision.ranked[0].matched_blocks == 20 and decision.ranked[0].total_blocks == 23
    # A runs 9 more requests than B (> max_imbalance 8): affinity is dropped, the idle replica wins
    views[0] = ReplicaView(A, in_flight=9, kv_usage=0.2)
    decision = _rank(features, views, index)
    assert decision.urls[0] == B and decision.reason == "load" and decision.ranked[-1].url == A


def test_prefill_work_spreads_a_shared_prefix_but_keeps_a_conversation_home():
    system = list(range(500))  # a tenant's system prompt, cached on A only
    index = _conversation_index(system)
    new_conversation = system + list(range(5000, 5100))
    features = RequestFeatures(hashes_for=HashCache(new_conversation), num_prompt_tokens=600)
    # A holds the shared prefix but is busy prefilling 1500 tokens for 4 requests: the idle B is cheaper.
    busy_a = ReplicaView(A, in_flight=4, kv_usage=0.2, in_flight_prefill_tokens=1500)
    idle_b = ReplicaView(B, in_flight=0, kv_usage=0.2)
    decision = _rank(features, [busy_a, idle_b], index)
    assert decision.urls[0] == B and decision.reason == "load"
    assert {s.url: s.uncached_tokens for s in decision.ranked} == {
        A: 600 - 31 * 16,
        B: 600,
    }  # 31 full blocks of 16 cached on A
    # A whole conversation's history (1000 tokens) cached on A outweighs A's two running requests.
    history = list(range(1000))
    index = _conversation_index(history)
    features = RequestFeatures(hashes_for=HashCache(history + list(range(7000, 7060))), num_prompt_tokens=1060)
    decision = _rank(features, [ReplicaView(A, in_flight=2, kv_usage=0.2), idle_b], index)
    assert decision.urls[0] == A and decision.reason == "prefix"


def test_load_decides_without_a_cached_prefix_and_reported_load_counts():
    index = PrefixIndex()
    features = RequestFeatures(hashes_for=HashCache(list(range(64))))
    views = [
        ReplicaView(A, in_flight=0, waiting=5, running=3, kv_usage=0.5),
        ReplicaView(B, in_flight=1, waiting=0, running=1, kv_usage=0.5),
    ]
    decision = _rank(features, views, index)
    assert decision.urls == [B, A] and decision.reason == "load"
    assert decision.ranked[1].load == 8  # waiting + running from /metrics beats the router's own count


def test_kv_pressure_and_stale_metrics():
    index = PrefixIndex()
    views = [ReplicaView(A, kv_usage=0.9), ReplicaView(B, kv_usage=0.1), ReplicaView(C, kv_usage=None)]
    decision = _rank(RequestFeatures(), views, index)
    assert decision.urls == [B, A, C]  # unknown (stale) KV usage scores as full
    assert decision.ranked[2].kv == 0.0


def test_ties_are_broken_at_random():
    views = [ReplicaView(A, kv_usage=0.0), ReplicaView(B, kv_usage=0.0), ReplicaView(C, kv_usage=0.0)]
    firsts = {_rank(RequestFeatures(), views, PrefixIndex(), seed=s).urls[0] for s in range(30)}
    assert firsts == {A, B, C}


def test_session_affinity_and_table_bounds():
    views = [ReplicaView(A, in_flight=3, kv_usage=0.1), ReplicaView(B, kv_usage=0.1)]
    decision = _rank(RequestFeatures(session_url=A), views, PrefixIndex())
    assert decision.urls[0] == A and decision.reason == "session"
    table = SessionTable(max_sessions=2)
    table.put("s1", A)
    table.put("s2", B)
    table.get("s1")
    table.put("s3", B)  # evicts s2, the least recently used
    assert table.get("s2") is None and table.get("s1") == A
    table.forget_replica(A)
    assert table.get("s1") is None and table.get("s3") == B


def test_weights_are_validated():
    with pytest.raises(ValueError, match="prefix"):
        Weights(prefix=-1)
    with pytest.raises(ValueError, match="queue_scale"):
        Weights(queue_scale=0)


def test_single_replica_and_no_replicas():
    assert _rank(RequestFeatures(), [], PrefixIndex()).ranked == []
    assert _rank(RequestFeatures(), [ReplicaView(A)], PrefixIndex()).reason == "only"


METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",num_gpu_blocks="100"} 1.0
"""


def test_parse_metrics_capacity_sources():
    m = parse_metrics(METRICS)
    assert (m.running, m.waiting, m.kv_usage, m.block_size) == (3, 7, 0.25, 32)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1000.0, 640.0)
    assert m.capacity_tokens == 3200  # vLLM: num_gpu_blocks x block_size
    with_gauge = METRICS + "# TYPE kvserve:kv_capacity_tokens gauge\nkvserve:kv_capacity_tokens 4096.0\n"
    assert parse_metrics(with_gauge).capacity_tokens == 4096  # kvserve's own gauge wins
    old = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n"
    m = parse_metrics(old)
    assert m.kv_usage == 0.5 and m.capacity_tokens is None and m.block_size is None


def test_replica_set_sizes_the_index_from_reported_capacity():
    rs = ReplicaSet(RouterConfig(default_capacity_tokens=1600, default_block_size=16))
    rs.set_endpoints({A, B})
    assert rs.capacity_blocks(rs.replicas[A]) == 100  # default: 1600 tokens / 16
    rs.observe_metrics(A, parse_metrics(METRICS + "kvserve:kv_capacity_tokens 640.0\n"), now=0.0)
    assert rs.capacity_blocks(rs.replicas[A]) == 20 and rs.block_size(rs.replicas[A]) == 32
    assert rs.index.ensure(A, rs.capacity_blocks(rs.replicas[A])).capacity_blocks == 20
    view = rs.view(rs.replicas[A], now=1.0)
    assert view.waiting == 7 and view.kv_usage == 0.25 and view.block_size == 32
    assert rs.view(rs.replicas[A], now=10.0).kv_usage is None  # stale after 2 s


def test_ejection_backoff_probe_readmit_drain_and_removal():
    rs = ReplicaSet(RouterConfig(eject_base_s=1.0, eject_max_s=4.0))
    rs.set_endpoints({A, B})
    rs.index.record(A, [b"x"], 10)
    rs.sessions.put("s", A)
    assert rs.eject(A, now=100.0, cause="connect") == 1.0
    assert rs.eject(A, now=100.0, cause="again") is None  # already out
    assert [r.url for r in rs.routable(100.0)] == [B]
    assert rs.index.size(A) == 0 and rs.sessions.get("s") is None
    assert rs.due_for_probe(100.5) == [] and rs.due_for_probe(101.0) == [A]
    rs.probe_failed(A, now=101.0)  # back-off doubles
    assert rs.replicas[A].ejected_until == 103.0
    rs.probe_failed(A, now=103.0)
    assert rs.replicas[A].ejected_until == 107.0  # capped at 4 s
    assert rs.readmit(A) and {r.url for r in rs.routable(107.0)} == {A, B}
    # every replica ejected: fail open rather than refuse everything
    rs.eject(A, 200.0, "x")
    rs.eject(B, 200.0, "x")
    assert {r.url for r in rs.routable(200.0)} == {A, B}
    # draining (serving + terminating) takes nothing new; removal forgets everything about the replica
    rs.set_endpoints({A}, draining={B})
    assert rs.replicas[B].draining and [r.url for r in rs.routable(300.0)] == [A]
    rs.index.record(B, [b"y"], 10)
    added, removed = rs.set_endpoints({A})
    assert removed == {B} and B not in rs.replicas and rs.index.size(B) == 0


def test_a_replica_that_reports_draining_takes_nothing_new_until_it_reports_otherwise():
    """A stop signal shows in the replica's /metrics (kvserve:draining 1) before the replica refuses anything
    (preStop sleep, --drain-accept-seconds): the router stops sending there first, with static backends too."""
    rs = ReplicaSet()
    rs.set_endpoints({A, B})
    assert parse_metrics("kvserve:draining 0\n").draining is False
    rs.observe_metrics(B, parse_metrics("# TYPE kvserve:draining gauge\nkvserve:draining 1\n"), now=1.0)
    assert [r.url for r in rs.routable(1.0)] == [A]
    rs.observe_metrics(B, parse_metrics("kvserve:draining 0\n"), now=2.0)  # restarted at the same URL
    assert {r.url for r in rs.routable(2.0)} == {A, B}
