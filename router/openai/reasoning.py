"""Reasoning parsers (vLLM's --reasoning-parser, here `router.reasoning_parser`): what a
model writes between <think> and </think> goes to `reasoning_content`, the rest to
`content`, in whole responses and in streamed deltas alike (a whole text is one delta).

- `deepseek_r1`: the chat template opens <think> itself, so the output begins inside it:
  everything up to </think> is reasoning (an output that never closes it is all reasoning).
- `qwen3`: reasoning only from an explicit <think> to its </think>; text before <think> is
  content, and an output without one (thinking turned off) is all content.

A tag may arrive split across streamed pieces: the tail that could be the start of one is
held back until the next piece (or the end) says what it is.
"""

from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


class ReasoningSplitter:
    """One choice's text, fed in pieces: each `feed` answers (reasoning, content) to send."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser {parser!r}: give one of {', '.join(PARSERS)}")
        self._state = "reasoning" if parser == "deepseek_r1" else "content"
        self._opened = parser == "deepseek_r1"  # a <think> seen (or implied by the template)
        self._at_start = True  # deepseek_r1: a <think> the model writes itself is dropped
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning, content = "", ""
        while text:
            if self._state == "reasoning" and self._at_start:
                if START.startswith(text) and len(text) < len(START):
                    self._held = text
                    return reasoning, content
                text = text.removeprefix(START)
                self._at_start = False
                continue
            tag = END if self._state == "reasoning" else START if not self._opened else None
            if tag is None:
                content += text
                break
            before, found, after = text.partition(tag)
            if not found:
                keep = _tag_prefix_at_end(text, tag)
                before, self._held = text[: len(text) - keep], text[len(text) - keep:]
            if self._state == "reasoning":
                reasoning += before
            else:
                content += before
            if not found:
                break
            if tag == START:
                self._state, self._opened, self._at_start = "reasoning", True, False
            else:
                self._state = "content"
            text = after
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "reasoning" else ("", held)


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning_content, content); None when it held no reasoning."""
    splitter = ReasoningSplitter(parser)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    return (reasoning + more_reasoning) or None, content + more_content


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
