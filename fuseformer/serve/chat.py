"""``POST /v1/chat/completions``: messages rendered into a prompt with a chat template, ``n``
completions of it, streamed as server-sent events (the role first, then content deltas) or whole.

The prompt (``chat_prompt``, also ``/tokenize``'s for messages): the server's template (the model's,
or ``serve --chat-template``), or the request's ``chat_template`` where the server trusts request
templates (``serve --trust-request-chat-template``); ``add_generation_prompt`` (default true) opens the
assistant's turn; ``continue_final_message`` instead leaves the last message's turn open for the model
to continue (then ``add_generation_prompt`` defaults to false: both true is a 400);
``chat_template_kwargs`` are more template variables. Content parts must be text.

Tools reach the template as transformers passes them: ``tools`` (the request's list, OpenAI's shape),
and ``tool_choice`` / ``parallel_tool_calls`` when the request gives them (templates that do not read
them ignore them). Messages go in as sent (``role: tool`` with ``tool_call_id``, an assistant's
``tool_calls``), except that a tool call's ``function.arguments``, a JSON string in OpenAI's API, is
given to the template as the object it encodes (vLLM does the same: templates write
``tool_call.arguments | tojson``).

Tool calls in the output (``tool_use``, vLLM's rules): with tools, ``tool_choice`` "auto" (the default)
parses each choice's text with the server's ``--tool-call-parser`` and needs ``--enable-auto-tool-choice``
too; "required" and a named function hold the output to calls in that format (structured outputs; the
server's parser, else ``serving.FORCED_TOOL_CALL_FORMAT``) and parse it back; "none" parses nothing. The
calls become ``message.tool_calls`` (``content``: the text outside them, null when there is none), or
streamed, ``delta.tool_calls`` entries (a call's first one with its id, type and name, then fragments
of its arguments); ``finish_reason`` is "tool_calls" for a choice that called a tool and ended on its
own, except for a named function ("stop", as OpenAI and vLLM answer). ``parallel_tool_calls`` false
keeps the first call only.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from fuseformer.models.tokenizer import ChatTemplateError
from fuseformer.serve.errors import APIError, shutdown_error
from fuseformer.serve.protocol import ChatCompletionRequest, TokenizeRequest
from fuseformer.serve.serving import Serving
from fuseformer.serve.streaming import Choice, Events, by_choice, chat_logprobs, merged, sse_stream, usage
from fuseformer.serve.tool_parsers import ToolCallError, ToolCallStream, ToolParser, check_tools

# Template variables that requests set through their own fields: not through chat_template_kwargs.
_OWN_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "tokenize",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
# Variables for features the server refuses (documents: parameters.REFUSED).
_REFUSED_VARIABLES = ("documents",)


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The request's messages (``ChatMessage``s) as the template reads them: text content parts joined,
    tool calls' ``arguments`` decoded (see the module docstring). APIError naming ``messages``."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):  # content parts: only text ones
            parts = [p.get("text") for p in m.content if p.get("type") == "text"]
            if len(parts) != len(m.content) or not all(isinstance(t, str) for t in parts):
                raise APIError("messages: only text content parts are supported", "messages")
            d["content"] = "".join(parts)
        if "tool_calls" in d:
            d["tool_calls"] = _template_tool_calls(d["tool_calls"], f"messages[{i}].tool_calls")
        out.append(d)
    return out


def _template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError(f"{where} must be a list of tool calls", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', "messages"
            )
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise APIError(f"{where}[{j}].function.arguments is not valid JSON: {exc}", "messages") from exc
        out.append(call | {"function": fn | {"arguments": arguments}})
    return out


def tool_template_variables(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> dict[str, Any]:
    """The template variables of a request's tool fields (those it gives), checked: APIError naming the
    field at fault."""
    if tools is None or tools == []:  # (an empty list asks for nothing)
        # "required" or a function needs tools; "required" of an empty list is "none" (vLLM's, OpenAI's).
        if tool_choice not in (None, "none", "auto") and not (tools == [] and tool_choice == "required"):
            raise APIError("tool_choice needs tools", "tool_choice")
        return {}
    variables: dict[str, Any] = {"tools": _checked_tools(tools, tool_choice, parallel_tool_calls)}
    if tool_choice is not None:
        variables["tool_choice"] = tool_choice
    if parallel_tool_calls is not None:
        variables["parallel_tool_calls"] = parallel_tool_calls
    return variables


def _checked_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> list[dict[str, Any]]:
    try:
        return check_tools(tools, tool_choice, parallel_tool_calls)
    except ToolCallError as exc:
        raise APIError(str(exc), exc.param) from exc


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How a chat request's outputs are read for tool calls (``tool_use``): with ``parser``; ``named``:
    ``tool_choice`` names the function; ``first_only``: ``parallel_tool_calls`` false (or named)."""

    parser: ToolParser
    named: bool
    first_only: bool

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """A choice's finish_reason: "tool_calls" when it called a tool and ended on its own (EOS, a stop;
        at the length limit it stays "length": the output was cut), except for a named function, whose
        call ends with "stop" (OpenAI's answer, and vLLM's)."""
        return "tool_calls" if called and reason == "stop" and not self.named else reason

    def calls_delta(self, delta: dict[str, Any]) -> bool:
        """Whether a ``ToolCallStream`` delta goes out: all of them, but a second call's (and later ones')
        with ``first_only``."""
        return not (self.first_only and "tool_calls" in delta and delta["tool_calls"][0]["index"] > 0)


