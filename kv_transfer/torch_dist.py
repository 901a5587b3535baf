"""KV transfer over torch.distributed point-to-point (backend "nccl"): NCCL between CUDA
caches, gloo between CPU caches. No `init_process_group`: one process may serve or feed
several peers, each through its own 2-rank process group.

Lifecycle of a transfer:

1. `TorchDistReceiver` hosts a `TCPStore` server on HOST:PORT (endpoint
   "nccl://HOST:PORT") and a thread that waits for new senders. Decode calls
   `expect(tid, dst_block_ids)`: the transfer is PENDING.
2. The first `push_layer` to an endpoint starts a connection thread in the sender: it
   takes a peer index i (`store.add("num_peers", 1)`), announces it on the store's
   "joins" queue and pushes `Handshake{layout, sender_id}` onto queue "peer{i}/ctl".
   The receiver starts a thread for peer i, answers `HandshakeReply` on "peer{i}/reply"
   and, if it accepted, both sides build the pair group (rank 0 receiver, rank 1 sender)
   over the store. A refused sender fails every transfer to that endpoint with the
   mismatch message; the receiver logs it and keeps serving others.
3. `push_layer` cuts the layer into chunks (chunks.py: a view per run of consecutive ids,
   or one gathered buffer past a few runs) and queues them; on CUDA with an event to wait.
4. Per push the sender pushes one frame onto "peer{i}/ctl": the chunks'
   `KVChunkHeader`s, each prefixed with its length (8 bytes, little-endian). Then it sends
   each chunk's raw bytes through the pair group, in order.
5. The receiver pops the frame and posts one receive per header, into the destination
   view or a gathered chunk's buffer, scattered on arrival (into scratch when the transfer
   is unknown or cancelled). Once every layer of every block landed, it is DONE.
6. `sender.wait(tid)` is DONE once every send of the transfer completed locally.
7. A broken pair (dead peer, timeout) fails the sender's transfers on it (the next push
   reconnects); on the receiver it ends that peer's thread only, and its transfers stay
   PENDING. An empty frame on "peer{i}/ctl" ends a peer: the sender pushes it when it
   closes, the receiver when it closes. (A sender that dies between two chunks cannot be
   noticed through the store: its idle peer thread waits until the receiver closes.)

Why headers travel through the store and not the pair group: a gloo receive cannot be
interrupted (abort is a no-op, a timeout closes the pair), so a receiver blocked waiting
for the next header could never close. A blocking pop on the store is woken by pushing
the empty message. Payloads only follow a popped header, so their receives do end.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import queue
import socket
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from google.protobuf.message import DecodeError

from vllm_cluster.kv_transfer.base import (
    KVLayout,
    KVTransferError,
    TransferStatus,
    check_kv_caches,
    describe_error,
    flat_bytes,
    handshake_message,
    pack_frames,
    parse_endpoint,
    unpack_frame,
)
from vllm_cluster.kv_transfer.chunks import OutgoingChunk, plan_chunks
from vllm_cluster.kv_transfer.torch_dist_io import local_address_towards, pair_group, pop, wait_done
from vllm_cluster.kv_transfer.tracking import ReceiveTable, SendTable
from vllm_cluster.proto import kv_transfer_pb2

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT = datetime.timedelta(seconds=10)
_IDLE_TIMEOUT = datetime.timedelta(days=1)  # a blocking pop; on timeout it just pops again
_JOIN_TIMEOUT_S = 15.0
_MAX_SENDS_IN_FLIGHT = 64  # per connection
_MAX_FRAME_BYTES = 1 << 16  # of one store message of headers
# RuntimeError covers gloo/NCCL errors and torch.distributed.DistError (store errors).
_CONNECTION_ERRORS = (RuntimeError, KVTransferError, DecodeError, OSError, ValueError)


_open_objects: weakref.WeakSet[TorchDistSender | TorchDistReceiver] = weakref.WeakSet()


@atexit.register
def _close_open_objects() -> None:
    # Threads blocked in the store or in gloo at interpreter exit abort the process
    # ("terminate called without an active exception"); stop them first.
    for obj in list(_open_objects):
        obj.close()


class TorchDistReceiver:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        cluster_token: str = "",
    ) -> None:
        check_kv_caches(kv_caches)
        self._table = ReceiveTable(kv_caches, layout, cluster_token)
        self._device = kv_caches[0].device
        self._host = host
        listen_socket = socket.create_server((host, port), backlog=128)
        self._port = listen_socket.getsockname()[1]
        # TCPStore would listen on every interface; hand it a socket bound to host (it owns it).
        self._store = dist.TCPStore(
            host,
            self._port,
            None,
            True,
            _CONNECT_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listen_socket.detach(),
        )
        self.endpoint = f"nccl://{host}:{self._port}"
        self._closed = threading.Event()
        self._peer_threads: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()
        self._watcher = threading.Thread(
            target=self._watch_joins, name="kv-recv-joins", daemon=True
        )
        self._watcher.start()
        _open_objects.add(self)

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
        if self._closed.is_set():
            return
        self._closed.set()
        self._store.queue_push("joins", b"")
        self._watcher.join(_JOIN_TIMEOUT_S)
        with self._lock:
            threads = dict(self._peer_threads)
        for index in threads:
            self._store.queue_push(f"peer{index}/ctl", b"")
        for thread in threads.values():
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("%s: %s did not stop; leaving it behind", self.endpoint, thread.name)
        del self._store  # the last reference: stops the server, so senders fail fast
        _open_objects.discard(self)

    def _client(self, timeout: datetime.timedelta) -> dist.TCPStore:
        return dist.TCPStore(self._host, self._port, None, False, timeout)

    def _watch_joins(self) -> None:
        joins = self._client(_IDLE_TIMEOUT)
        while (message := pop(joins, "joins")) and not self._closed.is_set():
            index = int(message)
            thread = threading.Thread(
                target=self._serve_peer, args=(index,), name=f"kv-recv-peer{index}", daemon=True
            )
            with self._lock:
                self._peer_threads[index] = thread
            thread.start()

    def _serve_peer(self, index: int) -> None:
        try:
            self._serve_chunks(index)
        except _CONNECTION_ERRORS as e:
            logger.info("%s: KV sender peer%d ended: %s", self.endpoint, index, describe_error(e))
        with self._lock:
            self._peer_threads.pop(index, None)

    def _serve_chunks(self, index: int) -> None:
        ctl = dist.PrefixStore(f"peer{index}", self._client(_IDLE_TIMEOUT))
        messages = unpack_frame(pop(ctl, "ctl"))
        if not messages:
            return
        reply = self._table.answer_handshake(kv_transfer_pb2.Handshake.FromString(messages[0]))
        ctl.queue_push("reply", reply.SerializeToString())
        if not reply.accepted:
            return
        group_store = dist.PrefixStore(f"peer{index}/group", self._client(_CONNECT_TIMEOUT))
        group = pair_group(group_store, 0, self._device, self._host)
        while messages := unpack_frame(pop(ctl, "ctl")):
            headers = [kv_transfer_pb2.KVChunkHeader.FromString(m) for m in messages]
            for header in headers:
                self._table.check_header(header)
            self._receive_all(group, headers)

    def _receive_all(self, group: Any, headers: list[kv_transfer_pb2.KVChunkHeader]) -> None:
        """Post the receives of one frame's chunks (straight into their destination views,
        or into scratch), then wait for them in order; raises if the pair broke."""
        posted = []
        for header in headers:
            dst = self._table.begin_chunk(header)
            target = self._table.scratch(header) if dst is None else flat_bytes(dst)
            posted.append((header, dst, target, group.recv([target], 1, 0)))
        error: BaseException | None = None
        for header, dst, target, work in posted:
            landed = False
            if error is None:
                try:
                    wait_done(work, target)
                    landed = True
                except _CONNECTION_ERRORS as e:
                    error = e  # the pair is closed: the later receives write nothing either
            if dst is not None:
                self._table.end_chunk(header, dst, landed)
        if error is not None:
            raise error


class _DistPeer:
    """One sender's connection to one receiver: a thread draining a queue of chunks.

    `failure` is set once the connection is refused or broken; from then on every send
    queued to this peer fails with it. A broken peer (not a refused one) is replaced by a
    new connection on the next push. A None in the queue stops the thread.
    """

    def __init__(
        self, endpoint: str, handshake: bytes, device: torch.device, table: SendTable, host: str = ""
    ) -> None:
        self.endpoint = endpoint
        self.local_host = host  # where this side's gloo socket binds ("": the route's source address)
        self.host, self.port = parse_endpoint(endpoint, "nccl")
        self.handshake = handshake
        self.device = device
        self.table = table
        self.queue: queue.Queue[list[OutgoingChunk] | None] = queue.Queue()  # one push each
        self.failure: str | None = None
        self.broken = False
        self.group: Any = None  # the pair group, once the handshake is accepted
        self.batch: list[OutgoingChunk] = []  # the push whose sends are being started
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{endpoint}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ctl: dist.Store | None = None
        in_flight: deque[tuple[OutgoingChunk, Any]] = deque()  # (chunk, its send's work)
        try:
            ctl = self._connect()
            if self.failure is None:
                self._send_all(ctl, in_flight)
        except _CONNECTION_ERRORS as e:
            self.failure = f"KV connection to {self.endpoint} failed: {describe_error(e)}"
            self.broken = True
            logger.warning("%s", self.failure)
        finally:
            if ctl is not None and not self.broken:
                self._say_goodbye(ctl)
        for chunk in [*self.batch, *(chunk for chunk, _ in in_flight)]:
            self.table.fail(chunk.header.transfer_id, self.failure or "sender closed")
        while self.failure is not None and (late := self.queue.get()) is not None:
            for chunk in late:
                self.table.fail(chunk.header.transfer_id, self.failure)

    def _connect(self) -> dist.Store:
        """Join the receiver and handshake; returns the peer's control store."""
        # Fail fast, and quietly, when nobody listens: TCPStore would retry until its
        # timeout and print C++ stack traces meanwhile.
        socket.create_connection((self.host, self.port), _CONNECT_TIMEOUT.total_seconds()).close()
        client = dist.TCPStore(self.host, self.port, None, False, _CONNECT_TIMEOUT)
        index = client.add("num_peers", 1) - 1
        ctl = dist.PrefixStore(f"peer{index}", client)
        (frame,) = pack_frames([self.handshake], _MAX_FRAME_BYTES)
        ctl.queue_push("ctl", frame)
        client.queue_push("joins", str(index).encode())
        reply = kv_transfer_pb2.HandshakeReply.FromString(bytes(ctl.queue_pop("reply")))
        if not reply.accepted:
            self.failure = reply.error
            return ctl
        address = self.local_host or local_address_towards(self.host, self.port)
        group_store = dist.PrefixStore(f"peer{index}/group", client)
        self.group = pair_group(group_store, 1, self.device, address)
        return ctl

    def _send_all(self, ctl: dist.Store, in_flight: deque[tuple[OutgoingChunk, Any]]) -> None:
        """Send queued pushes until None: per push one frame of headers through the store,
        then each chunk's bytes, keeping sends in flight while the queue has more. A chunk
        leaves `in_flight` once sent."""
        while True:
            if in_flight and self.queue.empty():
                self._retire_oldest(in_flight)
                continue
            chunks = self.queue.get()
            if chunks is None:
                while in_flight:
                    self._retire_oldest(in_flight)
                return
            if not chunks or not self.table.is_live(chunks[0].header.transfer_id):
                continue  # its wait() already gave up on it
            self.batch = chunks
            if chunks[0].ready is not None:
                chunks[0].ready.synchronize()
            headers = [chunk.header.SerializeToString() for chunk in chunks]
            for frame in pack_frames(headers, _MAX_FRAME_BYTES):
                ctl.queue_push("ctl", frame)
            for chunk in chunks:
                if len(in_flight) >= _MAX_SENDS_IN_FLIGHT:
                    self._retire_oldest(in_flight)
                in_flight.append((chunk, self.group.send([flat_bytes(chunk.payload)], 0, 0)))
            self.batch = []

    def _retire_oldest(self, in_flight: deque[tuple[OutgoingChunk, Any]]) -> None:
        chunk, work = in_flight[0]
        wait_done(work, chunk.payload)  # on error it stays in flight, and _run fails it
        in_flight.popleft()
        self.table.done(chunk.header.transfer_id)

    def _say_goodbye(self, ctl: dist.Store) -> None:
        with contextlib.suppress(*_CONNECTION_ERRORS):  # a receiver already gone needs no goodbye
            ctl.queue_push("ctl", b"")


