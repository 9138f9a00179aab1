"""``POST /v1/completions``: one or several prompts (text or token ids), ``n`` completions each,
streamed as server-sent events or returned whole. Choice ``i`` of prompt ``p`` is index ``p * n + i``.

``echo``: each choice's text starts with its prompt (streamed: in the choice's first chunk), and with
``logprobs`` its logprobs start with the prompt tokens' (the first one's null). ``prompt_logprobs``:
each choice carries its prompt's (vLLM's shape; streamed: in its first chunk)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from fuseformer.serve.errors import shutdown_error
from fuseformer.serve.protocol import CompletionRequest
from fuseformer.serve.serving import Serving
from fuseformer.serve.streaming import (
    Choice,
    Events,
    by_choice,
    completion_logprobs,
    merged,
    prompt_logprobs_json,
    sse_stream,
    usage,
)


async def create_completion(server: Serving, req: CompletionRequest, http_request: Request) -> Any:
    arrival = time.monotonic()
    server.check_model(req.model)
    asked = req.max_tokens if "max_tokens" in req.model_fields_set else None
    server.check_fields(req, asked)
    prompts = await server.prepare(http_request, server.completion_prompts, req)
    params = server.sampling_params(req, prompts, "prompt", "max_tokens")
    response_id, engine_id = server.request_ids(http_request, req, "cmpl")
    await server.compile_structured_outputs(params, req.structured_param)
    run = await server.add(engine_id, prompts, params, "prompt", req.user)
    created = int(time.time())
    n = params.n
    choices = [Choice() for _ in range(len(prompts) * n)]
    num_prompt = sum(len(p) for p in prompts)
    # Streams leave out deltas that add no text (held back: an incomplete character, a possible stop
    # string), except without a tokenizer (token-id prompts, text always empty): then every delta is
    # a chunk, the only sign of progress a client gets (the serving benchmark times its first one).
    text_only = server.tokenizer is not None
    head = dict(id=response_id, object="text_completion", created=created, model=server.model_name)
    echoes = server.echo_texts(req, prompts) if req.echo else None

    def prefix(index: int) -> tuple[str, list[int], list]:
        """What goes before choice ``index``'s own text, tokens and logprobs: its echoed prompt."""
        if echoes is None:
            return "", [], []
        p = index // n
        if params.logprobs is None:
            return echoes[p], [], []
        return echoes[p], prompts[p], run.prompt_logprobs.get(p) or [None] * len(prompts[p])

    if req.stream:

        async def events() -> AsyncIterator[str]:
            events = Events(head, req.include_usage)
            started: set[int] = set()  # choices whose first delta came: it carries the echo, prompt logprobs
            async for batch in merged(http_request, server.running, run):
                server.note(run, batch)
                chunks = []
                for index, c in by_choice(batch, n):
                    ch = server.record(choices[index], c, arrival)
                    first = index not in started
                    started.add(index)
                    echo, echo_ids, echo_lps = prefix(index) if first else ("", [], [])
                    text = echo + c.text
                    extra = {}
                    if first and req.prompt_logprobs is not None:
                        extra["prompt_logprobs"] = prompt_logprobs_json(run.prompt_logprobs.get(index // n))
                    if params.logprobs is None and not extra:
                        if c.finish_reason is None:
                            if text or not text_only:  # else held back: a partial character, a stop string
                                chunks.append(events.text(index, text))
                            continue
                        lps = None
                    elif params.logprobs is not None and (c.logprobs or echo_lps):
                        # Text offsets in the choice's whole text (after the echo, once it was sent).
                        offset = 0 if first else len(ch.text) - len(c.text) + (len(echoes[index // n]) if echoes else 0)
                        lps = completion_logprobs(
                            server.token_text, echo_ids + c.token_ids, echo_lps + (c.logprobs or []), offset
                        )
                    else:
                        lps = None
                    choice = dict(
                        index=index,
                        text=text,
                        logprobs=lps,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    chunks.append(events.choice(choice | extra))
                if chunks:
                    yield "".join(chunks)

        return StreamingResponse(
            sse_stream(
                events(),
                run,
                lambda: (
                    head | dict(choices=[], usage=usage(num_prompt, choices, run, len(prompts)))
                    if req.include_usage
                    else None
                ),
            ),
            media_type="text/event-stream",
        )

    async for batch in merged(http_request, server.running, run):
        server.note(run, batch)
        for index, c in by_choice(batch, n):
            server.record(choices[index], c, arrival)
    if run.cut:
        raise shutdown_error()
    if await http_request.is_disconnected():
        return Response(status_code=499)
    body_choices = []
    for index, ch in enumerate(choices):
        text, ids, lps = prefix(index)
        logprobs = None
        if params.logprobs is not None:
            logprobs = completion_logprobs(server.token_text, ids + ch.token_ids, lps + ch.logprobs, 0)
        choice = dict(
            index=index,
            text=text + ch.text,
            logprobs=logprobs,
            finish_reason=ch.finish_reason,
            stop_reason=ch.stop_reason,
        )
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(run.prompt_logprobs.get(index // n))
        body_choices.append(choice)
    return head | dict(choices=body_choices, usage=usage(num_prompt, choices, run, len(prompts)))
