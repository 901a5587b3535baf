"""The offline LLM API on the real SmolLM2, for the request fields that change what is
sampled or scheduled: logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens,
priority and chat_template_kwargs. Each changes the output as vLLM's does."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.logits_processors import banned_token_ids
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.tokenizer import apply_chat_template, encode_bad_words

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer is:"


def _greedy(llm: LLM, prompt: str | list[int], max_tokens: int = 8, **params: Any) -> list[int]:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_logit_bias_plus_100_makes_greedy_output_that_token(smollm2: LLM) -> None:
    banana = smollm2.get_tokenizer().encode(" banana")[0]
    assert banana not in _greedy(smollm2, PROMPT)
    assert _greedy(smollm2, PROMPT, max_tokens=4, logit_bias={banana: 100.0}) == [banana] * 4
    first = _greedy(smollm2, PROMPT, max_tokens=1)[0]
    assert _greedy(smollm2, PROMPT, max_tokens=1, logit_bias={first: -100.0})[0] != first


def test_allowed_token_ids_confine_sampled_output(smollm2: LLM) -> None:
    allowed = smollm2.get_tokenizer().encode(" cat dog bird")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed, n=3)
    for choice in smollm2.generate(PROMPT, params, use_tqdm=False)[0].outputs:
        assert len(choice.token_ids) == 12 and set(choice.token_ids) <= set(allowed)


def test_a_batch_mixing_processors_and_plain_requests_leaves_the_plain_ones_unchanged(smollm2: LLM) -> None:
    plain = _greedy(smollm2, PROMPT)
    banana = smollm2.get_tokenizer().encode(" banana")[0]
    params = [SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=8, logit_bias={banana: 100.0}),
              SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[banana])]
    outs = smollm2.generate([PROMPT] * 3, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids == [banana] * 8


def test_a_bad_word_never_appears(smollm2: LLM) -> None:
    tokenizer = smollm2.get_tokenizer()
    assert "Paris" in tokenizer.decode(_greedy(smollm2, PROMPT))
    out = smollm2.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, bad_words=["Paris"]), use_tqdm=False)
    assert "Paris" not in out[0].outputs[0].text
    # Sampled, many times: still never.
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=8, n=8, bad_words=["Paris", "France"])
    for choice in smollm2.generate(PROMPT, params, use_tqdm=False)[0].outputs:
        assert "Paris" not in choice.text and "France" not in choice.text


def test_a_multi_token_bad_word_bans_only_its_last_token_after_the_rest() -> None:
    word = [11, 12, 13]
    request = Request(RequestId("r"), [1], SamplingParams(bad_words_token_ids=[word, [40]]), None, 8)
    assert banned_token_ids(request) == [40]  # a one-token word is always banned
    request.output_token_ids = [5, 11]
    assert banned_token_ids(request) == [40]
    request.output_token_ids = [5, 11, 12]
    assert banned_token_ids(request) == [13, 40]


def test_bad_words_are_tokenized_with_and_without_a_leading_space(smollm2: LLM) -> None:
    tokenizer = smollm2.get_tokenizer()
    sequences = encode_bad_words(tokenizer, ["Paris"])
    assert tokenizer.encode("Paris", add_special_tokens=False) in sequences
    assert tokenizer.encode(" Paris", add_special_tokens=False) in sequences


def test_truncate_prompt_tokens_equals_sending_the_truncated_prompt(smollm2: LLM) -> None:
    ids = smollm2.get_tokenizer().encode(PROMPT)
    out = smollm2.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=3),
                           use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-3:]
    assert out.outputs[0].token_ids == _greedy(smollm2, ids[-3:])
    assert _greedy(smollm2, PROMPT, truncate_prompt_tokens=-1) == _greedy(smollm2, PROMPT)  # -1: max_model_len
    with pytest.raises(InvalidRequestError, match="greater than max_model_len"):
        smollm2.generate(PROMPT, SamplingParams(truncate_prompt_tokens=4096), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields", [{"logit_bias": {10**6: 1.0}}, {"allowed_token_ids": [10**6]}])
def test_token_ids_outside_the_vocabulary_are_refused(smollm2: LLM, fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match=f"{next(iter(fields))} has token ids"):
        smollm2.generate(PROMPT, SamplingParams(**fields), use_tqdm=False)


def test_priority_decides_the_order_with_one_seat(smollm2: LLM) -> None:
    llm = smollm2.derive(max_num_seqs=1, scheduling_policy="priority")
    prompts = [f"Request number {i} says" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    requests = [llm.core.make_request(str(i), llm.get_tokenizer().encode(p), params, priority=priority)
                for i, (p, priority) in enumerate(zip(prompts, [3, 0, 3, 1], strict=True))]
    for request in requests:
        llm.core.add_request(request)
    finished = []
    while llm.core.has_unfinished():
        finished += [u.request.request_id for u in llm.core.step() if u.finished]
    assert finished == ["1", "3", "0", "2"]  # lower first, ties by arrival
    # The outputs are those of each prompt alone: priority changes only the order.
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 0, 3, 1])
    assert [o.outputs[0].token_ids for o in outs] == [_greedy(smollm2, p, 2, ignore_eos=True) for p in prompts]


def test_priority_needs_the_priority_policy(smollm2: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="priority 1 needs scheduling_policy: priority"):
        smollm2.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False, priority=[1])
    assert smollm2.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False, priority=[0])


def test_chat_template_kwargs_reach_the_template(smollm2: LLM) -> None:
    chat = [{"role": "user", "content": "Hi"}]
    tokenizer = smollm2.get_tokenizer()
    with_prompt = apply_chat_template(tokenizer, chat)
    without = apply_chat_template(tokenizer, chat, {"add_generation_prompt": False})
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    # A Qwen3-style switch: the template reads enable_thinking.
    thinking = copy.copy(tokenizer)
    thinking.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    off = apply_chat_template(thinking, chat, {"enable_thinking": False})
    assert tokenizer.decode(off) == "Hi<think></think>"
    assert tokenizer.decode(apply_chat_template(thinking, chat)) == "Hi"
    out = smollm2.chat(chat, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs={"enable_thinking": 0})
    assert out[0].prompt_token_ids == with_prompt  # SmolLM2's template has no such variable
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
        apply_chat_template(tokenizer, chat, {"tokenize": False})
