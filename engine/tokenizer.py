"""Tokenizer loading (HF tokenizers, also from GGUF metadata) and the chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_cluster.engine.errors import ModelLoadError


def load_tokenizer(path: Path) -> Any:
    """An HF tokenizer for a model directory or a .gguf file."""
    from transformers import AutoTokenizer

    try:
        if path.is_file():
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here, 4.x a list.
    if hasattr(ids, "input_ids") or isinstance(ids, dict):
        ids = ids["input_ids"]
    return list(ids)
