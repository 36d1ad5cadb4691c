"""LoRA adapter affinity in `kvserve router` (issue 24 item 6): which names are adapters and where they are
served (replicas' /v1/models), where they run (vllm:lora_requests_info, the router's own requests), the
lora-affinity scorer and its filter, adapter-seeded prefix hashes; against fake replicas and two real engines
on 127.0.0.1."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from kvserve.runtime.router.prefix_index import PrefixIndex
from kvserve.runtime.router.replica_metrics import parse_metrics
from kvserve.runtime.router.replica_models import ReplicaModels, parse_models
from kvserve.runtime.router.replicas import ReplicaSet
from kvserve.runtime.router.scoring import HashCache, ReplicaView, RequestFeatures, Weights, rank

A, B, C, D = "http://a:1", "http://b:1", "http://c:1", "http://d:1"


def lora_info(running: str, waiting: str, max_lora: int, at: float) -> str:
    return (
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {at}\n'
    )


def test_lora_metric_newest_series_describes_the_replica():
    """Each (running, waiting) combination is its own series, valued at the time it was last current: only the
    newest describes the replica now (an older one still lists an adapter that has finished)."""
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        + lora_info("sql,chat", "", 4, 1700000050.0)
        + lora_info("sql", "fin", 4, 1700000099.5)
        + lora_info("", "", 4, 1700000010.0)
    )
    m = parse_metrics(text)
    assert m.running_adapters == {"sql"} and m.waiting_adapters == {"fin"} and m.max_loras == 4
    plain = parse_metrics("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2.0\n")
    assert plain.running_adapters == frozenset() and plain.max_loras is None and plain.waiting == 2


def test_models_cards_with_a_parent_are_adapters():
    body = {"data": [{"id": "llama", "parent": None}, {"id": "sql", "parent": "llama"}, {"id": "alias"}]}
    assert parse_models(body) == ReplicaModels(frozenset({"llama", "alias"}), frozenset({"sql"}))
    for bad in ({"object": "list"}, {"data": [{"parent": "llama"}]}, ["sql"]):
        with pytest.raises(ValueError):
            parse_models(bad)


def _rank(features, views, index=None, weights=Weights(), seed=0):
    return rank(features, views, index or PrefixIndex(), weights, random.Random(seed))


def test_affinity_order_running_then_free_slot_then_waiting():
    """The Gateway API Inference Extension's values: running 1, a free slot 0.8, waiting 0.6, else 0."""
    views = [
        ReplicaView(D, kv_usage=0.1, running_adapters=frozenset({"x", "y"}), max_loras=2),  # full, sql not there
        ReplicaView(
            C, kv_usage=0.1, running_adapters=frozenset({"x"}), waiting_adapters=frozenset({"sql"}), max_loras=2
        ),
        ReplicaView(B, kv_usage=0.1, running_adapters=frozenset({"x"}), max_loras=4),  # room to load sql
        ReplicaView(A, kv_usage=0.1, running_adapters=frozenset({"sql", "x"}), max_loras=2),
    ]
    for seed in range(5):  # equal load everywhere: the order is the adapter's alone, whatever the tie-break
        decision = _rank(RequestFeatures(adapter="sql"), views, seed=seed)
        assert decision.urls == [A, B, C, D] and decision.reason == "adapter"
        assert [s.adapter for s in decision.ranked] == [1.0, 0.8, 0.6, 0.0]
    # the base model's requests ignore adapters: load alone decides
    base = _rank(RequestFeatures(), views)
    assert base.reason == "load" and {s.adapter for s in base.ranked} == {0.0}


def test_affinity_beats_a_small_load_difference_but_not_saturation():
    running = ReplicaView(A, in_flight=3, kv_usage=0.1, running_adapters=frozenset({"sql"}), max_loras=1)
    full = ReplicaView(B, in_flight=0, kv_usage=0.1, running_adapters=frozenset({"x"}), max_loras=1)
    assert _rank(RequestFeatures(adapter="sql"), [running, full]).urls[0] == A
    busy = ReplicaView(A, in_flight=9, kv_usage=0.1, running_adapters=frozenset({"sql"}), max_loras=1)
    decision = _rank(RequestFeatures(adapter="sql"), [busy, full])  # 9 > max_imbalance 8 busier
    assert decision.urls[0] == B and decision.ranked[1].adapter == 0.0


