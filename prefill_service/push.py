"""The KVPush a prefill request carries: one transfer into one decode reservation."""

from __future__ import annotations

import logging
import time

from vllm_cluster.kv_transfer import KVSender, KVTransferError, TransferStatus

logger = logging.getLogger(__name__)


class ReservationPush:
    """Maps this engine's prompt blocks onto the decode's reserved blocks and sends them
    layer by layer through `sender`; `finish` waits for every send and records the outcome.

    A layer that cannot be queued (a reservation shorter than the prompt, a sender that
    raises) fails this push only: its later layers are not sent, the layers already queued
    are still waited for (their source blocks stay untouched until they land), and the
    outcome is FAILED with the reason. The other requests of the engine step go on."""

    def __init__(
        self,
        sender: KVSender,
        endpoint: str,
        transfer_id: str,
        dst_block_ids: list[int],
        num_skip_blocks: int,
        timeout_s: float,
    ) -> None:
        self.num_skip_blocks = num_skip_blocks
        self._sender = sender
        self._endpoint = endpoint
        self._transfer_id = transfer_id
        self._dst_block_ids = dst_block_ids
        self._timeout_s = timeout_s
        self.num_blocks_sent = 0  # per layer
        self.status: TransferStatus | None = None  # None: nothing to send
        self.error: str | None = None
        self.transfer_s = 0.0

    def push_layer(self, layer: int, src_block_ids: list[int]) -> None:
        if not src_block_ids or self.error is not None:
            return
        start = self.num_skip_blocks
        dst = self._dst_block_ids[start : start + len(src_block_ids)]
        try:
            if len(dst) != len(src_block_ids):
                raise KVTransferError(
                    f"the decode reservation holds {len(self._dst_block_ids)} blocks, {start} of them already "
                    f"cached; the prompt needs {len(src_block_ids)} more"
                )
            self._sender.push_layer(self._endpoint, self._transfer_id, layer, src_block_ids, dst)
        except Exception as e:  # this request's push only: never the engine step
            if not isinstance(e, KVTransferError):
                logger.exception("transfer %s: the KV sender raised at layer %d", self._transfer_id, layer)
            self.error = f"layer {layer} was not sent: {e}"
            return
        self.num_blocks_sent = len(src_block_ids)  # nonzero: `finish` waits for the layers queued

    def finish(self) -> None:
        if self.num_blocks_sent == 0 and self.error is None:
            return
        start = time.monotonic()
        if self.num_blocks_sent:
            self.status = self._sender.wait(self._transfer_id, self._timeout_s)
            if self.status != TransferStatus.DONE and self.error is None:
                self.error = self._sender.error(self._transfer_id) or f"transfer {self.status.name.lower()}"
        if self.error is not None:
            self.status = TransferStatus.FAILED
        self.transfer_s = time.monotonic() - start
