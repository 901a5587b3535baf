"""Paged attention over the KV cache: decode and prefill attention, the decode split combine,
rotary + KV write, the fp8 KV cache, AttentionMetadata; `dispatch` is what the engine calls."""
