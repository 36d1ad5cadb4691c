"""The router's KV-event subscribers against kvserve's real publisher over 127.0.0.1: a gap is filled by
replay, a publisher restart (sequence back to 0) resyncs, lost history resyncs and is marked partial, and a
live router scores from the events -- then, when a replica's stream dies, from its estimate, with every
request answered."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from kvserve.runtime.core.block_hash import block_hashes
from kvserve.runtime.core.kv_cache_events import RemovedBlocks, StoredBlocks, external_block_hash
from kvserve.runtime.kv_events.config import KVEventsConfig
from kvserve.runtime.kv_events.publisher import ZmqEventPublisher
from kvserve.runtime.router.kv_index import KVEventIndex
from kvserve.runtime.router.kv_subscriber import (
    EventEndpoints,
    EventSource,
    KVEventSubscriptions,
    ReplicaSubscriber,
)
from kvserve.runtime.router.scoring import HashCache

pytestmark = pytest.mark.timeout(60)
BS = 4


def publisher(endpoint: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*", **fields) -> ZmqEventPublisher:
    heartbeat_s = fields.pop("heartbeat_s", 60.0)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, **fields)
    return ZmqEventPublisher(config, heartbeat_s=heartbeat_s)


def store(tokens: list[int]) -> StoredBlocks:
    """A kvserve store of every full block of `tokens`, from the prompt's root."""
    hashes = [external_block_hash(h) for h in block_hashes(tokens, BS)]
    return StoredBlocks(hashes, None, tokens[: len(hashes) * BS], BS)


def remove(tokens: list[int]) -> RemovedBlocks:
    return RemovedBlocks([external_block_hash(h) for h in block_hashes(tokens, BS)])


