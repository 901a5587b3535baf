"""Runs the model on one scheduled step: builds the flattened varlen batch (token ids,
positions, slot mapping, block tables), runs the forward pass (a captured CUDA graph for
decode-only steps on GPU), and returns the logits of the requests that sample this step.
Holds the KV cache tensors and each request's block table, updated from the scheduler's
deltas."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_cluster.engine.cuda_graphs import CudaGraphRunner
from vllm_cluster.engine.device_tokens import DeviceTokens, PlaceholderFill
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.request import RequestId
from vllm_cluster.engine.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, make_plan


def kv_cache_block_bytes(model: CausalLM, block_size: int, kv_cache_dtype: torch.dtype) -> int:
    """One block's bytes over every layer (fp8: one per element, half a 16-bit cache's; MLA:
    the latent and rotary key only, ModelArchConfig.kv_cache_shape)."""
    elem = torch.empty((), dtype=kv_cache_dtype).element_size()
    return block_size * model.config.kv_bytes_per_token(elem)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        kv_cache_dtype: torch.dtype,
        cuda_graph_max_batch: int = 0,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
    ) -> None:
        """`num_layers`, `num_kv_heads`: a parallel rank's share (its stage's layers, its
        heads); the model's by default."""
        c = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        num_layers = c.num_hidden_layers if num_layers is None else num_layers
        num_kv_heads = c.num_key_value_heads if num_kv_heads is None else num_kv_heads
        # One tensor per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim] (MLA: one
        # latent entry per token, ModelArchConfig.kv_cache_shape), of the model's dtype or fp8
        # (kernels/fp8_kv.py). Zeroed, so masked-out slots never feed NaN into attention.
        shape = c.kv_cache_shape(num_blocks, block_size, num_kv_heads)
        self.kv_caches = [torch.zeros(shape, dtype=kv_cache_dtype, device=device) for _ in range(num_layers)]
        self.block_tables: dict[RequestId, list[int]] = {}
        self.graphs: CudaGraphRunner | None = None
        if device.type == "cuda" and cuda_graph_max_batch > 0:
            max_blocks = -(-max_model_len // block_size)
            self.graphs = CudaGraphRunner(model, self.kv_caches, cuda_graph_max_batch, max_blocks, max_model_len)

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        after_layer: Callable[[int], None] | None = None,
        prev_tokens: DeviceTokens | None = None,
    ) -> tuple[list[RequestId], torch.Tensor]:
        """Returns (ids of the requests that sample, their logits [N, V]); with prompt logprobs
        asked for, the rows of `logit_rows` instead (engine/prompt_logprobs.py splits them).

        `after_layer(i)` runs once layer i's KV is written (eager path only: a graph replay
        has no point to stop at between layers). `prev_tokens`: the previous step's sampled
        ids, still on the device, for this step's placeholder tokens (async scheduling)."""
        self.update_block_tables(output)
        sample_ids = [item.request_id for item in output.scheduled if item.samples]
        token_ids, positions, query_start_loc, seq_lens, tables = self._flatten(output.scheduled)
        fill = _placeholder_fill(output.scheduled, query_start_loc, prev_tokens)
        num_seqs = len(seq_lens)
        use_graph = self.graphs is not None and after_layer is None and self.graphs.fits(num_seqs)
        use_graph = use_graph and not any(item.num_prompt_logits for item in output.scheduled)
        if use_graph and len(token_ids) == num_seqs:
            assert self.graphs is not None
            # Decode-only: every sequence has one new token, and every one samples.
            slots = [
                t[p // self.block_size] * self.block_size + p % self.block_size
                for t, p in zip(tables, positions, strict=True)
            ]
            return sample_ids, self.graphs.run(token_ids, positions, slots, tables, seq_lens, fill)
        input_ids, pos, meta = self._prepare(token_ids, positions, query_start_loc, seq_lens, tables)
        if fill is not None:
            dst, src = (torch.tensor(x).to(self.device, non_blocking=True) for x in (fill.dst, fill.src))
            input_ids[dst] = fill.prev.token_ids[src]
        hidden = self.model(input_ids, pos, self.kv_caches, meta, after_layer)  # [T, D]
        rows = logit_rows(output.scheduled, query_start_loc)
        # Built on the host, then copied without waiting: a step in flight keeps running.
        row_ids = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return sample_ids, self.model.compute_logits(hidden[row_ids])

    def update_block_tables(self, output: SchedulerOutput) -> None:
        for request_id in output.removed_request_ids:
            self.block_tables.pop(request_id, None)
        for item in output.scheduled:
            if item.is_new:
                self.block_tables[item.request_id] = list(item.new_block_ids)
            else:
                self.block_tables[item.request_id].extend(item.new_block_ids)

    def prepare_inputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input ids [T], positions [T], attention metadata, the index of each sampling
        request's last token [N], and of its prompt-logprob positions: `logit_rows`) for a
        run of this step's requests, whose block tables are up to date (a parallel stage
        runs one per micro-batch)."""
        token_ids, positions, query_start_loc, seq_lens, tables = self._flatten(scheduled)
        input_ids, pos, meta = self._prepare(token_ids, positions, query_start_loc, seq_lens, tables)
        rows = logit_rows(scheduled, query_start_loc)
        return input_ids, pos, meta, torch.tensor(rows, dtype=torch.long, device=self.device)

    def _flatten(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens = []
        tables = []
        for item in scheduled:
            num_new = len(item.token_ids)
            token_ids += item.token_ids
            positions += range(item.num_computed_tokens, item.num_computed_tokens + num_new)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(item.num_computed_tokens + num_new)
            tables.append(self.block_tables[item.request_id])
        return token_ids, positions, query_start_loc, seq_lens, tables

    def _prepare(
        self,
        token_ids: list[int],
        positions: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        q_lens = torch.tensor([query_start_loc[b + 1] - query_start_loc[b] for b in range(len(seq_lens))])
        seq_index = torch.repeat_interleave(torch.arange(len(tables)), q_lens)
        slot_mapping = block_tables[seq_index, pos // self.block_size].long() * self.block_size + pos % self.block_size
        on_cpu = self.device.type == "cpu"
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device, non_blocking=True),
            block_tables=block_tables.to(self.device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(self.device, non_blocking=True),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(self.device, non_blocking=True),
            max_query_len=int(q_lens.max()),
            max_seq_len=max(seq_lens),
            cpu_plan=make_plan(query_start_loc, seq_lens) if on_cpu else None,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, pos.to(self.device, non_blocking=True), meta


def logit_rows(scheduled: list[ScheduledRequest], query_start_loc: list[int]) -> list[int]:
    """The token rows whose logits a step returns, request by request: its prompt-logprob
    positions (`num_prompt_logits` leading ones), then its last token if it samples."""
    rows: list[int] = []
    for b, item in enumerate(scheduled):
        rows += range(query_start_loc[b], query_start_loc[b] + item.num_prompt_logits)
        if item.samples:
            rows.append(query_start_loc[b + 1] - 1)
    return rows


def _placeholder_fill(
    scheduled: list[ScheduledRequest], query_start_loc: list[int], prev: DeviceTokens | None
) -> PlaceholderFill | None:
    """Async scheduling: which inputs are tokens the previous step sampled (only a request's
    last scheduled token can be one), and their rows in `prev`."""
    dst: list[int] = []
    src: list[int] = []
    for b, item in enumerate(scheduled):
        if item.token_ids and item.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            assert prev is not None and item.request_id in prev.rows, (
                f"request {item.request_id} has a placeholder token but no step in flight sampled it"
            )
            dst.append(query_start_loc[b + 1] - 1)
            src.append(prev.rows[item.request_id])
    return PlaceholderFill(dst, src, prev) if prev is not None and dst else None
