"""The OpenAPI document (/openapi.json) as the server really answers.

Each route declares the errors it answers itself (`error_responses`), with the error
envelope's schema (the Anthropic routes: Anthropic's error body). `document` adds what the
guard answers outside FastAPI's sight (401 without the API key, 408 and 413 for a body too
slow or too large, in the route's own error shape) and drops FastAPI's
default 422, which this server never sends: a body that fails validation is a 400.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from vllm_cluster.router.openai.errors import ErrorResponse
from vllm_cluster.router.openai.field_types import INT32, MAX_TOKENS, TOKEN_ID, TOKEN_ID_KEYS

_WHEN = {
    400: "The request is invalid: the message says what to change, `param` names the field.",
    401: "The API key is missing or wrong.",
    404: "No such model (or LoRA adapter), or the feature is off.",
    408: "The request body did not arrive in time; the connection is closed.",
    409: "The LoRA adapter is already loaded.",
    413: "The request body is too large; the connection is closed.",
    429: "Every decode instance is full; retry after Retry-After seconds.",
    503: "The cluster cannot serve now (no decode instance, or the router is restarting); retry after "
         "Retry-After seconds.",
}
_ENVELOPE = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_BODY_METHODS = ("post", "put", "patch")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route decorator's `responses`: each status answered with the error envelope (as JSON
    whatever the route's own media type)."""
    return {status: {"description": _WHEN[status], "content": _ENVELOPE} for status in statuses}


def document(app: FastAPI, unguarded_paths: tuple[str, ...], api_key_required: bool, max_model_len: int,
             vocab_size: int | None = None, reasoning: bool = False) -> None:
    """Make `app.openapi()` (what /openapi.json serves) include the guard's answers, and the
    rules of this server: max_tokens below `max_model_len`, token ids below `vocab_size` (the
    tokenizer's, when the server has one), and Anthropic's `thinking` only on a server that
    splits reasoning out."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, operations in doc["paths"].items():
                for method, operation in operations.items():
                    responses = operation["responses"]
                    responses.pop("422", None)
                    guarded = [401] if api_key_required and path not in unguarded_paths else []
                    content = _own_error_content(responses)
                    for status in guarded + ([408, 413] if method in _BODY_METHODS else []):
                        responses.setdefault(str(status), {"description": _WHEN[status], "content": content})
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            envelope = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(envelope.pop("$defs"), ErrorResponse=envelope)
            max_token_id = vocab_size - 1 if vocab_size else None
            _bound(doc, {TOKEN_ID: max_token_id, MAX_TOKENS: max_model_len - 1})
            _key_patterns(doc, integers_up_to(INT32 - 1 if max_token_id is None else max_token_id))
            if not reasoning and "ThinkingParam" in schemas:
                schemas["ThinkingParam"]["properties"]["type"] = {"const": "disabled", "type": "string"}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _own_error_content(responses: dict[str, Any]) -> dict[str, Any]:
    """The error body a route documents for its own 4xx (the Anthropic routes have their own
    shape, which the guard answers in too), else the envelope."""
    return next((r["content"] for status, r in responses.items() if status.startswith("4") and "content" in r),
                _ENVELOPE)


def _each_schema(node: Any, fn: Callable[[dict[str, Any]], None]) -> None:
    """`fn` on every JSON object in the document, outermost first."""
    if isinstance(node, dict):
        fn(node)
        for value in node.values():
            _each_schema(value, fn)
    elif isinstance(node, list):
        for value in node:
            _each_schema(value, fn)


def _bound(node: Any, maximums: dict[str, int | None]) -> None:
    """Each schema marked with a key of `maximums` (field_types.py) gets that maximum (None:
    unknown here, the type's own bound stays); the markers go."""

    def bound(schema: dict[str, Any]) -> None:
        for marker, maximum in maximums.items():
            if schema.pop(marker, False) and maximum is not None:
                schema.pop("exclusiveMaximum", None)
                schema["maximum"] = maximum

    _each_schema(node, bound)


def _key_patterns(node: Any, pattern: str) -> None:
    """Each schema marked TOKEN_ID_KEYS gets `pattern`; the marker goes."""

    def key_pattern(schema: dict[str, Any]) -> None:
        if schema.pop(TOKEN_ID_KEYS, False):
            schema["pattern"] = pattern

    _each_schema(node, key_pattern)


def integers_up_to(n: int) -> str:
    """A regex for the decimal integers 0..n as JSON object keys spell them (no sign, no
    leading zero): the shorter numbers, then each digit of n in turn held below its value."""
    digits = str(n)
    alternatives = ["0", f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, digit in enumerate(digits):
        low = 1 if i == 0 and len(digits) > 1 else 0
        if int(digit) - 1 >= low:
            rest = len(digits) - i - 1
            alternatives.append(f"{digits[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return f"^(?:{'|'.join([*alternatives, digits])})$"
