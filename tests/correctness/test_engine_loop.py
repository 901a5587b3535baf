"""The engine on its own thread, as the services run it: streamed deltas add up to what
`LLM.generate` returns, stop-string text is never streamed, aborts end streams and free blocks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.engine_loop import EngineLoop

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
