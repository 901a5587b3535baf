"""The full-head KV cache rank 0 keeps when a prefill or decode instance is tensor-parallel.

Each tensor rank's cache holds only its KV heads (a 1/tp share, or one replicated head
when tp exceeds them), while the KV transfer moves whole blocks with every head, so a
prefill with tp=2 and a decode with tp=1 (or the reverse) agree on the wire. Rank 0 keeps
one more cache, the mirror, laid out as a single-process engine's
(`[num_blocks, 2, block_size, num_kv_heads, head_dim]` per layer, same block ids):
  prefill  after the step that completes a prompt, every rank sends its heads of the
           pushed blocks to rank 0 (gather over the tensor group), which writes them into
           the mirror; the KV sender reads the mirror.
  decode   the KV receiver writes into the mirror; when a request lands, rank 0 sends
           the landed blocks to every rank (broadcast), which keeps its own heads.
Replicated heads are written more than once with the same values. The cost is one more
cache on rank 0 and, for prefill, no layer-by-layer push: the gather runs once the whole
step is done. Blocks travel as bytes (an fp8 cache too: gloo has no fp8 type).
"""

from __future__ import annotations

import torch

from vllm_cluster.engine.parallel.groups import Group
from vllm_cluster.engine.parallel.topology import kv_heads_of


class KVMirror:
    def __init__(
        self, kv_caches: list[torch.Tensor], tp: Group, num_kv_heads: int, mirror: list[torch.Tensor] | None
    ) -> None:
        """`kv_caches`: this rank's shard caches; `mirror`: the full-head caches (rank 0 only)."""
        self.kv_caches = kv_caches
        self.tp = tp
        self.num_kv_heads = num_kv_heads
        self.mirror = mirror
        self.heads = kv_heads_of(tp.rank_in_group, tp.size, num_kv_heads)

    def gather(self, block_ids: list[int]) -> None:
        """Prefill: every rank's heads of `block_ids`, layer by layer, into rank 0's mirror."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, device=self.kv_caches[0].device)
        for layer, cache in enumerate(self.kv_caches):
            shard = cache.index_select(0, index).contiguous()  # [n, 2, bs, h_rank, D]
            parts = self.tp.gather_list(shard.view(torch.uint8))
            if self.mirror is None:
                continue
            assert parts is not None
            full = self.mirror[layer]
            for rank, part in enumerate(parts):
                heads = kv_heads_of(rank, self.tp.size, self.num_kv_heads)
                full[index, :, :, heads.start : heads.stop] = part.view(cache.dtype)

    def scatter(self, block_ids: list[int]) -> None:
        """Decode: rank 0's mirror blocks `block_ids` into every rank's own heads."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, device=self.kv_caches[0].device)
        for layer, cache in enumerate(self.kv_caches):
            if self.mirror is not None:
                blocks = self.mirror[layer].index_select(0, index).contiguous()  # [n, 2, bs, H, D]
            else:
                shape = (len(block_ids), *cache.shape[1:3], self.num_kv_heads, cache.shape[4])
                blocks = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self.tp.broadcast_(blocks.view(torch.uint8), self.tp.ranks[0])
            cache[index] = blocks[:, :, :, self.heads.start : self.heads.stop]
