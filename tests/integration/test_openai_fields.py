"""Request fields that change what is sampled, scheduled or streamed, over the real cluster
(router + 1 prefill + 1 decode): over HTTP each gives the offline engine's answer for the
same parameters, and a bad value is a 400 naming the field; over gRPC (the Client) the
router tokenizes bad words and renders chat_template_kwargs."""

from __future__ import annotations

import copy
import json
import urllib.request
from typing import Any

import pytest

from tests.integration.openai_support import KEY, MODEL, assert_envelope, http
from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def cluster(openai_cluster: LocalCluster) -> LocalCluster:
    return openai_cluster


def _completion(cluster: LocalCluster, **fields: Any) -> dict[str, Any]:
    status, _, body = http(cluster, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields})
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def _offline(llm: LLM, prompt: str | list[int] = PROMPT, **params: Any) -> str:
    params = SamplingParams(temperature=0, max_tokens=6, **params)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_logits_processors_give_the_offline_answer(cluster: LocalCluster, smollm2: LLM) -> None:
    tokenizer = smollm2.get_tokenizer()
    banana = tokenizer.encode(" banana")[0]
    body = _completion(cluster, logit_bias={str(banana): 100})
    assert body["choices"][0]["text"] == " banana" * 6
    allowed = tokenizer.encode(" cat dog bird")
    text = _completion(cluster, allowed_token_ids=allowed)["choices"][0]["text"]
    assert text == _offline(smollm2, allowed_token_ids=allowed) and set(text.split()) <= {"cat", "dog", "bird"}
    text = _completion(cluster, bad_words=["Paris"])["choices"][0]["text"]
    assert "Paris" not in text and text == _offline(smollm2, bad_words=["Paris"])


def test_truncate_prompt_tokens_equals_sending_the_truncated_prompt(cluster: LocalCluster, smollm2: LLM) -> None:
    ids = smollm2.get_tokenizer().encode(PROMPT)
    truncated = _completion(cluster, truncate_prompt_tokens=3)
    assert truncated["usage"]["prompt_tokens"] == 3
    assert truncated["choices"][0]["text"] == _completion(cluster, prompt=ids[-3:])["choices"][0]["text"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1": "nan"}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 4096}, "truncate_prompt_tokens"),
        ({"priority": 2**40}, "priority"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(cluster: LocalCluster, fields: dict[str, Any], param: str) -> None:
    status, _, body = http(cluster, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, **fields})
    assert status == 400
    assert_envelope(body, 400, param)


@pytest.mark.parametrize("fields", [{"logit_bias": {"1000000": 1}}, {"allowed_token_ids": [1000000]},
                                    {"priority": 1}])
def test_what_only_the_instances_can_check_is_a_400_naming_the_field(cluster: LocalCluster,
                                                                     fields: dict[str, Any]) -> None:
    # Token ids past the vocabulary; a priority on instances that serve fcfs.
    status, _, body = http(cluster, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, **fields})
    assert status == 400
    assert_envelope(body, 400, next(iter(fields)))


def test_continuous_usage_stats_put_usage_on_every_chunk(cluster: LocalCluster) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse(cluster, "/v1/chat/completions", body)
    assert len(chunks) == 6  # one per token, then the usage chunk
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    assert [u["completion_tokens"] for u in usages] == [1, 2, 3, 4, 5, 5]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    body["stream_options"] = {"include_usage": True}
    assert [c["usage"] is None for c in _sse(cluster, "/v1/chat/completions", body)] == [True] * 5 + [False]


