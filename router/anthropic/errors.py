"""Anthropic's error body, `{"type": "error", "error": {"type", "message"}}`, for the Messages
routes: the front's ApiError (and a body that fails validation) answered in that shape, with
the same status and headers as the OpenAI routes give it (Retry-After on 429 and 503), so
the Anthropic SDK raises its typed exceptions (BadRequestError, AuthenticationError,
RateLimitError, ...)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from vllm_cluster.router.openai.errors import ApiError, invalid_body
from vllm_cluster.worker.rpc import scrub

logger = logging.getLogger(__name__)

ErrorType = Literal[
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "request_too_large",
    "timeout_error", "rate_limit_error", "conflict_error", "api_error", "overloaded_error",
]
_ERROR_TYPES: dict[int, ErrorType] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicErrorDetail(BaseModel):
    type: ErrorType
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error the Messages routes answer (error_body builds it)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def error_type(status: int) -> ErrorType:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(e.status), "message": scrub(e.message)}}


def error_response(e: ApiError) -> JSONResponse:
    headers = dict(e.headers)
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    return JSONResponse(error_body(e), status_code=e.status, headers=headers or None)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route decorator's `responses`: each status answered with Anthropic's error body."""
    return {status: {"model": AnthropicErrorResponse, "description": _WHEN[status]} for status in statuses}


_WHEN = {
    400: "The request is invalid (`invalid_request_error`): the message says what to change.",
    404: "No such model (`not_found_error`).",
    429: "Every decode instance is full (`rate_limit_error`); retry after Retry-After seconds.",
    503: "The cluster cannot serve now (`overloaded_error`); retry after Retry-After seconds.",
}


class AnthropicRoute(APIRoute):
    """A route whose errors, its body's validation included, come in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_in_shape(request: Request) -> Response:
            try:
                return await handle(request)
            except ApiError as e:
                return error_response(e)
            except RequestValidationError as e:
                return error_response(invalid_body(e.errors(), request.headers.get("content-type", "")))
            except HTTPException as e:  # a body that is not JSON at all
                return error_response(ApiError(e.status_code, str(e.detail), headers=e.headers))
            except Exception:
                request_id = request.scope["state"]["request_id"]
                logger.exception("unexpected error serving %s (request %s)", request.url.path, request_id)
                return error_response(ApiError(
                    500, f"internal server error; the server log has the details (request id {request_id})"
                ))

        return handle_in_shape
