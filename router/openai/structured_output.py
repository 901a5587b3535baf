"""Structured output in the OpenAI API: `response_format` (OpenAI's json_object and
json_schema; "text" is no constraint), vLLM's `structured_outputs` object and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields, all to one
StructuredOutputs message. At most one may constrain a request. The spec is checked here
(a bad schema, regex or grammar is a 400 naming the field and saying what is wrong), and
again by every instance that runs the request.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.errors import bad_request

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs(body: BaseModel) -> pb.StructuredOutputs | None:
    """The request's constraint, or None; a 400 naming the field when it is malformed."""
    found: list[tuple[str, dict[str, Any]]] = []  # (field, the constraint as StructuredOutputsParams kwargs)
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    extra = getattr(body, "structured_outputs", None)
    if extra is not None:
        found.append(("structured_outputs", _from_structured_outputs(extra)))
    for name, kind in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} each constrain the output: send only one of them", found[1][0])
    name, spec = found[0]
    try:
        params = StructuredOutputsParams(**spec)
    except InvalidRequestError as e:
        raise bad_request(f"{name}: {e}", name) from None
    schema = params.json if params.json is None or isinstance(params.json, str) else json.dumps(params.json)
    return pb.StructuredOutputs(
        json=schema or "", regex=params.regex or "", choice=params.choice or [], grammar=params.grammar or "",
        json_object=params.json_object,
    )


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        raise bad_request("response_format must be an object with a type", "response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        holder = value.get("json_schema")
        if not isinstance(holder, dict) or not isinstance(holder.get("schema", {}), dict | bool):
            raise bad_request(
                "response_format.json_schema must be an object with a schema: "
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                "response_format",
            )
        schema = holder.get("schema", {})  # OpenAI: no schema means any JSON
        return {"json": schema} if schema not in ({}, True) else {"json_object": True}
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format"
    )


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"structured_outputs must be an object with one of {', '.join(_KINDS)}", "structured_outputs")
    spec = {k: v for k, v in value.items() if k in _KINDS and v is not None}
    unknown = sorted(k for k in value if k not in _KINDS and value[k] is not None)
    if unknown:
        raise bad_request(
            f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(_KINDS)}", "structured_outputs"
        )
    return spec


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Responses API's `text.format` as chat's `response_format` (the schema sits in the
    format itself there, not under `json_schema`)."""
    if text is None or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict) or fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format must be an object with type 'text', 'json_object' or 'json_schema'", "text")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type", "text")}
    if not isinstance(fmt.get("schema", {}), dict | bool):
        raise bad_request('text.format.schema must be a JSON schema object: {"type": "json_schema", "name": ..., '
                          '"schema": {...}}', "text")
    schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema", {})}
    return {"type": "json_schema", "json_schema": schema}
