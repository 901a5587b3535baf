"""Batched LoRA for a mixed batch (punica's shrink and expand); `dispatch` is what the engine
calls."""
