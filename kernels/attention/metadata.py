"""What attention needs to know about a flattened varlen batch, built once per step: the
device tensors every path reads, and on CPU the host-side plan of the torch path."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CpuPlan:
    """How the torch path splits a batch: decode rows attend together, prefill rows one by one."""

    query_start_loc: list[int]
    seq_lens: list[int]
    decode_seq_ids: torch.Tensor  # [Bd] long: sequences with exactly one new token
    decode_token_ids: torch.Tensor  # [Bd] long: where their token sits in the batch
    decode_lens: torch.Tensor  # [Bd] long: their context lengths
    decode_min_len: int
    decode_max_len: int
    # [Bd, 1, 1, decode_max_len] bool, True = attend; None when all decode lengths are equal.
    decode_mask: torch.Tensor | None
    prefill_seq_ids: list[int]  # sequences with more than one new token


def make_plan(query_start_loc: list[int], seq_lens: list[int]) -> CpuPlan:
    """The plan of a batch from host copies of its query_start_loc [B + 1] and seq_lens [B]."""
    q_lens = [query_start_loc[b + 1] - query_start_loc[b] for b in range(len(seq_lens))]
    decode = [b for b, q in enumerate(q_lens) if q == 1]
    decode_lens = torch.tensor([seq_lens[b] for b in decode], dtype=torch.long)
    decode_max_len = max((seq_lens[b] for b in decode), default=0)
    mask = None
    if decode and bool((decode_lens != decode_max_len).any()):
        mask = (torch.arange(decode_max_len)[None, :] < decode_lens[:, None])[:, None, None, :]
    return CpuPlan(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        decode_seq_ids=torch.tensor(decode, dtype=torch.long),
        decode_token_ids=torch.tensor([query_start_loc[b] for b in decode], dtype=torch.long),
        decode_lens=decode_lens,
        decode_min_len=min((seq_lens[b] for b in decode), default=0),
        decode_max_len=decode_max_len,
        decode_mask=mask,
        prefill_seq_ids=[b for b, q in enumerate(q_lens) if q > 1],
    )


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset; -1 = padding token
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step; 0 = padding row
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b owns tokens [loc[b], loc[b+1])
    max_query_len: int
    max_seq_len: int  # an upper bound; a CUDA graph captures it as max_model_len
    cpu_plan: CpuPlan | None = None  # host-side plan of the torch path (CPU only)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