def subscribe(pub: ZmqEventPublisher):
    """A SUB socket on `pub`, as the router's (the test then feeds what it reads to a ReplicaSubscriber)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    return sub


def drain(sub, n: int) -> list[tuple[int, bytes]]:
    """The next n messages after the publisher's opening AllBlocksCleared (seq 0, sent as it starts: a SUB
    socket that connects later may or may not see it)."""
    out = []
    while len(out) < n:
        assert sub.poll(5000), f"only {len(out)} of {n} messages arrived"
        _, seq, payload = sub.recv_multipart()
        if int.from_bytes(seq, "big") > 0:
            out.append((int.from_bytes(seq, "big"), payload))
    return out


def matched(index: KVEventIndex, tokens: list[int]) -> float:
    return index.matched_blocks("r", HashCache(tokens)(BS))


A = list(range(100, 112))  # three blocks
B = list(range(200, 208))
C = list(range(300, 304))


def run_subscriber(source: EventSource, messages: list[tuple[int, bytes]]) -> tuple[ReplicaSubscriber, KVEventIndex]:
    async def feed():
        ctx = zmq.asyncio.Context()
        index = KVEventIndex()
        sub = ReplicaSubscriber("r", source, index, ctx)
        for seq, payload in messages:
            await sub.on_message(seq, payload)
        ctx.destroy(linger=0)
        return sub, index

    return asyncio.run(feed())


def test_gap_is_filled_by_replay():
    pub = publisher()
    sub = subscribe(pub)
    time.sleep(0.3)
    for records in ([store(A)], [store(B)], [remove(A)], [store(C)]):
        pub.publish(records)
    messages = drain(sub, 4)
    source = EventSource(pub.endpoint, pub.replay_endpoint)
    # Seqs 1..4; 2 (store B) and 3 (remove A) never reached this subscriber: it sees 1 then 4. Joining at 1 it
    # replays 0 (the opening clear); at 4 it replays 2 and 3.
    assert [s for s, _ in messages] == [1, 2, 3, 4]
    sub_state, index = run_subscriber(source, [messages[0], messages[3]])
    assert sub_state.replays == 2 and sub_state.resyncs == 0 and sub_state.last_seq == 4
    assert matched(index, A) == 0 and matched(index, B) == 2 and matched(index, C) == 1
    assert not index.replica("r").partial
    sub.close()
    pub.shutdown()


def test_lost_history_resyncs_and_is_marked_partial():
    pub = publisher(buffer_steps=1)
    sub = subscribe(pub)
    time.sleep(0.3)
    for records in ([store(A)], [store(B)], [store(C)]):
        pub.publish(records)
    messages = drain(sub, 3)
    # Saw 1, missed 2; the replay buffer holds only 3: A is forgotten (the resync clears), C is learnt, B lost.
    sub_state, index = run_subscriber(EventSource(pub.endpoint, pub.replay_endpoint), [messages[0], messages[2]])
    assert sub_state.resyncs == 1 and index.replica("r").partial
    assert matched(index, A) == 0 and matched(index, B) == 0 and matched(index, C) == 1
    sub.close()
    pub.shutdown()


def test_publisher_restart_resyncs_from_the_new_stream(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"  # fixed addresses, local only
    first = publisher(endpoint, replay)
    sub = subscribe(first)
    time.sleep(0.3)
    first.publish([store(A)])
    first.publish([store(B)])
    before = drain(sub, 2)
    first.shutdown()
    sub.close()
    second = publisher(endpoint, replay)  # the engine restarted: empty cache, sequence from 0
    sub = subscribe(second)
    time.sleep(0.3)
    second.publish([store(C)])
    second.publish([remove(C)])
    second.publish([store(B)])
    after = drain(sub, 3)
    assert [s for s, _ in before] == [1, 2] and [s for s, _ in after] == [1, 2, 3]
    # The restart lands between messages: the subscriber sees old 1 and 2, then the new stream's 2 (<= last).
    sub_state, index = run_subscriber(EventSource(endpoint, replay), [before[0], before[1], after[1], after[2]])
    assert sub_state.resyncs == 1 and sub_state.last_seq == 3
    # A was only in the old engine's cache; the new one stored C (seq 1, replayed), removed it, stored B.
    assert matched(index, A) == 0 and matched(index, C) == 0 and matched(index, B) == 2
    assert not index.replica("r").partial
    sub.close()
    second.shutdown()


def test_live_router_scores_from_events_and_survives_a_dead_stream(fakes):
    a, b = fakes("a", "b")
    pub_a, pub_b = publisher(heartbeat_s=0.1), publisher(heartbeat_s=0.1)
    endpoints = EventEndpoints(
        explicit={
            a.url: EventSource(pub_a.endpoint, pub_a.replay_endpoint),
            b.url: EventSource(pub_b.endpoint, pub_b.replay_endpoint),
        }
    )
    events = KVEventSubscriptions(endpoints, stale_after_s=0.5, sync_interval_s=0.1)
    tokenizer = fakes.WordTokenizer()
    router = fakes.router([a.url, b.url], tokenizer=tokenizer, kv_events=events)
    prompt = " ".join(f"w{i}" for i in range(40))  # 40 tokens: 10 blocks of 4
    tokens = tokenizer.token_ids("/v1/completions", {"prompt": prompt})
    deadline = time.monotonic() + 10
    while not all(events.index.is_fresh(u, time.monotonic()) for u in (a.url, b.url)):
        assert time.monotonic() < deadline, "the subscribers never synced (heartbeats)"
        time.sleep(0.05)
    pub_b.publish([store(tokens)])  # b holds the prompt: it was sent there by someone else (another router)
    deadline = time.monotonic() + 10
    while events.index.matched_blocks(b.url, HashCache(tokens)(BS)) < 10:
        assert time.monotonic() < deadline, "b's store never reached the index"
        time.sleep(0.05)
    for _ in range(3):
        resp = fakes.completion(router, prompt)
        assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == b.url
    assert router.metric("kvserve_router:kv_events_fresh", replica=b.url) == 1
    # b evicts it: the events say so at once; the estimate would still (wrongly) say b.
    pub_b.publish([remove(tokens)])
    pub_a.publish([store(tokens)])
    deadline = time.monotonic() + 10
    while events.index.matched_blocks(a.url, HashCache(tokens)(BS)) < 10:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    resp = fakes.completion(router, prompt)
    assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == a.url
    # a's event stream dies: a is scored from the estimate again, and every request is still answered.
    pub_a.shutdown()
    time.sleep(0.8)
    assert not events.index.is_fresh(a.url, time.monotonic()) and events.index.is_fresh(b.url, time.monotonic())
    for i in range(6):
        resp = fakes.completion(router, f"{prompt} more{i}")
        assert resp.status_code == 200
    time.sleep(0.2)  # a sync round updates the gauges
    assert router.metric("kvserve_router:kv_events_fresh", replica=a.url) == 0
    assert router.metric("kvserve_router:kv_events_age_seconds", replica=a.url) > 0.5
    pub_b.shutdown()


def test_an_ejected_replica_resyncs_at_its_next_message():
    from kvserve.runtime.router.kv_index import PreciseOrEstimate
    from kvserve.runtime.router.prefix_index import PrefixIndex

    pub = publisher()
    sub = subscribe(pub)
    time.sleep(0.3)
    for records in ([store(A)], [store(B)], [store(C)]):
        pub.publish(records)
    messages = drain(sub, 3)

    async def feed():
        ctx = zmq.asyncio.Context()
        index = KVEventIndex()
        subscriber = ReplicaSubscriber("r", EventSource(pub.endpoint, pub.replay_endpoint), index, ctx)
        await subscriber.on_message(*messages[0])
        index.replica("r").blocks[b"stale"] = {"GPU": 1}  # a block the index wrongly believes in
        PreciseOrEstimate(PrefixIndex(), index).drop("r")  # the router ejected the replica
        assert not index.is_fresh("r", time.monotonic())
        await subscriber.on_message(*messages[1])
        ctx.destroy(linger=0)
        return subscriber, index

    subscriber, index = asyncio.run(feed())
    assert subscriber.resyncs == 1 and b"stale" not in index.replica("r").blocks
    assert matched(index, A) == 3 and matched(index, B) == 2 and index.is_fresh("r", time.monotonic())
    sub.close()
    pub.shutdown()


def test_two_routers_on_the_same_streams_decide_alike(fakes):
    """Active-active: two router instances that never talk to each other build the same index from the same
    streams, so each sends a prompt where the other sent it before."""
    a, b = fakes("a", "b")
    pubs = {a.url: publisher(heartbeat_s=0.1), b.url: publisher(heartbeat_s=0.1)}
    tokenizer = fakes.WordTokenizer()
    routers, indexes = [], []
    for _ in range(2):
        endpoints = EventEndpoints(explicit={u: EventSource(p.endpoint, p.replay_endpoint) for u, p in pubs.items()})
        events = KVEventSubscriptions(endpoints, stale_after_s=2.0, sync_interval_s=0.1)
        routers.append(fakes.router([a.url, b.url], tokenizer=tokenizer, kv_events=events))
        indexes.append(events.index)
    deadline = time.monotonic() + 10
    while not all(i.is_fresh(u, time.monotonic()) for i in indexes for u in pubs):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for n, home in enumerate([a.url, b.url, a.url]):
        prompt = " ".join(f"t{n}x{i}" for i in range(24))
        tokens = tokenizer.token_ids("/v1/completions", {"prompt": prompt})
        pubs[home].publish([store(tokens)])  # the prompt ran on `home` (sent there by neither router)
        deadline = time.monotonic() + 10
        while not all(i.matched_blocks(home, HashCache(tokens)(BS)) == 6 for i in indexes):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for router in routers:
            resp = fakes.completion(router, prompt)
            assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == home
        pubs[home].publish([remove(tokens)])
    for p in pubs.values():
        p.shutdown()
