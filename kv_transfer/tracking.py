"""Transfer bookkeeping shared by every backend, free of I/O.

`ReceiveTable` (decode side) knows which transfers are expected, where their chunks may
land and what has landed:

1. `expect(tid, block_ids)` registers the transfer as PENDING.
2. For each incoming chunk the backend calls `begin_chunk(header)`: it returns the
   destination view to receive into (the chunk is then in flight), or None when the bytes
   must go to scratch and be dropped (unknown, cancelled or finished transfer).
3. `end_chunk(header, landed)` ends the flight; once every (layer, block) landed the
   transfer is DONE.
   `wait_blocks(tid, block_ids)` waits for a part of it (a pull fills leading blocks only).
4. `cancel(tid)` marks it CANCELLED, so no new chunk begins, waits for the chunks in
   flight, then forgets it. Finished transfers are kept (for `status`) until cancelled or
   until `max_num_finished` newer ones finished.

`SendTable` (prefill side) counts the sends each transfer still owes: `add` when queued,
`done` when a send completed locally, `fail` with a reason; `wait` returns DONE or FAILED
and forgets the transfer, keeping the reasons of the last failures for `error`.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_cluster.kv_transfer import faults
from vllm_cluster.kv_transfer.base import (
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    TransferStatus,
    check_block_ids,
    push_segments,
)
from vllm_cluster.proto import kv_transfer_pb2

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Incoming:
    block_ids: np.ndarray  # sorted destination block ids, each once
    landed: np.ndarray  # [num_layers, len(block_ids)] bool
    num_missing: int  # False entries of landed
    status: TransferStatus = TransferStatus.PENDING
    num_inflight: int = 0


def _columns(incoming: _Incoming, start: int, end: int) -> slice | None:
    """The columns of blocks [start, end) in `incoming.landed`; None unless all are expected."""
    # block_ids is sorted and unique, so [start, end) is expected iff it holds end - start ids.
    lo, hi = np.searchsorted(incoming.block_ids, [start, end])
    return slice(int(lo), int(hi)) if hi - lo == end - start else None


class ReceiveTable:
    """Thread-safe: backends call it from their receive threads, the engine from its own."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        cluster_token: str = "",
        max_num_finished: int = 4096,
    ) -> None:
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.num_blocks = self.kv_caches[0].shape[0]
        self.block_bytes = self.kv_caches[0][0].numel() * self.kv_caches[0].element_size()
        self.max_num_finished = max_num_finished
        self._token = cluster_token  # empty: a process outside a cluster (tests)
        self._incoming: dict[str, _Incoming] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()

    def expect(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        check_block_ids(block_ids, self.num_blocks, "destination")
        sorted_ids = np.unique(np.asarray(block_ids, dtype=np.int64))
        if len(sorted_ids) != len(block_ids):
            raise KVTransferError(
                f"transfer {transfer_id!r} expects a block id twice: {list(block_ids)}"
            )
        landed = np.zeros((self.layout.num_layers, len(sorted_ids)), dtype=bool)
        with self._cond:
            if transfer_id in self._incoming:
                raise KVTransferError(
                    f"transfer {transfer_id!r} is already expected; cancel it before reusing its id"
                )
            self._incoming[transfer_id] = _Incoming(sorted_ids, landed, landed.size)
            if landed.size == 0:
                self._finish(transfer_id, TransferStatus.DONE)

    def status(self, transfer_id: str) -> TransferStatus:
        with self._cond:
            return self._status(transfer_id)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        with self._cond:
            self._cond.wait_for(
                lambda: self._status(transfer_id) != TransferStatus.PENDING, timeout_s
            )
            return self._status(transfer_id)

    def wait_blocks(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float) -> bool:
        """True once every layer of `block_ids` (all expected by the transfer) has landed."""
        wanted = np.asarray(block_ids, dtype=np.int64)

        def landed() -> bool | None:  # None: not yet
            incoming = self._incoming.get(transfer_id)
            if incoming is None or incoming.status in (TransferStatus.FAILED, TransferStatus.CANCELLED):
                return False
            columns = np.searchsorted(incoming.block_ids, wanted)
            expected = columns < len(incoming.block_ids)
            if not expected.all() or (incoming.block_ids[columns] != wanted).any():
                return False
            return True if bool(incoming.landed[:, columns].all()) else None

        with self._cond:
            self._cond.wait_for(lambda: landed() is not None, timeout_s)
            return landed() is True

    def cancel(self, transfer_id: str) -> None:
        with self._cond:
            incoming = self._incoming.get(transfer_id)
            if incoming is None:
                return
            incoming.status = TransferStatus.CANCELLED
            self._cond.wait_for(lambda: incoming.num_inflight == 0)
            if self._incoming.get(transfer_id) is incoming:
                del self._incoming[transfer_id]
                self._finished.pop(transfer_id, None)
            self._cond.notify_all()

    def answer_handshake(
        self, handshake: kv_transfer_pb2.Handshake
    ) -> kv_transfer_pb2.HandshakeReply:
        """Accept a sender of our cluster (its token) whose layout equals ours; otherwise log
        why and refuse it."""
        if self._token and not hmac.compare_digest(handshake.cluster_token.encode(), self._token.encode()):
            logger.error("refusing KV sender %r: missing or wrong cluster token", handshake.sender_id)
            return kv_transfer_pb2.HandshakeReply(accepted=False, error="missing or wrong cluster token")
        problems = KVLayout.from_proto(handshake.layout).mismatches(self.layout)
        if not problems:
            return kv_transfer_pb2.HandshakeReply(accepted=True)
        error = str(KVLayoutMismatch(problems))
        logger.error("refusing KV sender %r: %s", handshake.sender_id, error)
        return kv_transfer_pb2.HandshakeReply(accepted=False, error=error)

    def check_header(self, header: kv_transfer_pb2.KVChunkHeader) -> None:
        """Raise KVTransferError if the header breaks the wire contract (the stream is then
        not to be trusted: the backend drops the connection)."""
        if not 0 <= header.layer < self.layout.num_layers or header.num_blocks < 1:
            raise KVTransferError(
                f"chunk header for {header.transfer_id!r} has layer {header.layer} and "
                f"{header.num_blocks} blocks; this cache has {self.layout.num_layers} layers"
            )
        if header.num_bytes != header.num_blocks * self.block_bytes:
            raise KVTransferError(
                f"chunk header for {header.transfer_id!r} announces {header.num_bytes} bytes for "
                f"{header.num_blocks} blocks of {self.block_bytes} bytes"
            )

    def begin_chunk(self, header: kv_transfer_pb2.KVChunkHeader) -> torch.Tensor | None:
        """The view to receive this (checked) chunk into, or None to receive it into scratch."""
        start, end = header.dst_block_start, header.dst_block_start + header.num_blocks
        with self._cond:
            incoming = self._incoming.get(header.transfer_id)
            if incoming is None or incoming.status != TransferStatus.PENDING:
                return None
            if _columns(incoming, start, end) is None:
                logger.warning(
                    "transfer %r: chunk for blocks [%d, %d) of layer %d, which it does not "
                    "expect; failing the transfer",
                    header.transfer_id,
                    start,
                    end,
                    header.layer,
                )
                self._finish(header.transfer_id, TransferStatus.FAILED)
                return None
            incoming.num_inflight += 1
        # view: [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous
        return self.kv_caches[header.layer].narrow(0, start, end - start)

    def end_chunk(self, header: kv_transfer_pb2.KVChunkHeader, landed: bool) -> None:
        """End the flight begun by `begin_chunk` (which returned a view)."""
        start, end = header.dst_block_start, header.dst_block_start + header.num_blocks
        corrupt = (
            landed
            and header.HasField("crc32")
            and chunk_crc32(self.kv_caches[header.layer][start:end]) != header.crc32
        )
        with self._cond:
            incoming = self._incoming.get(header.transfer_id)
            if incoming is None:  # evicted as one of the oldest finished transfers
                return
            incoming.num_inflight -= 1
            if corrupt and incoming.status == TransferStatus.PENDING:
                logger.error("transfer %r: layer %d blocks [%d, %d) landed corrupted (CRC-32 mismatch); "
                             "failing the transfer", header.transfer_id, header.layer, start, end)
                self._finish(header.transfer_id, TransferStatus.FAILED)
            elif landed and incoming.status == TransferStatus.PENDING:
                columns = _columns(incoming, start, end)
                assert columns is not None, "begin_chunk checked the blocks"
                row = incoming.landed[header.layer, columns]
                incoming.num_missing -= int(row.size - row.sum())
                row[:] = True
                if incoming.num_missing == 0:
                    self._finish(header.transfer_id, TransferStatus.DONE)
            self._cond.notify_all()

    def scratch(self, header: kv_transfer_pb2.KVChunkHeader) -> torch.Tensor:
        """Somewhere to receive a dropped chunk's (checked) bytes."""
        return torch.empty(header.num_bytes, dtype=torch.uint8, device=self.kv_caches[0].device)

    def _status(self, transfer_id: str) -> TransferStatus:
        incoming = self._incoming.get(transfer_id)
        return TransferStatus.CANCELLED if incoming is None else incoming.status

    def _finish(self, transfer_id: str, status: TransferStatus) -> None:
        """Called with the lock held: the only place a receive reaches DONE or FAILED."""
        self._incoming[transfer_id].status = status
        self._finished[transfer_id] = None
        while len(self._finished) > self.max_num_finished:
            oldest, _ = self._finished.popitem(last=False)
            del self._incoming[oldest]
        self._cond.notify_all()


@dataclass(slots=True)
class _Outgoing:
    num_pending: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SendTable:
    """Thread-safe: `push_layer` callers add, backend threads complete or fail."""

    def __init__(self, max_num_errors: int = 1024) -> None:
        self.max_num_errors = max_num_errors
        self._outgoing: dict[str, _Outgoing] = {}
        self._errors: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, transfer_id: str, num_sends: int) -> None:
        with self._lock:
            outgoing = self._outgoing.setdefault(transfer_id, _Outgoing())
            outgoing.num_pending += num_sends
            if outgoing.error is None and outgoing.num_pending == 0:
                outgoing.done.set()
            elif outgoing.error is None:
                outgoing.done.clear()

    def is_live(self, transfer_id: str) -> bool:
        """Whether sends for it are still wanted (known and not failed)."""
        with self._lock:
            outgoing = self._outgoing.get(transfer_id)
            return outgoing is not None and outgoing.error is None

    def done(self, transfer_id: str) -> None:
        with self._lock:
            outgoing = self._outgoing.get(transfer_id)
            if outgoing is None:
                return
            outgoing.num_pending -= 1
            if outgoing.num_pending == 0:
                outgoing.done.set()

    def fail(self, transfer_id: str, reason: str) -> None:
        """The first reason given is the one kept."""
        with self._lock:
            outgoing = self._outgoing.get(transfer_id)
            if outgoing is None or outgoing.error is not None:
                return
            outgoing.error = reason
            outgoing.done.set()

    def fail_all(self, reason: str) -> None:
        with self._lock:
            transfer_ids = list(self._outgoing)
        for transfer_id in transfer_ids:
            self.fail(transfer_id, reason)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        with self._lock:
            outgoing = self._outgoing.get(transfer_id)
            if outgoing is None:
                failed = transfer_id in self._errors
                return TransferStatus.FAILED if failed else TransferStatus.DONE
        deadline = time.monotonic() + timeout_s
        if not outgoing.done.wait(max(0.0, deadline - time.monotonic())):
            self.fail(
                transfer_id,
                f"timed out after {timeout_s:g} s with {outgoing.num_pending} sends of "
                f"{transfer_id!r} not completed",
            )
        with self._lock:
            self._outgoing.pop(transfer_id, None)
            if outgoing.error is None:
                return TransferStatus.DONE
            self._errors[transfer_id] = outgoing.error
            while len(self._errors) > self.max_num_errors:
                self._errors.popitem(last=False)
            return TransferStatus.FAILED

    def error(self, transfer_id: str) -> str | None:
        with self._lock:
            outgoing = self._outgoing.get(transfer_id)
            if outgoing is not None and outgoing.error is not None:
                return outgoing.error
            return self._errors.get(transfer_id)


