"""The value ranges of request fields, as pydantic types: the server refuses a value outside
them (a 400 naming the field) and /openapi.json states them (`minimum`, `maximum`, ...), so
that the document and the server agree. Token ids are bounded by the vocabulary, which only
the running server knows: TOKEN_ID marks their schemas, and openapi.py writes the bound
(MAX_TOKENS likewise, for the model's context length)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

INT32 = 2**31
MAX_N = 64  # choices per request; each is its own sequence on a decode instance
MAX_LOGPROBS = 20
TOKEN_ID = "x-token-id"  # a schema marker openapi.py replaces with the vocabulary's bound
MAX_TOKENS = "x-max-tokens"  # and this one with max_model_len - 1 (a prompt has at least one token)
TOKEN_ID_KEYS = "x-token-id-keys"  # and this one (an object's) with a pattern of its keys: token ids


def _whole(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer, so the integer fields take it (strict mode alone would not)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


_WHOLE = BeforeValidator(_whole)

TokenId = Annotated[int, Field(ge=0, lt=INT32, json_schema_extra={TOKEN_ID: True}), _WHOLE]
Int32 = Annotated[int, Field(ge=-INT32, lt=INT32), _WHOLE]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63), _WHOLE]
MaxTokens = Annotated[int, Field(ge=1, lt=INT32, json_schema_extra={MAX_TOKENS: True}), _WHOLE]
CompletionMaxTokens = Annotated[int, Field(ge=0, lt=INT32, json_schema_extra={MAX_TOKENS: True}), _WHOLE]  # 0: echo
NumChoices = Annotated[int, Field(ge=1, le=MAX_N), _WHOLE]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _WHOLE]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]  # 0 means greedy
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence and frequency
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0)]  # 1 means none
TopK = Annotated[int, Field(ge=-1, lt=INT32), _WHOLE]  # -1 or 0: no top-k
Count = Annotated[int, Field(ge=0, lt=INT32), _WHOLE]
StopTokenId = Annotated[int, Field(ge=0, lt=INT32), _WHOLE]  # any id: one past the vocabulary never matches
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonBlank = Annotated[str, Field(json_schema_extra={"pattern": r"\S"})]  # sampling_checks.py refuses a blank one



def _logit_bias_schema(schema: dict[str, Any]) -> None:
    """Token ids (openapi.py writes their pattern; sampling_checks.py refuses another key) to numbers."""
    schema.clear()
    schema.update(type="object", propertyNames={"type": "string", TOKEN_ID_KEYS: True},
                  additionalProperties={"type": "number"})


LogitBias = Annotated[dict[str, FiniteFloat], Field(json_schema_extra=_logit_bias_schema)]
