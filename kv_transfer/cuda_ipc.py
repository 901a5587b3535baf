"""cuda_ipc backend: prefill and decode on the same GPU (or GPUs of one node), as separate
processes. The sender maps the receiver's KV cache tensors through CUDA IPC handles and
writes the blocks itself with device-to-device copies; a TCP connection carries only
control messages (handshake, handles, "landed" notices, cancels), never tensor bytes.

Lifecycle of a transfer:
  1. The receiver listens on host:port (TCP). A sender's first push to it connects and
     sends `Handshake{layout}`; the receiver answers `HandshakeReply` and, when accepted,
     `CudaIpcExport` (one IPC handle per layer). The sender maps those tensors once.
  2. `expect(tid, block_ids)` on the receiver marks the transfer PENDING.
  3. `push_layer` on the sender queues the copies on its copy stream, after an event
     recorded on the compute stream (the layer's KV is written): one copy per run of
     blocks consecutive on both sides, or, when the blocks fall into more than a few runs,
     one gather and one scatter for the whole layer.
  4. A notifier thread waits for the copies, sends one `KVChunkHeader` per run of
     destination blocks ("landed"; all of a layer's in one write), and counts the sends
     done (`wait` on the sender returns DONE).
  5. The receiver marks each landed run; once all have, the transfer is DONE.
  6. `cancel(tid)` of a PENDING transfer asks every connected sender to stop writing for
     it and waits for their acknowledgement (sent after their copy stream drained), so
     no write lands in the blocks after cancel returns.
Frames: 1 byte kind, 4 bytes little-endian length, payload (protobuf or a transfer id).
Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_cluster.kv_transfer import faults
from vllm_cluster.kv_transfer.base import (
    KVLayout,
    KVTransferError,
    TransferStatus,
    check_block_ids,
    handshake_message,
    parse_endpoint,
    push_segments,
)
from vllm_cluster.kv_transfer.chunks import MAX_RUN_CHUNKS, layer_ready, plan_chunks
from vllm_cluster.kv_transfer.cuda_ipc_wire import (
    FRAME,
    block_header,
    block_runs,
    export_tensor,
    import_tensor,
    landed_headers,
    read_frame,
)
from vllm_cluster.kv_transfer.tracking import ReceiveTable, SendTable
from vllm_cluster.proto import kv_transfer_pb2 as kvpb

logger = logging.getLogger(__name__)

_HANDSHAKE, _REPLY, _EXPORT, _LANDED, _CANCEL, _CANCEL_ACK = range(1, 7)
_FRAME = FRAME
_CANCEL_TIMEOUT_S = 10.0
_MAX_CANCELLED = 4096


def _send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(_FRAME.pack(kind, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    return kind, _recv_exact(sock, length)


def _shut(sock: socket.socket) -> None:
    """Close a socket so that a thread blocked on it wakes up (close alone does not)."""
    with contextlib.suppress(OSError):  # not connected (a listener) or already closed
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# --------------------------------------------------------------------------- receiver


@dataclass
class _Conn:
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    acks: dict[str, threading.Event] = field(default_factory=dict)


class CudaIpcReceiver:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        cluster_token: str = "",
    ) -> None:
        if not kv_caches[0].is_cuda:
            raise KVTransferError(
                "the cuda_ipc backend needs KV caches on a CUDA device: use ucx or nccl on CPU"
            )
        self._table = ReceiveTable(kv_caches, layout, cluster_token)
        self._export = kvpb.CudaIpcExport(
            layers=[export_tensor(t) for t in kv_caches]
        ).SerializeToString()
        self._server = socket.create_server((host, port))
        self.endpoint = f"cuda_ipc://{host}:{self._server.getsockname()[1]}"
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="cuda-ipc-accept", daemon=True).start()

    def expect(self, transfer_id: str, block_ids: list[int]) -> None:
        self._table.expect(transfer_id, block_ids)

    def status(self, transfer_id: str) -> TransferStatus:
        return self._table.status(transfer_id)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        return self._table.wait(transfer_id, timeout_s)

    def wait_blocks(self, transfer_id: str, block_ids: list[int], timeout_s: float) -> bool:
        return self._table.wait_blocks(transfer_id, block_ids, timeout_s)

    def cancel(self, transfer_id: str) -> None:
        pending = self._table.status(transfer_id) == TransferStatus.PENDING
        self._table.cancel(transfer_id)  # landed notices for it are ignored from now on
        if not pending:
            return  # DONE, FAILED or unknown: no copy of it can still be in flight
        with self._lock:
            conns = list(self._conns)
        waits = []
        for conn in conns:
            event = threading.Event()
            try:
                with conn.lock:
                    conn.acks[transfer_id] = event
                    _send_frame(conn.sock, _CANCEL, transfer_id.encode())
                waits.append(event)
            except OSError:
                continue  # that sender is gone, and its GPU work with it
        for event in waits:
            if not event.wait(_CANCEL_TIMEOUT_S):
                logger.error(
                    "a sender did not confirm the cancel of %s in %.0fs",
                    transfer_id,
                    _CANCEL_TIMEOUT_S,
                )

    def close(self) -> None:
        self._closed = True
        _shut(self._server)  # wakes the accept() thread
        with self._lock:
            for conn in self._conns:
                _shut(conn.sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(_Conn(sock),), name="cuda-ipc-recv", daemon=True
            ).start()

    def _serve(self, conn: _Conn) -> None:
        try:
            kind, payload = _recv_frame(conn.sock)
            if kind != _HANDSHAKE:
                raise KVTransferError(f"expected a handshake, got frame kind {kind}")
            reply = self._table.answer_handshake(kvpb.Handshake.FromString(payload))
            with conn.lock:
                _send_frame(conn.sock, _REPLY, reply.SerializeToString())
                if not reply.accepted:
                    return
                _send_frame(conn.sock, _EXPORT, self._export)
            with self._lock:
                self._conns.append(conn)
            reader = conn.sock.makefile("rb")
            while True:
                kind, payload = read_frame(reader)
                if kind == _LANDED:
                    header = kvpb.KVChunkHeader.FromString(payload)
                    self._table.check_header(header)
                    if (view := self._table.begin_chunk(header)) is not None:
                        self._table.end_chunk(header, view, landed=True)
                elif kind == _CANCEL_ACK:
                    with conn.lock:
                        event = conn.acks.pop(payload.decode(), None)
                    if event is not None:
                        event.set()
                else:
                    raise KVTransferError(f"unexpected frame kind {kind}")
        except (OSError, ConnectionError, KVTransferError) as e:
            if not self._closed:
                logger.info("cuda_ipc sender connection closed: %s", e)
        finally:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            with conn.lock:
                for event in conn.acks.values():
                    event.set()  # a dead sender writes nothing more
            conn.sock.close()


# --------------------------------------------------------------------------- sender


class _Peer:
    def __init__(self, endpoint: str, handshake: bytes, kv_caches: Sequence[torch.Tensor]) -> None:
        self.sock = socket.create_connection(parse_endpoint(endpoint, "cuda_ipc"), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock = threading.Lock()
        _send_frame(self.sock, _HANDSHAKE, handshake)
        kind, payload = _recv_frame(self.sock)
        reply = kvpb.HandshakeReply.FromString(payload)
        if kind != _REPLY or not reply.accepted:
            self.sock.close()
            raise KVTransferError(reply.error or f"{endpoint} refused the handshake")
        kind, payload = _recv_frame(self.sock)
        export = kvpb.CudaIpcExport.FromString(payload)
        self.sock.settimeout(None)
        try:
            if len(export.layers) != len(kv_caches):
                raise KVTransferError(f"the receiver exports {len(export.layers)} layers, we hold {len(kv_caches)}")
            self.remote = [import_tensor(msg, like) for msg, like in zip(export.layers, kv_caches, strict=True)]
        except KVTransferError:  # a cache of another layout: nothing is mapped
            self.sock.close()
            raise


class CudaIpcSender:
    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, sender_id: str, cluster_token: str = ""
    ) -> None:
        if not kv_caches[0].is_cuda:
            raise KVTransferError(
                "the cuda_ipc backend needs KV caches on a CUDA device: use ucx or nccl on CPU"
            )
        self._kv_caches = list(kv_caches)
        self._handshake = handshake_message(layout, sender_id, cluster_token).SerializeToString()
        self._table = SendTable()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # the latest cancels only
        self._stream = torch.cuda.Stream(kv_caches[0].device)
        # The push in progress: (transfer id, src ids, dst ids, their device tensors, runs of dst ids)
        self._plan: tuple[str, list[int], list[int], torch.Tensor, torch.Tensor, list[tuple[int, int]]] | None = None
        self._landed: queue.Queue[
            tuple[_Peer, str, list[kvpb.KVChunkHeader], torch.cuda.Event] | None
        ] = queue.Queue()
        self._notifier = threading.Thread(target=self._notify, name="cuda-ipc-notify", daemon=True)
        self._notifier.start()

    def push_layer(
        self,
        endpoint: str,
        transfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> None:
        # Fragmented blocks (more runs than a few copies) move in one gather and one scatter,
        # from index tensors made once per transfer: no per-run work on this (the engine's) thread.
        num_runs = len(push_segments(transfer_id, src_block_ids, dst_block_ids))
        gather = num_runs > MAX_RUN_CHUNKS and faults.active() is None
        if gather:
            ready, chunks = layer_ready(self._kv_caches, layer, src_block_ids), []
        else:  # a few runs, or injected faults (which drop or corrupt single chunks)
            chunks = plan_chunks(self._kv_caches, transfer_id, layer, src_block_ids, dst_block_ids, gather=False)
            ready = chunks[0].ready if chunks else None
        self._table.add(transfer_id, 1)
        try:
            peer = self._peer(endpoint)
            check_block_ids(dst_block_ids, peer.remote[layer].shape[0], f"{endpoint}: destination")
        except OSError as e:
            self._table.fail(transfer_id, f"cannot reach {endpoint}: {e}")
            return
        except KVTransferError as e:  # a refused handshake, or destination ids the receiver lacks
            self._table.fail(transfer_id, str(e))
            return
        with self._lock:
            if transfer_id in self._cancelled:
                self._table.fail(transfer_id, f"transfer {transfer_id!r} was cancelled by the receiver")
                return
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                if gather:
                    src, dst, runs = self._gather_plan(transfer_id, src_block_ids, dst_block_ids)
                    peer.remote[layer].index_copy_(0, dst, self._kv_caches[layer].index_select(0, src))
                    headers = landed_headers(block_header(transfer_id, layer, self._kv_caches[layer]), runs)
                else:
                    headers = [c.header for c in chunks]
                    for chunk in chunks:
                        h = chunk.header
                        peer.remote[layer].narrow(0, h.dst_block_start, h.num_blocks).copy_(
                            chunk.payload, non_blocking=True
                        )
                done = torch.cuda.Event()
                done.record(self._stream)
        self._landed.put((peer, transfer_id, headers, done))

    def _gather_plan(
        self, transfer_id: str, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """The push's block ids on the device and its runs of destination blocks, made once for
        all its layers. Called on the copy stream; the ids go up without waiting for it."""
        plan = self._plan
        if plan is None or plan[:3] != (transfer_id, src_block_ids, dst_block_ids):
            device = self._kv_caches[0].device
            src, dst = (torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
                        for ids in (src_block_ids, dst_block_ids))  # fmt: skip
            plan = (transfer_id, list(src_block_ids), list(dst_block_ids), src, dst, block_runs(dst_block_ids))
            self._plan = plan
        return plan[3], plan[4], plan[5]

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        return self._table.wait(transfer_id, timeout_s)

    def error(self, transfer_id: str) -> str | None:
        return self._table.error(transfer_id)

    def close(self) -> None:
        self._landed.put(None)
        self._notifier.join(timeout=10)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            _shut(peer.sock)
            peer.remote.clear()  # unmap the receiver's cache before the process goes

    def _peer(self, endpoint: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = _Peer(endpoint, self._handshake, self._kv_caches)
                self._peers[endpoint] = peer
                threading.Thread(
                    target=self._listen, args=(peer,), name="cuda-ipc-cancels", daemon=True
                ).start()
            return peer

    def _notify(self) -> None:
        while (item := self._landed.get()) is not None:
            peer, transfer_id, headers, done = item
            done.synchronize()
            try:
                frames = []
                for header in headers:
                    payload = header.SerializeToString()
                    frames += [_FRAME.pack(_LANDED, len(payload)), payload]
                with peer.lock:
                    peer.sock.sendall(b"".join(frames))
                self._table.done(transfer_id)
            except OSError as e:
                self._table.fail(transfer_id, f"lost the connection to the receiver: {e}")

    def _listen(self, peer: _Peer) -> None:
        """Cancels from the receiver: stop writing for that transfer, drain, acknowledge."""
        try:
            while True:
                kind, payload = _recv_frame(peer.sock)
                if kind != _CANCEL:
                    raise KVTransferError(f"unexpected frame kind {kind} from the receiver")
                transfer_id = payload.decode()
                with self._lock:
                    self._cancelled[transfer_id] = None
                    while len(self._cancelled) > _MAX_CANCELLED:
                        self._cancelled.popitem(last=False)
                    self._stream.synchronize()  # every copy queued so far has landed
                with peer.lock:
                    _send_frame(peer.sock, _CANCEL_ACK, payload)
        except (OSError, ConnectionError, KVTransferError):
            with self._lock:
                for endpoint, known in list(self._peers.items()):
                    if known is peer:
                        del self._peers[endpoint]
