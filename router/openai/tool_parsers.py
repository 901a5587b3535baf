"""Tool-call parsers (vLLM's --tool-call-parser, here `router.tool_call_parser`): the calls a
model wrote into its text, taken out of it, in whole responses and in streamed deltas alike.

- `hermes` (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the tags is content (whitespace next to a call is
  dropped). A block whose JSON is not a call stays in the content as written.
- `llama3_json` (Llama 3.x): the whole output is calls when it begins with `<|python_tag|>`
  or `{`: JSON objects `{"name": ..., "parameters": {...}}` separated by `;`. What does not
  parse as a call, from there on, is content.

Two more parse what tool_choice `required` and a named function force through structured
output: a JSON array of `{"name", "parameters"}` objects, and one function's arguments.

Each parser reads a whole text (`parse`) or one choice's pieces as they stream (`stream()`,
then `feed` per piece and `finish` at the end). `parse` is `stream()` fed the whole text, so
the deltas of any split add up to the whole answer. A call is sent when it is complete
(hermes, llama3_json, required), except a named function's arguments, which stream as the
model writes them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made; `arguments` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A streamed piece of call `index`: its first piece carries `id` and `name`, later ones
    only more `arguments` text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Deltas = tuple[str, list[ToolCallDelta]]  # (content, call pieces) one fed piece gives


class ToolCallStream(Protocol):
    def feed(self, text: str) -> Deltas: ...

    def finish(self) -> Deltas:
        """What was held back, at the end of the output."""
        ...


class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output's (content, calls)."""
        ...

    def stream(self) -> ToolCallStream: ...


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def merge(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Deltas put together into whole calls, by index."""
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.id is not None:
            ids[d.index], names[d.index] = d.id, d.name or ""
        arguments[d.index] = arguments.get(d.index, "") + d.arguments
    return [ToolCall(ids[i], names[i], arguments[i]) for i in sorted(ids)]


def _whole(stream: ToolCallStream, text: str) -> tuple[str, list[ToolCall]]:
    """Every parser's `parse`: its stream fed the whole text."""
    content, deltas = stream.feed(text)
    more_content, more_deltas = stream.finish()
    return content + more_content, merge(deltas + more_deltas)


def _as_call(obj: Any, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _Calls:
    """Numbers the calls of one choice as they are found."""

    def __init__(self) -> None:
        self.count = 0

    def whole(self, name: str, arguments: str) -> ToolCallDelta:
        self.count += 1
        return ToolCallDelta(self.count - 1, arguments, new_call_id(), name)


# ---- hermes


class _ContentAroundCalls:
    """Content text less the whitespace that only stood next to call blocks: between two
    pieces of content it stays; at the content's start or end (once a call was made) it
    goes. Whitespace is held back until what follows it is known."""

    def __init__(self) -> None:
        self._pending = ""
        self._emitted = False
        self._calls_seen = False

    def text(self, text: str) -> str:
        text = self._pending + text
        if self._calls_seen and not self._emitted:
            text = text.lstrip()
        kept = text.rstrip()
        self._pending = text[len(kept):]
        self._emitted = self._emitted or bool(kept)
        return kept

    def call(self) -> None:
        self._calls_seen = True
        if not self._emitted:
            self._pending = ""

    def finish(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self._calls_seen else pending


class _HermesStream:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._in_call = False
        self._held = ""
        self._content = _ContentAroundCalls()
        self._calls = _Calls()

    def feed(self, text: str) -> Deltas:
        text, self._held = self._held + text, ""
        content, deltas = "", list[ToolCallDelta]()
        while text:
            if not self._in_call:
                before, found, after = text.partition(self.START)
                if not found:
                    keep = _tag_prefix_at_end(text, self.START)
                    before, self._held = text[: len(text) - keep], text[len(text) - keep:]
                content += self._content.text(before)
                if not found:
                    break
                self._in_call, text = True, after
            else:
                body, found, after = text.partition(self.END)
                if not found:
                    self._held = text  # a call is sent whole
                    break
                content += self._close(body, deltas, closed=True)
                self._in_call, text = False, after
        return content, deltas

    def finish(self) -> Deltas:
        held, self._held = self._held, ""
        deltas: list[ToolCallDelta] = []
        if self._in_call:  # an unclosed last call is still one when its JSON is whole
            self._in_call = False
            return self._close(held, deltas, closed=False) + self._content.finish(), deltas
        return self._content.text(held) + self._content.finish(), deltas

    def _close(self, body: str, deltas: list[ToolCallDelta], closed: bool) -> str:
        """A call block's body: a call, or (not JSON of one) content as written."""
        try:
            call = _as_call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return self._content.text(self.START + body + (self.END if closed else ""))
        self._content.call()
        deltas.append(self._calls.whole(*call))
        return ""


class HermesToolParser:
    def stream(self) -> ToolCallStream:
        return _HermesStream()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _whole(self.stream(), text)


# ---- JSON objects in a row: llama3_json and tool_choice required


class _JsonObjectsStream:
    """JSON call objects one after another, each sent once it is complete. An output that
    begins (after whitespace) with one of `openings` is calls, else all content; the
    opening is dropped unless it is in `kept_openings` (a `{` begins the first object).
    `separator` may stand between objects, and `closing` ends them."""

    def __init__(self, openings: tuple[str, ...], kept_openings: tuple[str, ...], separator: str, closing: str,
                 arguments_keys: tuple[str, ...]) -> None:
        self._openings, self._kept_openings = openings, kept_openings
        self._separator, self._closing, self._arguments_keys = separator, closing, arguments_keys
        self._state = "start"  # start -> calls -> done | content
        self._held = ""
        self._calls = _Calls()
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> Deltas:
        text, self._held = self._held + text, ""
        if self._state == "start":
            text = self._start(text)
        if self._state == "content":
            return text, []
        if self._state == "done":
            return "", []
        return self._objects(text)

    def finish(self) -> Deltas:
        held, self._held = self._held, ""
        if self._state == "calls":
            content, deltas = self._objects(held)
            rest, self._held = self._held, ""
            return content + rest.strip(), deltas  # an object cut off: its text is content
        return ("" if self._state == "done" else held), []

    def _start(self, text: str) -> str:
        stripped = text.lstrip()
        for opening in self._openings:
            if stripped.startswith(opening):
                self._state = "calls"
                return stripped if opening in self._kept_openings else stripped[len(opening):]
        if not stripped or any(o.startswith(stripped) for o in self._openings):
            self._held = text
        else:
            self._state = "content"
        return text if self._state == "content" else ""

    def _objects(self, text: str) -> Deltas:
        deltas: list[ToolCallDelta] = []
        while True:
            text = text.lstrip()
            if text.startswith(self._separator):
                text = text[len(self._separator):]
                continue
            if self._closing and text.startswith(self._closing):
                self._state = "done"
                return "", deltas
            if not text:
                return "", deltas
            try:
                obj, end = self._decoder.raw_decode(text)
            except json.JSONDecodeError:
                self._held = text  # not whole yet
                return "", deltas
            call = _as_call(obj, self._arguments_keys)
            if call is None:  # not a call: the rest is content
                self._state = "content"
                return text, deltas
            deltas.append(self._calls.whole(*call))
            text = text[end:]


class Llama3JsonToolParser:
    def stream(self) -> ToolCallStream:
        return _JsonObjectsStream(("<|python_tag|>", "{"), ("{",), ";", "", ("parameters", "arguments"))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _whole(self.stream(), text)


class RequiredToolParser:
    """tool_choice `required`: the JSON array tools.required_schema allows."""

    def stream(self) -> ToolCallStream:
        return _JsonObjectsStream(("[",), (), ",", "]", ("parameters",))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _whole(self.stream(), text)


# ---- a named function


class _NamedStream:
    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> Deltas:
        if not text:
            return "", []
        return "", [self._delta(text)]

    def finish(self) -> Deltas:
        return "", ([] if self._started else [self._delta("")])  # no output: a call, arguments ""

    def _delta(self, text: str) -> ToolCallDelta:
        if self._started:
            return ToolCallDelta(0, text)
        self._started = True
        return ToolCallDelta(0, text, new_call_id(), self._name)


class NamedToolParser:
    """tool_choice naming one function: the whole output is its arguments (tools.named_schema)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def stream(self) -> ToolCallStream:
        return _NamedStream(self.name)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _whole(self.stream(), text)


def tool_parser(name: str) -> ToolParser:
    """The parser `router.tool_call_parser` names."""
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return Llama3JsonToolParser()
    raise ValueError(f"tool call parser {name!r}: give one of {', '.join(TOOL_CALL_PARSERS)}")
