"""KV transfer over UCX (the `ucxx` package): host memory over tcp on CPU; on GPUs UCX
picks its CUDA transports and reads/writes the cache tensors in place.

Lifecycle of a transfer:

1. `UcxReceiver` listens on HOST:PORT, TCP (endpoint "ucx://HOST:PORT"); decode calls
   `expect(tid, dst_block_ids)`: the transfer is PENDING.
2. The first `push_layer` to an endpoint opens a TCP link to it; over the link each side
   sends its UCX worker address and the tag the other must send under, and each opens a
   UCX endpoint to the other's worker (ucx_io.connect / accept). The link stays open as
   long as the connection lives. The sender then sends `Handshake{layout, sender_id}`;
   the receiver answers `HandshakeReply`. A refused sender fails every transfer to that
   endpoint with the mismatch message; the receiver logs it and closes that connection
   only.
3. `push_layer` cuts the layer into chunks (chunks.py: a view per run of consecutive ids,
   or one gathered buffer past a few runs) and queues them; on CUDA with an event to wait.
4. The sender sends one frame with the chunks' `KVChunkHeader`s (each prefixed with its
   length, 8 bytes little-endian) under the frame tag, then each chunk's raw bytes, in
   order, under the bytes tag.
5. The receiver keeps frame receives posted ahead. For each header it posts the receive
   of the bytes into the destination view, or a gathered chunk's buffer (scattered on
   arrival), or into scratch when the transfer is unknown or cancelled. Once every layer
   of every expected block has landed, the transfer is DONE.
6. `sender.wait(tid)` is DONE once every send of the transfer completed locally.
7. A connection error fails the sender's transfers on it (the next push reconnects); on
   the receiver it ends that connection's handler only, and its transfers stay PENDING
   (decode's wait times out and it recomputes or retries). The receiver also ends a
   handler a grace period after its sender's TCP link closed (the sender closed or died):
   what the sender sent before may still be landing.

Threads: ucxx has one UCX context and worker per process, and its request notifier wakes
one asyncio loop, so every UcxSender and UcxReceiver of a process shares one event-loop
thread (`ucx_io.UcxLoop`). With a loop per object ucxx falls back to polling each pending
request from its loop, which costs a full core per idle receiver. Each completion still
costs a trip through ucxx's notifier thread, so sends and receives are kept in flight
rather than awaited one by one.

Binding: every socket of the transport is on the process's KV host (`host`, 127.0.0.1
by default): the receiver's TCP link, and UCX's own transports (ucx_io.net_devices). A
sender takes the KV host too: its UCX listens there for the receiver's endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from google.protobuf.message import DecodeError
from ucxx.exceptions import UCXError

from vllm_cluster.kv_transfer.base import (
    KVLayout,
    KVTransferError,
    TransferStatus,
    check_kv_caches,
    describe_error,
    handshake_message,
    pack_frames,
    parse_endpoint,
)
from vllm_cluster.kv_transfer.chunks import OutgoingChunk, plan_chunks
from vllm_cluster.kv_transfer.tracking import ReceiveTable, SendTable
from vllm_cluster.kv_transfer.ucx_io import (
    BYTES_TAG,
    CONNECT_TIMEOUT_S,
    MAX_FRAME_BYTES,
    UcxLoop,
    accept,
    as_buffer,
    connect,
    recv,
    recv_frame,
    send,
    send_frame,
)
from vllm_cluster.proto import kv_transfer_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CLOSE_TIMEOUT_S = 10.0
_MAX_SENDS_IN_FLIGHT = 64  # per connection
_MAX_RECEIVES_IN_FLIGHT = 64  # per connection
_NUM_FRAMES_AHEAD = 2  # per connection
_EVENT_POLL_S = 1e-4
_LINK_CLOSED_GRACE_S = 5.0  # a closed TCP link ends its receive handler after this
_CONNECTION_ERRORS = (UCXError, KVTransferError, DecodeError, asyncio.TimeoutError, OSError, EOFError)


class UcxReceiver:
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
        self._ucx = UcxLoop.get(on_cpu=kv_caches[0].device.type == "cpu", host=host)
        self._handlers: set[asyncio.Task[None]] = set()
        self._closed = False
        self._server = self._ucx.run(self._listen(host, port), CONNECT_TIMEOUT_S)
        self.endpoint = f"ucx://{host}:{self._server.sockets[0].getsockname()[1]}"
        self._ucx.open_objects.add(self)

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
        if self._closed:
            return
        self._closed = True
        self._ucx.run(self._shutdown(), _CLOSE_TIMEOUT_S)
        self._ucx.open_objects.discard(self)

    async def _listen(self, host: str, port: int) -> asyncio.Server:
        sock = socket.create_server((host, port), backlog=128)
        return await asyncio.start_server(self._serve, sock=sock)

    async def _shutdown(self) -> None:
        self._server.close()
        handlers = list(self._handlers)
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One sender's connection: its UCX endpoint, the handshake, then chunks until it ends."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        ep = watch = None
        try:
            if not self._closed:
                ep = await accept(reader, writer)
                watch = asyncio.ensure_future(_cancel_when_closed(reader, task))
                if await self._handshake(ep):
                    await self._serve_chunks(ep)
        except asyncio.CancelledError:
            pass  # the receiver is closing, or the sender's link closed
        except _CONNECTION_ERRORS as e:
            logger.info("KV sender connection to %s ended: %s", self.endpoint, describe_error(e))
        finally:
            self._handlers.discard(task)
            if watch is not None:
                watch.cancel()
            if ep is not None:
                ep.abort()
            writer.close()

    async def _handshake(self, ep: Any) -> bool:
        (message,) = await recv_frame(ep)
        reply = self._table.answer_handshake(kv_transfer_pb2.Handshake.FromString(message))
        (frame,) = pack_frames([reply.SerializeToString()], MAX_FRAME_BYTES)
        await send_frame(ep, frame)
        return reply.accepted

    async def _serve_chunks(self, ep: Any) -> None:
        frames = deque(asyncio.ensure_future(recv_frame(ep)) for _ in range(_NUM_FRAMES_AHEAD))
        receives: set[asyncio.Task[Any]] = set()
        try:
            while True:
                messages = await frames.popleft()
                frames.append(asyncio.ensure_future(recv_frame(ep)))
                for message in messages:
                    header = kv_transfer_pb2.KVChunkHeader.FromString(message)
                    self._table.check_header(header)
                    while len(receives) >= _MAX_RECEIVES_IN_FLIGHT:
                        await asyncio.wait(receives, return_when=asyncio.FIRST_COMPLETED)
                    receives.add(self._receive_bytes(ep, header, receives))
        finally:
            ep.abort()  # first: no posted receive may write after this handler ends
            for task in [*frames, *receives]:
                task.cancel()
            await asyncio.gather(*frames, *receives, return_exceptions=True)

    def _receive_bytes(
        self, ep: Any, header: kv_transfer_pb2.KVChunkHeader, receives: set[asyncio.Task[Any]]
    ) -> asyncio.Task[Any]:
        """Post the receive of a chunk's bytes, straight into its destination view (or into
        scratch); the table learns when it ends, without anyone awaiting it."""
        dst = self._table.begin_chunk(header)
        target = self._table.scratch(header) if dst is None else dst
        task = asyncio.ensure_future(recv(ep, as_buffer(target), BYTES_TAG))

        def finished(task: asyncio.Task[Any]) -> None:
            receives.discard(task)
            landed = not task.cancelled() and task.exception() is None
            if dst is not None:
                if not landed:
                    ep.abort()  # the receive may still be posted: no write after cancel()
                self._table.end_chunk(header, dst, landed)

        task.add_done_callback(finished)
        return task


async def _cancel_when_closed(reader: asyncio.StreamReader, handler: asyncio.Task[None]) -> None:
    """Cancel a receive handler once its sender's TCP link has been closed for a grace period."""
    await reader.read()  # nothing more comes on the link: this returns at its end
    await asyncio.sleep(_LINK_CLOSED_GRACE_S)
    handler.cancel()


