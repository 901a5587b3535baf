"""What a request's output must match (structured output), under vLLM's names: a JSON
schema, a regular expression, one of a list of strings, an EBNF grammar, or any JSON object.

Exactly one is set. The spec is checked when the params are built (a bad schema, regex or
grammar is an InvalidRequestError naming the field); engine/structured_output.py compiles
it against the tokenizer and masks the logits. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_cluster.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import xgrammar

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar reads it)
    json_object: bool = False  # any JSON object
    _grammar: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            choices_ok = isinstance(self.choice, list | tuple) and all(isinstance(c, str) and c for c in self.choice)
            if not self.choice or not choices_ok:
                raise InvalidRequestError(f"structured_outputs.choice must be non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        self._grammar = build_grammar(self)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: requests with equal keys share it."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json  # valid: checked on build
            return "json", json.dumps(schema, sort_keys=True)
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return self.kind, self.regex or self.grammar or ""

    def xgrammar(self) -> xgrammar.Grammar:
        """The grammar, tokenizer-free (checked on construction)."""
        return self._grammar


def build_grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The spec as an xgrammar Grammar; InvalidRequestError naming the field when it is bad."""
    import xgrammar as xgr  # imports torch: only when a request asks for structured output

    kind = params.kind
    try:
        if params.json is not None:
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            json.loads(schema)
            # Compact JSON: a small model given free whitespace may emit it until max_tokens.
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        if params.json_object:
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if params.regex is not None:
            return xgr.Grammar.from_regex(params.regex)
        if params.choice is not None:
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {literals}")
        assert params.grammar is not None
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(kind, kind)
        raise InvalidRequestError(f"structured_outputs.{kind} is not a valid {what}: {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    # xgrammar prefixes its messages with a time and a C++ source location.
    return _XGRAMMAR_PREFIX.sub("", text.splitlines()[0])[:300]
