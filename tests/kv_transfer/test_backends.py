"""Every backend (local, ucx, gloo) against the same contract, sender and receiver in-process."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from tests.kv_transfer.caches import MODEL, random_caches, zero_caches
from vllm_cluster.kv_transfer import KVLayout, TransferStatus, make_receiver, make_sender

TIMEOUT_S = 10.0


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (torch.equal has no fp8 kernel on CPU; bytes are what the wire must keep)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def wait_until_landed(
    dst: torch.Tensor, dst_block_ids: list[int], src: torch.Tensor, src_block_ids: list[int]
) -> None:
    """Poll until dst[dst_block_ids] equals src[src_block_ids] (a layer in flight lands)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not same_bytes(dst[dst_block_ids], src[src_block_ids]):
        assert time.monotonic() < deadline, "the layer never landed"
        time.sleep(0.01)


def open_pair(backend: str, closing: list[Any], dtype: torch.dtype = torch.float32) -> tuple:
    """(sender caches, receiver caches, sender, receiver) of the same layout."""
    src = random_caches(seed=1, dtype=dtype)
    dst = zero_caches(src)
    layout = KVLayout.from_kv_caches(src, MODEL)
    receiver = make_receiver(backend, dst, layout)
    closing.append(receiver)
    sender = make_sender(backend, src, layout, sender_id="prefill-0")
    closing.append(sender)
    return src, dst, sender, receiver


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "src_ids,dst_ids",
    [
        ([0, 1, 5, 7, 8], [3, 4, 9, 10, 2]),  # runs 0-1->3-4, 5->9, 7->10, 8->2: a chunk each
        ([9, 1, 7, 3, 5, 11, 12], [2, 14, 0, 6, 12, 4, 5]),  # six runs: one gathered chunk
    ],
    ids=["runs", "gathered"],
)
def test_blocks_land_exactly_and_only_after_the_last_layer(
    backend: str, closing: list[Any], dtype: torch.dtype, src_ids: list[int], dst_ids: list[int]
) -> None:
    src, dst, sender, receiver = open_pair(backend, closing, dtype)
    receiver.expect("req-1", dst_ids)
    assert receiver.status("req-1") == TransferStatus.PENDING

    sender.push_layer(receiver.endpoint, "req-1", 0, src_ids, dst_ids)
    wait_until_landed(dst[0], dst_ids, src[0], src_ids)
    assert receiver.status("req-1") == TransferStatus.PENDING
    assert receiver.wait("req-1", 0.05) == TransferStatus.PENDING

    sender.push_layer(receiver.endpoint, "req-1", 1, src_ids, dst_ids)
    assert sender.wait("req-1", TIMEOUT_S) == TransferStatus.DONE
    assert sender.error("req-1") is None
    assert receiver.wait("req-1", TIMEOUT_S) == TransferStatus.DONE
    untouched = [b for b in range(16) if b not in dst_ids]
    for layer in range(2):
        assert same_bytes(dst[layer][dst_ids], src[layer][src_ids])
        assert not dst[layer][untouched].view(torch.uint8).any()


