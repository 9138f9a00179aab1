"""``POST /v1/completions``: one or several prompts (text or token ids), ``n`` completions each,
streamed as server-sent events or returned whole. Choice ``i`` of prompt ``p`` is index ``p * n + i``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from fuseformer.serve.errors import shutdown_error
from fuseformer.serve.protocol import CompletionRequest
from fuseformer.serve.serving import Serving
from fuseformer.serve.streaming import Choice, Events, by_choice, completion_logprobs, merged, sse_stream, usage


async def create_completion(server: Serving, req: CompletionRequest, http_request: Request) -> Any:
    arrival = time.monotonic()
    server.check_model(req.model)
    asked = req.max_tokens if "max_tokens" in req.model_fields_set else None
    server.check_fields(req, asked)
    prompts = await server.prepare(http_request, server.completion_prompts, req)
    params = server.sampling_params(req, prompts, "prompt", "max_tokens")
    response_id, engine_id = server.request_ids(http_request, req, "cmpl")
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

    if req.stream:

        async def events() -> AsyncIterator[str]:
            events = Events(head, req.include_usage)
            async for batch in merged(http_request, server.running, run):
                server.note(run, batch)
                chunks = []
                for index, c in by_choice(batch, n):
                    ch = server.record(choices[index], c, arrival)
                    if params.logprobs is None:
                        if c.finish_reason is None:
                            if c.text or not text_only:  # else held back: a partial character, a stop string
                                chunks.append(events.text(index, c.text))
                            continue
                        lps = None
                    elif c.logprobs:
                        offset = len(ch.text) - len(c.text)
                        lps = completion_logprobs(server.token_text, c.token_ids, c.logprobs, offset)
                    else:
                        lps = None
                    choice = dict(
                        index=index,
                        text=c.text,
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
        lps = None
        if params.logprobs is not None:
            lps = completion_logprobs(server.token_text, ch.token_ids, ch.logprobs, 0)
        body_choices.append(
            dict(index=index, text=ch.text, logprobs=lps, finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)
        )
    return head | dict(choices=body_choices, usage=usage(num_prompt, choices, run, len(prompts)))
