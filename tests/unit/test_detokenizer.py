"""Incremental detokenization with the real SmolLM2 tokenizer: text equals a full decode,
stop strings across token boundaries, min_tokens, and multi-byte characters."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_cluster.engine import LLM
from vllm_cluster.engine.detokenizer import IncrementalDetokenizer
from vllm_cluster.engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(smollm2: LLM) -> Any:
    return smollm2.tokenizer


def feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], str | None]:
    """Feed tokens one at a time; returns the text after each and the stop string, if any."""
    texts = []
    for token_id in token_ids:
        stop = detok.update([token_id])
        texts.append(detok.text)
        if stop is not None:
            return texts, stop
    return texts, None


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


@pytest.mark.parametrize(
    "sentence",
    [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world!\n  Indented line\twith a tab, and numbers 3.14159 and 42.",
        "Café crème, naïve façade: 你好世界, 日本語 and emoji 🙂🚀 mixed in.",
        "def f(x):\n    return x ** 2  # it's \"quoted\"",
    ],
)
@pytest.mark.parametrize("prompt", ["", "Write something:"])
def test_incremental_text_equals_full_decode(tokenizer: Any, sentence: str, prompt: str) -> None:
    ids = encode(tokenizer, sentence)
    assert len(ids) > 5
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), SamplingParams())
    texts, stop = feed(detok, ids)
    assert stop is None
    assert detok.text == tokenizer.decode(ids) == sentence
    # Text only grows, and never by a partial character.
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before)
    assert all(REPLACEMENT_CHAR not in text for text in texts)


def test_first_token_keeps_its_leading_space_after_the_prompt(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "Hello,")
    ids = encode(tokenizer, "Hello, world")[len(prompt) :]
    assert tokenizer.decode(ids) == " world"
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    feed(detok, ids)
    assert detok.text == " world"


# --- stop strings ----------------------------------------------------------------------

SENTENCE = "Hello, world. STOP here"


def test_stop_string_spanning_two_tokens_is_found_and_cut(tokenizer: Any) -> None:
    ids = encode(tokenizer, SENTENCE)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert " ST" in pieces and "OP" in pieces  # "STOP" really spans two tokens
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    texts, stop = feed(detok, ids)
    assert stop == "STOP"
    assert detok.text == "Hello, world. "
    # Found on the token that completes it, not later.
    assert len(texts) == pieces.index("OP") + 1


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer: Any) -> None:
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    _, stop = feed(detok, encode(tokenizer, SENTENCE))
    assert stop == "STOP"
    assert detok.text == "Hello, world. STOP"


def test_stop_string_inside_one_token_cuts_mid_token(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["orl"]))
    _, stop = feed(detok, encode(tokenizer, SENTENCE))
    assert stop == "orl"
    assert detok.text == "Hello, w"


def test_any_of_several_stop_strings_stops(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["absent", "world"]))
    _, stop = feed(detok, encode(tokenizer, SENTENCE))
    assert stop == "world"
    assert detok.text == "Hello, "


def test_absent_stop_string_never_stops(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOPPED", "xyz"]))
    _, stop = feed(detok, encode(tokenizer, SENTENCE))
    assert stop is None
    assert detok.text == SENTENCE


def _num_tokens_to_complete(tokenizer: Any, ids: list[int], substring: str) -> int:
    return next(j for j in range(1, len(ids) + 1) if substring in tokenizer.decode(ids[:j]))


def test_stop_strings_not_checked_before_min_tokens(tokenizer: Any) -> None:
    ids = encode(tokenizer, "STOP one STOP two")
    first_stop_end = _num_tokens_to_complete(tokenizer, ids, "STOP")
    params = SamplingParams(stop=["STOP"], min_tokens=first_stop_end + 1)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    texts, stop = feed(detok, ids)
    assert stop == "STOP"
    assert detok.text == "STOP one "
    assert len(texts) > first_stop_end + 1


def test_stop_string_completed_exactly_at_min_tokens_is_found(tokenizer: Any) -> None:
    ids = encode(tokenizer, "STOP one STOP two")
    first_stop_end = _num_tokens_to_complete(tokenizer, ids, "STOP")
    params = SamplingParams(stop=["STOP"], min_tokens=first_stop_end)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    texts, stop = feed(detok, ids)
    assert stop == "STOP"
    assert detok.text == ""
    assert len(texts) == first_stop_end


# --- multi-byte characters -------------------------------------------------------------


def test_emoji_split_over_two_tokens_waits_for_the_whole_character(tokenizer: Any) -> None:
    ids = encode(tokenizer, "🙂")
    assert len(ids) == 2  # the emoji's four bytes span two tokens
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Smile:"), SamplingParams())
    assert detok.update(ids[:1]) is None
    assert detok.text == ""
    detok.update(ids[1:])
    assert detok.text == "🙂"


def test_e_acute_fed_as_single_bytes_never_shows_replacement_char(tokenizer: Any) -> None:
    # "é" is 0xC3 0xA9; the byte-level tokens for them are "Ã" and "©".
    byte_ids = tokenizer.convert_tokens_to_ids(["Ã", "©"])
    assert tokenizer.decode(byte_ids) == "é"
    ids = encode(tokenizer, "caf") + byte_ids + encode(tokenizer, " au lait")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    texts, _ = feed(detok, ids)
    assert all(REPLACEMENT_CHAR not in text for text in texts)
    assert detok.text == "café au lait"


def test_cjk_split_over_byte_tokens_never_shows_replacement_char(tokenizer: Any) -> None:
    ids = encode(tokenizer, "你好")
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    texts, _ = feed(detok, ids)
    assert all(REPLACEMENT_CHAR not in text for text in texts)
    assert detok.text == "你好"


def test_stop_string_of_a_multi_byte_character(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["🙂"]))
    _, stop = feed(detok, encode(tokenizer, "Nice 🙂 day"))
    assert stop == "🙂"
    assert detok.text == "Nice "


# --- special tokens --------------------------------------------------------------------


def test_special_tokens_skipped_by_default(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Done.") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    feed(detok, ids)
    assert detok.text == "Done."


def test_special_tokens_kept_when_not_skipped(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Done.") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    feed(detok, ids)
    assert detok.text == "Done." + tokenizer.eos_token
