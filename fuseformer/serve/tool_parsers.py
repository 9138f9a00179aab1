"""Tool calls in model output, as vLLM's ``--tool-call-parser``: ``hermes`` and ``llama3_json``.

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (newlines around the JSON as those templates write them); text outside the tags is content.
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole output is ``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``, several separated by ``;``; an output that does not
  start with one (after whitespace) is content only. ``arguments`` is read as well as ``parameters``.

A parser gives, for one choice's output text:

- ``extract(text) -> (content, tool_calls)``: content is the text outside the calls (None when only
  whitespace is left); whitespace next to a call is not content. A call that is not well-formed (not a
  JSON object, no string ``name``, ``arguments`` not an object, text before the end tag, JSON cut off by
  the end of the output) stays in the content, verbatim: nothing the model wrote is lost. A call without
  arguments gets ``"{}"``; a complete call whose ``</tool_call>`` the output ends without is a call (as
  vLLM reads it).
- ``stream()``: a ``ToolCallStream`` fed the text deltas as they come, returning OpenAI's delta dicts: a
  call's first delta has its ``index``, ``id``, ``type`` and ``function.name`` (and ``arguments: ""``),
  then its arguments come as fragments of their JSON text. ``extract`` is the stream fed all at once,
  so for any split of a text the concatenated deltas give ``extract``'s result. The one difference
  is for calls found malformed after part of them was streamed (cut off by max_tokens, or JSON that
  breaks late): what was streamed stays a (partial) tool call, and the text after the break follows as
  content.
- ``tool_choice_structured_outputs(tools, tool_choice, parallel_tool_calls)``: for ``"required"`` or a
  named function, the ``StructuredOutputsParams`` (a grammar in this parser's format, each call's JSON
  schema built from the tools' ``parameters``) that makes the model call a tool; None otherwise.

Tool call ids are ``chatcmpl-tool-<32 hex>``, as vLLM's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fuseformer.engine.structured_outputs import StructuredOutputsParams


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallError(ValueError):
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` malformed; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of its arguments object, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """As a chat completion message's ``tool_calls`` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> list[dict[str, Any]]:
    """The request's ``tools`` checked (OpenAI's shape: ``[{"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}]``), with ``tool_choice`` (``"none"``, ``"auto"``,
    ``"required"``, or ``{"type": "function", "function": {"name": ...}}`` naming one of them) and
    ``parallel_tool_calls`` (a bool). Returns the tools as plain dicts; ToolCallError naming the field."""
    if not isinstance(tools, list) or not tools:
        raise ToolCallError("tools must be a non-empty list of tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), Mapping)
        ):
            raise ToolCallError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolCallError(f"{where}.function.name must be a non-empty string", "tools")
        if name in names:
            raise ToolCallError(f"{where}.function.name {name!r} is given twice", "tools")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolCallError(f"{where}.function.description must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ToolCallError(f"{where}.function.parameters must be a JSON schema object", "tools")
    if tool_choice is not None and tool_choice not in ("none", "auto", "required"):
        fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
        if not isinstance(fn, Mapping) or tool_choice.get("type") != "function":
            raise ToolCallError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if fn.get("name") not in names:
            raise ToolCallError(f"tool_choice names {fn.get('name')!r}, which is not one of the tools", "tool_choice")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolCallError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return [dict(t) for t in tools]


# ---- one call's JSON object, scanned as it arrives ---------------------------------------------------

_WS = " \t\n\r"


class _ObjectScanner:
    """Follows a JSON object's text one character at a time: where each top-level key's value starts and
    ends, and where the object ends. It checks the structure it follows (braces, brackets, strings,
    colons, commas); the whole object is checked by ``json.loads`` once it is complete."""

    __slots__ = ("text", "depth", "in_string", "escape", "phase", "key_start", "key", "fields", "end", "invalid")

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = self.escape = False
        self.phase = "start"  # start, key, in_key, colon, value, in_value, after_value, done
        self.key_start = 0
        self.key = ""
        self.fields: dict[str, list[int | None]] = {}  # key -> [value start, value end (None while open)]
        self.end: int | None = None  # the object's end (one past its "}")
        self.invalid = False

    def feed(self, chunk: str) -> int:
        """Scan ``chunk``; returns how many of its characters belong to the object: all of them until its
        closing brace, or until a character that no JSON object can have there (``invalid`` is then set)."""
        for n, c in enumerate(chunk):
            if self.end is not None:
                return n
            self._step(len(self.text), c)
            if self.invalid:
                return n  # the offending character is not the object's
            self.text += c
        return len(chunk)

    def value(self, key: str) -> tuple[str, bool] | None:
        """(the text of ``key``'s value so far, whether it is complete), or None before it starts."""
        span = self.fields.get(key)
        if span is None:
            return None
        start, end = span
        return (self.text[start:end], True) if end is not None else (self.text[start:], False)

    def _close_value(self, i: int) -> None:
        self.fields[self.key][1] = i
        self.phase = "after_value"

    def _step(self, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1 and self.phase == "in_key":
                    self.key = json.loads(self.text[self.key_start :] + c)
                    self.phase = "colon"
                elif self.depth == 1 and self.phase == "in_value":
                    self._close_value(i + 1)
            return
        phase = self.phase
        if phase == "in_value" and self.depth > 1:  # inside a nested object or array
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._close_value(i + 1)
            return
        if c in _WS:
            if phase == "in_value":  # the end of a number, true, false or null
                self._close_value(i)
            return
        if phase == "start":
            self.depth, self.phase = (1, "key") if c == "{" else (0, "invalid")
        elif phase == "key" and c == '"':
            self.in_string, self.key_start, self.phase = True, i, "in_key"
        elif phase == "key" and c == "}" and not self.fields:
            self.depth, self.end = 0, i + 1
        elif phase == "colon" and c == ":":
            self.phase = "value"
        elif phase == "value":
            self.fields[self.key] = [i, None]
            self.phase = "in_value"
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in ",}]:":
                self.phase = "invalid"
        elif phase in ("in_value", "after_value") and c in ",}":
            if phase == "in_value":
                self._close_value(i)
            self.phase = "key"
            if c == "}":
                self.depth, self.end = 0, i + 1
        elif phase != "in_value":
            self.phase = "invalid"
        if self.phase == "invalid":
            self.invalid = True


class _Call:
    """A tool call being read: its raw text (what it is as content, should it turn out malformed), its
    scanner, and what of it was streamed."""

    __slots__ = ("id", "index", "raw", "scanner", "name", "sent")

    def __init__(self, raw: str) -> None:
        self.id = make_tool_call_id()
        self.index: int | None = None  # given when its first delta goes out
        self.raw = raw
        self.scanner = _ObjectScanner()
        self.name: str | None = None
        self.sent = 0  # characters of its arguments' text streamed

    def take(self, text: str) -> str:
        """Scan ``text``; returns the part after the object (all of it consumed until the object ends
        or a character breaks it)."""
        used = self.scanner.feed(text)
        self.raw += text[:used]
        return text[used:]


class ToolCallStream:
    """One choice's output, fed as text deltas (see the module docstring). ``feed`` and ``finish``
    return OpenAI delta dicts in order: ``{"content": str}`` or ``{"tool_calls": [one call's delta]}``.
    ``result()`` is what was found: the content, and the calls that are complete and well-formed."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self.buf = ""  # text received and not yet decided
        self.mode = parser.initial_mode
        self.call: _Call | None = None
        self.skipped = ""  # text consumed since the last call that is no content (a tag, a separator)
        self._held_ws = ""  # the content's trailing whitespace, held until known not to border a call
        self._after_call = False  # the content's leading whitespace after a call is not content
        self._deltas: list[dict[str, Any]] = []
        self._content = ""
        self._tool_calls: list[ToolCall] = []
        self.num_streamed_calls = 0  # calls whose first delta went out (well-formed or not)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.buf += delta
        self._parser._run(self, final=False)
        return self._take()

    def finish(self, delta: str = "") -> list[dict[str, Any]]:
        """The end of the output (with its last ``delta``): what was held back (a possible marker, a
        call cut off, trailing whitespace) is decided."""
        self.buf += delta
        self._parser._run(self, final=True)
        if self.call is not None:  # cut off: streamed as far as it went, else content
            if self.call.index is not None:
                self.progress(complete=False)
            self.end_call(False)
        if self._held_ws and not self.num_streamed_calls:
            self._emit_content(self._held_ws)  # no call: the text is content exactly as written
        self._held_ws = ""
        return self._take()

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls): content None when it is empty or only whitespace."""
        return (self._content if self._content.strip() else None), list(self._tool_calls)

    def _take(self) -> list[dict[str, Any]]:
        out, self._deltas = self._deltas, []
        return out

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        self._content += text
        if self._deltas and "content" in self._deltas[-1]:
            self._deltas[-1]["content"] += text
        else:
            self._deltas.append({"content": text})

    # ---- for the parsers ----

    def text(self, text: str) -> None:
        """Content outside calls; whitespace that borders a call is dropped (trailing whitespace is held
        until the text after it says whether a call follows)."""
        text = self._held_ws + text
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                self._held_ws = ""
                return
            self._after_call = False
        kept = text.rstrip(_WS)
        self._held_ws = text[len(kept) :]
        self._emit_content(kept)

    def verbatim(self, text: str) -> None:
        """Content exactly as written (a malformed call's text, the text after one)."""
        self._emit_content(self._held_ws + text)
        self._held_ws = ""
        self._after_call = False

    def start_call(self, marker: str) -> _Call:
        """A call begins; ``marker`` is the text that opened it (a tag, or nothing)."""
        self.call = _Call(self._held_ws + self.skipped + marker)
        self._held_ws = self.skipped = ""
        return self.call

    def progress(self, complete: bool) -> bool:
        """Stream what is new of the call: its first delta once its name is known, then the text of its
        arguments. ``complete``: the call's text is all there: it is checked first, and False (nothing
        streamed) when it is malformed. Also False for a name that is not a string."""
        call = self.call
        scanner = call.scanner
        keys = self._parser.arguments_keys
        args = next((v for k in keys if (v := scanner.value(k)) is not None), None)
        if complete:
            try:
                obj = json.loads(scanner.text)
            except json.JSONDecodeError:
                return False
            arg_key = next((k for k in keys if k in obj), None)
            if not isinstance(obj.get("name"), str) or (arg_key is not None and not isinstance(obj[arg_key], dict)):
                return False
            if args is None:
                args = ("{}", True)
        if call.name is None:
            name = scanner.value("name")
            if name is None or not name[1]:
                return True
            decoded = json.loads(name[0]) if name[0].startswith('"') else None
            if not isinstance(decoded, str):
                return False
            call.name, call.index = decoded, self.num_streamed_calls
            self.num_streamed_calls += 1
            head = {"index": call.index, "id": call.id, "type": "function"}
            self._deltas.append({"tool_calls": [head | {"function": {"name": decoded, "arguments": ""}}]})
        if args is not None and len(args[0]) > call.sent:
            fragment, call.sent = args[0][call.sent :], len(args[0])
            self._deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": fragment}}]})
        if complete:
            self._tool_calls.append(ToolCall(call.id, call.name, args[0]))
        return True

    def end_call(self, well_formed: bool) -> None:
        """The call's text ended. Malformed and not streamed: its text is content; malformed after part
        of it was streamed: that part stays a (partial) tool call."""
        call, self.call = self.call, None
        if well_formed:
            self._after_call = True
        elif call.index is None:
            self.verbatim(call.raw)


# ---- the parsers -----------------------------------------------------------------------------------


class ToolParser:
    """A tool-call format (see the module docstring); ``name`` is its ``--tool-call-parser`` name."""

    name = ""
    arguments_keys: tuple[str, ...] = ("arguments",)
    initial_mode = "text"
    markers: tuple[str, ...] = ()  # the format's tags: where they are special tokens, the text must keep them

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output."""
        stream = self.stream()
        stream.finish(text)
        return stream.result()

    def tool_choice_structured_outputs(
        self,
        tools: Sequence[Mapping[str, Any]],
        tool_choice: Any,
        parallel_tool_calls: bool | None = None,
        special_tokens: Mapping[str, int] | None = None,
    ) -> StructuredOutputsParams | None:
        """The constraint that makes the model call a tool in this format: for ``"required"``, one or
        more calls of any of ``tools`` (exactly one when ``parallel_tool_calls`` is false); for a named
        function, one call of it; the JSON written as the templates write it (``", "`` and ``": "``, no
        other whitespace). None for ``"auto"``, ``"none"`` or None. ``tools`` as ``check_tools``
        returns them; ``special_tokens``: the tokenizer's (``Tokenizer.special_tokens``): a marker that
        is one is matched as that token, not spelled out."""
        if tool_choice in (None, "auto", "none"):
            return None
        if tool_choice == "required":
            chosen, many = list(tools), parallel_tool_calls is not False
        else:
            name = tool_choice["function"]["name"]
            chosen, many = [t for t in tools if t["function"]["name"] == name], False
        schema = {"x-guidance": _CALL_JSON, "anyOf": [s for t in chosen for s in self._call_schemas(t["function"])]}
        return StructuredOutputsParams(grammar=self._grammar(schema, many, special_tokens or {}))

    def _call_schemas(self, fn: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The JSON schemas of one call of ``fn``: llguidance keeps a schema's property order, so one per
        order that the format's models write."""
        raise NotImplementedError

    def _grammar(self, call_schema: dict[str, Any], many: bool, special_tokens: Mapping[str, int]) -> str:
        """A Lark grammar (llguidance's dialect) of one call (``many``: one or more) in this format."""
        raise NotImplementedError

    def _run(self, stream: ToolCallStream, final: bool) -> None:
        """Decide as much of ``stream.buf`` as can be (all of it when ``final``)."""
        raise NotImplementedError


# A call's JSON as the formats' templates write it (Python's json.dumps: ", " and ": ", no other
# whitespace). Any whitespace, as JSON allows, let the built-in model loop in it until max_tokens in
# all 20 seeds (tests/engine/test_structured_outputs.py's tools, 200 tokens).
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _object_schema(properties: dict[str, Any], order: Sequence[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: properties[k] for k in order},
        "required": list(order),
        "additionalProperties": False,
    }


def _parameters(fn: Mapping[str, Any]) -> dict[str, Any]:
    """The function's arguments schema; a function without ``parameters`` takes an empty object."""
    return dict(fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False})


def _literal(text: str, special_tokens: Mapping[str, int]) -> str:
    """A Lark expression for ``text``: the special token by id when it is one, else the string."""
    return f"<[{special_tokens[text]}]>" if text in special_tokens else json.dumps(text)


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (the marker may be arriving)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the output."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)

    def _call_schemas(self, fn):
        props = {"name": {"const": fn["name"]}, "arguments": _parameters(fn)}
        # Qwen writes the name first, Hermes 2 Pro the arguments first.
        return [_object_schema(props, ("name", "arguments")), _object_schema(props, ("arguments", "name"))]

    def _grammar(self, call_schema, many, special_tokens):
        start, end = _literal(self.START, special_tokens), _literal(self.END, special_tokens)
        calls = 'call ("\\n" call)*' if many else "call"
        return f'start: {calls}\ncall: {start} "\\n" body "\\n" {end}\nbody: %json {json.dumps(call_schema)}\n'

    def _run(self, stream: ToolCallStream, final: bool) -> None:
        # Modes: "text" (content, looking for a start tag), "call" (in a call's JSON), "close" (after it,
        # whitespace then the end tag), "bad" (a malformed call's text, content up to its end tag).
        while stream.buf or stream.mode == "close":
            buf = stream.buf
            if stream.mode == "text":
                at = buf.find(self.START)
                if at < 0:
                    keep = 0 if final else _held_prefix(buf, self.START)
                    stream.text(buf[: len(buf) - keep])
                    stream.buf = buf[len(buf) - keep :]
                    return
                stream.text(buf[:at])
                stream.start_call(self.START)
                stream.buf, stream.mode = buf[at + len(self.START) :], "call"
            elif stream.mode == "call":
                stream.buf = stream.call.take(buf)
                if stream.call.scanner.invalid:
                    self._malformed(stream)
                elif stream.call.scanner.end is not None:
                    stream.mode = "close"
                elif not final and not stream.progress(complete=False):
                    self._malformed(stream)
            elif stream.mode == "close":
                rest = buf.lstrip(_WS)
                if rest.startswith(self.END) or (final and self.END.startswith(rest)):
                    n = len(buf) - len(rest) + min(len(rest), len(self.END))
                    stream.call.raw += buf[:n]
                    stream.buf, stream.mode = buf[n:], "text"
                    stream.end_call(stream.progress(complete=True))
                elif not self.END.startswith(rest):
                    self._malformed(stream)
                else:
                    stream.progress(complete=False)  # the end tag is arriving
                    return
            else:  # "bad"
                at = buf.find(self.END)
                if at >= 0:
                    stream.verbatim(buf[: at + len(self.END)])
                    stream.buf, stream.mode = buf[at + len(self.END) :], "text"
                else:
                    keep = 0 if final else _held_prefix(buf, self.END)
                    stream.verbatim(buf[: len(buf) - keep])
                    stream.buf = buf[len(buf) - keep :]
                    return

    @staticmethod
    def _malformed(stream: ToolCallStream) -> None:
        stream.end_call(False)
        stream.mode = "bad"


class Llama3JsonToolParser(ToolParser):
    """The output is ``{"name": ..., "parameters": {...}}`` calls (``;`` between them), or content."""

    name = "llama3_json"
    arguments_keys = ("parameters", "arguments")
    PYTHON_TAG = "<|python_tag|>"
    initial_mode = "start"
    markers = (PYTHON_TAG,)

    def _call_schemas(self, fn):
        props = {"name": {"const": fn["name"]}, "parameters": _parameters(fn)}
        return [_object_schema(props, ("name", "parameters"))]

    def _grammar(self, call_schema, many, special_tokens):
        calls = 'call ("; " call)*' if many else "call"
        return f"start: {calls}\ncall: %json {json.dumps(call_schema)}\n"

    def _run(self, stream: ToolCallStream, final: bool) -> None:
        # Modes: "start" (before anything but whitespace), "open" (a call's "{" expected), "call" (in
        # its JSON), "between" (after a call: ";" or the end), "content" (the rest is content).
        while stream.buf:
            buf = stream.buf
            rest = buf.lstrip(_WS)
            mode = stream.mode
            if mode == "content":
                stream.text(buf)
                stream.buf = ""
            elif mode == "call":
                stream.buf = stream.call.take(buf)
                if stream.call.scanner.invalid:
                    stream.end_call(False)
                    stream.mode = "content"
                elif stream.call.scanner.end is not None:
                    stream.end_call(stream.progress(complete=True))
                    stream.mode = "between"
                elif not final and not stream.progress(complete=False):
                    stream.end_call(False)
                    stream.mode = "content"
            elif not rest or (mode == "start" and self.PYTHON_TAG.startswith(rest)):
                if not final:
                    return  # whitespace, or the tag arriving
                if mode != "between":  # the whole output, or what follows a ";": content
                    stream.verbatim(stream.skipped + buf)
                stream.buf = stream.skipped = ""
            elif mode == "start" and rest.startswith(self.PYTHON_TAG):
                stream.skipped += buf[: len(buf) - len(rest) + len(self.PYTHON_TAG)]
                stream.buf, stream.mode = rest[len(self.PYTHON_TAG) :], "open"
            elif mode == "between" and rest.startswith(";"):
                stream.skipped += buf[: len(buf) - len(rest) + 1]
                stream.buf, stream.mode = rest[1:], "open"
            elif rest.startswith("{") and mode != "between":
                stream.start_call(buf[: len(buf) - len(rest)])
                stream.buf, stream.mode = rest, "call"
            else:  # not a call: the rest is content (after a call, its leading whitespace is not)
                if mode != "between":
                    stream.verbatim(stream.skipped)
                stream.skipped = ""
                stream.mode = "content"


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def tool_parser(name: str) -> ToolParser:
    """The parser of ``--tool-call-parser name``; ValueError listing the names there are."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}")
    return TOOL_PARSERS[name]()
