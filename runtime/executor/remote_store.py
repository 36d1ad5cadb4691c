"""The remote KV tier over Redis / Valkey (--kv-offloading-remote-url; scheduler side: core/remote_index.py):
blocks are values in an existing store, never a server of ours -- LMCache's remote backend, on the store
Debian ships (redis-server; Valkey speaks the same protocol).

- Key: `kvserve:kv:<fingerprint>:<chained block hash>`, the fingerprint the disk tier names its directory by
  (executor/disk_store.py layout_facts: model path and weight files, dtypes, block size, layers, KV heads, TP
  and PP sizes and the global rank). So every rank stores its own shard under its own key, engines of another
  model or layout never read these, and the LoRA adapter is in the block hash's root (core/block_hash.py).
- Value: a header (magic, payload length, BLAKE2b-256 of the payload) and the raw block, as a disk file. A
  value whose length or digest does not match is a failed read: the request recomputes from that block.
- Writes run on one background thread from a bounded queue (copies of host slots); a full queue drops the
  block (counted and logged), so a slow or dead store never holds up a step.
- Reads (fetches into host slots) run in the step, one GET per block, with the URL's socket timeout (default
  0.5 s). Any error -- refused connection, timeout, a missing key -- fails that block's read only.
- A store that fails is left alone for RETRY_AFTER_S: lookups then find nothing and writes are dropped, so a
  dead store costs one timeout per RETRY_AFTER_S, not one per request.
- Eviction and TTLs are the store's job (maxmemory with maxmemory-policy allkeys-lru): keys are written
  without an expiry, and the engine never deletes them (another engine may be reading them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.core.remote_index import LowerTiers, RemoteIndex
from kvserve.runtime.executor import disk_store

if TYPE_CHECKING:  # torch is imported where a block is read or written: the engine core imports this module
    import torch

logger = logging.getLogger("kvserve.kv_offload")

MAGIC = b"KVSRBL01"
DIGEST_BYTES = 32
HEADER_BYTES = len(MAGIC) + 8 + DIGEST_BYTES
DEFAULT_SOCKET_TIMEOUT_S = 0.5  # unless the URL says otherwise (?socket_timeout=...)
RETRY_AFTER_S = 5.0  # after a failure, the store is not asked again for this long
WRITE_QUEUE_BYTES = 256 << 20  # copies of host slots waiting for the writer thread, at most
WRITE_BATCH_BLOCKS = 32  # SETs sent in one pipeline (one round trip)


def key_prefix(config: EngineConfig, rank: int = 0) -> str:
    """kvserve:kv:<fingerprint>: -- the disk tier's layout facts, with the model's path and weight-file mtimes
    replaced by the download manifest's sha256 per file where `kvserve download` left one (content_identity):
    pods that each downloaded the same model then share blocks, which a path and mtimes never would."""
    facts = disk_store.layout_facts(config, rank)
    files = content_identity(config.model.model_dir)
    if files is not None:
        facts.pop("model")
        facts["weights"] = files
    fingerprint = hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=8).hexdigest()
    return f"kvserve:kv:{fingerprint}:"


def content_identity(model_dir: str) -> dict[str, str] | None:
    """{file: sha256} from the folder's download manifest (runtime/sources/download.py), or None when there is
    none or a file no longer matches it (missing, another size, or modified after the manifest was written)."""
    from kvserve.runtime.sources.download import MARKER

    path = os.path.join(model_dir, MARKER)
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        written_ns = os.stat(path).st_mtime_ns
        out = {}
        for name, entry in files.items():
            st = os.stat(os.path.join(model_dir, name))
            if st.st_size != entry["size"] or st.st_mtime_ns > written_ns:
                return None
            out[name] = str(entry["sha256"])
        weights = [n for n in os.listdir(model_dir) if n.endswith(disk_store.WEIGHT_SUFFIXES)]
        return out if all(n in out for n in weights) else None  # weights added after the download: not it
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def encode(payload: bytes) -> bytes:
    return MAGIC + len(payload).to_bytes(8, "little") + hashlib.blake2b(payload).digest()[:DIGEST_BYTES] + payload


def decode(value: bytes | None, nbytes: int) -> bytes | None:
    """The payload, or None when the value is missing, of another length, or fails its digest."""
    if value is None or len(value) != HEADER_BYTES + nbytes or value[: len(MAGIC)] != MAGIC:
        return None
    if int.from_bytes(value[len(MAGIC) : len(MAGIC) + 8], "little") != nbytes:
        return None
    payload = value[HEADER_BYTES:]
    if hashlib.blake2b(payload).digest()[:DIGEST_BYTES] != value[len(MAGIC) + 8 : HEADER_BYTES]:
        return None
    return payload


class StoreLink:
    """One Redis client with a back-off: after a failure the store is treated as absent for RETRY_AFTER_S."""

    def __init__(self, url: str):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        options = {} if "socket_timeout" in url else {"socket_timeout": DEFAULT_SOCKET_TIMEOUT_S}
        if "socket_connect_timeout" not in url:
            options["socket_connect_timeout"] = DEFAULT_SOCKET_TIMEOUT_S
        # No retries inside the client: a failed call fails its blocks (recompute) and starts the back-off.
        self.client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)
        self.where = _without_credentials(url)  # for logs: a URL may carry a password
        self._down_until = 0.0
        self.num_errors = 0

    def check_reachable(self) -> None:
        """At start: an unreachable store is logged, not fatal (the tier finds nothing until it answers)."""
        import redis

        try:
            self.client.ping()
        except (redis.RedisError, OSError) as e:
            self.failed("ping", e)

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, what: str, error: Exception) -> None:
        self.num_errors += 1
        self._down_until = time.monotonic() + RETRY_AFTER_S
        # A pipeline's error quotes the command, block bytes included: only the store's own words are logged.
        words = str(error).rpartition("caused error:")[2].strip()[:200]
        logger.warning(
            "KV remote tier: %s at %s failed (%s: %s); not asked again for %.0f s",
            what,
            self.where,
            type(error).__name__,
            words,
            RETRY_AFTER_S,
        )


def _without_credentials(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="").geturl()


def make_probe(link: StoreLink, prefix: str):
    """The scheduler's question to the store: which of these blocks do you hold (one pipelined round trip)."""
    import redis

    def probe(hashes: list[bytes]) -> list[bool]:
        if not link.up:
            return [False] * len(hashes)
        try:
            pipe = link.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(prefix + h.hex())
            return [bool(n) for n in pipe.execute()]
        except (redis.RedisError, OSError) as e:
            link.failed("lookup", e)
            return [False] * len(hashes)

    return probe