def test_only_replicas_serving_the_adapter_are_ranked_fail_open():
    """A replica whose /v1/models lacks the adapter would answer 404: it is left out, unless no replica is known
    to serve it; a replica whose models are unknown (unreadable) stays a candidate."""
    lacks = ReplicaView(A, kv_usage=0.0, adapters=frozenset({"chat"}))
    serves = ReplicaView(B, in_flight=5, kv_usage=0.9, adapters=frozenset({"sql"}))
    unknown = ReplicaView(C, in_flight=5, kv_usage=0.9)
    assert sorted(_rank(RequestFeatures(adapter="sql"), [lacks, serves, unknown]).urls) == [B, C]
    assert _rank(RequestFeatures(adapter="sql"), [lacks, serves]).urls == [B]  # though A is idle
    # running there (the metric) counts as serving, even before /v1/models listed it
    running = ReplicaView(C, adapters=frozenset(), running_adapters=frozenset({"sql"}))
    assert _rank(RequestFeatures(adapter="sql"), [lacks, running]).urls == [C]
    assert sorted(_rank(RequestFeatures(adapter="fin"), [lacks, serves]).urls) == [A, B]  # nobody: all


def test_an_adapters_prompts_have_their_own_prefix_chain():
    """The engine never shares KV blocks across adapters (or with the base model), so a prompt the router sent
    under one adapter is no prefix hit for the same prompt under another."""
    tokens = list(range(64))
    base, sql, chat = HashCache(tokens), HashCache(tokens, adapter="sql"), HashCache(tokens, adapter="chat")
    assert len({base(16)[0], sql(16)[0], chat(16)[0]}) == 3
    assert HashCache(tokens, adapter="sql")(16) == sql(16)  # stable: the same adapter finds its own prefix
    index = PrefixIndex()
    index.record(A, sql(16), 100)
    views = [ReplicaView(A, kv_usage=0.1), ReplicaView(B, kv_usage=0.1)]
    hit = _rank(RequestFeatures(hashes_for=HashCache(tokens, adapter="sql"), num_prompt_tokens=64), views, index)
    assert hit.urls[0] == A and hit.ranked[0].matched_blocks == 4
    miss = _rank(RequestFeatures(hashes_for=HashCache(tokens, adapter="chat"), num_prompt_tokens=64), views, index)
    assert {s.matched_blocks for s in miss.ranked} == {0}


def test_replica_set_knows_adapter_names_and_in_flight_adapters():
    replicas = ReplicaSet()
    replicas.set_endpoints({A, B})
    replicas.observe_models(A, ReplicaModels(frozenset({"llama"}), frozenset({"sql"})))
    replicas.observe_metrics(B, parse_metrics(lora_info("fin", "", 2, 5.0)), now=0.0)
    assert replicas.adapter_names() == {"sql", "fin"}
    replicas.replicas[A].in_flight_adapters["chat"] += 1
    view = replicas.view(replicas.replicas[A], now=0.0)
    assert view.adapters == {"sql"} and view.running_adapters == {"chat"} and view.max_loras is None
    assert replicas.view(replicas.replicas[B], now=1.0).running_adapters == {"fin"}
    assert replicas.view(replicas.replicas[B], now=10.0).running_adapters == frozenset()  # stale metrics
    replicas.eject(A, now=0.0, cause="test")  # a restarted replica may come back without runtime adapters
    assert replicas.replicas[A].models is None and replicas.adapter_names() == {"fin"}


# ---- live: fake replicas behind a real router -------------------------------------------------------------


def _post(router, model: str, prompt: str = "hello world", stream: bool = True) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "stream": stream}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=20)


