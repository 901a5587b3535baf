"""Decode steps replayed from CUDA graphs, so a step costs one launch, not hundreds.

At start, one graph is captured per batch size in `capture_sizes` (padded up to the
next size at run time), all sharing one memory pool and one set of static input
buffers. Padding rows have seq_len 0 and slot -1: attention writes and reads nothing
for them. The graphs cover the model forward and the logits; sampling runs after.

A step's inputs go up in two copies (ids/positions/slots/seq_lens, block tables) from one
of two pinned staging buffers, used in turn: with async scheduling the host fills step
N+1's while step N's copy may still be queued. Placeholder tokens (async scheduling) are
filled on the device from the previous step's sampled ids before the replay.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from vllm_cluster.engine.device_tokens import PlaceholderFill
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.kernels.attention.metadata import AttentionMetadata

_NUM_ROWS = 6


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        max_model_len: int,
    ) -> None:
        device = kv_caches[0].device
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks_per_seq
        # Rows: input ids, positions, slots, seq lens, placeholder dst, placeholder src.
        self._inputs = torch.zeros(_NUM_ROWS, max_batch, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._inputs[0], self._inputs[1], self._inputs[2]
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # Two pinned staging sets, used in turn (see the module docstring).
        self._host_ids = [torch.zeros(_NUM_ROWS, max_batch, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._host_tables = [
            torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, pin_memory=True) for _ in range(2)
        ]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._capture(size, pool)

    def _forward(self, size: int) -> torch.Tensor:
        self.seq_lens[:size].copy_(self._inputs[3, :size])  # int64 staging -> the kernels' int32
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, size: int, pool: Any) -> None:
        for _ in range(2):  # compile the Triton kernels and settle the allocator outside capture
            self._forward(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits[size] = self._forward(size)
        self.graphs[size] = graph

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
        fill: PlaceholderFill | None = None,
    ) -> torch.Tensor:
        """One decode step for len(token_ids) sequences; returns their logits [n, V]."""
        n = len(token_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._turn ^= 1
        host_ids, host_tables = self._host_ids[self._turn], self._host_tables[self._turn]
        host = host_ids.numpy()  # [_NUM_ROWS, max_batch]
        host[:, n:size] = 0
        host[2, n:size] = -1
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = token_ids, positions, slots, seq_lens
        rows = host_tables.numpy()
        for i, table in enumerate(tables):
            rows[i, : len(table)] = table
        if fill is not None and not fill.is_prefix:
            k = len(fill.dst)
            host[4, :k], host[5, :k] = fill.dst, fill.src
        self._inputs.copy_(host_ids, non_blocking=True)
        self.block_tables[:n].copy_(host_tables[:n], non_blocking=True)
        if fill is not None:
            self._fill(fill)
        self.graphs[size].replay()
        return self.logits[size][:n]

    def _fill(self, fill: PlaceholderFill) -> None:
        k = len(fill.dst)
        if fill.is_prefix:
            self.input_ids[:k].copy_(fill.prev.token_ids[:k])
        else:
            taken = fill.prev.token_ids.index_select(0, self._inputs[5, :k])
            self.input_ids.index_copy_(0, self._inputs[4, :k], taken)
