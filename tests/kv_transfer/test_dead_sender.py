"""A sender process that dies mid-transfer (a real subprocess, for ucx and gloo): the
receiver keeps the transfer PENDING, so decode's wait times out, and serves new senders."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.kv_transfer.caches import MODEL, random_caches, zero_caches
from vllm_cluster.kv_transfer import KVLayout, TransferStatus, make_receiver, make_sender

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["ucx", "nccl"], ids=["ucx", "gloo"])
def network_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ucx":
        pytest.importorskip("ucxx")
    return str(request.param)


def test_dead_sender_leaves_transfer_pending(network_backend: str, closing: list[Any]) -> None:
    src = random_caches(seed=1)  # what the subprocess sends
    dst = zero_caches(src)
    layout = KVLayout.from_kv_caches(dst, MODEL)
    receiver = make_receiver(network_backend, dst, layout)
    closing.append(receiver)
    receiver.expect("orphan", [2, 3, 4, 5])

    dying = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.kv_transfer.dying_sender",
            network_backend,
            receiver.endpoint,
            "orphan",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dying.stdout.strip() == "sent", dying.stdout + dying.stderr

    deadline = time.monotonic() + 10.0
    while not torch.equal(dst[0][2:6], src[0][0:4]):  # layer 0 landed before the death
        assert time.monotonic() < deadline, "layer 0 never landed"
        time.sleep(0.01)
    assert receiver.wait("orphan", 1.0) == TransferStatus.PENDING
    assert receiver.status("orphan") == TransferStatus.PENDING
    assert not dst[1].any()

    sender = make_sender(network_backend, src, layout, sender_id="prefill-1")
    closing.append(sender)
    receiver.expect("next", [8, 9])
    for layer in range(2):
        sender.push_layer(receiver.endpoint, "next", layer, [10, 11], [8, 9])
    assert sender.wait("next", 10.0) == TransferStatus.DONE
    assert receiver.wait("next", 10.0) == TransferStatus.DONE
    assert torch.equal(dst[1][[8, 9]], src[1][[10, 11]])
    receiver.cancel("orphan")  # what decode does when it gives up
    assert receiver.status("orphan") == TransferStatus.CANCELLED
