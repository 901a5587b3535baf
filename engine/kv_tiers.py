"""The two stores below the device KV cache: block copies in host memory, and files on disk.

Both are LRU maps from block hash to one block's KV over every layer, of a fixed capacity in
blocks. The head of each map is evicted first. Neither knows about the device: engine/kv_offload.py
moves blocks between them and the device cache, and decides what goes where.

  HostTier  one tensor per layer, [num_blocks, 2, block_size, num_kv_heads, head_dim] (the
            device cache's block layout, so a run of slots copies as one piece); pinned on
            CUDA hosts. A hash owns a slot until it is evicted.
  DiskTier  one file per block, named by the hash in hex: a magic, the sha256 of the payload,
            then every layer's bytes. A file that is missing, short or fails its checksum is a
            miss (the caller recomputes) and leaves the tier.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from pathlib import Path

import torch

from vllm_cluster.engine.block_hash import BlockHash

logger = logging.getLogger(__name__)

_MAGIC = b"VCKVBLK1"
_DIGEST_BYTES = 32
_SUFFIX = ".kvblock"


class HostTier:
    def __init__(
        self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, pin: bool
    ) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        # buffers[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]
        self.buffers = [
            torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin) for _ in range(num_layers)
        ]
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def hashes(self) -> list[BlockHash]:
        """Every hash held, least recently used first."""
        return list(self._slots)

    def slot(self, block_hash: BlockHash) -> int:
        return self._slots[block_hash]

    def touch(self, block_hash: BlockHash) -> None:
        self._slots.move_to_end(block_hash)

    def reserve(self, block_hash: BlockHash) -> tuple[int, tuple[BlockHash, int] | None]:
        """A slot for `block_hash` (most recently used now), and the (hash, slot) evicted to
        make room, if any: the caller saves that slot's data before writing the new block."""
        assert block_hash not in self._slots
        evicted = None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            evicted = self._slots.popitem(last=False)
            slot = evicted[1]
        self._slots[block_hash] = slot
        return slot, evicted

    def assign(self, block_hash: BlockHash, slot: int) -> None:
        """Move a held hash to another of the slots held (its LRU place unchanged)."""
        self._slots[block_hash] = slot

    def discard(self, block_hash: BlockHash) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free_slots.append(slot)

    def clear(self) -> list[BlockHash]:
        removed = list(self._slots)
        self._slots.clear()
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        return removed

    def block(self, slot: int) -> list[torch.Tensor]:
        """One slot's data, a view per layer: [2, block_size, num_kv_heads, head_dim]."""
        return [buffer[slot] for buffer in self.buffers]


class DiskTier:
    def __init__(self, directory: str | Path, num_blocks: int) -> None:
        assert num_blocks > 0
        self.directory = Path(directory)
        self.num_blocks = num_blocks
        self.directory.mkdir(parents=True, exist_ok=True)
        # Files left by an earlier process are not trusted to match this index: start empty.
        for stale in self.directory.glob(f"*{_SUFFIX}"):
            stale.unlink(missing_ok=True)
        self._files: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def hashes(self) -> list[BlockHash]:
        """Every hash held, least recently used first."""
        return list(self._files)

    def path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{bytes(block_hash).hex()}{_SUFFIX}"

    def touch(self, block_hash: BlockHash) -> None:
        self._files.move_to_end(block_hash)

    def store(self, block_hash: BlockHash, layers: list[torch.Tensor]) -> tuple[BlockHash | None, bool]:
        """Write one block (CPU tensors, one per layer), most recently used now. Returns (the
        hash evicted to make room, whether the write succeeded: a failed one stores nothing)."""
        assert block_hash not in self._files
        evicted = None
        if len(self._files) >= self.num_blocks:
            evicted, _ = self._files.popitem(last=False)
            self.path(evicted).unlink(missing_ok=True)
        payload = b"".join(_raw_bytes(t) for t in layers)
        path = self.path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("KV disk tier: could not write %s (%s); the block is dropped", path, exc)
            tmp.unlink(missing_ok=True)
            return evicted, False
        self._files[block_hash] = None
        return evicted, True

    def load(self, block_hash: BlockHash, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The block's layers (CPU tensors shaped and typed as `like`), or None when its file is
        missing or corrupt; such a block leaves the tier."""
        path = self.path(block_hash)
        nbytes = [t.numel() * t.element_size() for t in like]
        try:
            data = path.read_bytes()
        except OSError as exc:
            logger.warning("KV disk tier: could not read %s (%s); recomputing the block", path, exc)
            data = b""
        header = len(_MAGIC) + _DIGEST_BYTES
        payload = data[header:]
        ok = (
            len(data) == header + sum(nbytes)
            and data.startswith(_MAGIC)
            and hashlib.sha256(payload).digest() == data[len(_MAGIC) : header]
        )
        if not ok:
            if data:
                logger.warning("KV disk tier: %s is corrupt; recomputing the block", path)
            self.discard(block_hash)
            return None
        self.touch(block_hash)
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out, offset = [], 0
        for t, n in zip(like, nbytes, strict=True):
            out.append(flat[offset : offset + n].view(t.dtype).view(t.shape))
            offset += n
        return out

    def discard(self, block_hash: BlockHash) -> None:
        if self._files.pop(block_hash, 0) is None:
            self.path(block_hash).unlink(missing_ok=True)

    def clear(self) -> list[BlockHash]:
        removed = list(self._files)
        for block_hash in removed:
            self.path(block_hash).unlink(missing_ok=True)
        self._files.clear()
        return removed


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
