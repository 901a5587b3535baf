"""Workloads for the load tester: lists of `SampleRequest`, synthetic or read from a file.

Synthetic prompts (`random_dataset`, `prefix_repetition_dataset`, `mooncake_dataset`) are
token-id lists, so a prompt's length is exact and no detokenize/retokenize round trip
can change it; their ids avoid the tokenizer's special and added tokens. File loaders
validate as they read and raise `DatasetError` naming the file, the 1-based line (JSONL)
or the index (JSON), what is wrong and what was expected. Every sampler takes a seed and
is deterministic for it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ShareGPT filters, vLLM's defaults: drop prompts or replies under 4 tokens, prompts over
# 1024 tokens and pairs over 2048 tokens in all.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
_HUMAN_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant")
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids when the dataset builds tokens
    prompt_len: int
    output_len: int
    timestamp_s: float | None = None  # arrival time from a trace, when there is one


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and the place."""


def random_dataset(
    tokenizer: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Requests of random tokens, lengths uniform in [len*(1-r), len*(1+r)] (at least 1).

    Every prompt starts with the same `prefix_len` random tokens, so `prompt_len` is
    `prefix_len` plus its own sampled input length.
    """
    _check_count("num_requests", num_requests, minimum=0)
    _check_count("input_len", input_len, minimum=1)
    _check_count("output_len", output_len, minimum=1)
    _check_count("prefix_len", prefix_len, minimum=0)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    prefix = _random_tokens(rng, vocab, prefix_len)
    input_lens = _uniform_lengths(rng, input_len, range_ratio, num_requests)
    output_lens = _uniform_lengths(rng, output_len, range_ratio, num_requests)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        prompt = prefix + _random_tokens(rng, vocab, n_in)
        requests.append(SampleRequest(prompt, len(prompt), n_out))
    return requests


def prefix_repetition_dataset(
    tokenizer: Any,
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """Requests sharing one of `num_prefixes` random prefixes, each with its own random
    suffix; the prefixes are dealt round robin, then the requests shuffled."""
    _check_count("num_requests", num_requests, minimum=0)
    _check_count("num_prefixes", num_prefixes, minimum=1)
    _check_count("prefix_len", prefix_len, minimum=0)
    _check_count("suffix_len", suffix_len, minimum=0)
    _check_count("output_len", output_len, minimum=1)
    if prefix_len + suffix_len == 0:
        raise ValueError("prefix_len + suffix_len must be at least 1")
    if num_prefixes > max(num_requests, 1):
        raise ValueError(
            f"num_prefixes ({num_prefixes}) exceeds num_requests ({num_requests}); "
            "ask for fewer prefixes or more requests"
        )
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    prefixes = [_random_tokens(rng, vocab, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        prompt = prefixes[i % num_prefixes] + _random_tokens(rng, vocab, suffix_len)
        requests.append(SampleRequest(prompt, len(prompt), output_len))
    order = rng.permutation(num_requests)
    return [requests[i] for i in order]


def sharegpt_dataset(
    path: str | Path,
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """`num_requests` prompts from a ShareGPT JSON file, sampled with `seed`.

    The prompt is the first human/user turn, the output length the token count of the
    gpt/assistant turn right after it (or `output_len` when given). As vLLM does, skipped:
    conversations with fewer than 2 turns or no such pair, prompts or replies under
    SHAREGPT_MIN_LEN tokens (the reply check is off when `output_len` is given), prompts
    over SHAREGPT_MAX_PROMPT_LEN, and prompt + output over SHAREGPT_MAX_TOTAL_LEN tokens.
    Only the sampled conversations are tokenized.
    """
    _check_count("num_requests", num_requests, minimum=0)
    if output_len is not None:
        _check_count("output_len", output_len, minimum=1)
    path = Path(path)
    pairs = _read_sharegpt_pairs(path)
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    requests: list[SampleRequest] = []
    for i in order:
        if len(requests) == num_requests:
            break
        pair = pairs[i]
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = len(tokenizer(prompt).input_ids)
        reply_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if _sharegpt_keeps(prompt_len, reply_len, check_reply=output_len is None):
            requests.append(SampleRequest(prompt, prompt_len, reply_len))
    if len(requests) < num_requests:
        raise DatasetError(
            f"{path}: only {len(requests)} of {len(pairs)} conversations pass the filters, "
            f"{num_requests} requested; ask for fewer requests or use a larger file"
        )
    return requests


def mooncake_dataset(
    path: str | Path,
    tokenizer: Any,
    num_requests: int | None = None,
    block_size: int = 512,
    seed: int = 0,
) -> list[SampleRequest]:
    """The first `num_requests` (default all) requests of a Mooncake JSONL trace.

    Each line holds `timestamp` (ms), `input_length`, `output_length` and `hash_ids`.
    Block i of a prompt is `block_size` tokens that depend only on (seed, hash_ids[i]),
    so requests sharing a hash id share exactly that block; the prompt is truncated to
    `input_length` and hash ids beyond it are unused. Timestamps must not decrease.
    """
    if num_requests is not None:
        _check_count("num_requests", num_requests, minimum=0)
    _check_count("block_size", block_size, minimum=1)
    path = Path(path)
    vocab = allowed_token_ids(tokenizer)
    blocks: dict[int, list[int]] = {}
    requests: list[SampleRequest] = []
    last_timestamp_ms = -math.inf
    for line_no, record in _read_jsonl(path):
        if num_requests is not None and len(requests) == num_requests:
            break
        where = f"{path}:{line_no}"
        timestamp_ms, input_len, output_len, hash_ids = _mooncake_fields(record, where, block_size)
        if timestamp_ms < last_timestamp_ms:
            raise DatasetError(
                f"{where}: timestamp {timestamp_ms} is earlier than the previous line's "
                f"{last_timestamp_ms}; expected the trace sorted by timestamp"
            )
        last_timestamp_ms = timestamp_ms
        num_blocks = -(-input_len // block_size)
        prompt: list[int] = []
        for hash_id in hash_ids[:num_blocks]:
            if hash_id not in blocks:
                blocks[hash_id] = _random_tokens(
                    np.random.default_rng((seed, hash_id)), vocab, block_size
                )
            prompt += blocks[hash_id]
        del prompt[input_len:]
        requests.append(SampleRequest(prompt, input_len, output_len, timestamp_ms / 1000.0))
    if num_requests is not None and len(requests) < num_requests:
        raise DatasetError(
            f"{path}: holds {len(requests)} requests, {num_requests} requested; "
            "ask for fewer requests or leave num_requests unset"
        )
    return requests


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """The vocabulary minus special and added tokens (chat markers, EOS, ...)."""
    excluded = set(tokenizer.all_special_ids)
    excluded.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    ids = np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)
    assert ids.size > 0, "the tokenizer has no ordinary tokens"
    return ids


def _random_tokens(rng: np.random.Generator, vocab: np.ndarray, n: int) -> list[int]:
    tokens: list[int] = rng.choice(vocab, size=n).tolist()
    return tokens


def _uniform_lengths(rng: np.random.Generator, length: int, ratio: float, n: int) -> list[int]:
    low = max(1, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _sharegpt_keeps(prompt_len: int, reply_len: int, check_reply: bool) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or (check_reply and reply_len < SHAREGPT_MIN_LEN):
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and (
        prompt_len + reply_len <= SHAREGPT_MAX_TOTAL_LEN
    )


def _read_sharegpt_pairs(path: Path) -> list[tuple[str, str] | None]:
    """(prompt, reply) per conversation, None where there is no usable pair."""
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise DatasetError(
            f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); "
            "expected a ShareGPT file, a JSON list of conversations"
        ) from e
    if not isinstance(data, list):
        raise DatasetError(
            f"{path}: the top level is a {type(data).__name__}; expected a JSON list of "
            'objects like {"conversations": [{"from": "human", "value": "..."}, ...]}'
        )
    return [_sharegpt_pair(entry, f"{path}: conversation [{i}]") for i, entry in enumerate(data)]


def _sharegpt_pair(entry: Any, where: str) -> tuple[str, str] | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        raise DatasetError(
            f"{where}: expected an object with a 'conversations' list, got "
            f"{_describe(entry)}"
        )
    turns = entry["conversations"]
    for j, turn in enumerate(turns):
        if not (
            isinstance(turn, dict)
            and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)
        ):
            raise DatasetError(
                f"{where}, turn [{j}]: expected an object with string 'from' and 'value', "
                f"got {_describe(turn)}"
            )
    for j in range(len(turns) - 1):
        if turns[j]["from"] in _HUMAN_ROLES:
            if turns[j + 1]["from"] in _ASSISTANT_ROLES:
                return turns[j]["value"], turns[j + 1]["value"]
            return None
    return None


def _mooncake_fields(
    record: Any, where: str, block_size: int
) -> tuple[float, int, int, list[int]]:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {_describe(record)}")
    for name in _MOONCAKE_FIELDS:
        if name not in record:
            raise DatasetError(
                f"{where}: missing field '{name}'; expected {', '.join(_MOONCAKE_FIELDS)}"
            )
    timestamp_ms = record["timestamp"]
    if not _is_number(timestamp_ms) or timestamp_ms < 0:
        raise DatasetError(
            f"{where}: 'timestamp' is {timestamp_ms!r}; expected milliseconds >= 0"
        )
    for name in ("input_length", "output_length"):
        if not _is_int(record[name]) or record[name] < 1:
            raise DatasetError(f"{where}: '{name}' is {record[name]!r}; expected an integer >= 1")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise DatasetError(
            f"{where}: 'hash_ids' is {_describe(hash_ids)}; expected a list of integers >= 0"
        )
    input_len = record["input_length"]
    if input_len > len(hash_ids) * block_size:
        raise DatasetError(
            f"{where}: input_length {input_len} needs {-(-input_len // block_size)} blocks "
            f"of {block_size} tokens but hash_ids has {len(hash_ids)}; "
            "check block_size (Mooncake traces use 512)"
        )
    return float(timestamp_ms), input_len, record["output_length"], hash_ids


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed value) for every non-blank line, read lazily."""
    for line_no, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{path}:{line_no}: not valid JSON ({e.msg}, column {e.colno}); "
                "expected one JSON object per line"
            ) from e


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read the dataset file: {e}") from e


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _describe(value: Any) -> str:
    """A short description of a JSON value for an error message."""
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)}"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
