"""Load-test datasets with the real bundled tokenizer: random and prefix-repetition prompts,
ShareGPT and Mooncake files read from disk, and every kind of bad file failing with the
file and the line (or index) in the message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.tokenizer import load_tokenizer
from vllm_cluster.loadtest.datasets import (
    DatasetError,
    SampleRequest,
    allowed_token_ids,
    mooncake_dataset,
    prefix_repetition_dataset,
    random_dataset,
    sharegpt_dataset,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="module")
def special_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)


def token_prompt(request: SampleRequest) -> list[int]:
    assert isinstance(request.prompt, list)
    return request.prompt


# --- random ---------------------------------------------------------------------------


def test_random_exact_lengths_no_special_tokens(tokenizer: Any, special_ids: set[int]) -> None:
    requests = random_dataset(tokenizer, 20, input_len=32, output_len=8, seed=1)
    assert len(requests) == 20
    for r in requests:
        prompt = token_prompt(r)
        assert r.prompt_len == len(prompt) == 32
        assert r.output_len == 8
        assert r.timestamp_s is None
        assert not set(prompt) & special_ids
        assert all(0 <= t < len(tokenizer) for t in prompt)


def test_random_range_ratio_and_prefix(tokenizer: Any) -> None:
    requests = random_dataset(
        tokenizer, 200, input_len=100, output_len=50, range_ratio=0.5, prefix_len=16, seed=3
    )
    prefix = token_prompt(requests[0])[:16]
    input_lens = [r.prompt_len - 16 for r in requests]
    output_lens = [r.output_len for r in requests]
    assert all(token_prompt(r)[:16] == prefix for r in requests)
    assert all(r.prompt_len == len(token_prompt(r)) for r in requests)
    assert min(input_lens) >= 50 and max(input_lens) <= 150
    assert min(output_lens) >= 25 and max(output_lens) <= 75
    # 200 uniform draws over 101 values span most of the range.
    assert min(input_lens) < 60 and max(input_lens) > 140


def test_random_is_deterministic_per_seed(tokenizer: Any) -> None:
    a = random_dataset(tokenizer, 5, 16, 4, range_ratio=0.2, seed=7)
    b = random_dataset(tokenizer, 5, 16, 4, range_ratio=0.2, seed=7)
    c = random_dataset(tokenizer, 5, 16, 4, range_ratio=0.2, seed=8)
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"input_len": 0}, "input_len"),
        ({"output_len": -1}, "output_len"),
        ({"range_ratio": 1.0}, "range_ratio"),
        ({"prefix_len": -2}, "prefix_len"),
        ({"num_requests": 2.5}, "num_requests"),
    ],
)
def test_random_rejects_bad_arguments(tokenizer: Any, kwargs: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"num_requests": 3, "input_len": 8, "output_len": 4} | kwargs
    with pytest.raises(ValueError, match=fragment):
        random_dataset(tokenizer, **args)


def test_allowed_token_ids_excludes_added_tokens(tokenizer: Any, special_ids: set[int]) -> None:
    ids = set(allowed_token_ids(tokenizer).tolist())
    assert ids.isdisjoint(special_ids)
    assert len(ids) == len(tokenizer) - len(special_ids)


# --- prefix repetition ----------------------------------------------------------------


def test_prefix_repetition_shares_prefixes(tokenizer: Any) -> None:
    requests = prefix_repetition_dataset(
        tokenizer, 12, num_prefixes=3, prefix_len=20, suffix_len=5, output_len=7, seed=2
    )
    assert len(requests) == 12
    prefixes = [tuple(token_prompt(r)[:20]) for r in requests]
    assert len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    suffixes = {tuple(token_prompt(r)[20:]) for r in requests}
    assert len(suffixes) == 12
    assert all(r.prompt_len == len(token_prompt(r)) == 25 and r.output_len == 7 for r in requests)
    # Shuffled: not the round-robin order the prefixes were dealt in.
    assert prefixes != [prefixes[i % 3] for i in range(12)]


def test_prefix_repetition_rejects_more_prefixes_than_requests(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition_dataset(tokenizer, 2, num_prefixes=3, prefix_len=4, suffix_len=4, output_len=1)


# --- ShareGPT -------------------------------------------------------------------------

LONG_PROMPT = "Explain in a few sentences why the sky looks blue during the day."
LONG_REPLY = "Sunlight scatters off air molecules, and blue light scatters the most."


def conversation(*turns: tuple[str, str], conv_id: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    if conv_id is not None:
        entry["id"] = conv_id
    return entry


def write_json(tmp_path: Path, data: Any, name: str = "sharegpt.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=1))
    return path


def test_sharegpt_takes_first_human_turn_and_reply(tmp_path: Path, tokenizer: Any) -> None:
    path = write_json(
        tmp_path,
        [
            conversation(("gpt", "Hello there, I am an assistant."), ("human", LONG_PROMPT), ("gpt", LONG_REPLY)),
            conversation(("user", LONG_PROMPT + " Please."), ("assistant", LONG_REPLY + " Really."), conv_id="x"),
        ],
    )
    requests = sharegpt_dataset(path, tokenizer, 2, seed=0)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {LONG_PROMPT, LONG_PROMPT + " Please."}
    first = by_prompt[LONG_PROMPT]
    assert first.prompt_len == len(tokenizer(LONG_PROMPT).input_ids)
    assert first.output_len == len(tokenizer(LONG_REPLY).input_ids)


def test_sharegpt_skips_short_and_unpaired_conversations(tmp_path: Path, tokenizer: Any) -> None:
    path = write_json(
        tmp_path,
        [
            conversation(("human", LONG_PROMPT)),  # one turn
            conversation(("human", "Hi"), ("gpt", LONG_REPLY)),  # prompt under 4 tokens
            conversation(("human", LONG_PROMPT), ("gpt", "Ok")),  # reply under 4 tokens
            conversation(("human", LONG_PROMPT), ("human", LONG_PROMPT)),  # no reply
            conversation(("human", "word " * 1100), ("gpt", LONG_REPLY)),  # prompt over 1024
            conversation(("human", LONG_PROMPT), ("gpt", LONG_REPLY)),  # the only good one
        ],
    )
    requests = sharegpt_dataset(path, tokenizer, 1)
    assert [r.prompt for r in requests] == [LONG_PROMPT]
    with pytest.raises(DatasetError, match=r"only 1 of 6 conversations pass the filters, 2 requested"):
        sharegpt_dataset(path, tokenizer, 2)


def test_sharegpt_fixed_output_len_keeps_short_replies(tmp_path: Path, tokenizer: Any) -> None:
    path = write_json(tmp_path, [conversation(("human", LONG_PROMPT), ("gpt", "Ok"))])
    (request,) = sharegpt_dataset(path, tokenizer, 1, output_len=64)
    assert request.output_len == 64


def test_sharegpt_sampling_follows_seed(tmp_path: Path, tokenizer: Any) -> None:
    data = [conversation(("human", f"{LONG_PROMPT} Number {i}."), ("gpt", LONG_REPLY)) for i in range(30)]
    path = write_json(tmp_path, data)
    a = [r.prompt for r in sharegpt_dataset(path, tokenizer, 10, seed=1)]
    b = [r.prompt for r in sharegpt_dataset(path, tokenizer, 10, seed=1)]
    c = [r.prompt for r in sharegpt_dataset(path, tokenizer, 10, seed=2)]
    assert a == b
    assert a != c
    assert len(set(a)) == 10


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[\n {"conversations": []},\n {"conversations": [}\n]', r"sharegpt.json:3: not valid JSON"),
        ('{"conversations": []}', r"sharegpt.json: the top level is a dict; expected a JSON list"),
        ('[{"conversations": []}, 5]', r"sharegpt.json: conversation \[1\]: expected an object"),
        (
            '[{"conversations": []}, {"id": "a"}]',
            r"conversation \[1\]: .*'conversations' list, got an object with keys \['id'\]",
        ),
        (
            '[{"conversations": [{"from": "human", "value": 3}]}]',
            r"conversation \[0\], turn \[0\]: expected an object with string",
        ),
        ('[{"conversations": [{"value": "hello"}]}]', r"conversation \[0\], turn \[0\]"),
    ],
)
def test_sharegpt_bad_files_name_file_and_place(
    tmp_path: Path, tokenizer: Any, text: str, fragment: str
) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    with pytest.raises(DatasetError, match=fragment) as info:
        sharegpt_dataset(path, tokenizer, 1)
    assert str(path) in str(info.value)


def test_sharegpt_missing_file(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(DatasetError, match="cannot read the dataset file") as info:
        sharegpt_dataset(path, tokenizer, 1)
    assert str(path) in str(info.value)


# --- Mooncake -------------------------------------------------------------------------


def write_jsonl(tmp_path: Path, records: list[Any], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def record(timestamp: Any, input_length: Any, output_length: Any, hash_ids: Any) -> dict[str, Any]:
    return {"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids}


def test_mooncake_shared_hash_ids_share_exactly_those_blocks(
    tmp_path: Path, tokenizer: Any, special_ids: set[int]
) -> None:
    block = 8
    path = write_jsonl(
        tmp_path,
        [
            record(0, 24, 5, [0, 1, 2]),
            record(250, 24, 6, [0, 1, 3]),
            record(1500, 20, 7, [4, 1, 2]),  # 2.5 blocks: block 2 is truncated to 4 tokens
            "",  # blank lines are skipped
            record(1500, 8, 1, [5]),
        ],
    )
    requests = mooncake_dataset(path, tokenizer, block_size=block, seed=11)
    assert [r.timestamp_s for r in requests] == [0.0, 0.25, 1.5, 1.5]
    assert [r.prompt_len for r in requests] == [24, 24, 20, 8]
    assert [r.output_len for r in requests] == [5, 6, 7, 1]
    a, b, c, d = (token_prompt(r) for r in requests)
    assert all(len(p) == r.prompt_len for p, r in zip((a, b, c, d), requests, strict=True))

    def blk(prompt: list[int], i: int) -> list[int]:
        return prompt[i * block : (i + 1) * block]

    assert blk(a, 0) == blk(b, 0) and blk(a, 1) == blk(b, 1)  # hash ids 0 and 1
    assert blk(a, 2) != blk(b, 2)  # 2 vs 3
    assert blk(c, 1) == blk(a, 1)  # hash id 1 at the same position
    assert blk(c, 2) == blk(a, 2)[:4]  # hash id 2, truncated
    assert blk(c, 0) != blk(a, 0)  # 4 vs 0: a different first block
    distinct = [blk(a, 0), blk(a, 1), blk(a, 2), blk(b, 2), blk(c, 0), d]
    assert len({tuple(x) for x in distinct}) == 6
    assert not {t for p in (a, b, c, d) for t in p} & special_ids


def test_mooncake_blocks_follow_seed_and_num_requests(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path, [record(i * 100, 16, 4, [i, 99]) for i in range(5)])
    a = mooncake_dataset(path, tokenizer, block_size=8, seed=1)
    b = mooncake_dataset(path, tokenizer, block_size=8, seed=1)
    c = mooncake_dataset(path, tokenizer, block_size=8, seed=2)
    assert a == b
    assert all(x.prompt != y.prompt for x, y in zip(a, c, strict=True))
    # The block of a hash id does not depend on its position: hash 99 ends every prompt.
    assert len({tuple(token_prompt(r)[8:]) for r in a}) == 1
    assert mooncake_dataset(path, tokenizer, num_requests=2, block_size=8, seed=1) == a[:2]
    with pytest.raises(DatasetError, match=r"trace.jsonl: holds 5 requests, 6 requested"):
        mooncake_dataset(path, tokenizer, num_requests=6, block_size=8)


GOOD_LINE = record(0, 8, 2, [1])


@pytest.mark.parametrize(
    ("bad_line", "fragment"),
    [
        ('{"timestamp": 1, "input_length": ', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"timestamp": 5, "input_length": 8, "hash_ids": [1]}, "missing field 'output_length'"),
        (record(5, "8", 2, [1]), "'input_length' is '8'; expected an integer >= 1"),
        (record(5, 8, True, [1]), "'output_length' is True"),
        (record(5, 8, 0, [1]), "'output_length' is 0"),
        (record(-1, 8, 2, [1]), "'timestamp' is -1; expected milliseconds >= 0"),
        ({"timestamp": "soon", "input_length": 8, "output_length": 2, "hash_ids": [1]}, "'timestamp' is 'soon'"),
        (record(5, 8, 2, 7), "'hash_ids' is 7; expected a list of integers"),
        (record(5, 8, 2, [1, "x"]), "'hash_ids' is"),
        (record(5, 8, 2, [-3]), "expected a list of integers >= 0"),
        (record(5, 17, 2, [1, 2]), "input_length 17 needs 3 blocks of 8 tokens but hash_ids has 2"),
    ],
)
def test_mooncake_bad_lines_name_file_and_line(
    tmp_path: Path, tokenizer: Any, bad_line: Any, fragment: str
) -> None:
    path = write_jsonl(tmp_path, [GOOD_LINE, bad_line])
    with pytest.raises(DatasetError) as info:
        mooncake_dataset(path, tokenizer, block_size=8)
    message = str(info.value)
    assert message.startswith(f"{path}:2: "), message
    assert fragment in message


def test_mooncake_rejects_decreasing_timestamps(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path, [record(500, 8, 2, [1]), "", record(100, 8, 2, [2])])
    with pytest.raises(DatasetError, match=r"trace.jsonl:3: timestamp 100.0 is earlier"):
        mooncake_dataset(path, tokenizer, block_size=8)
