"""The sending side of the GPU transfer tests, in its own process (CUDA IPC handles cannot
be opened by the process that made them; NCCL wants one rank per process):
`python -m tests.kv_transfer.cuda_ipc_sender ENDPOINT TRANSFER_ID BLOCK_SIZE [DEVICE [DST]]`.
The backend is the endpoint's scheme. Pushes every layer of blocks [0, 1, 2, 5, 6] into
DST (comma-separated, default 7,8,9,3,4) and prints the outcome."""

from __future__ import annotations

import os
import sys

import torch

from tests.kv_transfer.caches import MODEL, random_caches
from vllm_cluster.kv_transfer import make_sender
from vllm_cluster.kv_transfer.base import KVLayout, TransferStatus


def main() -> None:
    endpoint, transfer_id, block_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cuda:0")
    dst = [int(b) for b in sys.argv[5].split(",")] if len(sys.argv) > 5 else [7, 8, 9, 3, 4]
    caches = [c.to(device) for c in random_caches(seed=1, block_size=block_size)]
    sender = make_sender(endpoint, caches, KVLayout.from_kv_caches(caches, MODEL), "gpu-prefill")
    for layer in range(len(caches)):
        sender.push_layer(endpoint, transfer_id, layer, [0, 1, 2, 5, 6], dst)
    status = sender.wait(transfer_id, 30.0)
    print("sent" if status == TransferStatus.DONE else f"failed: {sender.error(transfer_id)}", flush=True)
    torch.cuda.synchronize()
    sender.close()
    os._exit(0)  # skip interpreter teardown: torch's IPC bookkeeping threads may still run


if __name__ == "__main__":
    main()