def open_lower_tiers(config: EngineConfig, executor):
    """The host tier's connector's `disk`: the disk index alone, or with --kv-offloading-remote-url the disk
    (if any) and the store stacked (core/remote_index.py); None with neither."""
    disk = disk_store.open_disk_index(config, executor)
    url = config.cache.kv_offloading_remote_url
    if not url:
        return disk
    # The scheduler asks with rank 0's keys; a block another rank lacks fails that rank's read, and the ranks'
    # agreement on reads (executor/host_tier.py) turns it into a recompute on all of them.
    link = StoreLink(url)
    link.check_reachable()
    return LowerTiers(disk, RemoteIndex(make_probe(link, key_prefix(config))))


class RemoteStore:
    """The worker side: one rank's blocks in the store."""

    def __init__(self, url: str, prefix: str, block_bytes: int):
        self.link = StoreLink(url)
        self.prefix = prefix
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, WRITE_QUEUE_BYTES // max(1, block_bytes)))
        self.num_dropped_writes = 0  # a full queue or a store in back-off
        self.num_failed_writes = 0
        self.num_written = 0
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-remote-writer", daemon=True)
        self._writer.start()

    # -- writes (background) -----------------------------------------------------------------------------
    def write_async(self, block_hash: bytes, block: torch.Tensor) -> None:
        """block: a CPU tensor the caller no longer touches (a copy of the host slot)."""
        if not self.link.up:
            self._dropped("the store is in back-off")
            return
        try:
            self._queue.put_nowait((block_hash, block))
        except queue.Full:
            self._dropped("the write queue is full")

    def delete_async(self, block_hash: bytes) -> None:
        """Nothing: the store evicts (maxmemory-policy), and other engines may be reading the block."""

    def flush(self) -> None:
        """Wait until every queued write is sent (tests; shutdown)."""
        self._queue.join()

    def _dropped(self, why: str) -> None:
        self.num_dropped_writes += 1
        if self.num_dropped_writes & (self.num_dropped_writes - 1) == 0:  # 1st, 2nd, 4th, 8th ...: not a flood
            logger.warning("KV remote tier: a block write dropped (%s); %d so far", why, self.num_dropped_writes)

    def _write_loop(self) -> None:
        import redis
        import torch

        while True:
            batch = [self._queue.get()]
            while len(batch) < WRITE_BATCH_BLOCKS:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if not self.link.up:
                    self.num_dropped_writes += len(batch)
                    continue
                pipe = self.link.client.pipeline(transaction=False)
                for block_hash, block in batch:
                    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
                    pipe.set(self.prefix + block_hash.hex(), encode(payload))
                pipe.execute()
                self.num_written += len(batch)
            except (redis.RedisError, OSError) as e:  # the blocks are lost: their reads fail, and recompute
                self.num_failed_writes += len(batch)
                self.link.failed("write", e)
            except Exception:  # a bug must not kill the thread: flush() would wait for it forever
                self.num_failed_writes += len(batch)
                logger.exception("KV remote tier: a write batch failed")
            finally:
                for _ in batch:
                    self._queue.task_done()

    # -- reads (in the step) -----------------------------------------------------------------------------
    def read_into(self, block_hash: bytes, out: torch.Tensor) -> bool:
        """Fill `out` (a host slot's view) from the store; False if missing, corrupt, timed out or down."""
        import redis

        if not self.link.up:
            return False
        try:
            value = self.link.client.get(self.prefix + block_hash.hex())
        except (redis.RedisError, OSError) as e:
            self.link.failed("read", e)
            return False
        payload = decode(value, out.numel() * out.element_size())
        if payload is None:
            return False
        import torch

        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out.copy_(raw.view(out.dtype).view(out.shape))
        return True


class LowerTierStores:
    """The worker's pair for LowerTiers: reads from the disk first, then the store; writes to both; deletes
    from the disk only."""

    def __init__(self, disk, remote: RemoteStore):
        self.disk = disk  # DiskStore or None
        self.remote = remote

    def read_into(self, block_hash: bytes, out: torch.Tensor) -> bool:
        if self.disk is not None and self.disk.read_into(block_hash, out):
            return True
        return self.remote.read_into(block_hash, out)

    def write_async(self, block_hash: bytes, block: torch.Tensor) -> None:
        if self.disk is not None:
            self.disk.write_async(block_hash, block)
        self.remote.write_async(block_hash, block)

    def delete_async(self, block_hash: bytes) -> None:
        if self.disk is not None:
            self.disk.delete_async(block_hash)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()
        self.remote.flush()
