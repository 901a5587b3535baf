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


def _send(endpoint: str, transfer_id: str, block_size: int = 4, device: str = "cuda:0") -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tests.kv_transfer.cuda_ipc_sender", endpoint, transfer_id, str(block_size), device],
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
