"""Transfer bookkeeping shared by every backend, free of I/O.

`ReceiveTable` (decode side) knows which transfers are expected, where their chunks may
land and what has landed:

1. `expect(tid, block_ids)` registers the transfer as PENDING.
2. For each incoming chunk the backend calls `begin_chunk(header)`: it returns where to
   receive the bytes (the chunk is then in flight): the destination view, or for a gathered
   chunk (`chunks.py`) a buffer of its blocks; or None when the bytes must go to scratch
   and be dropped (unknown, cancelled or finished transfer).
3. `end_chunk(header, received, landed)` ends the flight (a gathered chunk's blocks are
   scattered into place first); once every (layer, block) landed the transfer is DONE.
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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_cluster.kv_transfer.base import (
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    TransferStatus,
    check_block_ids,
)
from vllm_cluster.kv_transfer.chunks import chunk_crc32
from vllm_cluster.proto import kv_transfer_pb2

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Incoming:
    block_ids: np.ndarray  # sorted destination block ids, each once
    landed: np.ndarray  # [num_layers, len(block_ids)] bool
    num_missing: int  # False entries of landed
    status: TransferStatus = TransferStatus.PENDING
    num_inflight: int = 0


def _columns(incoming: _Incoming, header: kv_transfer_pb2.KVChunkHeader) -> slice | np.ndarray | None:
    """The columns of a chunk's blocks in `incoming.landed`; None unless all are expected."""
    if header.dst_block_ids:  # a gathered chunk: any ids, each once
        ids = np.asarray(header.dst_block_ids, dtype=np.int64)
        columns = np.searchsorted(incoming.block_ids, ids)
        known = columns < len(incoming.block_ids)
        if not known.all() or (incoming.block_ids[columns] != ids).any() or len(np.unique(ids)) != len(ids):
            return None
        return columns
    # block_ids is sorted and unique, so [start, end) is expected iff it holds end - start ids.
    start, end = header.dst_block_start, header.dst_block_start + header.num_blocks
    lo, hi = np.searchsorted(incoming.block_ids, [start, end])
    return slice(int(lo), int(hi)) if hi - lo == end - start else None


def _describe(header: kv_transfer_pb2.KVChunkHeader) -> str:
    if header.dst_block_ids:
        return str(list(header.dst_block_ids))
    return f"[{header.dst_block_start}, {header.dst_block_start + header.num_blocks})"


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
        if header.dst_block_ids and len(header.dst_block_ids) != header.num_blocks:
            raise KVTransferError(
                f"chunk header for {header.transfer_id!r} lists {len(header.dst_block_ids)} destination "
                f"blocks for {header.num_blocks} blocks"
            )
        if header.num_bytes != header.num_blocks * self.block_bytes:
            raise KVTransferError(
                f"chunk header for {header.transfer_id!r} announces {header.num_bytes} bytes for "
                f"{header.num_blocks} blocks of {self.block_bytes} bytes"
            )

    def begin_chunk(self, header: kv_transfer_pb2.KVChunkHeader) -> torch.Tensor | None:
        """Where to receive this (checked) chunk: its destination view, a buffer for a gathered
        chunk's blocks, or None to receive it into scratch."""
        with self._cond:
            incoming = self._incoming.get(header.transfer_id)
            if incoming is None or incoming.status != TransferStatus.PENDING:
                return None
            if _columns(incoming, header) is None:
                logger.warning("transfer %r: chunk for blocks %s of layer %d, which it does not expect; "
                               "failing the transfer", header.transfer_id, _describe(header), header.layer)
                self._finish(header.transfer_id, TransferStatus.FAILED)
                return None
            incoming.num_inflight += 1
        cache = self.kv_caches[header.layer]  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        if header.dst_block_ids:
            return cache.new_empty((header.num_blocks, *cache.shape[1:]))
        return cache.narrow(0, header.dst_block_start, header.num_blocks)  # contiguous

    def end_chunk(self, header: kv_transfer_pb2.KVChunkHeader, received: torch.Tensor, landed: bool) -> None:
        """End the flight begun by `begin_chunk`, which returned `received`. A gathered chunk
        that landed intact is scattered into its blocks here, before they count as landed."""
        corrupt = landed and header.HasField("crc32") and chunk_crc32(received) != header.crc32
        if landed and not corrupt and header.dst_block_ids:
            with self._cond:  # a transfer that failed or is being cancelled gets no more writes
                landed = self._status(header.transfer_id) == TransferStatus.PENDING
            if landed:
                ids = torch.tensor(header.dst_block_ids, dtype=torch.long).to(received.device)
                self.kv_caches[header.layer].view(torch.uint8).index_copy_(0, ids, received.view(torch.uint8))
                if received.is_cuda:  # landed means readable from any stream
                    torch.cuda.current_stream(received.device).synchronize()
        with self._cond:
            incoming = self._incoming.get(header.transfer_id)
            if incoming is None:  # evicted as one of the oldest finished transfers
                return
            incoming.num_inflight -= 1
            if corrupt and incoming.status == TransferStatus.PENDING:
                logger.error("transfer %r: layer %d blocks %s landed corrupted (CRC-32 mismatch); "
                             "failing the transfer", header.transfer_id, header.layer, _describe(header))
                self._finish(header.transfer_id, TransferStatus.FAILED)
            elif landed and incoming.status == TransferStatus.PENDING:
                columns = _columns(incoming, header)
                assert columns is not None, "begin_chunk checked the blocks"
                row = incoming.landed[header.layer]
                incoming.num_missing -= int(np.count_nonzero(~row[columns]))
                row[columns] = True
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
