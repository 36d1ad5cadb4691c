"""The NIXL side channel (vLLM's NixlConnector handshake): a decode engine asks a prefill engine, at the
remote_host:remote_port of its kv_transfer_params, for its NIXL agent metadata and KV-cache geometry, once per
prefill engine; then it READs blocks directly. A ZMQ REQ/REP pair as in vLLM (request: msgpack
["get_meta_msg", tp_rank]); the reply is kvserve's own msgpack struct (HandshakeReply), so only kvserve
engines interoperate here, not vLLM's.

kvserve adds one question vLLM does not ask, ["lease_check", request_id] -> HELD / ENDED / UNKNOWN: after its
READ is done and before it notifies, a decode engine asks whether the lease is still held. A lease that ended
by timeout may have had its blocks reused while they were read; then the decode engine recomputes instead of
decoding from someone else's KV (vLLM leaves that window open). UNKNOWN: the prefill engine has not yet run a
step that lists the lease (it was made by the step that just ended) -- or never made it (it restarted): the
decode engine asks again until its handshake timeout, then recomputes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

logger = logging.getLogger("kvserve.kv_transfer")

PROTOCOL_VERSION = 1
LEASE_ENDED, LEASE_HELD, LEASE_UNKNOWN = 0, 1, 2
LEASE_RETRY_S = 0.01


class HandshakeReply(msgspec.Struct, array_like=True):
    compat_hash: str  # both engines' KV layouts must match (compat_hash below)
    engine_id: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata()
    base_addr: int  # the registered KV tensor [slabs, blocks, block bytes]
    num_slabs: int  # K and V of every layer: 2 x layers
    num_blocks: int
    block_bytes: int


def compat_hash(kv_shape_without_blocks: tuple[int, ...], dtype: str, kv_block_layout: str) -> str:
    """What must agree for a block to mean the same on both sides: K/V x layers, block size, KV heads, head
    size, dtype, the element order within a block (the attention backend's kv_block_layout) (vLLM's
    compatibility_hash also covers the model and versions). The weights themselves are not checked: both sides
    must serve the same checkpoint."""
    text = f"kvserve-nixl-{PROTOCOL_VERSION}:{kv_shape_without_blocks}:{dtype}:{kv_block_layout}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class SideChannelServer:
    """Answers handshakes from a daemon thread until close(); binds host:port (127.0.0.1 in tests)."""

    def __init__(self, host: str, port: int, reply: HandshakeReply, is_leased: Callable[[str], int]):
        self._reply = msgspec.msgpack.encode(reply)
        self._is_leased = is_leased
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        bind_host = "0.0.0.0" if host in ("", "*") else host
        if bind_host == "localhost":
            bind_host = "127.0.0.1"
        self._sock.bind(f"tcp://{bind_host}:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvserve-nixl-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                msg = msgspec.msgpack.decode(self._sock.recv())
                if isinstance(msg, list) and len(msg) == 2 and msg[0] == "lease_check" and isinstance(msg[1], str):
                    self._sock.send(msgspec.msgpack.encode(int(self._is_leased(msg[1]))))
                    continue
                if not (isinstance(msg, list) and msg and msg[0] == "get_meta_msg"):
                    logger.warning("NIXL side channel: unexpected message %r", msg)
                self._sock.send(self._reply)  # REP must answer every request
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("NIXL side channel failed to answer")
            except msgspec.DecodeError:
                self._sock.send(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self._sock.close()
        self._ctx.term()


def fetch_metadata(host: str, port: int, tp_rank: int, timeout_s: float) -> HandshakeReply:
    """One handshake; raises TimeoutError when the prefill engine does not answer in time."""
    return msgspec.msgpack.decode(_ask(host, port, ["get_meta_msg", tp_rank], timeout_s), type=HandshakeReply)


def lease_held(host: str, port: int, request_id: str, timeout_s: float) -> bool:
    """Whether the prefill engine still holds request_id's lease, asking again while it answers UNKNOWN for up
    to timeout_s (then False); TimeoutError if it does not answer at all."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = msgspec.msgpack.decode(_ask(host, port, ["lease_check", request_id], timeout_s), type=int)
        if answer != LEASE_UNKNOWN or time.monotonic() >= deadline:
            return answer == LEASE_HELD
        time.sleep(LEASE_RETRY_S)


def _ask(host: str, port: int, message: list, timeout_s: float) -> bytes:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode(message))
        try:
            return sock.recv()
        except zmq.Again:
            raise TimeoutError(f"no NIXL side-channel answer from {host}:{port} within {timeout_s} s") from None
    finally:
        sock.close()
