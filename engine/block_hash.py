"""Block hashing for prefix caching, shared by the engine, the Redis index and the router.

A block's hash covers its parent's hash, its token ids and extra keys (tenant salt, LoRA
id), so equal hashes mean equal prefixes. sha256, truncated to 16 bytes; never `hash()`,
which differs between processes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

BLOCK_HASH_BYTES = 16
_ROOT = b"\x00" * BLOCK_HASH_BYTES


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return BlockHash(h.digest()[:BLOCK_HASH_BYTES])


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on (a partial tail is skipped)."""
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes
