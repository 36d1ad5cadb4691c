"""P/D KV transfer bandwidth (issue 42 scope 6): how fast a decode engine's NIXL READ moves prompt KV out of
a prefill engine's cache, against a torch copy of the same bytes in one process.

Two NIXL agents (UCX backend, host memory) each register a KV tensor laid out as the runner's
[2, layers, blocks, block_size, kv_heads, head_dim]; one READs `--blocks` scattered blocks of every slab from
the other, with the very descriptors executor/kv_pull.py builds (kv_transfer/nixl_agent.block_descs). The
baseline is torch's index copy of the same blocks between two tensors (kv_dst[:, :, dst] = kv_src[:, :, src]),
what a same-process move of those blocks costs, and a plain contiguous copy_ of the same number of bytes (the
memcpy bound). All are checked byte-equal before any number is printed.

    python -m kvserve.runtime.bench.kv_transfer --layers 32 --kv-heads 8 --head-dim 128 --blocks 256

Timings on a shared machine are noise: say so next to any number you quote.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve.runtime import engine_args
from kvserve.runtime.kv_transfer import nixl_agent


def _sig(x: float) -> float:
    return float(f"{x:.4g}")  # four significant digits: a tiny test shape moves well under 1 MB/s


def _read_once(dst_agent, handle) -> float:
    start = time.perf_counter()
    state = dst_agent.transfer(handle)
    while state == "PROC":
        state = dst_agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL READ ended in state {state}")
    return time.perf_counter() - start


def run(layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int, repeats: int, dtype: str):
    dt = getattr(torch, dtype)
    pool = num_blocks * 2  # the blocks read are scattered over a pool twice their number
    shape = (2, layers, pool, block_size, kv_heads, head_dim)
    src = torch.randn(shape).to(dt)
    dst = torch.zeros(shape, dtype=dt)
    slabs, block_bytes = 2 * layers, block_size * kv_heads * head_dim * src.element_size()
    src_ids = list(range(0, pool, 2))  # every other block: one descriptor per block and slab, as a real pull
    dst_ids = list(range(1, pool, 2))
    nbytes = slabs * num_blocks * block_bytes

    prefill = nixl_agent.make_agent("bench-prefill", ("UCX",))
    decode = nixl_agent.make_agent("bench-decode", ("UCX",))
    prefill.register_memory(src)
    decode.register_memory(dst)
    remote = decode.add_remote_agent(prefill.get_agent_metadata())
    local = decode.get_xfer_descs(nixl_agent.block_descs(dst.data_ptr(), slabs, pool, block_bytes, dst_ids), "DRAM")
    far = decode.get_xfer_descs(nixl_agent.block_descs(src.data_ptr(), slabs, pool, block_bytes, src_ids), "DRAM")
    handle = decode.initialize_xfer("READ", local, far, remote, b"bench")
    _read_once(decode, handle)  # warm-up (connection set-up, registration caches)
    if not torch.equal(dst[:, :, dst_ids], src[:, :, src_ids]):
        raise AssertionError("NIXL READ: the bytes differ")
    nixl_s = [_read_once(decode, handle) for _ in range(repeats)]
    decode.release_xfer_handle(handle)

    copy_dst = torch.zeros(shape, dtype=dt)
    src_idx, dst_idx = torch.tensor(src_ids), torch.tensor(dst_ids)
    copy_dst[:, :, dst_idx] = src[:, :, src_idx]  # warm-up
    if not torch.equal(copy_dst[:, :, dst_ids], src[:, :, src_ids]):
        raise AssertionError("torch copy: the bytes differ")
    copy_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy_dst[:, :, dst_idx] = src[:, :, src_idx]
        copy_s.append(time.perf_counter() - start)
    flat_src = torch.randn(nbytes // src.element_size()).to(dt)
    flat_dst = torch.empty_like(flat_src)
    flat_dst.copy_(flat_src)  # warm-up (first touch of the pages)
    memcpy_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        flat_dst.copy_(flat_src)
        memcpy_s.append(time.perf_counter() - start)
    if not torch.equal(flat_dst, flat_src):
        raise AssertionError("torch memcpy: the bytes differ")
    nixl_gbps = nbytes / statistics.median(nixl_s) / 1e9
    copy_gbps = nbytes / statistics.median(copy_s) / 1e9
    memcpy_gbps = nbytes / statistics.median(memcpy_s) / 1e9
    return {
        "bytes": nbytes,
        "descriptors": slabs * num_blocks,
        "block_bytes": block_bytes,
        "nixl_read_GBps": _sig(nixl_gbps),
        "torch_memcpy_GBps": _sig(memcpy_gbps),
        "torch_index_copy_GBps": _sig(copy_gbps),
        "nixl_over_memcpy": _sig(nixl_gbps / memcpy_gbps),
        "nixl_over_index_copy": _sig(nixl_gbps / copy_gbps),
        "median_ms": {
            "nixl_read": _sig(statistics.median(nixl_s) * 1e3),
            "torch_memcpy": _sig(statistics.median(memcpy_s) * 1e3),
            "torch_index_copy": _sig(statistics.median(copy_s) * 1e3),
        },
        "repeats": repeats,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=engine_args.default("block_size"))
    p.add_argument("--blocks", type=int, default=64, help="blocks pulled (a 1,024-token prompt at block size 16)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    print(json.dumps(run(a.layers, a.kv_heads, a.head_dim, a.block_size, a.blocks, a.repeats, a.dtype)))


if __name__ == "__main__":
    main()
