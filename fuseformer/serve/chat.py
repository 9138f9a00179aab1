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
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from fuseformer.models.tokenizer import ChatTemplateError
from fuseformer.serve.errors import APIError, shutdown_error
from fuseformer.serve.protocol import ChatCompletionRequest, TokenizeRequest
from fuseformer.serve.serving import Serving
from fuseformer.serve.streaming import Choice, Events, by_choice, chat_logprobs, merged, sse_stream, usage
from fuseformer.serve.tool_parsers import ToolCallError, check_tools

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
    if tools is None or tools == []:  # (an empty list asks for nothing: parameters.REFUSED)
        if tool_choice not in (None, "none", "auto"):  # "required" or a function: there must be tools
            raise APIError("tool_choice needs tools", "tool_choice")
        return {}
    try:
        variables: dict[str, Any] = {"tools": check_tools(tools, tool_choice, parallel_tool_calls)}
    except ToolCallError as exc:
        raise APIError(str(exc), exc.param) from exc
    if tool_choice is not None:
        variables["tool_choice"] = tool_choice
    if parallel_tool_calls is not None:
        variables["parallel_tool_calls"] = parallel_tool_calls
    return variables


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
    # The tool fields: request fields once protocol.py declares them; until then a body's extras (which
    # parameters.REFUSED lets through only when they ask for nothing), read the same way.
    tools = tool_template_variables(
        getattr(req, "tools", None), getattr(req, "tool_choice", None), getattr(req, "parallel_tool_calls", None)
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
            async for batch in merged(http_request, server.running, run):
                server.note(run, batch)
                chunks = []
                for _, c in by_choice(batch, params.n):
                    server.record(choices[c.index], c, arrival)
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
        message = dict(role="assistant", content=ch.text)
        body_choices.append(
            dict(index=index, message=message, logprobs=lps, finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)
        )
    return head | dict(object="chat.completion", choices=body_choices, usage=usage(len(ids), choices, run, 1))
