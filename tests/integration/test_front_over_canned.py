"""The HTTP front (build_app on uvicorn, the bundled tokenizer) over the canned-token server:
the front's own paths that need no model, through real HTTP and gRPC, in seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.openai_support import MODEL, Front, assert_envelope, http, start_front
from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.tokenizer import load_tokenizer
from vllm_cluster.loadtest.canned import CannedConfig, canned_server

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    with canned_server(CannedConfig(model=MODEL)) as canned, start_front(
        canned.grpc_address, tokenizer=load_tokenizer(bundled_model_path())
    ) as served:
        yield served


def test_chat_prompt_logprobs_cover_the_truncated_prompt(front: Front) -> None:
    status, _, reply = http(front, "POST", "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0, "truncate_prompt_tokens": 3,
    })
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == len(reply["prompt_logprobs"]) == 3


def test_a_value_of_another_json_type_is_a_400_naming_the_field(front: Front) -> None:
    status, _, reply = http(front, "POST", "/v1/chat/completions", {"messages": CHAT, "stream": 0})
    assert status == 400
    assert_envelope(reply, 400, "stream")


def test_token_ids_past_the_vocabulary_are_a_400(front: Front) -> None:
    status, _, reply = http(front, "POST", "/v1/completions", {"prompt": [1, 49152], "max_tokens": 1})
    assert status == 400
    assert_envelope(reply, 400, "prompt")