def tool_use(server: Serving, req: ChatCompletionRequest) -> ToolUse | None:
    """How ``req``'s outputs are read for tool calls (see the module docstring); None: as text. For a
    forcing ``tool_choice``, the request is held to its constraint (``hold_to_tool_calls``). Where the
    format's markers are special tokens of the tokenizer, the output text keeps special tokens (vLLM's
    ``adjust_request``): a request's explicit ``skip_special_tokens: true`` is then a 400. APIError naming
    the field at fault."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        tool_template_variables(tools, choice, req.parallel_tool_calls)  # the checks of tool fields alone
        return None
    checked = _checked_tools(tools, choice, req.parallel_tool_calls)
    choice = "auto" if choice is None else choice  # vLLM's default with tools, as OpenAI's
    if choice == "none":
        return None
    if choice == "auto":
        missing = [
            flag
            for flag, given in (
                ("--enable-auto-tool-choice", server.enable_auto_tool_choice),
                ("--tool-call-parser", server.tool_parser is not None),
            )
            if not given
        ]
        if missing:
            raise APIError(
                'tool_choice "auto" (the default when tools are given) needs the server started with '
                f'{" and ".join(missing)}; this one takes tool_choice "none", "required" or a named function',
                "tool_choice",
            )
        parser = server.tool_parser
    else:
        parser = server.forced_tool_parser
        spec = parser.tool_choice_structured_outputs(checked, choice, req.parallel_tool_calls, server.special_tokens)
        req.hold_to_tool_calls(spec)
    special = [m for m in parser.markers if m in server.special_tokens]
    if special:
        if req.skip_special_tokens and "skip_special_tokens" in req.model_fields_set:
            raise APIError(
                f"skip_special_tokens: true would leave the tool-call marker {special[0]!r}, a special token of "
                "this model, out of the text that tool calls are parsed from",
                "skip_special_tokens",
            )
        req.skip_special_tokens = False
    named = isinstance(choice, dict)
    return ToolUse(parser, named, named or req.parallel_tool_calls is False)


def render_chat(server: Serving, req: ChatCompletionRequest | TokenizeRequest) -> str:
    """The prompt text of ``req.messages`` (see the module docstring); APIError naming the field at fault."""
    template = server.chat_template
    if req.chat_template is not None:
        if not server.trust_request_chat_template:
            raise APIError(
                "chat_template: this server renders chats with its own template only "
                "(serve --trust-request-chat-template accepts a request's)",
                "chat_template",
            )
        template = req.chat_template
    if server.tokenizer is None or template is None:
        raise APIError("the model has no chat template: use /v1/completions (or serve --chat-template)", "messages")
    kwargs = req.chat_template_kwargs or {}
    for key in kwargs:
        if key in _OWN_FIELDS:
            raise APIError(f"chat_template_kwargs: set {key!r} as a field of the request", "chat_template_kwargs")
        if key in _REFUSED_VARIABLES:
            raise APIError(f"chat_template_kwargs: {key!r} is not supported by this server", "chat_template_kwargs")
    add_generation_prompt = req.add_generation_prompt
    if req.continue_final_message:
        if add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        add_generation_prompt = False
    messages = template_messages(req.messages)
    # /tokenize's requests have tools, not tool_choice and parallel_tool_calls (vLLM's).
    tools = tool_template_variables(
        req.tools, getattr(req, "tool_choice", None), getattr(req, "parallel_tool_calls", None)
    )
    try:
        text = server.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            continue_final_message=req.continue_final_message,
            **kwargs,
            **tools,
        )
    except ChatTemplateError as exc:  # the template's failure on these messages, or a request's template
        message = str(exc)
        if message.startswith("continue_final_message"):
            raise APIError(message, "continue_final_message") from exc
        param = "chat_template" if req.chat_template is not None else "messages"
        raise APIError(f"messages: the chat template failed: {message}", param) from exc
    if not isinstance(text, str):
        raise APIError("messages: the chat template did not render to text", "messages")
    return text


def chat_prompt(server: Serving, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool) -> list[int]:
    """The prompt's token ids (``render_chat``, then tokenized), checked against the context length."""
    ids = server.encode(render_chat(server, req), "messages", add_special_tokens)
    if not ids:
        raise APIError("messages render to an empty prompt", "messages")
    server.check_prompt_length(len(ids), "messages")
    return ids


