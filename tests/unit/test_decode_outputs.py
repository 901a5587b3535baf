"""Both ends of a decode instance's Outputs stream, without a network: the decode side joins a
request's deltas and sends every request's in one message, releasing each stream slot exactly
once; the router side joins what piled up and turns errors and breaks into OutputsLost."""

from __future__ import annotations

import grpc
import pytest

from vllm_cluster.decode_service.outputs import Subscriber, Subscribers
from vllm_cluster.engine.engine_loop import StreamDelta
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.decode_outputs import OutputsLost, RequestOutputs


def _delta(token_ids: list[int], text: str, finish_reason: str | None = None, error: str | None = None) -> StreamDelta:
    return StreamDelta(token_ids, text, [], finish_reason=finish_reason, num_output_tokens=len(token_ids), error=error)


class _Slots:
    def __init__(self, num_open: int) -> None:
        self.num_open = num_open

    def release(self) -> None:
        assert self.num_open > 0
        self.num_open -= 1


def test_one_message_carries_every_request_and_joins_a_requests_deltas() -> None:
    slots = _Slots(2)
    subscriber = Subscriber("r", slots.release)
    assert subscriber.attach("a", pb.Timings(transfer_s=0.5, recomputed=True))
    assert subscriber.attach("b", pb.Timings())
    subscriber.put_deltas([("a", _delta([1], "x")), ("b", _delta([7], "p"))])
    subscriber.put_deltas([("a", _delta([2], "y")), ("b", _delta([8], "q", "stop"))])
    message = subscriber.next_message(0)
    assert message is not None
    assert [o.response.request_id for o in message.outputs] == ["a", "b"]
    a, b = (o.response for o in message.outputs)
    assert list(a.token_ids) == [1, 2] and a.text == "xy" and not a.finish_reason
    assert a.timings.transfer_s == 0.5 and a.timings.recomputed  # the first message's timings
    assert list(b.token_ids) == [7, 8] and b.finish_reason == "stop" and b.usage.completion_tokens == 1
    assert slots.num_open == 1  # b's slot: released by its last delta
    subscriber.put_deltas([("a", _delta([3], "z"))])
    later = subscriber.next_message(0)
    assert later is not None and not later.outputs[0].response.HasField("timings")
    assert subscriber.next_message(0) is None  # nothing pending


def test_an_error_travels_with_the_request_and_closing_releases_the_rest() -> None:
    slots = _Slots(3)
    aborted: list[str] = []
    subscriber = Subscriber("r", slots.release)
    for request_id in ("a", "b", "c"):
        assert subscriber.attach(request_id, pb.Timings())
    subscriber.put_deltas([("a", _delta([], "", "abort", error="the engine step failed"))])
    message = subscriber.next_message(0)
    assert message is not None and message.outputs[0].error == "the engine step failed"
    assert slots.num_open == 2
    subscriber.put_deltas([("b", _delta([4], "w"))])  # pending when the stream ends: dropped
    aborted += subscriber.close()
    assert aborted == ["b", "c"] and slots.num_open == 0
    subscriber.put_deltas([("b", _delta([], "", "abort"))])  # the engine's answer to that abort
    assert subscriber.next_message(0) is None and slots.num_open == 0  # released once only
    assert not subscriber.attach("d", pb.Timings())  # closed: the caller aborts it


def test_a_second_stream_under_the_same_id_ends_the_first() -> None:
    slots = _Slots(1)
    aborted: list[str] = []
    subscribers = Subscribers(slots.release, aborted.append)
    first = subscribers.serve("r", lambda: True)
    assert not next(first).outputs
    held = subscribers.get("r")
    assert held is not None and held.attach("a", pb.Timings())
    second = subscribers.serve("r", lambda: True)
    assert not next(second).outputs  # the reconnect
    assert aborted == ["a"] and slots.num_open == 0
    assert subscribers.get("r") is not held
    with pytest.raises(StopIteration):
        next(first)  # the old stream ends
    subscribers.drain()
    with pytest.raises(StopIteration):
        next(second)  # draining and idle: it ends


def _output(
    request_id: str, token_ids: list[int], text: str, finish_reason: str = "", error: str = ""
) -> pb.DecodeOutput:
    response = pb.GenerateResponse(request_id=request_id, token_ids=token_ids, text=text, finish_reason=finish_reason)
    if finish_reason:
        response.usage.completion_tokens = 3
    return pb.DecodeOutput(response=response, error=error)


def test_outputs_that_piled_up_come_joined() -> None:
    closed: list[str] = []
    outputs = RequestOutputs("a", closed.append)
    outputs.put(_output("a", [1], "x"))
    first = next(iter(outputs))
    assert list(first.token_ids) == [1]
    outputs.put(_output("a", [2], "y"))
    outputs.put(_output("a", [3], "z", "length"))
    rest = list(outputs)
    assert len(rest) == 1 and list(rest[0].token_ids) == [2, 3] and rest[0].text == "yz"
    assert rest[0].finish_reason == "length" and rest[0].usage.completion_tokens == 3
    outputs.close()
    assert closed == ["a"]


def test_an_error_or_a_broken_stream_raises_after_what_came_before() -> None:
    outputs = RequestOutputs("a", lambda _: None)
    outputs.put(_output("a", [1], "x"))
    outputs.put(_output("a", [], "", "abort", error="the engine step failed"))
    iterator = iter(outputs)
    assert list(next(iterator).token_ids) == [1]  # delivered before the error
    with pytest.raises(OutputsLost) as info:
        next(iterator)
    assert info.value.code == grpc.StatusCode.ABORTED
    broken = RequestOutputs("b", lambda _: None)
    broken.put(_output("b", [5], "q"))
    broken.put(OutputsLost(grpc.StatusCode.UNAVAILABLE, "connection reset"))
    iterator = iter(broken)
    assert list(next(iterator).token_ids) == [5]
    with pytest.raises(OutputsLost) as info:
        next(iterator)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    cancelled = RequestOutputs("c", lambda _: None)
    cancelled.cancel()
    assert list(cancelled) == []
