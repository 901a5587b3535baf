"""Cross-instance KV reuse, the instances' part: the holder's `PushCached` service (on every
prefill and decode instance) and the target's wait for what it was pushed. The lifecycle of
a pull is in engine/kv_pull.py.

Holder, one `PushCached` call:
  1. Check the reservation's KV layout against ours (a mismatch pushes nothing).
  2. Pin the leading asked blocks still held here (engine thread): those in the device
     cache as they are, those only in the host or disk tier loaded into free device blocks
     first (engine/kv_pull.py `pin_prefix`).
  3. Push every layer of them into the target's reserved blocks, after the blocks it
     already holds; wait for the sends (up to the call's timeout).
  4. Unpin, always; count the pull; answer how many blocks went (0 when a send failed:
     the router then has the target compute them).
A pin that outlives the call's wait for the engine thread (a step stuck that long) is undone
by a command queued right behind it, so no block stays pinned.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch

from vllm_cluster.engine.engine_core import EngineCore
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.kv_pull import (
    PinnedPrefix,
    cache_pulled,
    pin_prefix,
    reserved_blocks,
    transferring_request,
    unpin,
)
from vllm_cluster.kv_transfer import KVLayout, KVReceiver, KVSender, KVTransferError, TransferStatus
from vllm_cluster.metrics import InstanceMetrics
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class KVPullServicer(pb_grpc.KVPullServicer):
    def __init__(
        self, loop: EngineLoop, make_sender: Callable[[], KVSender], layout: KVLayout, metrics: InstanceMetrics
    ) -> None:
        """`make_sender` is called on the first pull (a decode instance makes its sender then)."""
        self._loop = loop
        self._make_sender = make_sender
        self._sender: KVSender | None = None
        self._lock = threading.Lock()
        self._layout = layout
        self._metrics = metrics
        self._block_bytes = block_bytes(layout)

    def PushCached(self, msg: pb.PushCachedRequest, context: grpc.ServicerContext) -> pb.PushCachedResponse:
        reservation = msg.reservation
        mismatches = self._layout.mismatches(KVLayout.from_proto(reservation.layout))
        if mismatches:
            self._metrics.observe_pull(0, 0, 0.0, ok=False)
            return pb.PushCachedResponse(error="KV layout mismatch: " + "; ".join(mismatches))
        start = time.monotonic()
        pinned = self._pin(list(msg.block_hashes), msg.timeout_s or 30.0)
        block_ids = pinned.block_ids
        try:
            if pinned.ready is not None:
                pinned.ready.synchronize()  # the tier loads have landed in the device blocks
            error = self._push(msg, block_ids)
        finally:
            self._loop.call(lambda core: unpin(core.kv.pool, block_ids))
        seconds = time.monotonic() - start
        num_pushed = 0 if error else len(block_ids)
        self._metrics.observe_pull(num_pushed, num_pushed * self._block_bytes, seconds, ok=not error)
        if not error and len(block_ids) < len(msg.block_hashes):
            error = f"{len(msg.block_hashes) - len(block_ids)} of the asked blocks are no longer held here"
        return pb.PushCachedResponse(num_blocks_pushed=num_pushed, error=error)

    def _pin(self, block_hashes: list[bytes], timeout_s: float) -> PinnedPrefix:
        """`pin_prefix` on the engine thread; nothing pinned when it does not answer in time
        (whatever it pins later is unpinned by the next command)."""
        result: list[PinnedPrefix] = []

        def pin(core: EngineCore) -> PinnedPrefix:
            result.append(pin_prefix(core.kv, block_hashes))
            return result[0]

        def release(core: EngineCore) -> None:
            if result:
                unpin(core.kv.pool, result[0].block_ids)

        try:
            return self._loop.call(pin, timeout_s)
        except TimeoutError:
            logger.warning("the engine did not pin a pull's blocks within %.1fs; pushing none", timeout_s)
            with contextlib.suppress(TimeoutError):
                self._loop.call(release, timeout_s=0)  # queued behind the pin: runs after it
            return PinnedPrefix()

    def sender(self) -> KVSender:
        with self._lock:
            if self._sender is None:
                self._sender = self._make_sender()
            return self._sender

    def close(self) -> None:
        with self._lock:
            if self._sender is not None:
                self._sender.close()

    def _push(self, msg: pb.PushCachedRequest, block_ids: list[int]) -> str:
        """Send every layer of `block_ids`; "" when all landed, else why not."""
        if not block_ids:
            return ""
        reservation = msg.reservation
        dst = list(reservation.block_ids[msg.num_skip_blocks : msg.num_skip_blocks + len(block_ids)])
        if len(dst) != len(block_ids):
            return f"the reservation has {len(reservation.block_ids)} blocks, too few for this pull"
        transfer_id = reservation.transfer_id
        sender = self.sender()
        timeout_s = msg.timeout_s or 30.0
        try:
            for layer in range(self._layout.num_layers):
                sender.push_layer(reservation.kv_endpoint, transfer_id, layer, block_ids, dst)
        except KVTransferError as e:
            sender.wait(transfer_id, timeout_s)  # what was queued reads the blocks: finish before unpinning
            return str(e)
        status = sender.wait(transfer_id, timeout_s)
        if status == TransferStatus.DONE:
            return ""
        return sender.error(transfer_id) or f"transfer {status.name.lower()}"


def block_bytes(layout: KVLayout) -> int:
    """One block's KV over every layer, in bytes."""
    entries = 1 if layout.layout.startswith("NB,1,") else 2  # an MLA latent entry, or K and V
    item_bytes = torch.empty(0, dtype=getattr(torch, layout.dtype)).element_size()
    return layout.num_layers * entries * layout.block_size * layout.num_kv_heads * layout.head_dim * item_bytes


def wait_pulled(
    loop: EngineLoop, receiver: KVReceiver, request_id: str, num_pulled_blocks: int, timeout_s: float
) -> bool:
    """Target: wait until every layer of the pulled blocks landed, stop the receiver, and
    register them in the prefix cache. False (nothing cached: the request computes those
    tokens) when they did not all land in time. The receiver is stopped either way."""
    def blocks(core: EngineCore) -> tuple[list[int], int] | None:
        request = transferring_request(core, request_id)
        return None if request is None else reserved_blocks(core.kv, request)

    def cache(core: EngineCore) -> bool:
        request = transferring_request(core, request_id)
        if request is not None:
            cache_pulled(core.kv, request, num_pulled_blocks)
        return request is not None

    reserved = loop.call(blocks)
    landed = False
    if reserved is not None:
        block_ids, num_skip_blocks = reserved
        pulled = block_ids[num_skip_blocks : num_skip_blocks + num_pulled_blocks]
        landed = len(pulled) == num_pulled_blocks and receiver.wait_blocks(request_id, pulled, timeout_s)
    receiver.cancel(request_id)  # nothing more may land: the blocks join the cache or get recomputed
    if not landed:
        logger.warning("%s: %d pulled blocks did not land in %.1fs; computing them here",
                       request_id, num_pulled_blocks, timeout_s)
        return False
    return loop.call(cache)
