"""The reasoning parsers: <think> text to reasoning_content, the rest to content, the same
however the text is cut into streamed pieces (a tag split across pieces included)."""

from __future__ import annotations

import pytest

from vllm_cluster.router.openai.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    ("deepseek_r1", "I think hard</think>\n\nParis.", ("I think hard", "\n\nParis.")),
    ("deepseek_r1", "<think>hmm</think>Paris", ("hmm", "Paris")),
    ("deepseek_r1", "still thinking", ("still thinking", "")),  # never closed: all reasoning
    ("qwen3", "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
    ("qwen3", "Paris.", (None, "Paris.")),  # thinking off: all content
    ("qwen3", "pre <think>x</think> post", ("x", "pre  post")),
    ("qwen3", "a < b <thin", (None, "a < b <thin")),  # a tag's start that never completes
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_whole_and_streamed_in_any_pieces_agree(parser: str, text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(parser, text) == expected
    for size in (1, 2, 3, 5, 8):
        splitter = ReasoningSplitter(parser)
        reasoning, content = "", ""
        for i in range(0, len(text), size):
            r, c = splitter.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = splitter.flush()
        assert ((reasoning + r) or None, content + c) == expected, size


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("granite")
