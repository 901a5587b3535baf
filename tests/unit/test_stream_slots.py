"""What keeps a busy server answering: deltas that piled up leave as one message
(RequestStream.coalesced), and streams beyond a server's limit are refused (StreamSlots)
instead of taking the threads its unary calls need."""

from __future__ import annotations

import threading

import pytest

from vllm_cluster.engine.engine_loop import RequestStream, StreamDelta
from vllm_cluster.engine.request import TokenLogprobs
from vllm_cluster.worker.rpc import MAX_STREAMS, MAX_WORKERS, StreamSlots


def _delta(token: int, finish: str | None = None, **rest: object) -> StreamDelta:
    return StreamDelta([token], f"<{token}>", [TokenLogprobs(token, -0.5, 1, {})], finish, **rest)  # type: ignore[arg-type]


def test_deltas_that_piled_up_come_as_one() -> None:
    stream = RequestStream("r")
    for token in (1, 2, 3):
        stream.put(_delta(token, queue_s=0.25 if token == 1 else 0.0))
    merged = next(stream.coalesced())
    assert (merged.token_ids, merged.text) == ([1, 2, 3], "<1><2><3>")
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
    assert merged.queue_s == 0.25 and merged.finish_reason is None


def test_the_last_delta_ends_the_stream_with_its_own_fields() -> None:
    stream = RequestStream("r")
    stream.put(_delta(1))
    stream.put(_delta(2, "stop", stop_reason="</s>", num_prompt_tokens=5, num_output_tokens=2))
    stream.put(_delta(99))  # nothing after a finish is read
    out = list(stream.coalesced())
    assert len(out) == 1
    assert out[0].token_ids == [1, 2] and out[0].finish_reason == "stop" and out[0].stop_reason == "</s>"
    assert (out[0].num_prompt_tokens, out[0].num_output_tokens) == (5, 2)


def test_a_consumer_that_keeps_up_gets_every_delta_alone() -> None:
    stream = RequestStream("r")
    got: list[list[int]] = []
    arrived = threading.Event()

    def consume() -> None:
        for delta in stream.coalesced():
            got.append(delta.token_ids)
            arrived.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    for token in range(3):
        arrived.clear()
        stream.put(_delta(token, "length" if token == 2 else None))
        assert arrived.wait(5)
    consumer.join(5)
    assert got == [[0], [1], [2]]


def test_stream_slots_refuse_beyond_the_limit_and_free_on_release() -> None:
    slots = StreamSlots(limit=2)
    assert slots.acquire() and slots.acquire()
    assert not slots.acquire()
    slots.release()
    assert slots.acquire() and slots.open == 2
    slots.release()
    slots.release()
    with pytest.raises(AssertionError, match="never acquired"):
        slots.release()


def test_servers_keep_threads_for_unary_calls() -> None:
    assert 0 < MAX_STREAMS < MAX_WORKERS
    assert StreamSlots().limit == MAX_STREAMS
