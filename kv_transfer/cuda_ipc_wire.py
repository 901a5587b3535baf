"""What the cuda_ipc backend puts on its control connection besides frames: CUDA IPC
handles of the receiver's cache layers (made there, mapped by the sender), and the
"landed" notices of a layer's copies, read in bulk."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import BinaryIO

import torch

from vllm_cluster.kv_transfer.base import KVTransferError
from vllm_cluster.proto import kv_transfer_pb2 as kvpb

FRAME = struct.Struct("<BI")  # 1 byte kind, 4 bytes little-endian length, then the payload


def read_frame(reader: BinaryIO) -> tuple[int, bytes]:
    """A frame from a buffered reader of the socket (a layer's landed notices come in one
    write: one read for all of them, not two per frame)."""
    head = reader.read(FRAME.size)
    if len(head) < FRAME.size:
        raise ConnectionError("peer closed the connection")
    kind, length = FRAME.unpack(head)
    payload = reader.read(length)
    if len(payload) < length:
        raise ConnectionError("peer closed the connection")
    return kind, payload


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, count) of each run of consecutive ids, in ascending order."""
    ids = sorted(block_ids)
    starts = [0, *(i for i in range(1, len(ids)) if ids[i] != ids[i - 1] + 1)]
    return [(ids[a], b - a) for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)]


def block_header(transfer_id: str, layer: int, cache: torch.Tensor) -> kvpb.KVChunkHeader:
    """A one-block header of this transfer and layer (`cache`: the layer's contiguous cache),
    the template of `landed_headers`."""
    num_bytes = cache.stride(0) * cache.element_size()
    return kvpb.KVChunkHeader(transfer_id=transfer_id, layer=layer, num_blocks=1, num_bytes=num_bytes)


def landed_headers(header: kvpb.KVChunkHeader, runs: Sequence[tuple[int, int]]) -> list[kvpb.KVChunkHeader]:
    """Landed notices for these runs of destination blocks, in the fields of `header` (a chunk
    header of the same transfer and layer)."""
    block_bytes = header.num_bytes // header.num_blocks
    return [kvpb.KVChunkHeader(transfer_id=header.transfer_id, layer=header.layer, dst_block_start=start,
                               num_blocks=count, num_bytes=count * block_bytes) for start, count in runs]


def export_tensor(tensor: torch.Tensor) -> kvpb.CudaIpcTensor:
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return kvpb.CudaIpcTensor(
        device=device,
        handle=handle,
        storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync,
        tensor_offset=int(tensor.storage_offset()),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
    )


def import_tensor(msg: kvpb.CudaIpcTensor, like: torch.Tensor) -> torch.Tensor:
    """The receiver's tensor, mapped here, in its own shape: typed like our cache layer `like`
    and with its block layout (every dimension but the first, the block count: a decode
    instance usually holds many more blocks than a prefill instance)."""
    if tuple(msg.shape[1:]) != tuple(like.shape[1:]):
        raise KVTransferError(
            f"the receiver's cache layer has shape {list(msg.shape)}, ours {list(like.shape)}: "
            "every dimension but the block count must match"
        )
    storage = torch.UntypedStorage._new_shared_cuda(
        msg.device,
        msg.handle,
        msg.storage_size_bytes,
        msg.storage_offset_bytes,
        msg.ref_counter_handle,
        msg.ref_counter_offset,
        msg.event_handle or None,
        msg.event_sync_required,
    )
    out = torch.empty(0, dtype=like.dtype, device=torch.device("cuda", msg.device))
    return out.set_(storage, msg.tensor_offset, tuple(msg.shape), tuple(msg.stride))
