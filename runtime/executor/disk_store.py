"""The local disk KV tier's files, worker side (index: core/disk_index.py): one file per block, named by its
chained block hash, in a directory named by the KV layout's fingerprint, written by one background thread
(off the step's critical path), read synchronously when the scheduler fetches blocks into the host tier.

A file is a header (magic, payload length, BLAKE2b-256 of the payload) and the block's raw bytes (every layer's
K and V of block_size tokens, this rank's heads). A write goes to a temporary name and is renamed, so a reader
sees a whole file or none; a read whose length or digest does not match reports the block failed (the
scheduler recomputes it) -- a corrupt disk block costs a recompute, never a wrong token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.core.disk_index import DiskIndex, block_file_name
from kvserve.runtime.executor import kv_sizing

if TYPE_CHECKING:  # torch is imported where a block is read or written: the engine core imports this module
    import torch

logger = logging.getLogger("kvserve.kv_offload")

MAGIC = b"KVSBLK01"
DIGEST_BYTES = 32
HEADER_BYTES = len(MAGIC) + 8 + DIGEST_BYTES


def layout_facts(config: EngineConfig, rank: int = 0) -> dict:
    """What must match for a block file to be reusable: the model, the KV layout, the ranks' layout and which
    rank's shard (global rank: its KV heads under tensor parallelism, its layers under pipeline parallelism)."""
    layout = kv_sizing.layout(config)
    model_dir = config.model.model_dir
    return {
        "model": os.path.abspath(model_dir),
        "architecture": config.model.architecture,
        "weights": _weight_files(model_dir),
        "dtype": config.model.dtype,
        "weight_dtype": config.model.weight_dtype,
        "kv_dtype": layout.kv_dtype,
        "block_size": layout.block_size,
        "kv_block_layout": config.cache.kv_block_layout,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "tensor_parallel_size": layout.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
        "rank": rank,
    }


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def _weight_files(model_dir: str) -> list:
    """(name, size, mtime) of the weight files: new weights at the same path are another model."""
    if not os.path.isdir(model_dir):
        return []
    out = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(model_dir, name))
            out.append([name, st.st_size, st.st_mtime_ns])
    return out


def store_dir(config: EngineConfig, rank: int = 0) -> str:
    """<--kv-offloading-disk-dir>/kvserve-<fingerprint>: one directory per layout and rank, so engines of other
    models or layouts sharing the disk never read each other's blocks, and each rank files its own shard. The
    scheduler's index lists rank 0's directory: a block another rank lacks fails that rank's read, and the
    ranks' agreement (executor/host_tier.py) turns it into a recompute on all of them."""
    facts = layout_facts(config, rank)
    digest = hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=8).hexdigest()
    return os.path.join(config.cache.kv_offloading_disk_dir, f"kvserve-{digest}")


def open_disk_index(config: EngineConfig, executor) -> DiskIndex | None:
    """--kv-offloading-disk-dir: the scheduler's index over the runner's layout directory (what an earlier
    engine of this layout left there included); None without a disk tier."""
    if not config.cache.kv_offloading_disk_dir:
        return None
    block_bytes = executor.kv_cache_bytes // executor.num_blocks  # one rank's shard of a block
    # The size is a total over the ranks, as --kv-offloading-size's is: each rank's share holds its shards.
    per_rank_bytes = config.cache.kv_offloading_disk_bytes // config.world_size
    return DiskIndex(store_dir(config), per_rank_bytes // block_bytes)


class DiskStore:
    def __init__(self, directory: str, facts: dict | None = None):
        """directory: store_dir(config); facts: layout_facts(config), written beside the blocks for people."""
        self.directory = directory
        os.makedirs(self.directory, exist_ok=True)
        if facts is not None:
            with open(os.path.join(self.directory, "layout.json"), "w") as f:
                json.dump(facts, f, indent=1, sort_keys=True)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-disk-writer", daemon=True)
        self._writer.start()

    # -- writes (background) -----------------------------------------------------------------------------
    def write_async(self, block_hash: bytes, block: torch.Tensor) -> None:
        """block: a CPU tensor the caller no longer touches (a copy of the host slot)."""
        self._queue.put(("write", block_hash, block))

    def delete_async(self, block_hash: bytes) -> None:
        self._queue.put(("delete", block_hash, None))

    def flush(self) -> None:
        """Wait until every queued write and delete is done (tests; shutdown)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            op, block_hash, block = self._queue.get()
            try:
                path = os.path.join(self.directory, block_file_name(block_hash))
                if op == "write":
                    import torch

                    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
                    header = MAGIC + len(payload).to_bytes(8, "little") + hashlib.blake2b(payload).digest()[:32]
                    tmp = f"{path}.tmp"
                    with open(tmp, "wb") as f:
                        f.write(header + payload)
                    os.replace(tmp, path)
                elif os.path.exists(path):
                    os.remove(path)
            except OSError:  # a full or failing disk loses the block: reads of it then fail, and recompute
                logger.warning("KV disk tier: %s of %s failed", op, block_hash.hex(), exc_info=True)
            finally:
                self._queue.task_done()

    # -- reads (in the step) -----------------------------------------------------------------------------
    def read_into(self, block_hash: bytes, out: torch.Tensor) -> bool:
        """Fill `out` (a host slot's view) from the block's file; False if it is missing, short or corrupt."""
        path = os.path.join(self.directory, block_file_name(block_hash))
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return False
        nbytes = out.numel() * out.element_size()
        if len(data) != HEADER_BYTES + nbytes or data[: len(MAGIC)] != MAGIC:
            return False
        if int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little") != nbytes:
            return False
        payload = data[HEADER_BYTES:]
        if hashlib.blake2b(payload).digest()[:32] != data[len(MAGIC) + 8 : HEADER_BYTES]:
            return False
        import torch

        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out.copy_(raw.view(out.dtype).view(out.shape))
        return True
