"""One rank's part of every step, the same code on the driver and on the workers.

Per step: update the block tables, cut the batch into micro-batches (one per pipeline
stage), and for each one in order: build its inputs, take the hidden states from the
previous stage (or embed the tokens on the first), run this stage's layers, then send
them on (without waiting: the next micro-batch starts at once) or, on the last stage,
compute the logits of its sampling requests. The driver (tensor rank 0 of the last
stage) gets the full logits; the other ranks return None.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_cluster.engine.model_runner import ModelRunner
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.parallel.context import ParallelContext
from vllm_cluster.engine.parallel.kv_mirror import KVMirror
from vllm_cluster.engine.parallel.pipeline import run_stage, split_micro_batches
from vllm_cluster.engine.parallel.topology import kv_heads_of
from vllm_cluster.engine.scheduler_output import ScheduledRequest, SchedulerOutput


class StageRunner:
    def __init__(
        self,
        model: CausalLM,
        ctx: ParallelContext,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
    ) -> None:
        """`dtype`: the model's (hidden states between stages, logits); `kv_cache_dtype`: the
        KV cache's (the model's, or fp8)."""
        c = model.config
        self.model = model
        self.ctx = ctx
        self.dtype = dtype
        tp = ctx.topology.tensor_parallel_size
        num_kv_heads = len(kv_heads_of(ctx.place.tp_rank, tp, c.num_key_value_heads))
        # Eager only: CUDA graphs that capture the all-reduces and transfers are not built yet.
        self.inner = ModelRunner(
            model, num_blocks, block_size, max_model_len, ctx.device, kv_cache_dtype, 0,
            num_layers=len(ctx.place.layers), num_kv_heads=num_kv_heads,
        )
        # Prefill/decode roles with tp > 1: rank 0 sets one with the full-head cache; the
        # other ranks build theirs at the first GATHER_KV / SCATTER_KV (kv_mirror.py).
        self.mirror: KVMirror | None = None

    def kv_mirror(self) -> KVMirror:
        if self.mirror is None:
            assert self.ctx.tp is not None, "KV moves between tensor ranks need tp > 1"
            self.mirror = KVMirror(self.kv_caches, self.ctx.tp, self.model.config.num_key_value_heads, None)
        return self.mirror

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.inner.kv_caches

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor | None:
        """The logits [N, V] of the step's sampling requests, in order, on the driver."""
        self.inner.update_block_tables(output)
        place = self.ctx.place
        sends: list[tuple[Any, torch.Tensor]] = []
        logits: list[torch.Tensor] = []
        for items in split_micro_batches(output.scheduled, self.ctx.topology.pipeline_parallel_size):
            x, residual, sample_index = self._run(items)
            if not place.is_last_stage:
                hidden = torch.stack([x, residual])  # [2, T, D]; kept alive until its send is done
                sends.append((self.ctx.world.send(hidden, self.ctx.next_stage_rank), hidden))
            elif len(sample_index):
                x, _ = self.model.model.norm(x, residual)
                logits.append(self.model.compute_logits(x[sample_index]))
        for work, _ in sends:
            work.wait()
        if not self.ctx.is_driver:
            return None
        if not logits:
            return torch.empty(0, self.model.config.vocab_size, dtype=self.dtype, device=self.ctx.device)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _run(self, items: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, residual) [T, D] after this stage's layers, and the sampling rows [N]."""
        input_ids, positions, meta, sample_index = self.inner.prepare_inputs(items)
        received = None
        if not self.ctx.place.is_first_stage:
            hidden_size = self.model.config.hidden_size
            received = torch.empty(2, len(input_ids), hidden_size, dtype=self.dtype, device=self.ctx.device)
            self.ctx.world.recv_(received, self.ctx.previous_stage_rank)  # [2, T, D]: x, residual
        x, residual = run_stage(self.model, self.ctx.place, input_ids, positions, received, self.kv_caches, meta)
        return x, residual, sample_index
