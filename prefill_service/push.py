"""The KVPush a prefill request carries: one transfer into one decode reservation."""

from __future__ import annotations

import time

from vllm_cluster.kv_transfer import KVSender, TransferStatus


class ReservationPush:
    """Maps this engine's prompt blocks onto the decode's reserved blocks and sends them
    layer by layer through `sender`; `finish` waits for every send and records the outcome."""

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
        if not src_block_ids:
            return
        start = self.num_skip_blocks
        dst = self._dst_block_ids[start : start + len(src_block_ids)]
        assert len(dst) == len(src_block_ids), "the reservation has fewer blocks than the prompt"
        self._sender.push_layer(self._endpoint, self._transfer_id, layer, src_block_ids, dst)
        self.num_blocks_sent = len(src_block_ids)

    def finish(self) -> None:
        if self.num_blocks_sent == 0:
            return
        start = time.monotonic()
        self.status = self._sender.wait(self._transfer_id, self._timeout_s)
        if self.status != TransferStatus.DONE:
            self.error = self._sender.error(self._transfer_id) or f"transfer {self.status.name.lower()}"
        self.transfer_s = time.monotonic() - start
