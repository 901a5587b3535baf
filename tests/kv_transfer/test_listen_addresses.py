"""Where the transports listen: every listening socket of this process is on the KV host
(127.0.0.1 here), never on a wildcard or another interface, once a receiver is up and a
sender has connected to it (UCX opens its own transport sockets then)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from tests.kv_transfer.caches import MODEL, random_caches, zero_caches
from tests.listening import is_loopback, listening_addresses
from vllm_cluster.kv_transfer import KVLayout, TransferStatus, make_receiver, make_sender

TIMEOUT_S = 10.0


def test_proc_net_reading_sees_a_wildcard_listener() -> None:
    """The reader itself: a socket on every interface shows up as one."""
    with socket.create_server(("0.0.0.0", 0)) as wildcard:
        port = wildcard.getsockname()[1]
        assert ("0.0.0.0", port) in listening_addresses()


@pytest.mark.parametrize("backend", ["ucx", "nccl"], ids=["ucx", "gloo"])
def test_transport_listens_on_the_kv_host_only(backend: str, closing: list[Any]) -> None:
    if backend == "ucx":
        pytest.importorskip("ucxx")
    src = random_caches(seed=1)
    dst = zero_caches(src)
    layout = KVLayout.from_kv_caches(src, MODEL)
    receiver = make_receiver(backend, dst, layout, host="127.0.0.1")
    closing.append(receiver)
    sender = make_sender(backend, src, layout, sender_id="prefill-0")
    closing.append(sender)
    receiver.expect("t", [3])
    for layer in range(len(src)):
        sender.push_layer(receiver.endpoint, "t", layer, [0], [3])
    assert receiver.wait("t", TIMEOUT_S) == TransferStatus.DONE

    listening = listening_addresses()
    port = int(receiver.endpoint.rpartition(":")[2])
    assert ("127.0.0.1", port) in listening
    elsewhere = sorted(a for a in listening if not is_loopback(a[0]))
    assert not elsewhere, f"{backend} listens beyond the KV host 127.0.0.1: {elsewhere}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc needs a GPU")
def test_cuda_ipc_listens_on_the_kv_host_only(closing: list[Any]) -> None:
    caches = [c.cuda() for c in zero_caches(random_caches(seed=1))]
    receiver = make_receiver("cuda_ipc", caches, KVLayout.from_kv_caches(caches, MODEL), host="127.0.0.1")
    closing.append(receiver)
    elsewhere = sorted(a for a in listening_addresses() if not is_loopback(a[0]))
    assert not elsewhere, f"cuda_ipc listens beyond the KV host 127.0.0.1: {elsewhere}"