def test_router_sends_an_adapter_where_it_runs_and_where_it_is_served(fakes):
    a, b = fakes("a", "b")
    a.adapters, b.adapters = ["sql"], ["sql", "fin"]
    a.extra_metrics = lora_info("chat", "", 1, time.time())  # its one slot is busy with another adapter
    b.extra_metrics = lora_info("sql", "", 1, time.time())
    router = fakes.router([a.url, b.url], tokenizer=fakes.WordTokenizer())
    router.poll()
    assert router.router.replicas.adapter_names() == {"sql", "fin", "chat"}  # chat: from a's metric
    for _ in range(4):
        assert _post(router, "sql").headers["x-kvserve-endpoint"] == b.url
    assert router.metric("kvserve_router:requests_total", replica=b.url, reason="adapter") == 4
    # "fin" is on b only: a would answer 404 however idle it is
    a.extra_metrics = b.extra_metrics = ""
    router.poll()
    assert {_post(router, "fin").headers["x-kvserve-endpoint"] for _ in range(4)} == {b.url}
    # the base model's requests are not held to adapters: both replicas take them
    seen = {_post(router, "fake", prompt=f"p{i} q").headers["x-kvserve-endpoint"] for i in range(12)}
    assert seen == {a.url, b.url}
    assert all(body["model"] in ("sql", "fin", "fake") for body in a.received + b.received)
    assert not any(body["model"] == "fin" for body in a.received)


def test_router_keeps_an_adapters_burst_together_before_the_metric_shows_it(fakes):
    """No replica runs `sql` yet and the metric lags a scrape: the router's own in-flight request marks where
    it went, so the next one follows it instead of loading the adapter on a second replica."""
    a, b = fakes("a", "b", events=3, gap_s=0.4)
    a.adapters = b.adapters = ["sql"]
    router = fakes.router([a.url, b.url])
    router.poll()
    first: dict = {}

    def hold_open() -> None:
        with httpx.stream("POST", router.url + "/v1/completions", json={"model": "sql", "prompt": "x"}) as resp:
            first["url"] = resp.headers["x-kvserve-endpoint"]
            for _ in resp.iter_bytes():
                pass

    t = threading.Thread(target=hold_open)
    t.start()
    deadline = time.monotonic() + 5
    while "url" not in first:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _post(router, "sql").headers["x-kvserve-endpoint"] == first["url"]
    t.join(10)
    assert router.in_flight() == 0
    assert all(not r.in_flight_adapters for r in router.router.replicas.replicas.values())  # released


# ---- live: two real engines, the adapter on one --------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_replicas(tmp_path_factory):
    from kvserve_testing import STORIES_DIR

    from kvserve.runtime.models.synthetic import make_random_adapter_dir
    from tests.router.conftest import EngineReplica

    path = make_random_adapter_dir(str(STORIES_DIR), str(tmp_path_factory.mktemp("adapter") / "sql"), rank=4, seed=1)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    common = dict(kv_cache_bytes=8 << 20, max_num_seqs=8, seed=0, dtype="float32")
    with_sql = EngineReplica(str(STORIES_DIR), lora_modules=f"sql={path}", **lora, **common)
    without = EngineReplica(str(STORIES_DIR), **lora, **common)
    yield with_sql, without
    with_sql.stop()
    without.stop()


def test_real_replicas_adapter_requests_reach_the_replica_that_serves_it(fakes, lora_replicas):
    """kvserve's own /v1/models and vllm:lora_requests_info, read by the router: every `sql` request lands on
    the replica started with it (the other would 404) and is served; base requests still spread."""
    from tests.router.conftest import WordTokenizer

    with_sql, without = lora_replicas
    router = fakes.router([with_sql.url, without.url], tokenizer=WordTokenizer())
    router.poll()
    assert router.router.replicas.adapter_names() == {"sql"}
    assert parse_metrics(httpx.get(with_sql.url + "/metrics").text).max_loras == 1  # the real metric parses
    for i in range(4):
        resp = _post(router, "sql", prompt=f"Once upon a time {i}", stream=False)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvserve-endpoint"] == with_sql.url and resp.json()["model"] == "sql"
    seen = set()
    for i in range(12):
        resp = _post(router, "stories", prompt=f"The cat {i} sat", stream=False)
        assert resp.status_code == 200, resp.text
        seen.add(resp.headers["x-kvserve-endpoint"])
    assert seen == {with_sql.url, without.url}
