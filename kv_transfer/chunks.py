"""What a sender sends for one pushed layer: chunks, each a header and the bytes after it.

A layer's source blocks pair up with the decode's destination blocks. Each run of blocks
consecutive on both sides (`base.push_segments`) goes as one chunk, a view of the sender's
cache, with no copy. Past `MAX_RUN_CHUNKS` runs (a pool after some traffic hands out
scattered ids) the layer goes as one gathered chunk instead: its blocks copied into one
buffer in the order of the header's `dst_block_ids`, which the receiver lands and then
scatters into place (`tracking.ReceiveTable`). A chunk costs a header, a message and a
completion on each side whatever its size; a gathered chunk costs two copies of the
layer's blocks instead.

On CUDA every chunk of a layer carries one event, recorded after the layer's compute (and
its gather, queued on the same stream): the send waits for it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_cluster.kv_transfer import faults
from vllm_cluster.kv_transfer.base import KVTransferError, check_block_ids, push_segments
from vllm_cluster.proto import kv_transfer_pb2

# A layer of more runs than this goes as one gathered chunk (the cuda_ipc sender, which
# copies rather than sends, uses the same bound between copies per run and one gather).
MAX_RUN_CHUNKS = 4


@dataclass(frozen=True, slots=True)
class OutgoingChunk:
    """One chunk of a push, ready to go: its header and its bytes."""

    header: kv_transfer_pb2.KVChunkHeader
    payload: torch.Tensor  # [num_blocks, ...]: a view of one layer's cache, or its gathered blocks
    ready: torch.cuda.Event | None  # on CUDA: the send waits for the layer's compute


def check_layer(kv_caches: Sequence[torch.Tensor], layer: int, src_block_ids: Sequence[int]) -> None:
    """Raise KVTransferError unless `layer` and the source ids are in the cache."""
    if not 0 <= layer < len(kv_caches):
        raise KVTransferError(f"layer {layer} is outside the cache's {len(kv_caches)} layers")
    check_block_ids(src_block_ids, kv_caches[layer].shape[0], "source")


def layer_ready(kv_caches: Sequence[torch.Tensor], layer: int, src_block_ids: Sequence[int]) -> torch.cuda.Event | None:
    """Check a pushed layer and its source ids (KVTransferError); on CUDA, an event recorded
    on the compute stream now, when the layer's compute has been queued (None on CPU: the
    layer is ready when it is pushed)."""
    check_layer(kv_caches, layer, src_block_ids)
    return _recorded(kv_caches[layer])


def plan_chunks(
    kv_caches: Sequence[torch.Tensor],
    transfer_id: str,
    layer: int,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    gather: bool = True,
) -> list[OutgoingChunk]:
    """Check a push_layer call and cut it into chunks: one per run of blocks, or one gathered
    chunk past MAX_RUN_CHUNKS runs unless `gather` is False. Raises KVTransferError."""
    segments = push_segments(transfer_id, src_block_ids, dst_block_ids)
    check_layer(kv_caches, layer, src_block_ids)
    cache = kv_caches[layer]
    block_bytes = cache.stride(0) * cache.element_size()  # contiguous: check_kv_caches
    if gather and len(segments) > MAX_RUN_CHUNKS:
        ids = torch.tensor(src_block_ids, dtype=torch.long)
        ids = ids.to(cache.device, non_blocking=True) if cache.is_cuda else ids
        header = _header(transfer_id, layer, 0, len(dst_block_ids), block_bytes)
        header.dst_block_ids.extend(dst_block_ids)
        pieces = [(header, cache.view(torch.uint8).index_select(0, ids).view(cache.dtype))]  # bytes: fp8 too
    else:  # narrow: cheaper than a slice
        pieces = [(_header(transfer_id, layer, s.dst_block_start, s.num_blocks, block_bytes),
                   cache.narrow(0, s.src_block_start, s.num_blocks)) for s in segments]  # fmt: skip
    ready = _recorded(cache)
    injected = faults.active()
    if injected is not None:
        faults.delay(injected[0])
    chunks = []
    for header, payload in pieces:
        if not payload.is_cuda:
            header.crc32 = chunk_crc32(payload)
        if injected is not None:
            spec, rng = injected
            if rng.random() < spec.drop:
                faults.INJECTED["drop"] += 1
                continue
            if rng.random() < spec.corrupt:
                faults.INJECTED["corrupt"] += 1
                payload = faults.corrupted(payload, rng)
        chunks.append(OutgoingChunk(header, payload, ready))
    return chunks


def chunk_crc32(blocks: torch.Tensor) -> int:
    """CRC-32 of blocks in host memory (contiguous: a run of one layer's cache, or a gather)."""
    return zlib.crc32(blocks.contiguous().view(-1).view(torch.uint8).numpy().data)


def _header(
    transfer_id: str, layer: int, dst_block_start: int, num_blocks: int, block_bytes: int
) -> kv_transfer_pb2.KVChunkHeader:
    return kv_transfer_pb2.KVChunkHeader(
        transfer_id=transfer_id,
        layer=layer,
        dst_block_start=dst_block_start,
        num_blocks=num_blocks,
        num_bytes=num_blocks * block_bytes,
    )


def _recorded(cache: torch.Tensor) -> torch.cuda.Event | None:
    """On CUDA, an event recorded on the current stream: the send waits for what is queued."""
    if not cache.is_cuda:
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(cache.device))
    return ready
