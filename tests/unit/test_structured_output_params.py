"""Structured-output specs, checked before anything runs: the engine's params (exactly one
spec, each one valid, errors naming the field), the OpenAI fields that map to them (400s
naming the field), the wire message both ways, and a migrated request's replay count."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.migration import Progress, continuation
from vllm_cluster.router.openai.errors import ApiError
from vllm_cluster.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_cluster.worker.convert import sampling_params_from_proto, sampling_params_to_proto

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "objekt"}}, r"structured_outputs.json is not a valid JSON schema: .*objekt"),
        ({"json": "{not json"}, "structured_outputs.json is not a valid JSON schema"),
        ({"regex": "a(("}, "structured_outputs.regex is not a valid regular expression: .*parenthesis"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar is not a valid EBNF grammar"),
        ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar is not a valid EBNF grammar: .*root"),
        ({"choice": []}, "structured_outputs.choice must be non-empty strings"),
        ({"choice": "ab"}, "structured_outputs.choice must be non-empty strings"),
        ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "json_object": True}, "exactly one of .*; got regex, json_object"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutputsParams(**spec)


def test_equal_specs_share_a_key() -> None:
    a = StructuredOutputsParams(json=SCHEMA)
    b = StructuredOutputsParams(json={"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.key == b.key and a.kind == "json"
    assert StructuredOutputsParams(choice=["x", "y"]).key != StructuredOutputsParams(choice=["x y"]).key


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(regex="[0-9]+"),
        StructuredOutputsParams(choice=["a", "b"]),
        StructuredOutputsParams(grammar='root ::= "x"'),
        StructuredOutputsParams(json_object=True),
    ],
)
def test_wire_round_trip(so: StructuredOutputsParams) -> None:
    back = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(structured_outputs=so)))
    assert back.structured_outputs is not None and back.structured_outputs.key == so.key
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())).structured_outputs is None


def _chat(**fields: Any) -> pb.SamplingParams:
    return ChatCompletionRequest(messages=CHAT, **fields).to_sampling_params()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         {"json": SCHEMA}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, {"grammar": 'root ::= "x"'}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
    ],
)
def test_openai_fields_become_one_constraint(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    msg = _chat(**fields)
    assert msg.HasField("structured_outputs")
    params = sampling_params_from_proto(msg)
    assert params.structured_outputs is not None
    assert params.structured_outputs.key == StructuredOutputsParams(**expected).key
    completion = CompletionRequest(prompt="hi", **fields).to_sampling_params()
    assert completion.structured_outputs == msg.structured_outputs


def test_response_format_text_is_no_constraint() -> None:
    assert not _chat(response_format={"type": "text"}).HasField("structured_outputs")
    assert not _chat().HasField("structured_outputs")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format", "not a valid JSON schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be 'text', 'json_object' or 'json_schema'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "must be an object with a schema"),
        ({"structured_outputs": {"regex": "a(("}}, "structured_outputs", "not a valid regular expression"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag is not supported"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "not a valid EBNF grammar"),
        ({"guided_choice": []}, "guided_choice", "non-empty strings"),
        ({"guided_regex": "[0-9]", "response_format": {"type": "json_object"}}, "guided_regex", "send only one"),
    ],
)
def test_bad_openai_fields_are_400_naming_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(ApiError) as raised:
        _chat(**fields)
    assert raised.value.status == 400 and raised.value.param == param
    assert message in raised.value.message


def test_continuation_counts_the_tokens_its_grammar_replays() -> None:
    sampling = pb.SamplingParams(max_tokens=10, structured_outputs=pb.StructuredOutputs(regex="[a-z]+"))
    request = pb.WorkerRequest(request_id="r1", prompt_token_ids=[5, 6], sampling_params=sampling)
    leg = continuation(request, Progress([5, 6], token_ids=[7, 8, 9], migrations=1))
    assert leg.sampling_params.structured_outputs.num_generated_prompt_tokens == 3
    plain = continuation(pb.WorkerRequest(request_id="r2", prompt_token_ids=[5]), Progress([5], token_ids=[7]))
    assert not plain.sampling_params.HasField("structured_outputs")


def test_the_mask_kernel_warm_up_runs_and_a_failure_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    """The warm-up's calls are xgrammar's own (on CPU here, its CPU kernel; on CUDA, the
    Triton one it compiles ahead); one that fails leaves a warning, not an error."""
    import torch

    from vllm_cluster.engine.structured_output import warm_mask_kernel

    with caplog.at_level("WARNING", logger="vllm_cluster.engine.structured_output"):
        warm_mask_kernel(1000, torch.device("cpu"), torch.float32)
        assert not caplog.records
        warm_mask_kernel(1000, torch.device("cpu"), torch.int8)  # not a logits dtype xgrammar takes
    assert "it compiles on first use" in caplog.text
