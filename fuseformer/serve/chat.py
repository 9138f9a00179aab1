"""``POST /v1/chat/completions``: messages rendered into a prompt with a chat template, ``n``
completions of it, streamed as server-sent events (the role first, then content deltas) or whole.

The prompt (``chat_prompt``, also ``/tokenize``'s for messages): the server's template (the model's,
or ``serve --chat-template``), or the request's ``chat_template`` where the server trusts request
templates (``serve --trust-request-chat-template``); ``add_generation_prompt`` (default true) opens the
assistant's turn; ``continue_final_message`` instead leaves the last message's turn open for the model
to continue (then ``add_generation_prompt`` defaults to false: both true is a 400);
``chat_template_kwargs`` are more template variables. Content parts must be text.
"""

from __future__ import annotations

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

# Template variables that requests set through their own fields: not through chat_template_kwargs.
_OWN_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize")
# Variables for features the server refuses (tools and documents: parameters.REFUSED).
_REFUSED_VARIABLES = ("tools", "documents")


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
    messages = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):  # content parts: only text ones
            parts = [p.get("text") for p in m.content if p.get("type") == "text"]
            if len(parts) != len(m.content) or not all(isinstance(t, str) for t in parts):
                raise APIError("messages: only text content parts are supported", "messages")
            d["content"] = "".join(parts)
        messages.append(d)
    try:
        text = server.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            continue_final_message=req.continue_final_message,
            **kwargs,
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
