"""The cuda_ipc backend's landed notices: one per run of consecutive destination blocks,
whatever order the blocks come in, each announcing its run's bytes."""

from __future__ import annotations

from vllm_cluster.kv_transfer.cuda_ipc_wire import block_runs, landed_headers
from vllm_cluster.proto import kv_transfer_pb2 as kvpb


def test_runs_of_consecutive_ids_in_any_order() -> None:
    assert block_runs([9, 8, 7, 3, 4, 20]) == [(3, 2), (7, 3), (20, 1)]
    assert block_runs([5]) == [(5, 1)]


def test_landed_headers_keep_the_transfer_and_layer_and_count_bytes() -> None:
    chunk = kvpb.KVChunkHeader(transfer_id="t", layer=3, dst_block_start=0, num_blocks=2, num_bytes=200)
    headers = landed_headers(chunk, block_runs([9, 8, 7, 3, 4]))
    assert [(h.transfer_id, h.layer, h.dst_block_start, h.num_blocks, h.num_bytes) for h in headers] == [
        ("t", 3, 3, 2, 200), ("t", 3, 7, 3, 300)]
