"""The pure parts of kv_transfer: layout, segments, and the receive/send bookkeeping."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.kv_transfer.caches import MODEL, random_caches, zero_caches
from vllm_cluster.kv_transfer import KVLayout, KVLayoutMismatch, KVTransferError, TransferStatus, make_sender
from vllm_cluster.kv_transfer.base import Segment, pack_frames, push_segments, split_segments, unpack_frame
from vllm_cluster.kv_transfer.chunks import MAX_RUN_CHUNKS, plan_chunks
from vllm_cluster.kv_transfer.tracking import ReceiveTable, SendTable
from vllm_cluster.proto import kv_transfer_pb2


def header(
    transfer_id: str, layer: int, start: int, num_blocks: int
) -> kv_transfer_pb2.KVChunkHeader:
    block_bytes = 2 * 4 * 2 * 8 * 4  # [2, block_size 4, 2 heads, 8 dims] of float32
    return kv_transfer_pb2.KVChunkHeader(
        transfer_id=transfer_id,
        layer=layer,
        dst_block_start=start,
        num_blocks=num_blocks,
        num_bytes=num_blocks * block_bytes,
    )


def test_layout_from_caches_and_proto_round_trip() -> None:
    layout = KVLayout.from_kv_caches(random_caches(seed=0, dtype=torch.bfloat16), MODEL, 2, 1)
    assert layout == KVLayout(MODEL, "bfloat16", 4, 2, 2, 8, "NB,2,BS,H,D", 2, 1)
    assert KVLayout.from_proto(layout.to_proto()) == layout


def test_layout_rejects_a_cache_that_is_not_paged() -> None:
    with pytest.raises(ValueError, match="expected \\[num_blocks, 2, block_size"):
        KVLayout.from_kv_caches([torch.zeros(16, 4, 2, 8)], MODEL)
    with pytest.raises(ValueError, match="same block shape"):
        KVLayout.from_kv_caches([torch.zeros(16, 2, 4, 2, 8), torch.zeros(16, 2, 8, 2, 8)], MODEL)


def test_mismatch_names_every_differing_field_with_both_values() -> None:
    sender = KVLayout(MODEL, "float32", 16, 30, 3, 64)
    receiver = KVLayout(MODEL, "bfloat16", 32, 30, 3, 64, tp_size=2)
    problems = sender.mismatches(receiver)
    assert problems == [
        "dtype: sender float32, receiver bfloat16",
        "block_size: sender 16, receiver 32",
        "tp_size: sender 1, receiver 2",
    ]
    assert str(KVLayoutMismatch(problems)) == (
        "KV layout mismatch between prefill and decode: dtype: sender float32, receiver "
        "bfloat16; block_size: sender 16, receiver 32; tp_size: sender 1, receiver 2. Run "
        "both with the same model, dtype, kv_cache_dtype, block_size and parallel layout."
    )
    assert sender.mismatches(sender) == []


def test_split_segments_cuts_where_either_side_jumps() -> None:
    assert split_segments([0, 1, 2, 5, 6, 9], [10, 11, 3, 4, 5, 0]) == [
        Segment(0, 10, 2),
        Segment(2, 3, 1),
        Segment(5, 4, 2),
        Segment(9, 0, 1),
    ]
    assert split_segments([], []) == []
    with pytest.raises(ValueError, match="3 source blocks but 2 destination"):
        split_segments([0, 1, 2], [0, 1])


def test_frames_round_trip_and_split_at_the_limit() -> None:
    messages = [bytes([i]) * (10 + i) for i in range(5)]  # entries of 18..22 bytes
    (frame,) = pack_frames(messages, 1000)
    assert unpack_frame(frame + b"garbage after the end") == messages
    frames = pack_frames(messages, 50)  # 8-byte end mark + two entries fit, not three
    assert [len(unpack_frame(f)) for f in frames] == [2, 2, 1]
    assert all(len(f) <= 50 for f in frames)
    assert [m for f in frames for m in unpack_frame(f)] == messages
    with pytest.raises(KVTransferError, match="exceeds the frame limit"):
        pack_frames([bytes(100)], 50)
    with pytest.raises(KVTransferError, match="truncated frame"):
        unpack_frame(frame[:15])  # the first message announces 10 bytes; 7 follow


def test_plan_chunks_sends_views_of_the_cache_without_copies() -> None:
    caches = random_caches(seed=0)
    chunks = plan_chunks(caches, "t", 1, [3, 4, 8], [0, 1, 2])
    assert [(c.header.dst_block_start, c.header.num_blocks) for c in chunks] == [(0, 2), (2, 1)]
    assert chunks[0].payload.data_ptr() == caches[1][3].data_ptr()
    assert chunks[0].header.num_bytes == 2 * caches[1][0].numel() * 4
    with pytest.raises(KVTransferError, match="layer 2 is outside"):
        plan_chunks(caches, "t", 2, [0], [0])
    with pytest.raises(KVTransferError, match="source block ids \\[16\\]"):
        plan_chunks(caches, "t", 0, [16], [0])


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))],
)
def test_a_fragmented_layer_goes_as_one_gathered_chunk_that_lands_scattered(device: str) -> None:
    caches = [cache.to(device) for cache in random_caches(seed=0)]
    src, dst = [9, 1, 7, 3, 5, 11], [2, 14, 0, 6, 12, 4]  # six runs: past MAX_RUN_CHUNKS
    assert len(split_segments(src, dst)) > MAX_RUN_CHUNKS
    (chunk,) = plan_chunks(caches, "g", 1, src, dst)
    assert list(chunk.header.dst_block_ids) == dst and chunk.header.num_blocks == len(dst)
    assert torch.equal(chunk.payload, caches[1][src])  # the source blocks, in pairing order
    assert chunk.header.HasField("crc32") == (device == "cpu")  # GPU links carry their own
    assert (chunk.ready is not None) == (device == "cuda")  # recorded after the gather
    assert len(plan_chunks(caches, "g", 1, src, dst, gather=False)) == len(src)  # cuda_ipc copies runs

    received = zero_caches(caches)
    table = ReceiveTable(received, KVLayout.from_kv_caches(caches, MODEL))
    table.expect("g", sorted(dst))
    table.check_header(chunk.header)
    for layer in range(2):
        (chunk,) = plan_chunks(caches, "g", layer, src, dst)
        buffer = table.begin_chunk(chunk.header)
        assert buffer is not None and buffer.data_ptr() != received[layer].data_ptr()
        if chunk.ready is not None:
            chunk.ready.synchronize()  # what the senders wait for
        buffer.copy_(chunk.payload)  # what the transport does
        assert table.status("g") == TransferStatus.PENDING
        table.end_chunk(chunk.header, buffer, landed=True)
    assert table.status("g") == TransferStatus.DONE
    for layer in range(2):
        assert torch.equal(received[layer][dst], caches[layer][src])
        untouched = [b for b in range(16) if b not in dst]
        assert not received[layer][untouched].any()


def test_a_gathered_chunk_that_lands_corrupted_or_cancelled_writes_no_block() -> None:
    caches = random_caches(seed=0)
    src, dst = [9, 1, 7, 3, 5, 11], [2, 14, 0, 6, 12, 4]
    received = zero_caches(caches)
    table = ReceiveTable(received, KVLayout.from_kv_caches(caches, MODEL))
    table.expect("bad", sorted(dst))
    (chunk,) = plan_chunks(caches, "bad", 0, src, dst)
    buffer = table.begin_chunk(chunk.header)
    assert buffer is not None
    buffer.copy_(chunk.payload)
    buffer[3] += 1.0  # a flipped payload: its CRC no longer matches
    table.end_chunk(chunk.header, buffer, landed=True)
    assert table.status("bad") == TransferStatus.FAILED
    assert not received[0].any()

    table.expect("late", sorted(dst))
    (chunk,) = plan_chunks(caches, "late", 0, src, dst)
    buffer = table.begin_chunk(chunk.header)
    assert buffer is not None
    buffer.copy_(chunk.payload)
    canceller = threading.Thread(target=table.cancel, args=("late",))
    canceller.start()  # waits for the chunk in flight, which then scatters nothing
    while table.status("late") == TransferStatus.PENDING:
        threading.Event().wait(0.01)
    table.end_chunk(chunk.header, buffer, landed=True)
    canceller.join(5.0)
    assert not received[0].any()


def test_a_gathered_header_must_name_expected_blocks_once_each() -> None:
    caches = random_caches(seed=0)
    table = ReceiveTable(zero_caches(caches), KVLayout.from_kv_caches(caches, MODEL))
    short = header("t", 0, 0, 3)
    short.dst_block_ids.extend([1, 2])
    with pytest.raises(KVTransferError, match="lists 2 destination blocks for 3 blocks"):
        table.check_header(short)
    for ids in ([1, 2, 9], [1, 2, 2]):  # block 9 is not expected; block 2 twice
        table.expect("t", [1, 2, 3])
        twice = header("t", 0, 0, 3)
        twice.dst_block_ids.extend(ids)
        table.check_header(twice)
        assert table.begin_chunk(twice) is None
        assert table.status("t") == TransferStatus.FAILED
        table.cancel("t")


def test_push_segments_are_cut_once_per_transfer_and_follow_new_ids() -> None:
    first = push_segments("memo", [0, 1, 2, 5], [10, 11, 3, 4])
    assert first == [Segment(0, 10, 2), Segment(2, 3, 1), Segment(5, 4, 1)]
    assert push_segments("memo", [0, 1, 2, 5], [10, 11, 3, 4]) is first  # the next layer: no new cut
    assert push_segments("memo", [0, 1], [7, 8]) == [Segment(0, 7, 2)]  # same id, other blocks
    with pytest.raises(KVTransferError, match="2 source blocks but 1 destination"):
        push_segments("memo", [0, 1], [7])


def test_receive_table_lands_layer_by_layer() -> None:
    table = ReceiveTable(
        zero_caches(random_caches(seed=0)), KVLayout.from_kv_caches(random_caches(seed=0), MODEL)
    )
    table.expect("t", [3, 4, 7])
    for layer in range(2):
        for start, num_blocks in [(3, 2), (7, 1)]:
            assert table.status("t") == TransferStatus.PENDING
            dst = table.begin_chunk(header("t", layer, start, num_blocks))
            assert dst is not None and dst.shape[0] == num_blocks
            table.end_chunk(header("t", layer, start, num_blocks), dst, landed=True)
    assert table.status("t") == TransferStatus.DONE


def test_receive_table_failed_write_does_not_count_and_unknown_is_dropped() -> None:
    caches = random_caches(seed=0)
    table = ReceiveTable(zero_caches(caches), KVLayout.from_kv_caches(caches, MODEL))
    table.expect("t", [0])
    dst = table.begin_chunk(header("t", 0, 0, 1))
    assert dst is not None
    table.end_chunk(header("t", 0, 0, 1), dst, landed=False)
    assert table.status("t") == TransferStatus.PENDING
    assert table.begin_chunk(header("nobody", 0, 0, 1)) is None
    assert table.status("nobody") == TransferStatus.CANCELLED


def test_receive_table_chunk_outside_expected_blocks_fails_the_transfer() -> None:
    caches = random_caches(seed=0)
    table = ReceiveTable(zero_caches(caches), KVLayout.from_kv_caches(caches, MODEL))
    table.expect("t", [0, 1])
    assert table.begin_chunk(header("t", 0, 1, 2)) is None  # block 2 is not expected
    assert table.status("t") == TransferStatus.FAILED


def test_receive_table_rejects_headers_that_break_the_contract() -> None:
    caches = random_caches(seed=0)
    table = ReceiveTable(zero_caches(caches), KVLayout.from_kv_caches(caches, MODEL))
    table.check_header(header("t", 1, 0, 3))
    with pytest.raises(KVTransferError, match="layer 2"):
        table.check_header(header("t", 2, 0, 1))
    bad_size = header("t", 0, 0, 1)
    bad_size.num_bytes += 1
    with pytest.raises(KVTransferError, match="announces 513 bytes"):
        table.check_header(bad_size)


def test_cancel_waits_for_the_write_in_flight() -> None:
    caches = random_caches(seed=0)
    table = ReceiveTable(zero_caches(caches), KVLayout.from_kv_caches(caches, MODEL))
    table.expect("t", [0])
    dst = table.begin_chunk(header("t", 0, 0, 1))
    assert dst is not None
    cancelled = threading.Event()

    def cancel() -> None:
        table.cancel("t")
        cancelled.set()

    canceller = threading.Thread(target=cancel)
    canceller.start()
    assert not cancelled.wait(0.2)  # blocked by the chunk in flight
    assert table.begin_chunk(header("t", 1, 0, 1)) is None  # but no new chunk starts
    table.end_chunk(header("t", 0, 0, 1), dst, landed=True)
    canceller.join(5.0)
    assert cancelled.is_set()
    assert table.status("t") == TransferStatus.CANCELLED


def test_receive_table_forgets_the_oldest_finished_transfers() -> None:
    caches = random_caches(seed=0)
    table = ReceiveTable(
        zero_caches(caches), KVLayout.from_kv_caches(caches, MODEL), max_num_finished=2
    )
    for transfer_id in ["a", "b", "c"]:
        table.expect(transfer_id, [])
    assert [table.status(t) for t in "abc"] == [TransferStatus.CANCELLED] + [
        TransferStatus.DONE
    ] * 2


def test_send_table_wait_is_done_failed_or_timed_out() -> None:
    table = SendTable()
    table.add("ok", 2)
    table.done("ok")
    table.done("ok")
    assert table.wait("ok", 0.0) == TransferStatus.DONE
    table.add("broken", 1)
    table.fail("broken", "peer died")
    table.fail("broken", "a later reason")
    assert table.wait("broken", 0.0) == TransferStatus.FAILED
    assert table.error("broken") == "peer died"  # kept after wait returned
    table.add("slow", 1)
    assert table.wait("slow", 0.05) == TransferStatus.FAILED
    assert "timed out after 0.05 s with 1 sends" in (table.error("slow") or "")
    assert table.wait("never-pushed", 0.0) == TransferStatus.DONE


def test_make_sender_names_valid_backends() -> None:
    caches = random_caches(seed=0)
    with pytest.raises(ValueError, match="unknown KV transfer backend 'tcp://127.0.0.1:1'"):
        make_sender("tcp://127.0.0.1:1", caches, KVLayout.from_kv_caches(caches, MODEL), "p")