def test_concurrent_transfers_from_two_senders(backend: str, closing: list[Any]) -> None:
    src_a, src_b = random_caches(seed=1), random_caches(seed=2)
    dst = zero_caches(src_a)
    layout = KVLayout.from_kv_caches(dst, MODEL)
    receiver = make_receiver(backend, dst, layout)
    closing.append(receiver)
    # transfer id -> (sender caches, src block ids, dst block ids)
    plans = {
        "a1": (src_a, [0, 1, 2], [0, 1, 2]),
        "a2": (src_a, [3, 9], [5, 4]),
        "b1": (src_b, [0, 1], [8, 9]),
        "b2": (src_b, [4, 6, 7], [12, 14, 15]),
    }
    for transfer_id, (_, _, dst_ids) in plans.items():
        receiver.expect(transfer_id, dst_ids)
    senders = {}
    for name, caches in [("a", src_a), ("b", src_b)]:
        senders[name] = make_sender(backend, caches, layout, sender_id=f"prefill-{name}")
        closing.append(senders[name])

    def push_all(name: str) -> None:
        mine = [tid for tid in plans if tid.startswith(name)]
        for layer in range(2):  # interleave this sender's transfers layer by layer
            for transfer_id in mine:
                _, src_ids, dst_ids = plans[transfer_id]
                senders[name].push_layer(receiver.endpoint, transfer_id, layer, src_ids, dst_ids)

    threads = [threading.Thread(target=push_all, args=(name,)) for name in senders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for transfer_id, (caches, src_ids, dst_ids) in plans.items():
        assert senders[transfer_id[0]].wait(transfer_id, TIMEOUT_S) == TransferStatus.DONE
        assert receiver.wait(transfer_id, TIMEOUT_S) == TransferStatus.DONE
        for layer in range(2):
            assert torch.equal(dst[layer][dst_ids], caches[layer][src_ids])


def test_cancel_stops_writes_and_forgets(backend: str, closing: list[Any]) -> None:
    src, dst, sender, receiver = open_pair(backend, closing)
    receiver.expect("doomed", [0, 1, 2])
    sender.push_layer(receiver.endpoint, "doomed", 0, [4, 5, 6], [0, 1, 2])
    wait_until_landed(dst[0], [0, 1, 2], src[0], [4, 5, 6])

    receiver.cancel("doomed")
    receiver.cancel("doomed")  # idempotent
    assert receiver.status("doomed") == TransferStatus.CANCELLED
    assert receiver.wait("doomed", 0.0) == TransferStatus.CANCELLED
    before = [cache.clone() for cache in dst]

    # The rest of the doomed transfer, and chunks of a transfer nobody expects, are dropped;
    # a transfer behind them on the same connection proves they were received.
    sender.push_layer(receiver.endpoint, "doomed", 1, [4, 5, 6], [0, 1, 2])
    sender.push_layer(receiver.endpoint, "stranger", 0, [7], [3])
    receiver.expect("next", [8, 9])
    for layer in range(2):
        sender.push_layer(receiver.endpoint, "next", layer, [10, 11], [8, 9])
    assert receiver.wait("next", TIMEOUT_S) == TransferStatus.DONE
    assert sender.wait("doomed", TIMEOUT_S) == TransferStatus.DONE  # the sender cannot know

    for layer in range(2):
        assert torch.equal(dst[layer][:8], before[layer][:8])
        assert torch.equal(dst[layer][[8, 9]], src[layer][[10, 11]])
    assert receiver.status("stranger") == TransferStatus.CANCELLED


def test_layout_mismatch_fails_the_sender_and_receiver_keeps_serving(
    backend: str, closing: list[Any]
) -> None:
    src, dst, good_sender, receiver = open_pair(backend, closing)
    bad_caches = random_caches(seed=3, block_size=8, dtype=torch.float64)
    bad_layout = KVLayout.from_kv_caches(bad_caches, MODEL)
    bad_sender = make_sender(backend, bad_caches, bad_layout, sender_id="prefill-bad")
    closing.append(bad_sender)
    receiver.expect("bad", [0])

    bad_sender.push_layer(receiver.endpoint, "bad", 0, [0], [0])
    assert bad_sender.wait("bad", TIMEOUT_S) == TransferStatus.FAILED
    error = bad_sender.error("bad")
    assert error is not None
    assert "block_size: sender 8, receiver 4" in error
    assert "dtype: sender float64, receiver float32" in error
    bad_sender.push_layer(receiver.endpoint, "bad-again", 0, [1], [1])  # refused at once now
    assert bad_sender.wait("bad-again", TIMEOUT_S) == TransferStatus.FAILED
    assert receiver.status("bad") == TransferStatus.PENDING
    assert not dst[0].any()

    receiver.expect("good", [5, 6])
    for layer in range(2):
        good_sender.push_layer(receiver.endpoint, "good", layer, [1, 2], [5, 6])
    assert good_sender.wait("good", TIMEOUT_S) == TransferStatus.DONE
    assert receiver.wait("good", TIMEOUT_S) == TransferStatus.DONE
    assert torch.equal(dst[1][[5, 6]], src[1][[1, 2]])


def test_fp8_sender_and_16_bit_receiver_are_refused_naming_both(backend: str, closing: list[Any]) -> None:
    """kv_cache_dtype fp8 on one side only: the handshake refuses it, naming both dtypes."""
    dst = zero_caches(random_caches(seed=1, dtype=torch.bfloat16))
    receiver = make_receiver(backend, dst, KVLayout.from_kv_caches(dst, MODEL))
    closing.append(receiver)
    src = random_caches(seed=2, dtype=torch.float8_e4m3fn)
    sender = make_sender(backend, src, KVLayout.from_kv_caches(src, MODEL), sender_id="prefill-fp8")
    closing.append(sender)
    receiver.expect("fp8", [0])
    sender.push_layer(receiver.endpoint, "fp8", 0, [0], [0])
    assert sender.wait("fp8", TIMEOUT_S) == TransferStatus.FAILED
    error = sender.error("fp8")
    assert error is not None and "dtype: sender float8_e4m3fn, receiver bfloat16" in error
    assert "kv_cache_dtype" in error
    assert not dst[0].view(torch.uint8).any()


@pytest.mark.parametrize("connected", [False, True], ids=["fresh", "connected"])
def test_closed_receiver_fails_the_transfer_with_its_endpoint(
    backend: str, closing: list[Any], connected: bool
) -> None:
    src, dst, sender, receiver = open_pair(backend, closing)
    if connected:
        receiver.expect("early", [0])
        for layer in range(2):
            sender.push_layer(receiver.endpoint, "early", layer, [0], [0])
        assert receiver.wait("early", TIMEOUT_S) == TransferStatus.DONE
    receiver.close()
    # Over an open UCX connection a send can complete locally (eager protocol) before the
    # close is seen; the next ones fail, naming the endpoint.
    for attempt in range(20):
        sender.push_layer(receiver.endpoint, f"late-{attempt}", 0, [1], [1])
        if sender.wait(f"late-{attempt}", TIMEOUT_S) == TransferStatus.FAILED:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("pushes to a closed receiver kept succeeding")
    assert connected or attempt == 0, "a fresh sender must fail its first push"
    assert receiver.endpoint in (sender.error(f"late-{attempt}") or "")
    assert not dst[0][1].any()


def test_sender_of_another_cluster_is_refused(backend: str, closing: list[Any]) -> None:
    """The receiver takes KV only from senders carrying its cluster token."""
    src = random_caches(seed=1)
    dst = zero_caches(src)
    layout = KVLayout.from_kv_caches(src, MODEL)
    receiver = make_receiver(backend, dst, layout, cluster_token="our-cluster")
    closing.append(receiver)
    stranger = make_sender(backend, src, layout, sender_id="stranger", cluster_token="some-other-cluster")
    closing.append(stranger)
    receiver.expect("req", [0, 1])
    stranger.push_layer(receiver.endpoint, "req", 0, [0, 1], [0, 1])
    assert stranger.wait("req", TIMEOUT_S) == TransferStatus.FAILED
    assert "cluster token" in (stranger.error("req") or "")
    assert not dst[0].any()
    member = make_sender(backend, src, layout, sender_id="prefill-0", cluster_token="our-cluster")
    closing.append(member)
    for layer in range(2):
        member.push_layer(receiver.endpoint, "req", layer, [0, 1], [0, 1])
    assert member.wait("req", TIMEOUT_S) == TransferStatus.DONE
    assert receiver.wait("req", TIMEOUT_S) == TransferStatus.DONE
    assert torch.equal(dst[1][[0, 1]], src[1][[0, 1]])


def test_corrupted_chunk_fails_the_transfer(backend: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose bytes change on the wire (injected) is caught by its CRC-32: the
    receiver fails the transfer, so decode never serves those blocks."""
    from vllm_cluster.kv_transfer import faults

    src, dst, sender, receiver = open_pair(backend, closing)
    monkeypatch.setattr(faults, "_state", None)  # restored after the test
    faults.configure("corrupt=1")
    receiver.expect("corrupt", [0, 1])
    for layer in range(2):
        sender.push_layer(receiver.endpoint, "corrupt", layer, [0, 1], [0, 1])
    assert receiver.wait("corrupt", TIMEOUT_S) == TransferStatus.FAILED
    faults.configure("")
    receiver.expect("clean", [2, 3])
    for layer in range(2):
        sender.push_layer(receiver.endpoint, "clean", layer, [0, 1], [2, 3])
    assert receiver.wait("clean", TIMEOUT_S) == TransferStatus.DONE
    assert torch.equal(dst[1][[2, 3]], src[1][[0, 1]])


def test_dropped_chunk_leaves_the_transfer_pending(
    backend: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_cluster.kv_transfer import faults

    src, dst, sender, receiver = open_pair(backend, closing)
    monkeypatch.setattr(faults, "_state", None)  # restored after the test
    faults.configure("drop=1")
    receiver.expect("dropped", [0])
    for layer in range(2):
        sender.push_layer(receiver.endpoint, "dropped", layer, [0], [0])
    assert receiver.wait("dropped", 0.5) == TransferStatus.PENDING  # decode's timeout decides
    assert faults.INJECTED["drop"] >= 2


def test_fault_spec_is_validated() -> None:
    from vllm_cluster.kv_transfer.faults import Faults

    assert Faults.parse("corrupt=0.5, drop=0.1,delay_ms=5,seed=3") == Faults(0.5, 0.1, 5.0, 3)
    with pytest.raises(ValueError, match="unknown fault 'flip'"):
        Faults.parse("flip=1")
    with pytest.raises(ValueError, match="probabilities"):
        Faults.parse("drop=2")
