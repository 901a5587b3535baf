"""What the OpenAI target counts as a streamed piece of output (time to first token and the
gaps between pieces hang on it)."""

from __future__ import annotations

from vllm_cluster.loadtest.targets import _is_piece


def test_a_completion_chunk_with_empty_text_is_a_piece() -> None:
    # A special token, or a model served without a tokenizer: vLLM's bench counts it too.
    assert _is_piece({"choices": [{"index": 0, "text": "", "finish_reason": None}]}, chat=False)
    assert _is_piece({"choices": [{"index": 0, "text": "Hi"}]}, chat=False)


def test_usage_and_role_chunks_are_not_pieces() -> None:
    assert not _is_piece({"choices": [], "usage": {"completion_tokens": 3}}, chat=False)
    assert not _is_piece({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, chat=True)
    assert _is_piece({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, chat=True)
