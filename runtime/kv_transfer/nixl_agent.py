"""The NIXL library (PyPI `nixl-cu12`, or the `nixl` meta package) behind two functions: make an agent, and
the descriptor list of some blocks of a registered KV tensor. Host memory ("DRAM") through the UCX backend;
the device-memory path on GPUs is the same calls with "VRAM" (kv_buffer_device, not exercised here)."""

from __future__ import annotations

import numpy as np


def nixl_api():
    """The module holding nixl_agent and nixl_agent_config; ImportError with the install line if absent."""
    try:
        from nixl import _api  # the meta package: picks its CUDA-major build
    except ImportError:
        try:
            from nixl_cu12 import _api
        except ImportError:
            raise ImportError(
                "--kv-transfer-config with NixlConnector needs NIXL: pip install 'kvserve[disagg]' "
                "(nixl-cu12, installed beside the pinned torch with --no-deps)"
            ) from None
    return _api


def make_agent(name: str, backends: tuple[str, ...]):
    api = nixl_api()
    return api.nixl_agent(name, api.nixl_agent_config(backends=list(backends)))


def block_descs(base_addr: int, num_slabs: int, num_blocks: int, block_bytes: int, block_ids: list[int]) -> np.ndarray:
    """[(addr, len, dev)] of the given blocks in every slab (K and V of every layer) of a KV tensor laid out
    [slabs, blocks, block bytes], slab-major: the same order on both sides, so descriptor i reads into i."""
    blocks = np.asarray(block_ids, dtype=np.uint64)
    slabs = np.arange(num_slabs, dtype=np.uint64)
    addrs = base_addr + (slabs[:, None] * num_blocks + blocks[None, :]).ravel() * block_bytes
    out = np.zeros((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = block_bytes
    return out
