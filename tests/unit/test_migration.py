"""The migration bookkeeping: a continuation carries the prompt plus what was relayed,
with its limits reduced; text a lost instance held back is recovered exactly."""

from __future__ import annotations

from vllm_cluster.engine.detokenizer import IncrementalDetokenizer
from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.tokenizer import load_tokenizer
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.migration import Progress, continuation, held_back_text, remaining_tokens


def _request(**sampling: object) -> pb.WorkerRequest:
    return pb.WorkerRequest(request_id="r1", prompt_token_ids=[5, 6, 7], sampling_params=pb.SamplingParams(**sampling),
                            extra_keys=["tenant"])


def test_continuation_extends_the_prompt_and_shrinks_the_limits() -> None:
    progress = Progress([5, 6, 7], token_ids=[8, 9], migrations=1)
    leg = continuation(_request(max_tokens=10, min_tokens=3, temperature=0.5), progress)
    assert list(leg.prompt_token_ids) == [5, 6, 7, 8, 9]
    assert leg.request_id == "r1~m1" and list(leg.extra_keys) == ["tenant"]
    assert leg.sampling_params.max_tokens == 8 and leg.sampling_params.min_tokens == 1
    assert leg.sampling_params.temperature == 0.5
    assert remaining_tokens(leg) == 8


def test_continuation_of_defaults_and_unlimited() -> None:
    progress = Progress([5, 6, 7], token_ids=[1] * 16)
    assert remaining_tokens(continuation(_request(), progress)) == 0  # the default 16 were all relayed
    unlimited = continuation(_request(max_tokens_unlimited=True), progress)
    assert unlimited.sampling_params.max_tokens_unlimited and remaining_tokens(unlimited) is None


def test_held_back_text_is_what_was_generated_but_not_sent() -> None:
    tokenizer = load_tokenizer(bundled_model_path())
    prompt = tokenizer.encode("The capital of France is")
    generated = tokenizer.encode(" Paris. It is known")
    full = tokenizer.decode(generated)
    progress = Progress(prompt, token_ids=generated, text=full[:-4])  # the last 4 characters held back
    assert held_back_text(tokenizer, _request(), progress) == full[-4:]
    assert held_back_text(tokenizer, _request(), Progress(prompt, token_ids=generated, text=full)) == ""
    assert held_back_text(None, _request(), progress) == ""


def test_a_migration_inside_a_multibyte_character_loses_and_adds_nothing() -> None:
    """At every split point of an output whose characters span two tokens each: the text the
    lost instance sent, the text it held back, and the text the continuation's instance
    sends add up to the text one instance would have sent."""
    tokenizer = load_tokenizer(bundled_model_path())
    prompt = tokenizer.encode("Say it in Arabic:")
    output = tokenizer.encode("صص！ and ص")
    assert any(tokenizer.decode(output[:k]).endswith("\ufffd") for k in range(1, len(output)))
    whole = _detokenized(tokenizer, prompt, output)
    assert whole == tokenizer.decode(output)
    for k in range(1, len(output)):
        sent = _detokenized(tokenizer, prompt, output[:k])
        progress = Progress(prompt, token_ids=output[:k], text=sent)
        progress.pending_text = held_back_text(tokenizer, _request(), progress)
        rest = _detokenized(tokenizer, prompt + output[:k], output[k:])
        assert sent + progress.pending_text + rest == whole, k


def _detokenized(tokenizer: object, prompt: list[int], output: list[int]) -> str:
    """What an instance streams for `output` after `prompt`, token by token."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    for token_id in output:
        detokenizer.update([token_id])
    return detokenizer.text
