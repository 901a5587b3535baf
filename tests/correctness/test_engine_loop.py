"""The engine on its own thread, as the services run it: streamed deltas add up to what
`LLM.generate` returns, stop-string text is never streamed, aborts end streams and free blocks."""

from __future__ import annotations

import threading

import pytest

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.engine_loop import EngineLoop, StreamDelta

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop(smollm2: LLM):  # type: ignore[no-untyped-def]
    engine = smollm2.derive()
    loop = EngineLoop(engine.core, smollm2.get_tokenizer())
    yield loop
    loop.stop()


def test_stream_adds_up_to_generate(loop: EngineLoop, smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    prompts = ["The capital of France is", "Roses are red,"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = smollm2.generate(prompts, params, use_tqdm=False)
    streams = [loop.add(loop.core.make_request(f"s{i}", tok.encode(p), params)) for i, p in enumerate(prompts)]
    for stream, exp in zip(streams, expected, strict=True):
        deltas = list(stream)
        assert [t for d in deltas for t in d.token_ids] == exp.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == exp.outputs[0].text
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 10


def test_a_stream_interval_sends_tokens_in_groups_that_add_up_the_same(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=1)
    expected = smollm2.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    grouped = EngineLoop(smollm2.derive(stream_interval=4).core, tok)
    try:
        deltas = list(grouped.add(grouped.core.make_request("g", tok.encode("The capital of France is"), params)))
    finally:
        grouped.stop()
    # The first token at once (time to first token), then groups of 4, the rest with the finish.
    assert [len(d.token_ids) for d in deltas] == [1, 4, 4, 2]
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert [lp.token_id for d in deltas for lp in d.logprobs] == expected.token_ids
    assert deltas[-1].finish_reason == "length"


class _Recorder:
    """A DeltaSink that keeps every call it gets."""

    def __init__(self, num_requests: int) -> None:
        self.calls: list[list[tuple[str, StreamDelta]]] = []
        self._num_open = num_requests
        self.done = threading.Event()

    def put_deltas(self, deltas: list[tuple[str, StreamDelta]]) -> None:
        self.calls.append(list(deltas))
        self._num_open -= sum(delta.finish_reason is not None for _, delta in deltas)
        if self._num_open == 0:
            self.done.set()


def test_attached_streams_reach_their_sink_together_once_per_step(loop: EngineLoop, smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    prompts = ["The capital of France is", "Roses are red,", "def quicksort(arr):"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = smollm2.generate(prompts, params, use_tqdm=False)
    sink = _Recorder(len(prompts))
    for i, prompt in enumerate(prompts):  # deltas made before the attach come first
        loop.attach(loop.add(loop.core.make_request(f"sink{i}", tok.encode(prompt), params)), sink)
    assert sink.done.wait(60)
    for call in sink.calls:  # a step gives a request one delta at most
        assert len({request_id for request_id, _ in call}) == len(call)
    for i, exp in enumerate(expected):
        deltas = [d for call in sink.calls for rid, d in call if rid == f"sink{i}"]
        assert [t for d in deltas for t in d.token_ids] == exp.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == exp.outputs[0].text
        assert deltas[-1].finish_reason == "length"
    # Requests decoding in the same steps share a call: far fewer calls than deltas.
    assert len(sink.calls) < sum(len(call) for call in sink.calls) * 2 / 3


def test_stop_string_is_never_streamed(loop: EngineLoop, smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    probe = smollm2.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = probe[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # three characters from the middle
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    deltas = list(loop.add(loop.core.make_request("stop", tok.encode("1, 2, 3, 4,"), params)))
    streamed = [d.text for d in deltas]
    assert all(stop not in "".join(streamed[: i + 1]) for i in range(len(streamed)))
    assert "".join(streamed) == text[: text.index(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_abort_ends_stream_and_frees_blocks(loop: EngineLoop, smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    stream = loop.add(loop.core.make_request("long", tok.encode("Tell me a story."), params))
    first = stream.get(timeout_s=60)
    assert first.finish_reason is None
    assert loop.abort("long")
    last = list(stream)[-1]
    assert last.finish_reason == "abort"
    assert not loop.abort("long")
    pool = loop.core.kv.pool
    assert loop.call(lambda core: pool.num_free_blocks) == pool.num_blocks


class _Fatal(BaseException):
    """Not an Exception: gets past the step's own error handling, as a real bug's would."""


def test_dead_loop_ends_streams_and_refuses_calls(smollm2: LLM) -> None:
    from vllm_cluster.engine.errors import EngineDeadError

    loop = EngineLoop(smollm2.derive().core, smollm2.get_tokenizer())
    tok = smollm2.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = loop.add(loop.core.make_request("doomed", tok.encode("Once upon a time"), params))
    assert stream.get(timeout_s=30).token_ids  # decoding

    def explode() -> None:
        raise _Fatal("a bug in the step")

    loop.core.step = explode  # type: ignore[method-assign]  # the next step kills the loop thread
    last = list(stream)[-1]
    assert last.finish_reason == "abort" and last.error is not None and "loop died" in last.error
    assert loop.problem() is not None and "died" in loop.problem()  # type: ignore[operator]
    with pytest.raises(EngineDeadError):
        loop.call(lambda core: core.stats(), timeout_s=5)


def test_stuck_step_is_reported_then_clears(smollm2: LLM) -> None:
    import time

    loop = EngineLoop(smollm2.derive().core, smollm2.get_tokenizer(), stall_timeout_s=0.5)
    real_step = loop.core.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(2.0)
        return real_step()

    loop.core.step = slow_step  # type: ignore[method-assign]
    tok = smollm2.get_tokenizer()
    stream = loop.add(loop.core.make_request("slow", tok.encode("Hi"), SamplingParams(temperature=0, max_tokens=1)))
    time.sleep(1.2)
    problem = loop.problem()
    assert problem is not None and "stuck" in problem
    assert list(stream)[-1].finish_reason == "length"
    loop.core.step = real_step  # type: ignore[method-assign]
    time.sleep(0.2)
    assert loop.problem() is None
    loop.stop()
