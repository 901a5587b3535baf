"""The offline LLM API on the real SmolLM2: n, seeds, stop strings, min/max tokens,
ignore_eos, logprobs, token-id prompts and batched chat. Every test ends with all KV
blocks back in the pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.outputs import CompletionOutput
from vllm_cluster.engine.tokenizer import apply_chat_template

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
SHORT_ANSWER_CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(autouse=True)
def no_leaked_blocks(smollm2: LLM) -> Iterator[None]:
    yield
    assert not smollm2.core.has_unfinished()
    assert smollm2.core.kv.pool.num_free_blocks == smollm2.core.kv.pool.num_blocks


def generate_one(llm: LLM, prompt: str | list[int], params: SamplingParams) -> CompletionOutput:
    outputs = llm.generate(prompt, params, use_tqdm=False)
    assert len(outputs) == 1 and len(outputs[0].outputs) == 1
    return outputs[0].outputs[0]


@pytest.fixture(scope="module")
def greedy_reference(smollm2: LLM) -> CompletionOutput:
    """PROMPT continued greedily for 16 tokens (the model does not stop by itself there)."""
    out = generate_one(smollm2, PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    return out


@pytest.fixture(scope="module")
def short_chat_reference(smollm2: LLM) -> CompletionOutput:
    """A chat the model answers greedily in a few tokens, ending with EOS."""
    outputs = smollm2.chat(SHORT_ANSWER_CHAT, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    out = outputs[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == smollm2.core.eos_token_id
    return out


# --- n and seeds ----------------------------------------------------------------------


def test_n_seeded_completions_repeat_across_calls(smollm2: LLM) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8)
    first = smollm2.generate(PROMPT, params, use_tqdm=False)
    second = smollm2.generate(PROMPT, params, use_tqdm=False)
    assert len(first) == len(second) == 1
    completions = first[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(c.finished and len(c.token_ids) > 0 for c in completions)
    assert [c.token_ids for c in completions] == [c.token_ids for c in second[0].outputs]
    assert [c.text for c in completions] == [c.text for c in second[0].outputs]
    # The three children draw with different seeds, so they do not all agree.
    assert len({tuple(c.token_ids) for c in completions}) > 1
    assert first[0].finished


def test_other_seed_gives_other_completions(smollm2: LLM) -> None:
    seven = smollm2.generate(PROMPT, SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8), use_tqdm=False)
    eight = smollm2.generate(PROMPT, SamplingParams(n=3, temperature=0.8, seed=8, max_tokens=8), use_tqdm=False)
    assert [c.token_ids for c in seven[0].outputs] != [c.token_ids for c in eight[0].outputs]


# --- stop strings ---------------------------------------------------------------------


def _stop_string_from(reference: CompletionOutput) -> str:
    # A word from the middle of the greedy text, so the stop comes mid-generation.
    words = reference.text.split()
    stop = words[len(words) // 2]
    assert reference.text.find(stop) > 0
    return stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_text_with_finish_reason_stop(
    smollm2: LLM, greedy_reference: CompletionOutput, include: bool
) -> None:
    stop = _stop_string_from(greedy_reference)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], include_stop_str_in_output=include)
    out = generate_one(smollm2, PROMPT, params)
    index = greedy_reference.text.find(stop)
    assert out.text == greedy_reference.text[: index + len(stop) if include else index]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    # Generation stopped when the stop string appeared, not at max_tokens.
    assert len(out.token_ids) < len(greedy_reference.token_ids)
    assert out.token_ids == greedy_reference.token_ids[: len(out.token_ids)]


def test_stop_token_id_ends_generation_with_it_as_stop_reason(
    smollm2: LLM, greedy_reference: CompletionOutput
) -> None:
    stop_token = greedy_reference.token_ids[5]
    first = greedy_reference.token_ids.index(stop_token)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_token])
    out = generate_one(smollm2, PROMPT, params)
    assert out.token_ids == greedy_reference.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token


# --- min_tokens, ignore_eos, max_tokens ------------------------------------------------


def test_min_tokens_holds_off_eos(smollm2: LLM, short_chat_reference: CompletionOutput) -> None:
    num_answer = len(short_chat_reference.token_ids)
    min_tokens = num_answer + 3
    params = SamplingParams(temperature=0.0, min_tokens=min_tokens, max_tokens=min_tokens + 3)
    out = smollm2.chat(SHORT_ANSWER_CHAT, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= min_tokens
    assert smollm2.core.eos_token_id not in out.token_ids[:min_tokens]
    # Up to where EOS was masked, greedy decoding is unchanged.
    assert out.token_ids[: num_answer - 1] == short_chat_reference.token_ids[:-1]


def test_ignore_eos_generates_past_eos_up_to_max_tokens(
    smollm2: LLM, short_chat_reference: CompletionOutput
) -> None:
    max_tokens = len(short_chat_reference.token_ids) + 3
    params = SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=4, max_tokens=max_tokens)
    out = smollm2.chat(SHORT_ANSWER_CHAT, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == max_tokens
    assert out.finish_reason == "length"
    # The EOS the model chose is kept in the tokens; generation went on after it.
    assert out.token_ids[: len(short_chat_reference.token_ids)] == short_chat_reference.token_ids


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_gives_length_and_exactly_that_many_tokens(
    smollm2: LLM, greedy_reference: CompletionOutput, max_tokens: int
) -> None:
    out = generate_one(smollm2, PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    assert out.finish_reason == "length"
    assert out.stop_reason is None
    assert len(out.token_ids) == max_tokens
    assert out.token_ids == greedy_reference.token_ids[:max_tokens]
    assert out.text == smollm2.tokenizer.decode(out.token_ids)


def test_max_tokens_capped_by_max_model_len(smollm2: LLM) -> None:
    llm = smollm2.derive(max_model_len=12, num_blocks=2)
    prompt_ids = smollm2.tokenizer.encode(PROMPT)
    out = generate_one(llm, prompt_ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))
    assert out.finish_reason == "length"
    assert len(prompt_ids) + len(out.token_ids) == 12
    assert llm.core.kv.pool.num_free_blocks == llm.core.kv.pool.num_blocks


# --- logprobs -------------------------------------------------------------------------


def test_greedy_logprobs_hold_the_sampled_token_at_rank_one(smollm2: LLM) -> None:
    out = generate_one(smollm2, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))
    assert out.logprobs is not None
    assert len(out.logprobs) == len(out.token_ids) == 6
    total = 0.0
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in entry
        assert entry[token_id].rank == 1
        assert len(entry) == 3  # the greedy token is one of the top 3
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        values = [lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        assert entry[token_id].decoded_token == smollm2.tokenizer.decode([token_id])
        total += entry[token_id].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_sampled_logprobs_contain_the_sampled_token(smollm2: LLM) -> None:
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=8, logprobs=3)
    out = generate_one(smollm2, PROMPT, params)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in entry
        assert len(entry) in (3, 4)  # the top 3, plus the sampled token when outside them
        sampled = entry[token_id]
        if len(entry) == 4:
            assert sampled.rank > 3
        others = [lp for t, lp in entry.items() if t != token_id]
        assert sum(1 for lp in others if lp.logprob > sampled.logprob) == min(sampled.rank - 1, 3)


def test_no_logprobs_unless_asked(smollm2: LLM) -> None:
    out = generate_one(smollm2, PROMPT, SamplingParams(temperature=0.0, max_tokens=2))
    assert out.logprobs is None and out.cumulative_logprob is None


# --- prompts --------------------------------------------------------------------------


def test_token_id_prompt_matches_text_prompt(smollm2: LLM, greedy_reference: CompletionOutput) -> None:
    prompt_ids = list(smollm2.tokenizer.encode(PROMPT))
    outputs = smollm2.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert len(outputs) == 1
    assert outputs[0].prompt is None
    assert outputs[0].prompt_token_ids == prompt_ids
    assert outputs[0].outputs[0].token_ids == greedy_reference.token_ids[:6]


def test_batch_of_token_id_prompts(smollm2: LLM, greedy_reference: CompletionOutput) -> None:
    prompts = [list(smollm2.tokenizer.encode(PROMPT)), list(smollm2.tokenizer.encode("The sky is"))]
    outputs = smollm2.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert outputs[0].outputs[0].token_ids == greedy_reference.token_ids[:4]
    assert len(outputs[1].outputs[0].token_ids) == 4


def test_chat_batch_of_two_conversations(smollm2: LLM) -> None:
    conversations = [
        [{"role": "user", "content": "Say hi."}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outputs = smollm2.chat(conversations, params, use_tqdm=False)
    assert len(outputs) == 2
    assert len({o.request_id for o in outputs}) == 2
    for conversation, output in zip(conversations, outputs, strict=True):
        assert output.prompt_token_ids == apply_chat_template(smollm2.tokenizer, conversation)
        alone = smollm2.chat(conversation, params, use_tqdm=False)
        assert len(alone) == 1
        assert output.outputs[0].token_ids == alone[0].outputs[0].token_ids
        assert output.outputs[0].text
