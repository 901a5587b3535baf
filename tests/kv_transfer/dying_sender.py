"""A prefill that dies mid-transfer: run as `python -m tests.kv_transfer.dying_sender
BACKEND ENDPOINT TRANSFER_ID`. It pushes layer 0 of blocks 0-3 into blocks 2-5, waits
until those sends completed, says "sent" and exits without closing anything."""

from __future__ import annotations

import os
import sys

from tests.kv_transfer.caches import MODEL, random_caches
from vllm_cluster.kv_transfer import KVLayout, TransferStatus, make_sender


def main() -> None:
    backend, endpoint, transfer_id = sys.argv[1:4]
    caches = random_caches(seed=1)
    sender = make_sender(backend, caches, KVLayout.from_kv_caches(caches, MODEL), "doomed-prefill")
    sender.push_layer(endpoint, transfer_id, 0, [0, 1, 2, 3], [2, 3, 4, 5])
    status = sender.wait(transfer_id, 30.0)
    print("sent" if status == TransferStatus.DONE else f"failed: {sender.error(transfer_id)}")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
