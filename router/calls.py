"""Ending a client's gRPC call from the router: what a client may see of a failure."""

from __future__ import annotations

from typing import NoReturn

import grpc

from vllm_cluster.router.handoff import Handoff
from vllm_cluster.worker.rpc import abort as _abort
from vllm_cluster.worker.rpc import scrub


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End a client's call; worker details reach the client without internal endpoints."""
    _abort(context, code, scrub(message))


def end_aborted(context: grpc.ServicerContext, handoff: Handoff) -> NoReturn:
    """End the call of an aborted request: DEADLINE_EXCEEDED when its deadline_s passed."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED if handoff.deadline_passed else grpc.StatusCode.CANCELLED
    abort(context, code, handoff.abort_reason or "aborted")
