"""The HTTP front accepts what /openapi.json states and nothing else: values of another JSON
type are refused (not converted), token ids are bounded by the tokenizer's vocabulary in
the document and at the server, and fields the document calls required or exclusive are so.
tests/integration/test_openapi_fuzz.py checks the same with schemathesis; these pin each rule."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.tokenizer import load_tokenizer
from vllm_cluster.router.anthropic.protocol import MessagesRequest
from vllm_cluster.router.openai.app import build_app
from vllm_cluster.router.openai.backend import RouterBackend
from vllm_cluster.router.openai.errors import ApiError, invalid_body
from vllm_cluster.router.openai.openapi import integers_up_to
from vllm_cluster.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoRAAdapterRequest,
    TokenizeRequest,
)
from vllm_cluster.router.openai.serving import OpenAIServing

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def serving() -> OpenAIServing:
    # The backend is never started: every request here is refused before it is sent.
    return OpenAIServing(RouterBackend("127.0.0.1:1"), load_tokenizer(bundled_model_path()), "m", 1024)


def _refused(model: type[BaseModel], body: dict[str, Any]) -> ApiError:
    """The 400 the front answers for `body` (app.py turns validation errors into it)."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return invalid_body(e.value.errors(), "application/json")


@pytest.mark.parametrize(("field", "value"), [("stream", 0), ("stream", "true"), ("logprobs", 1), ("n", "2"),
                                              ("temperature", True), ("seed", 1.5)])
def test_a_value_of_another_json_type_is_refused_naming_the_field(field: str, value: Any) -> None:
    error = _refused(ChatCompletionRequest, {"messages": CHAT, field: value})
    assert error.status == 400 and error.param == field


def test_a_whole_number_written_with_a_fraction_is_an_integer_as_in_json_schema() -> None:
    assert ChatCompletionRequest.model_validate({"messages": CHAT, "n": 2.0, "max_tokens": 5.0}).n == 2


@pytest.mark.parametrize(("field", "value"), [("temperature", -0.5), ("top_p", 0.0), ("n", 0), ("top_k", -2),
                                              ("allowed_token_ids", []), ("truncate_prompt_tokens", 0)])
def test_a_value_out_of_its_documented_range_is_refused_naming_the_field(field: str, value: Any) -> None:
    assert _refused(CompletionRequest, {"prompt": "x", field: value}).param == field


@pytest.mark.parametrize(("field", "value"), [("bad_words", [" "]), ("logit_bias", {"-1": 1.0}),
                                              ("logit_bias", {"01": 1.0}), ("logit_bias", {" 1": 1.0})])
def test_a_value_off_its_documented_pattern_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ApiError) as e:
        CompletionRequest.model_validate({"prompt": "x", field: value}).to_sampling_params()
    assert e.value.status == 400 and e.value.param == field


def test_anthropic_max_tokens_below_one_is_refused_before_the_chat_path() -> None:
    body = {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}
    assert _refused(MessagesRequest, body).param == "max_tokens"


def test_lora_load_needs_a_name_and_a_path() -> None:
    assert _refused(LoRAAdapterRequest, {"lora_name": "a"}).param == "lora_path"


@pytest.mark.parametrize("body", [{}, {"prompt": "x", "messages": CHAT}, {"prompt": None, "messages": CHAT}])
def test_tokenize_takes_exactly_one_of_prompt_or_messages_never_null(body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as e:
        TokenizeRequest.model_validate(body)
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize(("body", "field"), [({"prompt": [1, 49152]}, "prompt"),
                                             ({"prompt": "x", "allowed_token_ids": [49152]}, "allowed_token_ids"),
                                             ({"prompt": "x", "logit_bias": {"49152": 1.0}}, "logit_bias")])
def test_token_ids_past_the_vocabulary_are_refused_at_the_front(
    serving: OpenAIServing, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiError) as e:
        asyncio.run(serving.completions(CompletionRequest.model_validate(body), "r"))  # type: ignore[arg-type]
    assert e.value.status == 400 and e.value.param == field and "49152" in e.value.message


def test_the_document_states_the_bounds_only_the_running_server_knows(
    serving: OpenAIServing,
) -> None:
    doc = build_app(serving).app.openapi()  # type: ignore[attr-defined]
    schemas = doc["components"]["schemas"]
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert tokens["maximum"] == len(serving.tokenizer) - 1 and "exclusiveMaximum" not in tokens
    assert "x-token-id" not in str(doc) and "x-max-tokens" not in str(doc)
    max_tokens = schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert max_tokens["maximum"] == serving.max_model_len - 1  # a prompt has at least one token
    assert schemas["ThinkingParam"]["properties"]["type"]["const"] == "disabled"  # no reasoning parser here
    bias = schemas["CompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["propertyNames"]
    assert bias["pattern"] == integers_up_to(len(serving.tokenizer) - 1)
    assert schemas["TokenizeRequest"]["oneOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]


@pytest.mark.parametrize("n", [0, 7, 10, 19, 100, 909, 4915])
def test_the_token_id_key_pattern_matches_exactly_the_ids_up_to_n(n: int) -> None:
    pattern = re.compile(integers_up_to(n))
    assert [k for k in range(n + 1000) if pattern.fullmatch(str(k))] == list(range(n + 1))
    assert not any(pattern.fullmatch(key) for key in ("", "-1", "00", "01", "+1", " 1"))
