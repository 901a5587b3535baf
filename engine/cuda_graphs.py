"""Decode steps replayed from CUDA graphs, so a step costs one launch, not hundreds.

At start, one graph is captured per batch size in `capture_sizes` (padded up to the
next size at run time), all sharing one memory pool and one set of static input
buffers. Padding rows have seq_len 0 and slot -1: attention writes and reads nothing
for them. The graphs cover the model forward and the logits; sampling runs after.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from engine.models import CausalLM
from kernels import AttentionMetadata


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
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # Host staging for one step's inputs: filled in place, copied with one transfer each.
        self._host_ids = torch.zeros(4, max_batch, dtype=torch.long, pin_memory=True)
        self._host_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, pin_memory=True)
        self._host_tables_np = self._host_tables.numpy()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._capture(size, pool)

    def _forward(self, size: int) -> torch.Tensor:
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
    ) -> torch.Tensor:
        """One decode step for len(token_ids) sequences; returns their logits [n, V]."""
        n = len(token_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        host = self._host_ids
        host[:, :size].zero_()
        host[0, :n] = torch.tensor(token_ids)
        host[1, :n] = torch.tensor(positions)
        host[2, :size] = -1
        host[2, :n] = torch.tensor(slots)
        host[3, :n] = torch.tensor(seq_lens)
        rows = self._host_tables_np
        for i, table in enumerate(tables):
            rows[i, : len(table)] = table
        self.input_ids[:size].copy_(host[0, :size], non_blocking=True)
        self.positions[:size].copy_(host[1, :size], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2, :size], non_blocking=True)
        self.seq_lens[:size].copy_(host[3, :size], non_blocking=True)
        self.block_tables[:n].copy_(self._host_tables[:n], non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:n]
