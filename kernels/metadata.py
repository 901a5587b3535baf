"""What attention needs to know about a flattened varlen batch, built once per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_cluster.kernels.torch_ops import CpuPlan


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
