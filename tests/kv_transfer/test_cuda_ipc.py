"""GPU transfers between processes: cuda_ipc (a sender process writes straight into the
receiver's KV cache on the same GPU) and NCCL (a sender process on another GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kv_transfer.caches import MODEL, random_caches, zero_caches
from vllm_cluster.kv_transfer.base import KVLayout, TransferStatus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
ROOT = Path(__file__).resolve().parents[2]


def _send(endpoint: str, transfer_id: str, block_size: int = 4, device: str = "cuda:0", dst: str = "7,8,9,3,4") -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tests.kv_transfer.cuda_ipc_sender", endpoint, transfer_id, str(block_size), device,
         dst],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_blocks_land_exactly_and_mismatch_is_named() -> None:
    from vllm_cluster.kv_transfer.cuda_ipc import CudaIpcReceiver

    source = random_caches(seed=1)
    caches = [c.cuda() for c in zero_caches(source)]
    receiver = CudaIpcReceiver(caches, KVLayout.from_kv_caches(caches, MODEL))
    try:
        receiver.expect("t1", [7, 8, 9, 3, 4])
        assert receiver.status("t1") == TransferStatus.PENDING
        assert _send(receiver.endpoint, "t1") == "sent"
        assert receiver.wait("t1", 10.0) == TransferStatus.DONE
        for layer, (got, want) in enumerate(zip(caches, source, strict=True)):
            got = got.cpu()
            for src, dst in zip([0, 1, 2, 5, 6], [7, 8, 9, 3, 4], strict=True):
                assert torch.equal(got[dst], want[src]), (layer, src, dst)
            untouched = [b for b in range(16) if b not in (7, 8, 9, 3, 4)]
            assert not got[untouched].any()
        # A sender with another block size is refused, with both values named.
        outcome = _send(receiver.endpoint, "t2", block_size=8)
        assert outcome.startswith("failed") and "block_size: sender 8, receiver 4" in outcome
        # Cancel of a pending transfer returns; later notices for it are dropped.
        receiver.expect("t3", [7, 8, 9, 3, 4])
        receiver.cancel("t3")
        assert receiver.status("t3") == TransferStatus.CANCELLED
    finally:
        receiver.close()


def test_a_receiver_with_more_blocks_than_the_sender_takes_them_all() -> None:
    """A decode instance holds many more blocks than the prefill instance that feeds it: the
    sender maps the receiver's cache in the receiver's shape, so blocks past the sender's own
    count land, and ids past the receiver's fail the transfer, not the sender."""
    from vllm_cluster.kv_transfer.cuda_ipc import CudaIpcReceiver

    source = random_caches(seed=1)  # the sender's: 16 blocks
    caches = [c.cuda() for c in random_caches(seed=2, num_blocks=64)]
    before = [c.clone() for c in caches]
    receiver = CudaIpcReceiver(caches, KVLayout.from_kv_caches(caches, MODEL))
    try:
        receiver.expect("far", [40, 41, 63, 3, 4])
        assert _send(receiver.endpoint, "far", dst="40,41,63,3,4") == "sent"
        assert receiver.wait("far", 10.0) == TransferStatus.DONE
        for got, want, old in zip(caches, source, before, strict=True):
            got, old = got.cpu(), old.cpu()
            for src, dst in zip([0, 1, 2, 5, 6], [40, 41, 63, 3, 4], strict=True):
                assert torch.equal(got[dst], want[src])
            untouched = [b for b in range(64) if b not in (40, 41, 63, 3, 4)]
            assert torch.equal(got[untouched], old[untouched])
        outcome = _send(receiver.endpoint, "past", dst="62,63,64,65,3")
        assert outcome.startswith("failed") and "destination block ids [64, 65]" in outcome, outcome
        assert "64 blocks" in outcome
    finally:
        receiver.close()


def test_fragmented_blocks_land_through_one_gather_and_scatter() -> None:
    """Five runs (past the few the sender copies one by one): the layer moves as one gather
    and one scatter, each block to its own destination, and every run is reported landed."""
    from vllm_cluster.kv_transfer.cuda_ipc import CudaIpcReceiver

    source = random_caches(seed=1)
    caches = [c.cuda() for c in zero_caches(source)]
    receiver = CudaIpcReceiver(caches, KVLayout.from_kv_caches(caches, MODEL))
    dst = [15, 1, 13, 3, 11]
    try:
        receiver.expect("frag", dst)
        assert _send(receiver.endpoint, "frag", dst=",".join(map(str, dst))) == "sent"
        assert receiver.wait("frag", 10.0) == TransferStatus.DONE
        for got, want in zip(caches, source, strict=True):
            got = got.cpu()
            for src, to in zip([0, 1, 2, 5, 6], dst, strict=True):
                assert torch.equal(got[to], want[src])
            assert not got[[b for b in range(16) if b not in dst]].any()
    finally:
        receiver.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between processes needs two GPUs")
def test_nccl_between_two_gpus() -> None:
    from vllm_cluster.kv_transfer.torch_dist import TorchDistReceiver

    source = random_caches(seed=1)
    caches = [c.to("cuda:0") for c in zero_caches(source)]
    receiver = TorchDistReceiver(caches, KVLayout.from_kv_caches(caches, MODEL))
    try:
        receiver.expect("n1", [7, 8, 9, 3, 4])
        assert _send(receiver.endpoint, "n1", device="cuda:1") == "sent"
        assert receiver.wait("n1", 30.0) == TransferStatus.DONE
        for got, want in zip(caches, source, strict=True):
            got = got.cpu()
            for src, dst in zip([0, 1, 2, 5, 6], [7, 8, 9, 3, 4], strict=True):
                assert torch.equal(got[dst], want[src])
        outcome = _send(receiver.endpoint, "n2", block_size=8, device="cuda:1")
        assert outcome.startswith("failed") and "block_size: sender 8, receiver 4" in outcome
    finally:
        receiver.close()