class _UcxPeer:
    """One sender's connection to one receiver, fed by a queue (one push_layer's chunks
    per item) that one task drains.

    `failure` is set once the connection is refused or broken; from then on every send
    queued to this peer fails with it. A broken peer (not a refused one) is replaced by a
    new connection on the next push.
    """

    def __init__(self, endpoint: str, handshake: bytes, table: SendTable) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint, "ucx")
        self.handshake = handshake
        self.table = table
        self.queue: asyncio.Queue[list[OutgoingChunk]] = asyncio.Queue()
        self.failure: str | None = None
        self.broken = False
        self.task: asyncio.Task[None] | None = None
        self.link: asyncio.StreamWriter | None = None  # the TCP link, open while the endpoint is

    async def pump(self) -> None:
        # (chunk, its bytes' send) in send order; a frame's send has no chunk
        in_flight: deque[tuple[OutgoingChunk | None, asyncio.Task[Any]]] = deque()
        ep = watch = None
        try:
            ep, reader = await self._connect()
            watch = asyncio.ensure_future(self._watch_link(reader))
            while self.failure is None:
                await self._send_next(ep, in_flight)
        except _CONNECTION_ERRORS as e:
            self._break(describe_error(e))
        finally:
            if watch is not None:
                watch.cancel()
            if ep is not None:
                ep.abort()
            if self.link is not None:
                self.link.close()
            for chunk, send in in_flight:
                send.cancel()
                if chunk is not None:
                    self.table.fail(chunk.header.transfer_id, self.failure or "sender closed")
            await asyncio.gather(*(send for _, send in in_flight), return_exceptions=True)
        assert self.failure is not None  # the loop above ends only on a failure
        while True:  # until the sender closes: pushes that raced with the failure fail too
            for chunk in await self.queue.get():
                self.table.fail(chunk.header.transfer_id, self.failure)

    def _break(self, why: str) -> None:
        if self.failure is None:
            self.failure = f"KV connection to {self.endpoint} failed: {why}"
            self.broken = True
            logger.warning("%s", self.failure)

    async def _watch_link(self, reader: asyncio.StreamReader) -> None:
        """Break the connection once the receiver closes the TCP link (it closed, or died);
        UCX alone may not notice, e.g. between two endpoints of one process."""
        with contextlib.suppress(OSError):
            await reader.read()  # nothing comes on the link: this returns at its end
        self._break("the receiver closed the connection")
        self.queue.put_nowait([])  # wakes the pump

    async def _connect(self) -> tuple[Any, asyncio.StreamReader]:
        """An endpoint whose receiver accepted our handshake, and the link's reading end;
        sets `failure` if refused."""
        ep, reader, self.link = await connect(self.host, self.port)
        try:
            (frame,) = pack_frames([self.handshake], MAX_FRAME_BYTES)
            await send_frame(ep, frame)
            (message,) = await asyncio.wait_for(recv_frame(ep), CONNECT_TIMEOUT_S)
        except BaseException:
            ep.abort()
            raise
        reply = kv_transfer_pb2.HandshakeReply.FromString(message)
        if not reply.accepted:
            self.failure = reply.error
        return ep, reader

    async def _send_next(
        self, ep: Any, in_flight: deque[tuple[OutgoingChunk | None, asyncio.Task[Any]]]
    ) -> None:
        """Start the sends of the next queued push, or retire the oldest send in flight."""
        if in_flight and (self.queue.empty() or len(in_flight) >= _MAX_SENDS_IN_FLIGHT):
            chunk, oldest = in_flight[0]
            await oldest  # on error it stays in flight, and pump() fails it
            in_flight.popleft()
            if chunk is not None:
                self.table.done(chunk.header.transfer_id)
            return
        chunks = await self.queue.get()
        if not chunks or not self.table.is_live(chunks[0].header.transfer_id):
            return  # its wait() already gave up on it
        if chunks[0].ready is not None:
            while not chunks[0].ready.query():
                await asyncio.sleep(_EVENT_POLL_S)
        # Tasks start in creation order, so the sends are posted in this order.
        headers = [chunk.header.SerializeToString() for chunk in chunks]
        for frame in pack_frames(headers, MAX_FRAME_BYTES):
            in_flight.append((None, asyncio.ensure_future(send_frame(ep, frame))))
        for chunk in chunks:
            sending = asyncio.ensure_future(send(ep, as_buffer(chunk.payload), BYTES_TAG))
            in_flight.append((chunk, sending))


