"""Prompt logprobs and echo through the served cluster. Over gRPC, colocated (the decode
instance computes the prompt, chunk by chunk) and disaggregated (the prefill instance
computes it; its logprobs travel with its reply through the router) equal the offline
engine's. Over HTTP, /v1/completions with echo and vLLM's `prompt_logprobs` take OpenAI's
and vLLM's shapes. lm-evaluation-harness runs against the HTTP front offline (tasks and
data written here): `local-completions` scores a multiple-choice task through echo +
logprobs (echo, max_tokens 1, logprobs 1, temperature 0) and picks, item by item, the
choice HF transformers' logprobs pick; `local-chat-completions` runs a generate_until task
and answers what the offline engine answers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.openai_support import CHAT, KEY, MODEL, assert_envelope, http
from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.outputs import RequestOutput

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read books. " * 2,
]
NUM_TOP = 2
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def disaggregated(openai_cluster: LocalCluster) -> LocalCluster:
    return openai_cluster


@pytest.fixture(scope="module")
def colocated(colocated_cluster: LocalCluster) -> LocalCluster:
    return colocated_cluster


@pytest.fixture(scope="module")
def offline(smollm2: LLM) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=NUM_TOP)
    return smollm2.generate(PROMPTS, params, use_tqdm=False)


def assert_close_to_offline(ours: list[Any], expected: RequestOutput) -> None:
    """`ours`: the wire's prompt logprobs (tokens 1, 2, ...) against the offline engine's."""
    assert expected.prompt_logprobs is not None
    assert len(ours) == len(expected.prompt_token_ids) - 1
    for lp, want, token_id in zip(ours, expected.prompt_logprobs[1:], expected.prompt_token_ids[1:], strict=True):
        assert want is not None and lp.token_id == token_id
        assert math.isclose(lp.logprob, want[token_id].logprob, abs_tol=2e-3)
        assert len(lp.top) == NUM_TOP
        for top in lp.top:
            assert top.token_id in want and math.isclose(top.logprob, want[top.token_id].logprob, abs_tol=2e-3)


@pytest.mark.parametrize("which", ["colocated", "disaggregated"])
def test_grpc_prompt_logprobs_equal_offline(which: str, request: pytest.FixtureRequest, offline: Any) -> None:
    cluster: LocalCluster = request.getfixturevalue(which)
    client = Client(cluster.router_address, api_key=cluster.api_key)
    try:
        for expected in offline:
            got = client.generate(
                token_ids=expected.prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=NUM_TOP
            )
            assert_close_to_offline(got.prompt_logprobs, expected)
            assert got.token_ids == expected.outputs[0].token_ids
            assert got.usage is not None and got.usage.cached_tokens == 0
            assert got.timings is not None and got.timings.prefill_skipped == (which == "colocated")
        plain = client.generate(token_ids=offline[0].prompt_token_ids, max_tokens=2, temperature=0.0)
        assert plain.prompt_logprobs == []
        # A cluster without prefill instances is no failed hand-off: nothing recomputed or warned.
        assert not plain.timings.recomputed
        assert "prefill failed" not in (cluster.log_dir / "router.log").read_text()
    finally:
        client.close()


# ---- HTTP


def _completion(cluster: LocalCluster, **body: Any) -> dict[str, Any]:
    status, _, reply = http(cluster, "POST", "/v1/completions", {"model": MODEL, "temperature": 0, **body})
    assert status == 200, reply
    return reply


def test_echo_without_generation_is_the_prompt_and_its_logprobs(disaggregated: LocalCluster, offline: Any) -> None:
    expected = offline[0]
    choice = _completion(disaggregated, prompt=PROMPTS[0], echo=True, max_tokens=0, logprobs=1)["choices"][0]
    assert choice["text"] == PROMPTS[0]
    logprobs = choice["logprobs"]
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == num_prompt
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for ours, want, token_id in zip(logprobs["token_logprobs"][1:], expected.prompt_logprobs[1:],
                                    expected.prompt_token_ids[1:], strict=True):
        assert math.isclose(ours, want[token_id].logprob, abs_tol=2e-3)
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])


def test_echo_with_generation_puts_the_prompt_first(disaggregated: LocalCluster, offline: Any) -> None:
    expected = offline[0]
    choice = _completion(disaggregated, prompt=PROMPTS[0], echo=True, max_tokens=MAX_TOKENS, logprobs=0)["choices"][0]
    assert choice["text"] == PROMPTS[0] + expected.outputs[0].text
    num_prompt = len(expected.prompt_token_ids)
    assert len(choice["logprobs"]["tokens"]) == num_prompt + MAX_TOKENS
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])
    plain = _completion(disaggregated, prompt=[PROMPTS[0], PROMPTS[1]], echo=True, max_tokens=MAX_TOKENS)
    for c, prompt, want in zip(plain["choices"], PROMPTS, offline, strict=True):
        assert c["text"] == prompt + want.outputs[0].text and c["logprobs"] is None


def test_streamed_echo_equals_whole(disaggregated: LocalCluster) -> None:
    whole = _completion(disaggregated, prompt=PROMPTS[0], echo=True, max_tokens=MAX_TOKENS, logprobs=1)["choices"][0]
    status, _, events = http(disaggregated, "POST", "/v1/completions", {
        "model": MODEL, "prompt": PROMPTS[0], "echo": True, "max_tokens": MAX_TOKENS, "logprobs": 1,
        "temperature": 0, "stream": True,
    })
    assert status == 200
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]


def test_vllm_prompt_logprobs_field(disaggregated: LocalCluster, offline: Any) -> None:
    expected = offline[1]
    choice = _completion(disaggregated, prompt=expected.prompt_token_ids, max_tokens=1,
                         prompt_logprobs=NUM_TOP)["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(expected.prompt_token_ids)
    for entry, want, token_id in zip(entries[1:], expected.prompt_logprobs[1:], expected.prompt_token_ids[1:],
                                     strict=True):
        ours = entry[str(token_id)]
        assert math.isclose(ours["logprob"], want[token_id].logprob, abs_tol=2e-3)
        assert set(ours) == {"logprob", "rank", "decoded_token"} and ours["rank"] >= 1
        assert {int(t) for t in entry} == set(want)
    status, _, reply = http(disaggregated, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0,
    })
    assert status == 200, reply
    assert reply["prompt_logprobs"][0] is None and len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in reply["prompt_logprobs"][1:])


def test_prompt_logprobs_refused_when_streaming(disaggregated: LocalCluster) -> None:
    status, _, reply = http(disaggregated, "POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "prompt_logprobs": 1, "stream": True,
    })
    assert status == 400
    assert_envelope(reply, 400, "prompt_logprobs")
    status, _, reply = http(disaggregated, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert status == 400


# ---- lm-evaluation-harness

MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "label": 0},
    {"question": "Two plus two equals", "choices": ["seven", "four", "ten"], "label": 1},
    {"question": "The color of the clear daytime sky is", "choices": ["green", "purple", "blue"], "label": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "label": 0},
]
GENERATE = [{"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "Name a primary color.", "answer": "Red"}]
MAX_GEN_TOKS = 8


@pytest.fixture
def offline_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)


def _write_task(directory: Path, name: str, rows: list[dict[str, Any]], spec: str) -> None:
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\ndoc_to_text: '{{{{question}}}}'\n{spec}"
    )


def _evaluate(task_dir: Path, name: str, model: str, model_args: dict[str, Any], **options: Any) -> list[Any]:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[name], task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True, bootstrap_iters=0, **options,
    )
    assert results is not None
    return sorted(results["samples"][name], key=lambda s: s["doc_id"])


def _hf_loglikelihood(hf: Any, tokenizer: Any, context: str, continuation: str) -> float:
    """What lm-eval asks for: the continuation's logprob after the context, tokenized as
    lm-eval does (the whole text encoded, the context's tokens split off the front)."""
    whole = tokenizer.encode(context + continuation)
    num_context = len(tokenizer.encode(context))
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(logprobs[p - 1, whole[p]]) for p in range(num_context, len(whole)))


