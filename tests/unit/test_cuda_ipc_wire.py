"""The cuda_ipc backend's landed notices: one per run of consecutive destination blocks,
whatever order the blocks come in, each announcing its run's bytes; the receiver's cache
is mapped in its own shape, and only where its blocks are laid out like ours."""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.kv_transfer.base import KVTransferError
from vllm_cluster.kv_transfer.cuda_ipc_wire import block_runs, import_tensor, landed_headers
from vllm_cluster.proto import kv_transfer_pb2 as kvpb


def test_runs_of_consecutive_ids_in_any_order() -> None:
    assert block_runs([9, 8, 7, 3, 4, 20]) == [(3, 2), (7, 3), (20, 1)]
    assert block_runs([5]) == [(5, 1)]


def test_landed_headers_keep_the_transfer_and_layer_and_count_bytes() -> None:
    chunk = kvpb.KVChunkHeader(transfer_id="t", layer=3, dst_block_start=0, num_blocks=2, num_bytes=200)
    headers = landed_headers(chunk, block_runs([9, 8, 7, 3, 4]))
    assert [(h.transfer_id, h.layer, h.dst_block_start, h.num_blocks, h.num_bytes) for h in headers] == [
        ("t", 3, 3, 2, 200), ("t", 3, 7, 3, 300)]


def test_import_refuses_a_cache_whose_blocks_are_laid_out_otherwise() -> None:
    """The receiver's block count may differ from ours (a decode instance holds more); every
    other dimension must match, or nothing is mapped."""
    like = torch.zeros(16, 2, 4, 2, 8)  # 16 blocks of [K/V, block_size, heads, head_dim]
    for shape in ([64, 2, 4, 2, 16], [64, 2, 8, 2, 8], []):
        with pytest.raises(KVTransferError, match="every dimension but the block count must match"):
            import_tensor(kvpb.CudaIpcTensor(shape=shape), like)