@dataclass(frozen=True, slots=True)
class OutgoingChunk:
    """One segment of a push, ready to go: its header and a view of its bytes."""

    header: kv_transfer_pb2.KVChunkHeader
    payload: torch.Tensor  # kv_caches[layer][start:start + num_blocks], contiguous
    ready: torch.cuda.Event | None  # on CUDA: the send waits for the layer's compute


def layer_ready(kv_caches: Sequence[torch.Tensor], layer: int, src_block_ids: Sequence[int]) -> torch.cuda.Event | None:
    """Check a pushed layer and its source ids (KVTransferError); on CUDA, an event recorded
    on the compute stream now, when the layer's compute has been queued (None on CPU: the
    layer is ready when it is pushed)."""
    if not 0 <= layer < len(kv_caches):
        raise KVTransferError(f"layer {layer} is outside the cache's {len(kv_caches)} layers")
    check_block_ids(src_block_ids, kv_caches[layer].shape[0], "source")
    if not kv_caches[layer].is_cuda:
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(kv_caches[layer].device))
    return ready


def plan_chunks(
    kv_caches: Sequence[torch.Tensor],
    transfer_id: str,
    layer: int,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
) -> list[OutgoingChunk]:
    """Check a push_layer call and cut it into chunks; raises KVTransferError on bad arguments.
    The chunks' `ready` is `layer_ready`'s event."""
    segments = push_segments(transfer_id, src_block_ids, dst_block_ids)
    ready = layer_ready(kv_caches, layer, src_block_ids)
    block_bytes = kv_caches[layer].stride(0) * kv_caches[layer].element_size()  # contiguous: check_kv_caches
    chunks = []
    injected = faults.active()
    if injected is not None:
        faults.delay(injected[0])
    for segment in segments:
        start = segment.src_block_start
        payload = kv_caches[layer].narrow(0, start, segment.num_blocks)  # a view; narrow is cheaper than a slice
        header = kv_transfer_pb2.KVChunkHeader(
            transfer_id=transfer_id,
            layer=layer,
            dst_block_start=segment.dst_block_start,
            num_blocks=segment.num_blocks,
            num_bytes=segment.num_blocks * block_bytes,
        )
        if not payload.is_cuda:
            header.crc32 = chunk_crc32(payload)
        if injected is not None:
            spec, rng = injected
            if rng.random() < spec.drop:
                faults.INJECTED["drop"] += 1
                continue
            if rng.random() < spec.corrupt:
                faults.INJECTED["corrupt"] += 1
                payload = faults.corrupted(payload, rng)
        chunks.append(OutgoingChunk(header, payload, ready))
    return chunks


def chunk_crc32(blocks: torch.Tensor) -> int:
    """CRC-32 of a run of blocks in host memory (contiguous: a slice of one layer's cache)."""
    return zlib.crc32(blocks.contiguous().view(-1).view(torch.uint8).numpy().data)