async def create_chat_completion(server: Serving, req: ChatCompletionRequest, http_request: Request) -> Any:
    arrival = time.monotonic()
    server.check_model(req.model)
    tools = tool_use(server, req)  # before the fields' checks: a forcing tool_choice sets the constraint
    asked, field_name = req.requested_max_tokens
    server.check_fields(req, asked)
    ids = await server.prepare(http_request, chat_prompt, server, req, req.add_special_tokens)
    params = server.sampling_params(req, [ids], "messages", field_name)
    top = req.top_logprobs or 0
    response_id, engine_id = server.request_ids(http_request, req, "chatcmpl")
    await server.compile_structured_outputs(params, req.structured_param)
    run = await server.add(engine_id, [ids], params, "messages", req.user)
    created = int(time.time())
    choices = [Choice() for _ in range(params.n)]
    text_only = server.tokenizer is not None  # as completions: deltas without text are held back
    head = dict(id=response_id, object="chat.completion.chunk", created=created, model=server.model_name)

    if req.stream:

        async def events() -> AsyncIterator[str]:
            events = Events(head, req.include_usage)
            for index in range(params.n):
                delta = dict(role="assistant", content="")
                yield events.choice(dict(index=index, delta=delta, logprobs=None, finish_reason=None, stop_reason=None))
            # With tool calls read: a parser per choice, and the logprobs it has not sent yet.
            parsers = None if tools is None else [tools.parser.stream() for _ in range(params.n)]
            held: list[list[dict[str, Any]]] = [[] for _ in range(params.n)]
            async for batch in merged(http_request, server.running, run):
                server.note(run, batch)
                chunks = []
                for _, c in by_choice(batch, params.n):
                    server.record(choices[c.index], c, arrival)
                    if parsers is not None:
                        if req.logprobs and c.logprobs:
                            held[c.index] += chat_logprobs(server.token_text, c.token_ids, c.logprobs, top)["content"]
                        chunks += _tool_call_chunks(events, c, parsers[c.index], tools, held[c.index])
                        continue
                    if not req.logprobs and c.finish_reason is None:
                        if c.text or not text_only:  # else held back: a partial character, a stop string
                            chunks.append(events.content(c.index, c.text))
                        continue
                    lps = None
                    if req.logprobs and c.logprobs:
                        lps = chat_logprobs(server.token_text, c.token_ids, c.logprobs, top)
                    delta = dict(content=c.text) if c.text or c.finish_reason is None else {}
                    choice = dict(
                        index=c.index,
                        delta=delta,
                        logprobs=lps,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    chunks.append(events.choice(choice))
                if chunks:
                    yield "".join(chunks)

        return StreamingResponse(
            sse_stream(
                events(),
                run,
                lambda: head | dict(choices=[], usage=usage(len(ids), choices, run, 1)) if req.include_usage else None,
            ),
            media_type="text/event-stream",
        )

    async for batch in merged(http_request, server.running, run):
        server.note(run, batch)
        for _, c in by_choice(batch, params.n):
            server.record(choices[c.index], c, arrival)
    if run.cut:
        raise shutdown_error()
    if await http_request.is_disconnected():
        return Response(status_code=499)
    body_choices = []
    for index, ch in enumerate(choices):
        lps = chat_logprobs(server.token_text, ch.token_ids, ch.logprobs, top) if req.logprobs else None
        message: dict[str, Any] = dict(role="assistant", content=ch.text)
        finish = ch.finish_reason
        if tools is not None:
            content, calls = tools.parser.extract(ch.text)
            if calls:
                calls = calls[:1] if tools.first_only else calls
                message = dict(role="assistant", content=content, tool_calls=[call.to_openai() for call in calls])
                finish = tools.finish_reason(finish, True)
        body_choices.append(
            dict(index=index, message=message, logprobs=lps, finish_reason=finish, stop_reason=ch.stop_reason)
        )
    return head | dict(object="chat.completion", choices=body_choices, usage=usage(len(ids), choices, run, 1))


def _tool_call_chunks(
    events: Events, c: Any, stream: ToolCallStream, tools: ToolUse, logprobs: list[dict[str, Any]]
) -> list[str]:
    """The chunks of engine delta ``c`` of a choice whose output is read for tool calls: its text parsed
    into content and tool-call deltas (text that may begin a call is held back until it is known); the
    choice's ``logprobs`` not sent yet (emptied in place) go on the first chunk out, and its finish_reason
    on the last (a chunk of its own when nothing else is left)."""
    deltas = stream.feed(c.text) if c.finish_reason is None else stream.finish(c.text)
    deltas = [d for d in deltas if tools.calls_delta(d)]
    if c.finish_reason is not None and not deltas:
        deltas = [{}]
    out = []
    for j, delta in enumerate(deltas):
        lps = None
        if logprobs:
            lps = dict(content=list(logprobs))
            logprobs.clear()
        finish = stop_reason = None
        if c.finish_reason is not None and j == len(deltas) - 1:
            finish = tools.finish_reason(c.finish_reason, stream.num_streamed_calls > 0)
            stop_reason = c.stop_reason
        out.append(
            events.choice(dict(index=c.index, delta=delta, logprobs=lps, finish_reason=finish, stop_reason=stop_reason))
        )
    return out