def test_chat_template_kwargs_reach_the_template(cluster: LocalCluster, smollm2: LLM) -> None:
    def prompt_tokens(**fields: Any) -> int:
        status, _, body = http(cluster, "POST", "/v1/chat/completions",
                               {"model": MODEL, "messages": CHAT, "max_tokens": 1, **fields})
        assert status == 200, body
        return int(body["usage"]["prompt_tokens"])

    generation_prompt = len(smollm2.get_tokenizer().encode("<|im_start|>assistant\n"))
    assert prompt_tokens() - prompt_tokens(chat_template_kwargs={"add_generation_prompt": False}) == generation_prompt
    status, _, body = http(cluster, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": CHAT, "chat_template_kwargs": {"tokenize": False}})
    assert status == 400
    assert_envelope(body, 400, "chat_template_kwargs")


def test_grpc_client_bad_words_truncation_and_chat_template_kwargs(cluster: LocalCluster, smollm2: LLM) -> None:
    with Client(cluster.router_address, api_key=KEY, timeout_s=120) as client:
        out = client.generate(PROMPT, max_tokens=6, temperature=0, bad_words=["Paris"])
        assert out.text == _offline(smollm2, bad_words=["Paris"])
        out = client.generate(PROMPT, max_tokens=6, temperature=0, truncate_prompt_tokens=3)
        assert out.text == _offline(smollm2, smollm2.get_tokenizer().encode(PROMPT)[-3:])
        with_prompt = client.generate(chat=CHAT, max_tokens=1)
        without = client.generate(chat=CHAT, max_tokens=1, chat_template_kwargs={"add_generation_prompt": False})
        assert with_prompt.usage.prompt_tokens > without.usage.prompt_tokens


def _sse(cluster: LocalCluster, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    request = urllib.request.Request(cluster.http_address + path, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(request, timeout=120) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# ---- every other field of the request models (router/openai/fields.py REQUEST_FIELDS)

_SEEDED = {"temperature": 1.5, "seed": 7}


def _sampling_cases(tokenizer: Any) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """field -> (the request without it, what it adds): each addition changes the answer."""
    paris = tokenizer.encode(" Paris")[0]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return {
        "top_p": (_SEEDED, {"top_p": 0.01}),
        "top_k": (_SEEDED, {"top_k": 1}),
        "min_p": (_SEEDED, {"min_p": 1.0}),
        "presence_penalty": ({}, {"presence_penalty": 2.0}),
        "frequency_penalty": ({}, {"frequency_penalty": 2.0}),
        "repetition_penalty": ({}, {"repetition_penalty": 2.0}),
        "stop": ({}, {"stop": ["."]}),
        "stop_token_ids": ({}, {"stop_token_ids": [paris]}),
        "min_tokens": ({"stop_token_ids": [paris]}, {"min_tokens": 3}),
        "include_stop_str_in_output": ({"stop": ["."]}, {"include_stop_str_in_output": True}),
        "ignore_eos": ({"logit_bias": {str(im_end): 100}}, {"ignore_eos": True}),
        "skip_special_tokens": ({"logit_bias": {str(im_end): 100}, "ignore_eos": True}, {"skip_special_tokens": False}),
    }


def test_sampling_fields_change_the_answer_as_offline(cluster: LocalCluster, smollm2: LLM) -> None:
    cases = _sampling_cases(smollm2.get_tokenizer())
    offline_params = []
    for base, added in cases.values():
        fields = {"temperature": 0, "max_tokens": 6, **base, **added}
        if "logit_bias" in fields:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        offline_params.append(SamplingParams(**fields))
    outputs = smollm2.generate([PROMPT] * len(cases), offline_params, use_tqdm=False)
    offline = [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]

    def answer(**fields: Any) -> tuple[str, int]:
        body = _completion(cluster, **fields)
        return body["choices"][0]["text"], body["usage"]["completion_tokens"]

    for (name, (base, added)), expected in zip(cases.items(), offline, strict=True):
        with_field, without = answer(**base, **added), answer(**base)
        assert with_field == expected, name
        assert with_field != without, name


def test_cache_salt_separates_prefix_caches(cluster: LocalCluster) -> None:
    prompt = "Salted prompts share cached blocks only with the same salt. " * 3

    def cached(salt: str) -> int:
        body = _completion(cluster, prompt=prompt, max_tokens=1, cache_salt=salt)
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("a") == 0
    assert cached("a") > 0
    assert cached("b") == 0


def test_chat_and_responses_limits_and_instructions(cluster: LocalCluster) -> None:
    status, _, body = http(cluster, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": CHAT, "max_completion_tokens": 3, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3

    def input_tokens(**fields: Any) -> int:
        status, _, body = http(cluster, "POST", "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1,
                                                                  **fields})
        assert status == 200, body
        return int(body["usage"]["input_tokens"])

    assert input_tokens(instructions="Answer in French.") != input_tokens()

    def output_text(**fields: Any) -> str:
        status, _, body = http(cluster, "POST", "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 8,
                                                                  **fields})
        assert status == 200, body
        return str(body["output"][0]["content"][0]["text"])

    assert output_text(temperature=1.5, top_p=0.01) == output_text(temperature=0)  # top_p 0.01: greedy


def test_tokenizer_options_reach_the_tokenizer(smollm2: LLM) -> None:
    """A chat message's name reaches the template; add_special_tokens and add_generation_prompt
    the tokenizer (on a copy that adds a BOS token, which SmolLM2's does not)."""
    from vllm_cluster.router.openai.protocol import ChatCompletionRequest
    from vllm_cluster.router.openai.serving import OpenAIServing

    tokenizer = copy.deepcopy(smollm2.get_tokenizer())
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.get('name', '?') }}: {{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %} A:{% endif %}"
    )
    tokenizer.add_bos_token = True
    serving = OpenAIServing(None, tokenizer, MODEL, 1024)  # type: ignore[arg-type]  # tokenize needs no backend
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi", "name": "Ann"}])
    assert tokenizer.decode(serving.tokenize(None, body.chat(), True, False)["tokens"]) == "Ann: Hi"
    assert tokenizer.decode(serving.tokenize(None, body.chat(), True, True)["tokens"]) == "Ann: Hi A:"
    with_bos = serving.tokenize("Hi", None, True, True)["tokens"]
    assert with_bos[1:] == serving.tokenize("Hi", None, False, True)["tokens"] and with_bos[0] == tokenizer.bos_token_id


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/v1/responses", {"input": "Hi", "tools": [{"type": "function"}]}, "tools"),
        ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ("/v1/responses", {"input": [{"role": "user", "content": "Hi", "type": "function_call"}]}, "input"),
    ],
)
def test_fields_not_served_are_refused_naming_them(cluster: LocalCluster, route: str, fields: dict[str, Any],
                                                   param: str) -> None:
    status, _, body = http(cluster, "POST", route, {"model": MODEL, **fields})
    assert status == 400, body
    assert_envelope(body, 400, param)


def test_tokenizer_routes_check_the_model(cluster: LocalCluster) -> None:
    assert http(cluster, "POST", "/tokenize", {"model": MODEL, "prompt": "Hi"})[0] == 200
    status, _, body = http(cluster, "POST", "/tokenize", {"model": "other", "prompt": "Hi"})
    assert status == 404
    assert_envelope(body, 404, "model")
    status, _, body = http(cluster, "POST", "/detokenize", {"model": "other", "tokens": [1]})
    assert status == 404
    assert_envelope(body, 404, "model")
