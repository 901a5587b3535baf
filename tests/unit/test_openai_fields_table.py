"""Every field of every HTTP request model is accounted for in fields.REQUEST_FIELDS, and
the table tells the truth: a served or refused field is read by the HTTP front and named by
a test that exists; a refused one is a 400 naming it; nothing is parsed and then dropped.

A new field fails `test_every_field_is_in_the_table` until it has a row, and the row needs
a test that shows what the field does (or that it is refused)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from vllm_cluster.router.openai import protocol
from vllm_cluster.router.openai.errors import ApiError
from vllm_cluster.router.openai.fields import REQUEST_FIELDS

REPO_ROOT = Path(__file__).resolve().parents[2]
FRONT = Path(protocol.__file__).resolve().parent  # router/openai/
# Fields OpenAI defines as having no effect on the answer; anything else must act or be refused.
NO_EFFECT_ALLOWED = {"user"}


def _models() -> list[type[BaseModel]]:
    return [
        cls for cls in vars(protocol).values()
        if inspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == protocol.__name__
    ]


def _declared_fields() -> set[str]:
    """"Model.field" for every field, under the model that declares it."""
    names = set()
    for model in _models():
        for field in model.model_fields:
            owner = next(c for c in model.__mro__ if field in vars(c).get("__annotations__", {}))
            names.add(f"{owner.__name__}.{field}")
    return names


def _read_names() -> set[str]:
    """Attribute names read, and string constants, in the HTTP front's code outside the
    models' field declarations (getattr loops name fields by string)."""
    names: set[str] = set()
    for path in FRONT.glob("*.py"):
        if path.name == "fields.py":  # the table itself reads nothing
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def test_every_field_is_in_the_table() -> None:
    declared = _declared_fields()
    assert sorted(declared - set(REQUEST_FIELDS)) == [], "fields without a row in fields.REQUEST_FIELDS"
    assert sorted(set(REQUEST_FIELDS) - declared) == [], "rows of fields.REQUEST_FIELDS for no field"


def test_served_and_refused_fields_are_read_and_named_by_a_test_that_exists() -> None:
    read = _read_names()
    for name, use in REQUEST_FIELDS.items():
        field = name.split(".")[1]
        if use.kind == "no_effect":
            assert field in NO_EFFECT_ALLOWED, f"{name} has no effect: serve it or refuse it"
            continue
        if use.kind == "elsewhere":
            assert (REPO_ROOT / use.test).exists(), f"{name}: {use.test} does not exist"
            continue
        assert field in read, f"{name} is parsed but never read by router/openai/"
        path, _, test = use.test.partition("::")
        source = (REPO_ROOT / path).read_text()
        functions = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert test in functions, f"{name}: {use.test} does not exist"
        assert field in source, f"{name}: {path} never mentions {field}"


# A value of each refused field that would change the answer, and how its model is sent.
_REFUSED_VALUES: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "_SamplingFields.best_of": (protocol.CompletionRequest, {"prompt": "x", "best_of": 2}),
    "CompletionRequest.suffix": (protocol.CompletionRequest, {"prompt": "x", "suffix": "y"}),
    "ResponsesRequest.previous_response_id": (protocol.ResponsesRequest, {"input": "x", "previous_response_id": "r"}),
}


@pytest.mark.parametrize("name", sorted(_REFUSED_VALUES))
def test_a_refused_field_is_a_400_naming_it(name: str) -> None:
    assert REQUEST_FIELDS[name].kind == "refused"
    model, body = _REFUSED_VALUES[name]
    request = model(**body)
    with pytest.raises(ApiError) as e:
        if isinstance(request, protocol.ResponsesRequest):
            request.to_chat_request()
        else:
            request.to_sampling_params()  # type: ignore[attr-defined]
    assert e.value.status == 400 and e.value.param == name.split(".")[1]


def test_every_refused_field_of_a_sampling_model_has_a_refusing_value() -> None:
    refused = {n for n, u in REQUEST_FIELDS.items() if u.kind == "refused"}
    # refused by type (HTTP test)
    validated_by_shape = {"ContentPart.type", "ResponsesInputMessage.type", "ToolCall.type"}
    assert refused - validated_by_shape == set(_REFUSED_VALUES)
