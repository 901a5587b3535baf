"""The error envelope every HTTP error uses, vLLM's: `{"error": {"message", "type", "param", "code"}}`.

`ApiError` is raised anywhere in the front and becomes one response here: the message scrubbed
of internal addresses, `type` named after the status (the OpenAI SDK's class names where it
has one), `param` the request field to change (null when no one field is at fault).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from vllm_cluster.worker.rpc import scrub


class ApiError(Exception):
    """An error the client gets as the envelope, with `headers` on the response (Retry-After
    for `retry_after_s`)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, retry_after_s: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error response (error_body builds it)."""

    error: ErrorInfo


_ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
    409: "ConflictError", 413: "RequestTooLargeError", 429: "RateLimitError", 499: "ClientClosedRequest",
    503: "ServiceUnavailableError", 504: "TimeoutError",
}


def error_type(status: int) -> str:
    """The OpenAI SDK's class name, else the status phrase in the same shape (405:
    MethodNotAllowedError, 408: RequestTimeoutError); every other 5xx is InternalServerError."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError"
    return "InternalServerError" if status >= 500 else phrase.title().replace(" ", "").replace("-", "") + "Error"


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": scrub(e.message), "type": error_type(e.status), "param": e.param, "code": e.status}}


def error_response(e: ApiError) -> JSONResponse:
    headers = dict(e.headers)
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    return JSONResponse(error_body(e), status_code=e.status, headers=headers or None)


# A field name (snake_case) or a list index; pydantic also puts union branches and validator
# wrappers in an error's location ("str", "list[int]", "function-after[...]"), which no client sent.
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_BRANCHES = {"str", "int", "float", "bool", "bytes", "none", "list", "dict", "tuple", "set", "union", "nullable"}


def field_path(loc: Sequence[Any]) -> str:
    """A validation error's location as the dotted path of the field the client sent."""
    parts = [str(p) for p in loc if isinstance(p, int) or (_FIELD.fullmatch(str(p)) and p not in _BRANCHES)]
    return ".".join(parts)


def invalid_body(errors: Sequence[Mapping[str, Any]], content_type: str) -> ApiError:
    """A 400 for a body that failed validation: the first error, naming its field. A body that
    is not a JSON object at all (another content type, an array, nothing) says what to send."""
    first = errors[0] if errors else {}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if not loc:
        media_type = content_type.split(";")[0].strip().lower()
        if media_type and media_type != "application/json" and not media_type.endswith("+json"):
            return bad_request(
                f"the request body must be a JSON object sent with `Content-Type: application/json`; "
                f"this one came as {media_type!r}"
            )
        return bad_request("the request body must be a JSON object (`{...}`) sent with "
                           "`Content-Type: application/json`")
    where = field_path(loc)
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"{where}: {message}" if where else message, where or None)


def lone_surrogate(value: Any) -> tuple[str, str, int] | None:
    """The first text in decoded JSON that UTF-8 cannot encode: (its dotted field path, the
    text, the index of the lone surrogate). A dict key is reported at the dict's path."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return ".".join(str(p) for p in path), item, e.start
        elif isinstance(item, dict):
            children = [(path, key) for key in item] + [((*path, key), v) for key, v in item.items()]
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([((*path, i), v) for i, v in enumerate(item)]))
    return None
