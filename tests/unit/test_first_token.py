"""When the router may send the prefill's first token ahead of the decode instance
(router/first_token.py), with the bundled model's real tokenizer: its text is what the
decode instance's detokenizer gives that token, and nothing that could still change it goes."""

from __future__ import annotations

import pytest

from vllm_cluster.engine import LLM
from vllm_cluster.engine.detokenizer import IncrementalDetokenizer
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.first_token import EarlyToken, drop_early_token, early_first_token


@pytest.fixture(scope="module")
def tokenizer(smollm2: LLM):
    return smollm2.get_tokenizer()


def _request(tokenizer, text: str, **params: object) -> pb.WorkerRequest:
    return pb.WorkerRequest(request_id="r", prompt_token_ids=tokenizer.encode(text),
                            sampling_params=pb.SamplingParams(**params))


def _prefilled(token_id: int) -> pb.PrefillResponse:
    return pb.PrefillResponse(first_token=pb.TokenLogprob(token_id=token_id))


def test_the_text_is_the_decode_detokenizers(tokenizer) -> None:
    request = _request(tokenizer, "The capital of France is")
    token = tokenizer.encode(" Paris")[0]
    early = early_first_token(tokenizer, request, _prefilled(token))
    decode_side = IncrementalDetokenizer(tokenizer, list(request.prompt_token_ids), SamplingParams())
    decode_side.update([token])
    assert early == EarlyToken(token, decode_side.text) and early.text.strip()


def test_what_could_still_change_is_left_to_the_decode_instance(tokenizer) -> None:
    token = tokenizer.encode(" Paris")[0]
    assert early_first_token(tokenizer, _request(tokenizer, "x", stop=["\n"]), _prefilled(token)) is None
    assert early_first_token(tokenizer, _request(tokenizer, "x", logprobs=1), _prefilled(token)) is None
    assert early_first_token(tokenizer, _request(tokenizer, "x", prompt_logprobs=0), _prefilled(token)) is None
    assert early_first_token(tokenizer, _request(tokenizer, "x", stop_token_ids=[token]), _prefilled(token)) is None
    eos = tokenizer.eos_token_id
    assert early_first_token(tokenizer, _request(tokenizer, "x"), _prefilled(eos)) is None
    assert early_first_token(tokenizer, _request(tokenizer, "x"), pb.PrefillResponse()) is None  # no token
    assert early_first_token(None, _request(tokenizer, "x"), _prefilled(token)) is None
    # Half of a character (the first byte token of a multi-byte one) waits for the next token.
    first_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")
    assert early_first_token(tokenizer, _request(tokenizer, "x"), _prefilled(first_byte)) is None


def test_the_decode_instances_copy_is_dropped() -> None:
    early = EarlyToken(7, " Paris")
    message = pb.GenerateResponse(request_id="r", token_ids=[7, 8], text=" Paris is")
    assert drop_early_token(message, early)
    assert (list(message.token_ids), message.text) == ([8], " is")
    other = pb.GenerateResponse(request_id="r", token_ids=[9], text=" Lyon")
    assert not drop_early_token(other, early) and list(other.token_ids) == [9]  # left as it was
