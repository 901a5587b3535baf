"""Runs the model on one scheduled step: builds the flattened varlen batch (token ids,
positions, slot mapping, block tables), runs the forward pass, and returns the logits of
the requests that sample this step. Holds the KV cache tensors and each request's block
table, updated from the scheduler's deltas."""

from __future__ import annotations

import torch

from engine.models import CausalLM
from engine.request import RequestId
from engine.scheduler_output import SchedulerOutput
from kernels import AttentionMetadata


def kv_cache_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return c.num_hidden_layers * 2 * block_size * c.num_key_value_heads * c.head_dim * elem


class ModelRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        c = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        # One tensor per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]. Zeroed, so
        # masked-out slots never feed NaN into attention.
        shape = (num_blocks, 2, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_hidden_layers)]
        self.block_tables: dict[RequestId, list[int]] = {}

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> tuple[list[RequestId], torch.Tensor]:
        """Returns (ids of the requests that sample, their logits [N, V])."""
        for request_id in output.removed_request_ids:
            self.block_tables.pop(request_id, None)
        for item in output.scheduled:
            if item.is_new:
                self.block_tables[item.request_id] = list(item.new_block_ids)
            else:
                self.block_tables[item.request_id].extend(item.new_block_ids)
        input_ids, positions, meta = self._prepare(output)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, D]
        sample_ids = [item.request_id for item in output.scheduled if item.samples]
        last = [meta.query_start_loc[b + 1] - 1 for b, item in enumerate(output.scheduled) if item.samples]
        logits = self.model.compute_logits(hidden[torch.tensor(last, device=self.device, dtype=torch.long)])
        return sample_ids, logits

    def _prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens = []
        tables = []
        for item in output.scheduled:
            num_new = len(item.token_ids)
            token_ids += item.token_ids
            positions += range(item.num_computed_tokens, item.num_computed_tokens + num_new)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(item.num_computed_tokens + num_new)
            tables.append(self.block_tables[item.request_id])
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        seq_index = torch.repeat_interleave(
            torch.arange(len(tables)), torch.tensor([len(i.token_ids) for i in output.scheduled])
        )
        slot_mapping = block_tables[seq_index, pos // self.block_size] * self.block_size + pos % self.block_size
        q_lens = [len(i.token_ids) for i in output.scheduled]
        decode = [b for b, q in enumerate(q_lens) if q == 1]
        decode_lens = torch.tensor([seq_lens[b] for b in decode], dtype=torch.long)
        decode_max_len = max((seq_lens[b] for b in decode), default=0)
        decode_mask = None
        if decode and bool((decode_lens != decode_max_len).any()):
            decode_mask = (torch.arange(decode_max_len)[None, :] < decode_lens[:, None])[:, None, None, :]
            decode_mask = decode_mask.to(self.device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables.to(self.device),
            decode_seq_ids=torch.tensor(decode, dtype=torch.long, device=self.device),
            decode_token_ids=torch.tensor([query_start_loc[b] for b in decode], dtype=torch.long, device=self.device),
            decode_seq_lens=decode_lens.to(self.device),
            decode_max_len=decode_max_len,
            decode_mask=decode_mask,
            prefill_seq_ids=[b for b, q in enumerate(q_lens) if q > 1],
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return input_ids, pos.to(self.device), meta
