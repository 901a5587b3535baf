"""Incremental detokenization and stop strings that may span token boundaries.

Text is decoded over a small window of recent tokens; a trailing U+FFFD means a
multi-byte character is incomplete, so that text waits for the next token. A prompt may end
inside a character (a migrated request's continuation does whenever the lost instance was
holding half of one back): that character's first tokens count as not yet read, so the
output token that completes it brings the whole character.
"""

from __future__ import annotations

from typing import Any

from vllm_cluster.engine.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens decoded with the first output token, for correct spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._read_offset -= num_unfinished_tokens(tokenizer, self._ids, params.skip_special_tokens)
        self._num_output_tokens = 0
        self.text = ""
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (text is cut there)."""
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new_text
        if self._num_output_tokens < self.params.min_tokens:
            return None
        return self._find_stop(len(new_text))

    def _find_stop(self, num_new_chars: int) -> str | None:
        start = max(0, len(self.text) - num_new_chars - self._max_stop_len + 1)
        for stop in self.params.stop:
            index = self.text.find(stop, start)
            if index != -1:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self.text = self.text[:end]
                return stop
        return None


def num_unfinished_tokens(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> int:
    """How many of the last tokens of `token_ids` end inside a character (their text waits
    for the tokens that complete it): at most 3, the continuation bytes a UTF-8 character can
    be missing, so bytes that never form a character are not waited for."""
    n = len(token_ids)
    while n > max(0, len(token_ids) - 3) and _ends_inside_a_character(tokenizer, token_ids[:n], skip_special_tokens):
        n -= 1
    return len(token_ids) - n


def _ends_inside_a_character(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> bool:
    return bool(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens).endswith("\ufffd"))