def test_local_completions_multiple_choice_picks_what_hf_picks(
    disaggregated: LocalCluster, smollm2: LLM, hf_smollm2: Any, tmp_path: Path, offline_env: None
) -> None:
    tokenizer_dir = tmp_path / "tokenizer"
    smollm2.tokenizer.save_pretrained(str(tokenizer_dir))
    _write_task(tmp_path, "tiny_mc", MULTIPLE_CHOICE,
                "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: label\n"
                "metric_list:\n  - metric: acc\n")
    samples = _evaluate(tmp_path, "tiny_mc", "local-completions", {
        "model": MODEL, "base_url": f"{disaggregated.http_address}/v1/completions", "tokenizer": str(tokenizer_dir),
        "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1,
    })
    assert len(samples) == len(MULTIPLE_CHOICE)
    for sample, row in zip(samples, MULTIPLE_CHOICE, strict=True):
        ours = [float(resp[0]) for resp in sample["filtered_resps"]]
        hf = [_hf_loglikelihood(hf_smollm2, smollm2.tokenizer, row["question"], " " + c) for c in row["choices"]]
        for a, b in zip(ours, hf, strict=True):
            assert math.isclose(a, b, abs_tol=1e-2), (row, ours, hf)
        assert ours.index(max(ours)) == hf.index(max(hf)), (row, ours, hf)


def test_local_chat_completions_generate_until(
    disaggregated: LocalCluster, smollm2: LLM, tmp_path: Path, offline_env: None
) -> None:
    _write_task(tmp_path, "tiny_gen", GENERATE,
                "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
                f"generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
                "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    samples = _evaluate(tmp_path, "tiny_gen", "local-chat-completions", {
        "model": MODEL, "base_url": f"{disaggregated.http_address}/v1/chat/completions", "tokenizer_backend": None,
        "num_concurrent": 1, "max_retries": 1,
    }, apply_chat_template=True)
    assert len(samples) == len(GENERATE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_GEN_TOKS, stop=["\n"])
    for sample, row in zip(samples, GENERATE, strict=True):
        expected = smollm2.chat([{"role": "user", "content": row["question"]}], params, use_tqdm=False)[0]
        assert sample["filtered_resps"][0] == expected.outputs[0].text
