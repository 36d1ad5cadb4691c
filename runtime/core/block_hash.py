"""Chained prefix-cache block hashes: the one definition shared by the KV manager (which blocks it can
reuse) and `kvserve router` (which replica most likely holds a prompt's prefix). Pure Python, no torch.

Block i's hash covers block i-1's hash and block i's token ids, so equal hashes mean equal whole prefixes.
Only full blocks are hashed: a partial last block is never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Fixed seed (not random) so every process -- TP ranks, restarts, the router -- computes the same chain.
NONE_HASH = b"kvserve/prefix-cache/v1"


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained 128-bit BLAKE2b over (parent hash, this block's token ids)."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def root_hash(lora_identity: str | None = None) -> bytes:
    """The chain's seed. A LoRA request seeds it with the loaded adapter's content identity (not its name),
    so the same prompt under two adapters -- or under an adapter reloaded with new weights under the same
    name -- never shares KV blocks, while requests under one loaded adapter do."""
    if not lora_identity:
        return NONE_HASH
    return hashlib.blake2b(NONE_HASH + b"/lora/" + lora_identity.encode(), digest_size=16).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, root: bytes = NONE_HASH
) -> list[bytes]:
    """Append to `hashes` (the chain of the first len(hashes) full blocks of `token_ids`) the hashes of every
    further full block, in place; returns `hashes`. `root` seeds the chain (see root_hash)."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else root, token_ids[i * block_size : (i + 1) * block_size])
        )
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`."""
    return extend_block_hashes([], token_ids, block_size)
