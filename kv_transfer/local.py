"""In-process KV transfer: the trivial backend that tests (and single-process setups) use.

Lifecycle of a transfer:

1. `LocalReceiver(kv_caches, layout, name)` registers itself under `name` in this
   process; its endpoint is "local://NAME".
2. Decode calls `receiver.expect(tid, dst_block_ids)`: the transfer is PENDING.
3. Prefill calls `sender.push_layer(endpoint, tid, layer, src_ids, dst_ids)`. The first
   push to an endpoint does the handshake: the receiver compares the two layouts and, on
   a mismatch, logs it and refuses; every transfer to that endpoint then fails with the
   mismatch message (`sender.error(tid)`).
4. Each chunk (chunks.py: a run of consecutive source and destination blocks, or a
   layer's scattered blocks gathered) is copied into the receiver's view or buffer, in the
   caller's thread, while the receiver counts it in flight (so `cancel` waits for it).
5. `sender.wait(tid)` is DONE once its copies are made; `receiver.status(tid)` is DONE once
   every layer of every expected block has landed.
6. `receiver.close()` unregisters it; later pushes to it fail.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from vllm_cluster.kv_transfer.base import (
    KVLayout,
    KVTransferError,
    TransferStatus,
    check_kv_caches,
    handshake_message,
)
from vllm_cluster.kv_transfer.chunks import plan_chunks
from vllm_cluster.kv_transfer.tracking import ReceiveTable, SendTable
from vllm_cluster.proto import kv_transfer_pb2

_registry: dict[str, LocalReceiver] = {}
_registry_lock = threading.Lock()


class LocalReceiver:
    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, name: str, cluster_token: str = ""
    ) -> None:
        check_kv_caches(kv_caches)
        self.endpoint = f"local://{name}"
        self._table = ReceiveTable(kv_caches, layout, cluster_token)
        with _registry_lock:
            if name in _registry:
                raise KVTransferError(f"a local KV receiver named {name!r} already exists")
            _registry[name] = self
        self._name = name

    def expect(self, transfer_id: str, block_ids: list[int]) -> None:
        self._table.expect(transfer_id, block_ids)

    def status(self, transfer_id: str) -> TransferStatus:
        return self._table.status(transfer_id)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        return self._table.wait(transfer_id, timeout_s)

    def wait_blocks(self, transfer_id: str, block_ids: list[int], timeout_s: float) -> bool:
        return self._table.wait_blocks(transfer_id, block_ids, timeout_s)

    def cancel(self, transfer_id: str) -> None:
        self._table.cancel(transfer_id)

    def close(self) -> None:
        with _registry_lock:
            if _registry.get(self._name) is self:
                del _registry[self._name]

    def handshake(self, handshake: kv_transfer_pb2.Handshake) -> kv_transfer_pb2.HandshakeReply:
        return self._table.answer_handshake(handshake)

    def deliver(self, header: kv_transfer_pb2.KVChunkHeader, src: torch.Tensor) -> None:
        """Copy one chunk in, or drop it if its transfer is not (or no longer) expected."""
        self._table.check_header(header)
        dst = self._table.begin_chunk(header)
        if dst is None:
            return
        landed = False
        try:
            dst.copy_(src)
            landed = True
        finally:
            self._table.end_chunk(header, dst, landed)


class LocalSender:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        sender_id: str = "local",
        cluster_token: str = "",
    ) -> None:
        check_kv_caches(kv_caches)
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.sender_id = sender_id
        self.cluster_token = cluster_token
        self._table = SendTable()
        self._rejections: dict[str, str] = {}  # endpoint -> handshake error
        self._accepted: set[str] = set()

    def push_layer(
        self,
        endpoint: str,
        transfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> None:
        chunks = plan_chunks(self.kv_caches, transfer_id, layer, src_block_ids, dst_block_ids)
        self._table.add(transfer_id, len(chunks))
        try:
            receiver = self._connect(endpoint)
            for chunk in chunks:
                receiver.deliver(chunk.header, chunk.payload)
                self._table.done(transfer_id)
        except KVTransferError as e:
            self._table.fail(transfer_id, str(e))

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        return self._table.wait(transfer_id, timeout_s)

    def error(self, transfer_id: str) -> str | None:
        return self._table.error(transfer_id)

    def close(self) -> None:
        self._table.fail_all("sender closed")

    def _connect(self, endpoint: str) -> LocalReceiver:
        """The receiver behind `endpoint`, handshaking on first use; raises KVTransferError."""
        if endpoint in self._rejections:
            raise KVTransferError(self._rejections[endpoint])
        name = endpoint.removeprefix("local://")
        with _registry_lock:
            receiver = _registry.get(name)
        if receiver is None:
            raise KVTransferError(f"no local KV receiver at {endpoint!r} (closed, or never made)")
        if endpoint not in self._accepted:
            handshake = handshake_message(self.layout, self.sender_id, self.cluster_token)
            reply = receiver.handshake(handshake)
            if not reply.accepted:
                self._rejections[endpoint] = reply.error
                raise KVTransferError(reply.error)
            self._accepted.add(endpoint)
        return receiver
