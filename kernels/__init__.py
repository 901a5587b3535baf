"""Attention and fused hot-path kernels.

Each op has a torch reference (`kernels/reference/`) and one dispatch point here: the
engine calls only these functions. On CPU they run the reference; the Triton kernels of
the GPU issue plug in behind the same signatures.
"""

from kernels.attention import AttentionMetadata, paged_attention, write_kv_cache

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
