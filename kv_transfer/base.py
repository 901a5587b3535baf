"""The KV transfer contract: layout, statuses, errors and the sender/receiver protocols.

A transfer moves the KV of one request from a prefill engine's cache into blocks that a
decode engine reserved. Both caches are one tensor per layer,
`kv_caches[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]`, so one block of
one layer is contiguous and a run of consecutive block ids is one contiguous range. A
transfer is therefore a list of segments (layer, a run of source blocks, a run of
destination blocks), each sent as one `KVChunkHeader` plus one raw message.

Every backend (local, ucx, nccl) implements `KVSender` and `KVReceiver` below.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from vllm_cluster.proto import kv_transfer_pb2


class TransferStatus(enum.IntEnum):
    """Where a transfer stands. Everything after PENDING is final."""

    PENDING = 0
    DONE = 1
    FAILED = 2
    CANCELLED = 3


class KVTransferError(Exception):
    """A transfer could not be carried out (bad arguments, unreachable peer, ...)."""


class KVLayoutMismatch(KVTransferError):
    """The two ends of a transfer disagree on the KV cache layout."""

    def __init__(self, mismatches: Sequence[str]) -> None:
        assert mismatches, "a layout mismatch names at least one field"
        self.mismatches = list(mismatches)
        super().__init__(
            "KV layout mismatch between prefill and decode: "
            + "; ".join(self.mismatches)
            + ". Run both with the same model, dtype, kv_cache_dtype, block_size and parallel layout."
        )


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What both ends of a transfer must agree on; compared field by field in the handshake."""

    model: str
    dtype: str  # the KV cache's: the model's, or "float8_e4m3fn" (kv_cache_dtype fp8), sent as raw bytes
    block_size: int
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    layout: str = "NB,2,BS,H,D"
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def from_kv_caches(
        cls, kv_caches: Sequence[torch.Tensor], model: str, tp_size: int = 1, tp_rank: int = 0
    ) -> KVLayout:
        """The layout of `kv_caches`; raises ValueError if they are not a valid paged cache."""
        check_kv_caches(kv_caches)
        # first: [num_blocks, 2, block_size, num_kv_heads, head_dim]
        first = kv_caches[0]
        return cls(
            model=model,
            dtype=str(first.dtype).removeprefix("torch."),
            block_size=first.shape[2],
            num_layers=len(kv_caches),
            num_kv_heads=first.shape[3],
            head_dim=first.shape[4],
            layout="NB,2,BS,H,D" if first.shape[1] == 2 else "NB,1,BS,1,L",  # L: an MLA latent entry
            tp_size=tp_size,
            tp_rank=tp_rank,
        )

    def to_proto(self) -> kv_transfer_pb2.KVLayout:
        return kv_transfer_pb2.KVLayout(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, msg: kv_transfer_pb2.KVLayout) -> KVLayout:
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})

    def mismatches(self, other: KVLayout) -> list[str]:
        """Every field that differs, as "field: sender X, receiver Y" (self is the sender)."""
        return [
            f"{f.name}: sender {getattr(self, f.name)}, receiver {getattr(other, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def check_kv_caches(kv_caches: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless `kv_caches` is one contiguous paged tensor per layer, all alike."""
    if not kv_caches:
        raise ValueError("kv_caches is empty: pass one tensor per layer")
    first = kv_caches[0]
    for layer, cache in enumerate(kv_caches):
        if cache.dim() != 5 or cache.shape[1] not in (1, 2):
            raise ValueError(
                f"kv_caches[{layer}] has shape {tuple(cache.shape)}; expected "
                "[num_blocks, 2, block_size, num_kv_heads, head_dim] (or [num_blocks, 1, block_size, 1, "
                "latent width]: a multi-head latent attention cache)"
            )
        if cache.shape[1:] != first.shape[1:] or cache.dtype != first.dtype:
            raise ValueError(
                f"kv_caches[{layer}] is {cache.dtype} {tuple(cache.shape)} but kv_caches[0] is "
                f"{first.dtype} {tuple(first.shape)}; every layer must have the same block shape"
            )
        if cache.device != first.device:
            raise ValueError(
                f"kv_caches[{layer}] is on {cache.device}, kv_caches[0] on {first.device}"
            )
        if not cache.is_contiguous():
            raise ValueError(f"kv_caches[{layer}] is not contiguous; a block must be one range")


@dataclass(frozen=True, slots=True)
class Segment:
    """`num_blocks` consecutive source blocks going to as many consecutive destination blocks."""

    src_block_start: int
    dst_block_start: int
    num_blocks: int


def split_segments(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[Segment]:
    """Cut the block pairs into the fewest runs where both source and destination are consecutive."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks; "
            "each source block needs exactly one destination block"
        )
    if not src_block_ids:
        return []
    src, dst = np.asarray(src_block_ids), np.asarray(dst_block_ids)
    # A run breaks before i where either side does not step by one from i - 1.
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(src)]
    return [Segment(int(src[a]), int(dst[a]), b - a) for a, b in zip(starts, ends, strict=True)]


class _SegmentMemo:
    """The segments of the pushes in progress, cut once per transfer: a push sends the same
    block pairs at every layer, and cutting fragmented ids costs the engine's thread about
    as much per layer as launching the layer's kernels (a few microseconds per segment)."""

    def __init__(self, capacity: int = 256) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._cuts: OrderedDict[str, tuple[list[int], list[int], list[Segment]]] = OrderedDict()

    def segments(self, transfer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[Segment]:
        """Raises KVTransferError when the two id lists cannot pair up."""
        with self._lock:
            cut = self._cuts.get(transfer_id)
            if cut is not None and cut[0] == src_block_ids and cut[1] == dst_block_ids:
                return cut[2]
        try:
            segments = split_segments(src_block_ids, dst_block_ids)
        except ValueError as e:
            raise KVTransferError(str(e)) from e
        with self._lock:
            self._cuts[transfer_id] = (list(src_block_ids), list(dst_block_ids), segments)
            self._cuts.move_to_end(transfer_id)
            while len(self._cuts) > self._capacity:
                self._cuts.popitem(last=False)
        return segments


_SEGMENTS = _SegmentMemo()


def push_segments(transfer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[Segment]:
    """The runs of blocks consecutive on both sides, as `split_segments` cuts them, remembered
    for the transfer's later layers; raises KVTransferError."""
    return _SEGMENTS.segments(transfer_id, src_block_ids, dst_block_ids)


def parse_endpoint(endpoint: str, scheme: str) -> tuple[str, int]:
    """("HOST", PORT) from "SCHEME://HOST:PORT"; raises KVTransferError."""
    prefix = f"{scheme}://"
    host, _, port = endpoint.removeprefix(prefix).rpartition(":")
    if not endpoint.startswith(prefix) or not host or not port.isdigit():
        raise KVTransferError(f"bad endpoint {endpoint!r}: expected {prefix}HOST:PORT")
    return host, int(port)


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    """Raise KVTransferError unless every id is a block of a cache with `num_blocks` blocks."""
    if block_ids and not 0 <= min(block_ids) <= max(block_ids) < num_blocks:
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        raise KVTransferError(
            f"{what} block ids {bad[:8]} are outside the cache's {num_blocks} blocks"
        )


_LENGTH_BYTES = 8


def pack_frames(messages: Sequence[bytes], max_frame_bytes: int) -> list[bytes]:
    """Frame protobufs for the wire: each as its length (8 bytes, little-endian) then its
    bytes, packed into as few frames of at most `max_frame_bytes` as fit; every frame ends
    with a zero length, so it can be received into a larger buffer."""
    frames: list[bytes] = []
    parts: list[bytes] = []
    size = _LENGTH_BYTES  # the terminating zero length
    for message in messages:
        entry_bytes = _LENGTH_BYTES + len(message)
        if entry_bytes + _LENGTH_BYTES > max_frame_bytes:
            raise KVTransferError(f"a {len(message)}-byte message exceeds the frame limit")
        if size + entry_bytes > max_frame_bytes:
            frames.append(b"".join([*parts, bytes(_LENGTH_BYTES)]))
            parts, size = [], _LENGTH_BYTES
        parts += [len(message).to_bytes(_LENGTH_BYTES, "little"), message]
        size += entry_bytes
    if parts:
        frames.append(b"".join([*parts, bytes(_LENGTH_BYTES)]))
    return frames


def unpack_frame(frame: bytes) -> list[bytes]:
    """The protobufs of one frame made by `pack_frames` (bytes after its end are ignored)."""
    messages: list[bytes] = []
    offset = 0
    while offset + _LENGTH_BYTES <= len(frame):
        length = int.from_bytes(frame[offset : offset + _LENGTH_BYTES], "little")
        offset += _LENGTH_BYTES
        if length == 0:
            break
        if offset + length > len(frame):
            raise KVTransferError(f"truncated frame: a {length}-byte message at byte {offset}")
        messages.append(frame[offset : offset + length])
        offset += length
    return messages


def describe_error(error: BaseException) -> str:
    """One line for logs and `error()`: torch's distributed errors carry a C++ stack trace
    after their first line, and asyncio's timeouts carry no message at all."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else 'no detail'}"


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor: any dtype (bfloat16 included) travels as bytes."""
    assert tensor.is_contiguous(), "only contiguous views are sent or received in place"
    return tensor.reshape(-1).view(torch.uint8)


class KVReceiver(Protocol):
    """The decode side: owns destination blocks and reports when a transfer has fully landed."""

    endpoint: str  # "ucx://127.0.0.1:PORT", "nccl://127.0.0.1:PORT", "local://NAME"

    def expect(self, transfer_id: str, block_ids: list[int]) -> None:
        """From now on chunks for `transfer_id` may land in these destination blocks (all layers)."""
        ...

    def status(self, transfer_id: str) -> TransferStatus:
        """DONE once every layer of every expected block landed; unknown ids are CANCELLED."""
        ...

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        """Block until the transfer is no longer PENDING, or until the timeout (then PENDING)."""
        ...

    def wait_blocks(self, transfer_id: str, block_ids: list[int], timeout_s: float) -> bool:
        """Block until every layer of these expected blocks (a part of the transfer) landed:
        True; False at the timeout, or when the transfer failed, was cancelled or does not
        expect them all. (A pull fills only the leading blocks of a reservation.)"""
        ...

    def cancel(self, transfer_id: str) -> None:
        """Stop writes into its blocks (returns after in-flight writes finished); forget it."""
        ...

    def close(self) -> None: ...


class KVSender(Protocol):
    """The prefill side: pushes layers of its cache into blocks a receiver expects."""

    def push_layer(
        self,
        endpoint: str,
        transfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> None:
        """Queue the send of kv_caches[layer][src_block_ids] into the receiver's dst blocks."""
        ...

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        """DONE once every queued send of the transfer completed locally; FAILED on error."""
        ...

    def error(self, transfer_id: str) -> str | None:
        """Why the transfer FAILED; None if it did not."""
        ...

    def close(self) -> None: ...


def handshake_message(layout: KVLayout, sender_id: str, cluster_token: str) -> kv_transfer_pb2.Handshake:
    """A sender's first message: its layout, its name and its cluster's token (the receiver
    accepts KV only from processes of its own cluster)."""
    return kv_transfer_pb2.Handshake(
        layout=layout.to_proto(), sender_id=sender_id, cluster_token=cluster_token
    )