class TorchDistSender:
    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: KVLayout, sender_id: str, cluster_token: str = "",
        host: str = "",
    ) -> None:
        """`host`: this process's KV address, where its gloo sockets bind; "" or a wildcard: the
        address the route to each receiver leaves from (loopback for a receiver on 127.0.0.1)."""
        check_kv_caches(kv_caches)
        self._host = "" if host in ("", "0.0.0.0", "::") else host
        self.kv_caches = list(kv_caches)
        self._table = SendTable()
        self._handshake = handshake_message(layout, sender_id, cluster_token).SerializeToString()
        self._peers: dict[str, _DistPeer] = {}
        self._all_peers: list[_DistPeer] = []
        self._lock = threading.Lock()
        self._closed = False
        _open_objects.add(self)

    def push_layer(
        self,
        endpoint: str,
        transfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> None:
        chunks = plan_chunks(self.kv_caches, transfer_id, layer, src_block_ids, dst_block_ids)
        peer = self._peer(endpoint)
        self._table.add(transfer_id, len(chunks))
        peer.queue.put(chunks)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        return self._table.wait(transfer_id, timeout_s)

    def error(self, transfer_id: str) -> str | None:
        return self._table.error(transfer_id)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for peer in self._all_peers:
            peer.queue.put(None)
        for peer in self._all_peers:
            peer.thread.join(_JOIN_TIMEOUT_S)
        self._table.fail_all("sender closed")
        _open_objects.discard(self)

    def _peer(self, endpoint: str) -> _DistPeer:
        with self._lock:
            if self._closed:
                raise KVTransferError("push_layer on a closed TorchDistSender")
            peer = self._peers.get(endpoint)
            if peer is None or peer.broken:
                peer = _DistPeer(endpoint, self._handshake, self.kv_caches[0].device, self._table, self._host)
                self._peers[endpoint] = peer
                self._all_peers.append(peer)
            return peer