class UcxSender:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        sender_id: str,
        cluster_token: str = "",
        host: str = "127.0.0.1",
    ) -> None:
        check_kv_caches(kv_caches)
        self.kv_caches = list(kv_caches)
        self._table = SendTable()
        self._handshake = handshake_message(layout, sender_id, cluster_token).SerializeToString()
        self._ucx = UcxLoop.get(on_cpu=kv_caches[0].device.type == "cpu", host=host)
        self._peers: dict[str, _UcxPeer] = {}
        self._all_peers: list[_UcxPeer] = []
        self._lock = threading.Lock()
        self._closed = False
        self._ucx.open_objects.add(self)

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
        self._ucx.loop.call_soon_threadsafe(peer.queue.put_nowait, chunks)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        return self._table.wait(transfer_id, timeout_s)

    def error(self, transfer_id: str) -> str | None:
        return self._table.error(transfer_id)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._ucx.run(self._shutdown(), _CLOSE_TIMEOUT_S)
        self._table.fail_all("sender closed")
        self._ucx.open_objects.discard(self)

    def _peer(self, endpoint: str) -> _UcxPeer:
        with self._lock:
            if self._closed:
                raise KVTransferError("push_layer on a closed UcxSender")
            peer = self._peers.get(endpoint)
            if peer is None or peer.broken:
                peer = _UcxPeer(endpoint, self._handshake, self._table)
                self._ucx.run(self._start(peer), CONNECT_TIMEOUT_S)
                self._peers[endpoint] = peer
                self._all_peers.append(peer)
            return peer

    @staticmethod
    async def _start(peer: _UcxPeer) -> None:
        peer.task = asyncio.create_task(peer.pump())

    async def _shutdown(self) -> None:
        tasks = [peer.task for peer in self._all_peers if peer.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
