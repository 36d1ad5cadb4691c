"""The ZMQ publisher of KV-event batches, wire-compatible with vLLM's ZmqEventPublisher.

Every message on the PUB socket is three frames: the topic, the sequence number (8 bytes, big-endian,
unsigned, from 0 per publisher lifetime) and the msgpack EventBatch (events.py). The last `buffer_steps`
messages stay in memory: a client of the ROUTER replay socket sends one frame, a start sequence (8 bytes
big-endian), and gets `(seq, payload)` for every buffered seq >= start, then the end marker (seq -1 signed,
empty payload). A client that asks for a sequence older than the buffer gets what the buffer still holds:
it sees from the first seq returned that it missed history.

Off the engine's hot path: the engine core hands each step's records to `publish`, which takes the next
sequence number and puts them on a bounded queue without blocking; one daemon thread converts, encodes, sends
and services replay requests. When the queue is full the batch is dropped and counted (`dropped_batches`):
its sequence number is never sent, so a consumer sees the gap, finds it missing from the replay too, and
resyncs instead of trusting an index that lost events.

The first batch (seq 0) is an AllBlocksCleared: a new publisher is a new engine with an empty cache, so a
consumer that replays from 0 -- after a restart it noticed or not -- starts from an empty index for it.

While nothing happens the thread repeats the last batch's sequence number with an empty batch every
`heartbeat_s` (1 s; newer vLLM also sends empty batches when idle), so a consumer can tell an idle engine
from a dead stream. Heartbeats take no sequence number and are not buffered: the replay buffer's
`buffer_steps` hold only batches that carry events, however long the engine idles. A consumer written for
vLLM processes a heartbeat as an empty batch (its sequence is not beyond the last one, so it is no gap).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from kvserve.runtime.core.kv_cache_events import MEDIUM_DEVICE, AllCleared, CacheEvent
from kvserve.runtime.kv_events.config import KVEventsConfig
from kvserve.runtime.kv_events.events import KVEventBatch, to_wire

logger = logging.getLogger("kvserve.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
HEARTBEAT_S = 1.0
_POLL_S = 0.05  # how long the thread waits on the queue before servicing replay requests again


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local address, connect to anything else (llm-d's "central" mode: the
    router binds, engines connect)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, heartbeat_s: float = HEARTBEAT_S):
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.heartbeat_s = heartbeat_s
        self.dropped_batches = 0  # batches lost because the queue was full (the thread fell behind)
        self.sent_batches = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._seq = 0  # the next batch's sequence number; taken under _lock together with the queue slot
        self._lock = threading.Lock()
        self._enqueue([AllCleared()])  # seq 0: this engine's cache starts empty
        logger.info(
            "KV events: publishing on %s (replay: %s, topic %r)", self.endpoint, self.replay_endpoint, config.topic
        )
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (the real port when the config asked for port 0 or *)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, records: list[CacheEvent]) -> None:
        """Called by the engine core with one step's records; never blocks."""
        self._enqueue(records)

    def _enqueue(self, records: list[CacheEvent]) -> None:
        # One lock keeps sequence numbers in queue order whichever thread publishes.
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            try:
                self._queue.put_nowait((seq, time.time(), records))
            except queue.Full:
                self.dropped_batches += 1

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for at most timeout_s), then close the sockets."""
        self._running = False
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    # ---- the publisher thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        last_sent = time.monotonic()
        last_seq: bytes | None = None  # the last batch's sequence frame, repeated by heartbeats
        while self._running or not self._queue.empty():
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._service_replay()
                    except Exception:  # noqa: BLE001 -- a bad replay request must not stop publishing
                        logger.exception("KV events: replay request failed")
            try:
                seq, ts, records = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._running and last_seq is not None and time.monotonic() - last_sent >= self.heartbeat_s:
                    heartbeat = encoder.encode(KVEventBatch(time.time(), [], self.data_parallel_rank))
                    self._send(last_seq, heartbeat)
                    last_sent = time.monotonic()
                continue
            try:
                batch = KVEventBatch(ts, to_wire(records, MEDIUM_DEVICE), self.data_parallel_rank)
                payload = encoder.encode(batch)
                last_seq = seq.to_bytes(8, "big")
                self._send(last_seq, payload)
                self._buffer.append((seq, payload))
                self.sent_batches += 1
                last_sent = time.monotonic()
            except Exception:  # noqa: BLE001 -- keep the thread alive; back off a little
                logger.exception("KV events: publishing batch %d failed", seq)
                time.sleep(0.1)

    def _send(self, seq: bytes, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq, payload), copy=False)

    def _service_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
