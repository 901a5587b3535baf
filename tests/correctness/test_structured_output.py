"""Structured output on the bundled SmolLM2: outputs parse and match their JSON schema,
regex, choice or grammar; a request that completes its grammar finishes with "stop";
unconstrained requests in the same batch are untouched; the decode side of a hand-off
continues the grammar from the prefill's first token; a migrated request replays its
generated tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.correctness.handoff import run_disaggregated
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

# Bounded output: a short capitalised name, a small integer, one of three colours.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
# What 200 sampled requests share: short (about 14 tokens), so that they are cheap on a CPU.
AGE_COLOR = {
    "type": "object",
    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "color": {"enum": ["red", "blue"]}},
    "required": ["age", "color"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a favourite color."}]


def _chat(llm: LLM, so: StructuredOutputsParams, **options: object) -> tuple[str, str | None]:
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=so, **options)  # type: ignore[arg-type]
    out = llm.chat(ASK, params, use_tqdm=False)[0].outputs[0]
    return out.text, out.finish_reason


def test_json_schema_output_validates(smollm2: LLM) -> None:
    text, finish_reason = _chat(smollm2, StructuredOutputsParams(json=PERSON))
    jsonschema.validate(json.loads(text), PERSON)
    assert finish_reason == "stop"


def test_regex_choice_json_object_and_grammar(smollm2: LLM) -> None:
    text, finish_reason = _chat(smollm2, StructuredOutputsParams(regex=r"[A-Z][a-z]+ is [0-9]{2} years old\."))
    assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{2} years old\.", text) and finish_reason == "stop"
    text, finish_reason = _chat(smollm2, StructuredOutputsParams(choice=["sunny", "rainy", "cloudy"]))
    assert text in ("sunny", "rainy", "cloudy") and finish_reason == "stop"
    so = StructuredOutputsParams(json_object=True)
    out = smollm2.chat(ASK, SamplingParams(temperature=0, max_tokens=48, structured_outputs=so), use_tqdm=False)
    if out[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(out[0].outputs[0].text), dict)
    else:  # cut by max_tokens: still a prefix of one JSON object
        assert out[0].outputs[0].text.startswith("{")
    text, finish_reason = _chat(smollm2, StructuredOutputsParams(grammar='root ::= ("yes" | "no") "!"'))
    assert text in ("yes!", "no!") and finish_reason == "stop"


def test_grammar_end_finishes_the_request_even_with_ignore_eos(smollm2: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=50, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["ok"])
    )
    out = smollm2.chat(ASK, params, use_tqdm=False)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"
    assert len(out.token_ids) <= 3  # "ok" and the end of sequence


def test_min_tokens_does_not_hold_a_complete_grammar_open(smollm2: LLM) -> None:
    """min_tokens bans the end-of-sequence token; a complete grammar allows nothing else, so
    the grammar decides: the same answer as without min_tokens, nothing outside the grammar."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [SamplingParams(max_tokens=20, temperature=0, min_tokens=n, structured_outputs=choice) for n in (0, 10)]
    outs = [smollm2.generate(["Is the sky blue? Answer:"], p, use_tqdm=False)[0].outputs[0] for p in params]
    assert outs[1].text in ("yes", "no") and outs[1].finish_reason == "stop"
    assert outs[1].token_ids == outs[0].token_ids


def test_unconstrained_requests_in_a_mixed_batch_are_untouched(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "1, 2, 3,")]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in smollm2.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=PERSON))
    mixed = smollm2.generate(
        [prompts[0], prompts[0], prompts[1], prompts[1], prompts[2]],
        [plain, constrained, plain, constrained, plain],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    assert all(mixed[i].outputs[0].text.startswith("{") for i in (1, 3))


def test_200_sampled_json_schema_requests_all_validate(smollm2: LLM) -> None:
    llm = smollm2.derive(max_num_seqs=100)
    num_compiled = llm.core.grammars.num_compiled
    so = StructuredOutputsParams(json=AGE_COLOR)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=32, structured_outputs=so) for i in range(200)]
    outputs = llm.generate(["A person, as JSON:"] * 200, params, use_tqdm=False)  # a short prompt: 200 are many
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), AGE_COLOR)
    assert llm.core.grammars.num_compiled == num_compiled + 1  # one compiled grammar, shared by all 200


def test_decode_continues_the_grammar_after_the_prefill_token(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    pattern = r"[a-z]{3,6} = [0-9]{3};"
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = [tok.encode(t) for t in ("The capital of France is", "Once upon a time, ")]
    expected = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    prefill = smollm2.derive(role="prefill").core
    decode = smollm2.derive(role="decode").core
    got, _ = run_disaggregated(prefill, decode, prompts, params)
    assert got == expected
    for token_ids in got:
        assert re.fullmatch(pattern, tok.decode(token_ids, skip_special_tokens=True))


def test_migrated_request_replays_its_generated_tokens(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    so = StructuredOutputsParams(regex=r"[a-z]{3,6} = [0-9]{3};")
    prompt = tok.encode("The capital of France is")
    full = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=20, structured_outputs=so), use_tqdm=False)
    token_ids = full[0].outputs[0].token_ids
    core = smollm2.core
    params = SamplingParams(temperature=0, max_tokens=20 - 3, structured_outputs=so)
    request = core.make_request("migrated", prompt + token_ids[:3], params, num_generated_prompt_tokens=3)
    core.add_request(request)
    while core.has_unfinished():
        core.step()
    assert request.output_token_ids == token_ids[3:]
    with pytest.raises(InvalidRequestError, match="already generated"):
        core.make_request("bad", prompt + tok.encode("123"), params, num_generated_prompt_tokens=1)
