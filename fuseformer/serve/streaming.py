"""A request's outputs, from the engine's streams to OpenAI's response shapes.

``merged`` reads every stream of a request (one per prompt) as batches of deltas, aborting them when
the client disconnects or leaves; ``by_choice`` joins a batch's deltas per choice; ``Events`` writes
server-sent events; ``usage``, ``completion_logprobs``, ``chat_logprobs`` and ``prompt_logprobs_json``
are the response's parts.

Per-token cost is kept off the hot path, because the engine's step loop is host-bound and shares the
GIL with this event loop: every Python microsecond spent here per request per step comes off the
engine's throughput. A step's deltas arrive in one loop wake-up; a request's reader takes all deltas
that have arrived (one SSE event per choice per wake-up, however many steps it covers); the event's
JSON is a template around one encoded string.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from fuseformer.engine.async_engine import RequestStream
from fuseformer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from fuseformer.serve.errors import shutdown_error, stream_error


@dataclass(slots=True, eq=False)
class Running:
    """The streams of one request being answered (one per prompt); ``cut`` once the shutdown timeout
    ended it unfinished; per prompt, the prompt tokens the engine found in the prefix cache, and the
    prompt's logprobs (with ``prompt_logprobs``, once the engine gave them)."""

    streams: list[RequestStream]
    cut: bool = False
    cached_tokens: dict[int, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # prompts whose first output was read
    prompt_logprobs: dict[int, list[PositionLogprobs | None]] = field(default_factory=dict)


@dataclass(slots=True)
class Choice:
    """One completion's text, tokens and logprobs so far, its finish, and the timing for the metrics."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None


def first_output_stats(out: RequestOutput) -> tuple[int | None, float | None]:
    """(prompt tokens served from the prefix cache, seconds from arrival to first scheduling) of a
    prompt's first output; None where the engine does not report it. The engine's fields are vLLM's
    names, ``RequestOutput.num_cached_tokens`` and ``RequestMetrics.first_scheduled_time`` (not set by
    the engine yet: until it is, the queue-time histogram stays empty)."""
    cached = getattr(out, "num_cached_tokens", None)
    metrics = out.metrics
    scheduled = getattr(metrics, "first_scheduled_time", None) if metrics is not None else None
    queued = scheduled - metrics.arrival_time if scheduled is not None else None
    return (cached if isinstance(cached, int) and cached >= 0 else None), queued


async def _watch_disconnect(http_request: Request, streams: list[RequestStream]) -> None:
    """Close the streams (abort their requests) when the client disconnects. Waits on the ASGI receive
    channel, which the server answers with "http.disconnect" when the connection drops: no polling (a
    poll every 0.1 s per request was a quarter of the event loop's time at 128 streams)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # uvicorn blocks until the disconnect; a server that answers at once must not spin
    for s in streams:
        s.close()


async def merged(
    http_request: Request, running: set[Running], run: Running
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Batches of (prompt index, delta) from all of ``run``'s streams: each batch is everything that
    arrived since the previous one (one write per batch when the client falls behind). Leaving early,
    the client disconnecting (a watcher task closes the streams) or a cancellation aborts every
    unfinished stream. At the end ``run`` leaves ``running``."""
    streams = run.streams
    watcher = asyncio.ensure_future(_watch_disconnect(http_request, streams))
    tasks = [watcher]
    try:
        if len(streams) == 1:  # the common case: no task between the stream and the response
            stream = streams[0]
            while batch := await stream.get_batch():
                yield [(0, out) for out in batch]
            return
        queue: asyncio.Queue[list[tuple[int, RequestOutput]] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                while batch := await stream.get_batch():
                    queue.put_nowait([(i, out) for out in batch])
            except Exception as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks += [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        while remaining:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch = []
            for item in items:
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    batch += item
            if batch:
                yield batch
    finally:
        running.discard(run)
        for s in streams:
            s.close()
        for t in tasks:
            t.cancel()


def by_choice(batch: list[tuple[int, RequestOutput]], n: int) -> list[tuple[int, CompletionOutput]]:
    """(choice index, delta) per choice in ``batch``, deltas of one choice joined into one (a reader that
    fell behind sends one event per choice, not one per engine step). Choice index: prompt * n + index."""
    if len(batch) == 1 and len(batch[0][1].outputs) == 1:  # the usual case: one step, one choice
        i, out = batch[0]
        return [(i * n + out.outputs[0].index, out.outputs[0])]
    joined: dict[int, CompletionOutput] = {}
    for i, out in batch:
        for c in out.outputs:
            index = i * n + c.index
            prev = joined.get(index)
            if prev is not None:
                logprobs = None
                if prev.logprobs is not None or c.logprobs is not None:
                    logprobs = (prev.logprobs or []) + (c.logprobs or [])
                c = CompletionOutput(
                    index=c.index,
                    text=prev.text + c.text,
                    token_ids=prev.token_ids + c.token_ids,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=logprobs,
                    cumulative_logprob=c.cumulative_logprob,
                )
            joined[index] = c
    return list(joined.items())


_JSON = json.JSONEncoder(ensure_ascii=False)


class Events:
    """The server-sent events of one streamed response. The head (id, object, created, model) is
    encoded once; the usual event, text only and not finished, is filled into a template with one
    string encoded per event (0.7 us; ``json.dumps`` of the whole chunk dict: 12.7 us, per request
    per step). ``choice(...)`` equals ``sse(head | {"choices": [choice]} | usage)``."""

    def __init__(self, head: dict[str, Any], include_usage: bool) -> None:
        self._prefix = f'data: {_JSON.encode(head)[:-1]}, "choices": ['
        self._suffix = ', "usage": null}\n\n' if include_usage else "}\n\n"

    def choice(self, choice: dict[str, Any]) -> str:
        return f"{self._prefix}{_JSON.encode(choice)}]{self._suffix}"

    def text(self, index: int, text: str) -> str:
        """A completion chunk's choice {"index", "text", "logprobs": null, "finish_reason": null,
        "stop_reason": null}."""
        choice = (
            f'{{"index": {index}, "text": {_JSON.encode(text)}, "logprobs": null, "finish_reason": null, '
            '"stop_reason": null}'
        )
        return f"{self._prefix}{choice}]{self._suffix}"

    def content(self, index: int, text: str) -> str:
        """A chat chunk's choice {"index", "delta": {"content"}, "logprobs": null, "finish_reason": null,
        "stop_reason": null}."""
        delta = f'{{"content": {_JSON.encode(text)}}}'
        choice = f'{{"index": {index}, "delta": {delta}, "logprobs": null, "finish_reason": null, "stop_reason": null}}'
        return f"{self._prefix}{choice}]{self._suffix}"


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_stream(
    body: AsyncIterator[str], run: Running, final: Callable[[], dict[str, Any] | None]
) -> AsyncIterator[str]:
    """A streamed response's events: ``body``'s chunks; then the shutdown error if the server cut the
    run, else ``final()`` (the usage chunk, or None for none); an exception of ``body`` goes in the
    stream as an error event (the headers are sent); then [DONE]. Completions and chat alike."""
    try:
        async for chunk in body:
            yield chunk
        if run.cut:
            yield sse(shutdown_error().body())
        elif (last := final()) is not None:
            yield sse(last)
    except Exception as exc:
        yield sse(stream_error(exc).body())
    yield sse("[DONE]")


def usage(prompt_tokens: int, choices: list[Choice], run: Running, num_prompts: int) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` once the engine reported it for every prompt."""
    completion_tokens = sum(len(ch.token_ids) for ch in choices)
    details = None
    if len(run.cached_tokens) == num_prompts:
        details = dict(cached_tokens=sum(run.cached_tokens.values()))
    return dict(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


def completion_logprobs(
    token_text: Callable[[int], str],
    token_ids: list[int],
    logprobs: list[PositionLogprobs | None],
    offset: int,
) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset. A
    position without logprobs (None: an echoed prompt's first token) has null ones, as OpenAI's."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops: list[dict[str, float] | None] = []
    for lp in logprobs:
        if lp is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for k, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob):
            top.setdefault(token_text(k), v.logprob)  # tokens that decode alike (partial characters): the best
        tops.append(top)
    token_logprobs = [None if lp is None else lp[t].logprob for t, lp in zip(token_ids, logprobs)]
    return dict(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(
    token_text: Callable[[int], str], token_ids: list[int], logprobs: list[PositionLogprobs], top: int
) -> dict[str, Any]:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the ``top`` best."""

    def entry(t: int, v: float) -> dict[str, Any]:
        s = token_text(t)
        return dict(token=s, logprob=v, bytes=list(s.encode("utf-8")))

    content = []
    for t, lp in zip(token_ids, logprobs):
        best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append(entry(t, lp[t].logprob) | dict(top_logprobs=[entry(k, v.logprob) for k, v in best]))
    return dict(content=content)


def prompt_logprobs_json(prompt_logprobs: list[PositionLogprobs | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token None (the first) or {token id (a
    string, as JSON keys are): {"logprob", "rank", "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): dict(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token) for t, lp in position.items()
        }
        for position in prompt_logprobs
    ]
