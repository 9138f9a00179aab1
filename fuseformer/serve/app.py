"""The OpenAI-compatible HTTP app: ``create_app(engine, model_name, api_key=None)`` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each streaming as server-sent events
``data: {...}`` ending in ``data: [DONE]``, or not), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter
(``param`` names the field), malformed JSON, text that is not valid Unicode, a prompt over the context
length, a ``max_tokens`` that does not fit, a chat template that fails on the messages; 401 without
the API key (when one is set: every ``/v1`` path, checked from the headers before the body is read;
``/health`` and ``/metrics`` stay open for probes and scrapers, as in vLLM); 404 ``model_not_found``
for a model this server does not serve, as OpenAI and vLLM answer; 404/405 for wrong routes; 413 for a
body over ``max_body_bytes``; 503 while shutting down, and for requests still running when the
shutdown timeout ends them (a stream gets an error event, then ``data: [DONE]``). User input never
gives a 500; an unexpected error gives a 500 in the same shape and the connection stays usable.

Limits (each a client's 4xx, not a slow or stuck server): the body (``max_body_bytes``, 16 MiB by
default), stop strings (``protocol.MAX_STOP_STRINGS`` of at most ``MAX_STOP_STRING_CHARS``),
completions (``MAX_N``) and logprobs per request. The prompt of a large body (over
``_INLINE_BODY_BYTES``) is tokenized, and its chat template rendered, on a worker thread with the
GIL released, so that it does not stop the other clients; token-id prompts over the context length
are refused before any text is tokenized, and a list of prompts stops at the first that is too long.

A client that disconnects has its requests aborted, and their KV blocks freed, at once: a watcher
task per request waits on the ASGI receive channel for "http.disconnect" and closes the request's
streams (non-streaming requests get no cancellation from Starlette; streaming bodies may also be
cancelled by Starlette, whose ``finally`` closes the streams). The lifespan's exit runs
``engine.shutdown``: uvicorn on SIGTERM stops accepting, waits for in-flight requests (up to its
graceful timeout, then cancels them, which aborts them), then exits the lifespan.

Per-token cost is kept off the hot path, because the engine's step loop is host-bound and shares the
GIL with this event loop: every Python microsecond spent here per request per step comes off the
engine's throughput. A step's deltas arrive in one loop wake-up; a request's reader takes all deltas
that have arrived (one SSE event per choice per wake-up, however many steps it covers); the event's
JSON is a template around one encoded string.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fuseformer.engine.async_engine import AsyncEngine, EngineDeadError, EngineShutdownError, RequestStream
from fuseformer.engine.outputs import CompletionOutput, RequestOutput
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import SchedulerStats
from fuseformer.serve.metrics import ServerMetrics
from fuseformer.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)

# Union members' tags in pydantic's error locations ("prompt", "list[int]", 0): not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}

logger = logging.getLogger("fuseformer.serve")

# Bodies over this get 413 (``create_app(max_body_bytes=)``, ``serve --max-body-bytes``): 16x the body
# of the longest prompt of a 128K-token model (~1 MB as JSON token ids, about as much as text), so that
# a 1M-token model's longest prompt fits too. JSON parsing stays on the event loop (~0.1 s at 16 MiB).
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# Bodies over this have their prompt prepared (tokenized, the chat template rendered) on a worker
# thread: the tests' byte-level BPE takes ~1 us a character, the 5 MB prompt of issue 30 held the
# event loop, and every client with it, for 12 s. Below it the thread hop (0.1-1 ms while the engine
# thread holds the GIL) would cost more than it saves.
_INLINE_BODY_BYTES = 4096
_PREPARE_THREADS = 4  # large prompts tokenized at once, at most; the others queue
# The body's size, as the guard middleware read it, in the ASGI scope.
_BODY_BYTES = "fuseformer.body_bytes"


def check_api_key(api_key: str | None) -> None:
    """Raise ValueError for an API key no client can send: empty, or with a character outside
    printable ASCII or a space (HTTP clients strip, split or refuse those in a header)."""
    if api_key is None:
        return
    if not api_key:
        raise ValueError("the API key must not be empty")
    bad = [c for c in api_key if not "!" <= c <= "~"]
    if bad:
        raise ValueError(
            f"the API key has {bad[0]!r}: a key must be printable ASCII without spaces, so that a client "
            "can send it in an Authorization header"
        )


def _encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens)``, with the GIL released while the Rust tokenizer
    runs (``tokenizers``' ``encode`` holds it throughout; ``encode_batch`` releases it), so that a long
    text tokenized on a worker thread does not stop the event loop. The BOS/EOS rule is
    ``Tokenizer.encode``'s; a tokenizer of another kind is called as it is."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is None or not hasattr(inner, "encode_batch"):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    ids = inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    if add_special_tokens:
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        if tokenizer.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if tokenizer.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
    return ids


def _check_unicode(text: str, where: str) -> None:
    """400 for a lone surrogate (JSON's ``"\ud800"``): no tokenizer takes it, and it has no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            f"{where} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}", where
        ) from None


@dataclass(slots=True, eq=False)
class _Running:
    """The streams of one request being answered; ``cut`` once the shutdown timeout ended it unfinished."""

    streams: list[RequestStream]
    cut: bool = False


@dataclass(slots=True)
class _Choice:
    """One completion's text, tokens and logprobs so far, and the timing for the latency metrics."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_time: float | None = None


class _Server:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._default_params: SamplingParams | None = None
        self.running: set[_Running] = set()
        self.ended = False  # end_unfinished ran: no new requests
        self._pool: ThreadPoolExecutor | None = None
        # Response ids: a random prefix per server and a counter, not uuid4 per request (its urandom
        # call releases the GIL, and the engine thread then holds it for the switch interval, 5 ms).
        self._id_prefix = secrets.token_hex(8)
        self._ids = itertools.count()

    def next_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):016x}"

    def default_params(self) -> SamplingParams:
        if self._default_params is None:
            self._default_params = self.engine.default_sampling_params()  # reads config only
        return self._default_params

    def end_unfinished(self) -> None:
        """End every request still running (the shutdown timeout passed): each gets a 503 in OpenAI's
        shape, or an SSE error event and ``data: [DONE]``, and its engine request is aborted. Requests
        that arrive afterwards get a 503 at once."""
        self.ended = True
        for run in list(self.running):
            if not all(s.finished for s in run.streams):
                run.cut = True
                for s in run.streams:
                    s.close()

    async def prepare(self, http_request: Request, fn: Any, *args: Any) -> Any:
        """``fn(*args)``: on the event loop for a small request, on a worker thread for a large body
        (``_INLINE_BODY_BYTES``), so that tokenizing it does not stop the other clients."""
        if http_request.scope.get(_BODY_BYTES, 0) <= _INLINE_BODY_BYTES:
            return fn(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_PREPARE_THREADS, thread_name_prefix="fuseformer-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- checks ----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )

    def check_fields(self, req: Any, asked: int | None) -> None:
        """Raise the APIError of a sampling field out of range, before any prompt is tokenized (and so
        before a length error). ``asked``: the max tokens the request gave, else None."""
        req.to_sampling_params(self.default_params(), 1 if asked is None else asked)

    def check_prompt_length(self, num_tokens: int, where: str) -> None:
        if num_tokens >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the {where} has {num_tokens} "
                f"tokens (at most {self.max_model_len - 1}, to leave room for one output token)",
                where,
                code="context_length_exceeded",
            )

    def check_lengths(self, prompts: list[list[int]], req: Any, where: str, max_tokens_field: str) -> int:
        """The max_tokens every prompt gets: as asked (400 when prompt + it does not fit), else what fits."""
        asked = req.requested_max_tokens[0] if isinstance(req, ChatCompletionRequest) else req.max_tokens
        explicit = max_tokens_field in req.model_fields_set
        longest = max(len(p) for p in prompts)
        self.check_prompt_length(longest, where)
        room = self.max_model_len - longest
        if asked is None:
            return room
        if not explicit:  # the default (16 for completions) is cut to fit, not refused
            return max(1, min(asked, room))
        if asked >= 1 and asked > room:
            raise APIError(
                f"{max_tokens_field} {asked} plus the {longest} tokens of the {where} exceed this model's maximum "
                f"context length {self.max_model_len}: at most {room} output tokens fit",
                max_tokens_field,
                code="context_length_exceeded",
            )
        return asked

    def sampling_params(self, req: Any, prompts: list[list[int]], where: str, field: str) -> SamplingParams:
        """The request's SamplingParams, max_tokens as ``check_lengths`` gives it (its fields' ranges
        were checked by ``check_fields``)."""
        return req.to_sampling_params(self.default_params(), self.check_lengths(prompts, req, where, field))

    def encode(self, text: str, where: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError("the model has no tokenizer.json: give the prompt as token ids", where)
        _check_unicode(text, where)
        try:
            return _encode_text(self.tokenizer, text, add_special_tokens)
        except Exception as exc:  # the tokenizer refused the client's text: a 400, with its reason
            raise APIError(f"{where} could not be tokenized: {type(exc).__name__}: {exc}", where) from exc

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt. Token-id prompts over the context length are refused before any
        text is tokenized, and texts are tokenized one by one up to the first that is too long."""
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif not p:
            raise APIError("prompt must not be empty", "prompt")
        elif all(isinstance(t, int) for t in p):
            items = [p]
        else:
            items = p
        for item in items:
            if isinstance(item, str):
                continue
            if not isinstance(item, list) or not all(isinstance(t, int) for t in item):
                raise APIError("prompt must be a string, a list of token ids, or a list of either", "prompt")
            if not item:
                raise APIError("prompt must not be empty", "prompt")
            self.check_prompt_length(len(item), "prompt")
        out = []
        for item in items:
            ids = self.encode(item, "prompt") if isinstance(item, str) else list(item)
            if not ids:
                raise APIError("prompt must not be empty", "prompt")
            self.check_prompt_length(len(ids), "prompt")
            out.append(ids)
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise APIError("the model has no chat template: use /v1/completions", "messages")
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
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **(req.chat_template_kwargs or {}))
        except jinja2.TemplateError as exc:
            raise APIError(f"messages: the chat template failed: {exc}", "messages") from exc
        except Exception as exc:  # the template's own limits (range(), recursion, ...) met by these messages
            raise APIError(f"messages: the chat template failed: {type(exc).__name__}: {exc}", "messages") from exc
        if not isinstance(text, str):
            raise APIError("messages: the chat template did not render to text", "messages")
        ids = self.encode(text, "messages", add_special_tokens=False)  # the template writes the special tokens
        if not ids:
            raise APIError("messages render to an empty prompt", "messages")
        self.check_prompt_length(len(ids), "messages")
        return ids

    # ---- running requests ------------------------------------------------------------------------

    async def add(self, base_id: str, prompts: list[list[int]], params: SamplingParams, where: str) -> _Running:
        if self.ended:
            raise EngineShutdownError("the server is shutting down")
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(rid, ids, params))
        except ValueError as exc:
            for s in streams:
                s.close()
            raise APIError(str(exc).removeprefix("LLM: "), where) from exc
        except BaseException:
            for s in streams:
                s.close()
            raise
        run = _Running(streams)
        self.running.add(run)
        return run

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def record(self, choice: _Choice, c: CompletionOutput, arrival: float) -> _Choice:
        """Add an engine delta ``c`` to ``choice`` (text, tokens, logprobs, finish reason) and count it
        in the latency and token metrics. Returns ``choice``."""
        self._observe(choice, len(c.token_ids), arrival)
        choice.text += c.text
        choice.token_ids += c.token_ids
        if c.logprobs:
            choice.logprobs += c.logprobs
        if c.finish_reason is not None:
            choice.finish_reason = c.finish_reason
            self.metrics.count_finished(c.finish_reason)
        return choice

    def _observe(self, choice: _Choice, num_new: int, arrival: float) -> None:
        now = time.monotonic()
        if num_new:
            if choice.last_token_time is None:
                self.metrics.observe_first_token(now - arrival)
                if num_new > 1:
                    self.metrics.observe_inter_token(0.0, num_new - 1)
            else:
                self.metrics.observe_inter_token(now - choice.last_token_time, num_new)
            choice.last_token_time = now
            self.metrics.count_tokens(generation=num_new)


async def _watch_disconnect(http_request: Request, streams: list[RequestStream]) -> None:
    """Close the streams (abort their requests) when the client disconnects. Waits on the ASGI receive
    channel, which the server answers with "http.disconnect" when the connection drops: no polling (a
    poll every 0.1 s per request was a quarter of the event loop's time at 128 streams)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # uvicorn blocks until the disconnect; a server that answers at once must not spin
    for s in streams:
        s.close()


async def _merged(
    http_request: Request, server: _Server, run: _Running
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Batches of (prompt index, delta) from all of ``run``'s streams: each batch is everything that
    arrived since the previous one (one write per batch when the client falls behind). Leaving early,
    the client disconnecting (a watcher task closes the streams) or a cancellation aborts every
    unfinished stream. At the end ``run`` leaves ``server.running``."""
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
        server.running.discard(run)
        for s in streams:
            s.close()
        for t in tasks:
            t.cancel()


def _by_choice(batch: list[tuple[int, RequestOutput]], n: int) -> list[tuple[int, CompletionOutput]]:
    """(choice index, delta) per choice in ``batch``, deltas of one choice joined into one (a reader that
    fell behind sends one event per choice, not one per engine step). Choice index: prompt * n + index."""
    if len(batch) == 1 and len(batch[0][1].outputs) == 1:  # the usual case: one step, one choice
        i, out = batch[0]
        return [(i * n + out.outputs[0].index, out.outputs[0])]
    merged: dict[int, CompletionOutput] = {}
    for i, out in batch:
        for c in out.outputs:
            index = i * n + c.index
            prev = merged.get(index)
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
            merged[index] = c
    return list(merged.items())


_JSON = json.JSONEncoder(ensure_ascii=False)


class _Events:
    """The server-sent events of one streamed response. The head (id, object, created, model) is
    encoded once; the usual event, text only and not finished, is filled into a template with one
    string encoded per event (0.7 us; ``json.dumps`` of the whole chunk dict: 12.7 us, per request
    per step). ``choice(...)`` equals ``_sse(head | {"choices": [choice]} | usage)``."""

    def __init__(self, head: dict[str, Any], include_usage: bool) -> None:
        self._prefix = f'data: {_JSON.encode(head)[:-1]}, "choices": ['
        self._suffix = ', "usage": null}\n\n' if include_usage else "}\n\n"

    def choice(self, choice: dict[str, Any]) -> str:
        return f"{self._prefix}{_JSON.encode(choice)}]{self._suffix}"

    def text(self, index: int, text: str) -> str:
        """A completion chunk's choice {"index", "text", "logprobs": null, "finish_reason": null}."""
        choice = f'{{"index": {index}, "text": {_JSON.encode(text)}, "logprobs": null, "finish_reason": null}}'
        return f"{self._prefix}{choice}]{self._suffix}"

    def content(self, index: int, text: str) -> str:
        """A chat chunk's choice {"index", "delta": {"content"}, "logprobs": null, "finish_reason": null}."""
        delta = f'{{"content": {_JSON.encode(text)}}}'
        choice = f'{{"index": {index}, "delta": {delta}, "logprobs": null, "finish_reason": null}}'
        return f"{self._prefix}{choice}]{self._suffix}"


def _shutdown_error() -> APIError:
    return APIError(
        "the server shut down before the request finished (serve --shutdown-timeout)",
        None,
        status=503,
        type="service_unavailable_error",
        code="server_shutdown",
    )


def _stream_error(exc: Exception) -> APIError:
    """The SSE error event of an exception raised while a response streams."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineDeadError, EngineShutdownError)):
        return APIError(str(exc), None, status=503, type="service_unavailable_error")
    logger.error("error while streaming a response", exc_info=exc)
    return APIError(f"{type(exc).__name__}: {exc}", None, status=500, type="internal_server_error")


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return dict(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _completion_logprobs(server: _Server, token_ids: list[int], logprobs: list[dict[int, float]], offset: int):
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [server.token_text(t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for lp in logprobs:
        top: dict[str, float] = {}
        for k, v in sorted(lp.items(), key=lambda kv: -kv[1]):
            top.setdefault(server.token_text(k), v)  # tokens that decode alike (partial characters): the best
        tops.append(top)
    token_logprobs = [lp[t] for t, lp in zip(token_ids, logprobs)]
    return dict(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets)


def _chat_logprobs(server: _Server, token_ids: list[int], logprobs: list[dict[int, float]], top: int):
    def entry(t: int, v: float) -> dict[str, Any]:
        s = server.token_text(t)
        return dict(token=s, logprob=v, bytes=list(s.encode("utf-8")))

    content = []
    for t, lp in zip(token_ids, logprobs):
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append(entry(t, lp[t]) | dict(top_logprobs=[entry(k, v) for k, v in best]))
    return dict(content=content)


async def _send_error(send: Any, err: APIError) -> None:
    body = json.dumps(err.body(), ensure_ascii=False).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Guard:
    """The app's outer layer (ASGI), before FastAPI reads anything:

    - the API key, on ``/v1`` paths, from the headers before the body is read: ``Bearer`` in any case,
      compared as SHA-256 digests with ``hmac.compare_digest`` (the time taken says nothing about the
      key, its length included);
    - the body's size: 413 from Content-Length before reading, else once the chunks read pass it; the
      body is read here once and handed on (its size in the scope, for ``_Server.prepare``);
    - an exception nothing else handled: a 500 in OpenAI's shape, logged, with the connection kept
      (Starlette's own error middleware re-raises, and uvicorn then closes the connection).

    The send channel is not wrapped (a call per streamed chunk): a response already started is
    seen as the error sending the 500 raises, and the exception then goes on to uvicorn."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.key_digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is not None:
            await _send_error(send, error)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        scope[_BODY_BYTES] = size
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict[str, Any]:
            return pending.pop() if pending else await receive()

        try:
            await self.app(scope, replay, send)
        except Exception as exc:
            err = APIError(f"{type(exc).__name__}: {exc}", None, status=500, type="internal_server_error")
            try:
                await _send_error(send, err)
            except Exception:  # the response had started (a stream): uvicorn closes the connection
                raise exc from None
            logger.error("unexpected error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)

    def _refusal(self, scope: dict[str, Any]) -> APIError | None:
        """The error to answer from the headers alone, or None."""
        headers = dict(reversed(scope["headers"]))  # the first of each name (names are lower case)
        path = scope.get("path", "")
        if self.key_digest is not None and (path == "/v1" or path.startswith("/v1/")):
            scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
            digest = hashlib.sha256(token.strip()).digest()
            if not (hmac.compare_digest(digest, self.key_digest) and scheme.lower() == b"bearer"):
                return APIError(
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    None,
                    status=401,
                    code="invalid_api_key",
                )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(
            f"the request body is over {self.max_body_bytes} bytes (serve --max-body-bytes)",
            None,
            status=413,
            code="request_too_large",
        )


def create_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    shutdown_grace_s: float = 0.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
):
    """The FastAPI app serving ``engine`` as ``model_name``.

    Args:
        engine: the AsyncEngine (started on the app's startup if it is not yet; shut down on exit).
        model_name: the id clients give as ``model`` (and ``/v1/models`` lists).
        api_key: when set, ``/v1`` paths need ``Authorization: Bearer <api_key>`` (else 401; the scheme's
            case does not matter). ValueError for a key no client can send (``check_api_key``).
        shutdown_grace_s: at shutdown, seconds the engine lets unfinished requests run before aborting
            them (uvicorn has already waited for its in-flight requests by then).
        max_body_bytes: larger request bodies get 413, unread.
    """
    from fuseformer import __version__

    check_api_key(api_key)
    if not (isinstance(max_body_bytes, int) and max_body_bytes > 0):
        raise ValueError(f"create_app: max_body_bytes must be a positive int, got {max_body_bytes!r}")
    server = _Server(engine, model_name)
    # Streams leave out deltas that add no text (held back: an incomplete character, a possible stop
    # string), except without a tokenizer (token-id prompts, text always empty): then every delta is
    # a chunk, the only sign of progress a client gets (the serving benchmark times its first one).
    text_only = engine.tokenizer is not None

    # Handlers reach the engine through ``server`` only, never as a closure variable: after shutdown the
    # app lets go of it (FastAPI keeps the endpoint functions of every app it built in a cache, so an
    # engine a closure held would live on, model and KV cache included, for as long as the process).
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await server.engine.shutdown(shutdown_grace_s)
        server.engine = None
        server.close()

    app = FastAPI(title="fuseformer", version=__version__, lifespan=lifespan)
    app.state.server = server

    # ---- errors ----------------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            err = APIError(f"malformed JSON body: {first.get('msg', '')}", None, code="invalid_json")
            return JSONResponse(err.body(), status_code=400)
        messages, params = [], []
        for e in errors:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            # Union members show in loc ("prompt", "str"): keep the request's field names only.
            name = ".".join(x for x in loc if x not in _TYPE_TAGS and not x.startswith(("list[", "dict[", "function-")))
            params.append(name or None)
            messages.append(f"{name or 'body'}: {e.get('msg', 'invalid')}")
        err = APIError("; ".join(dict.fromkeys(messages)), params[0] if params else None)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{exc.detail}: {request.method} {request.url.path}"
        err = APIError(message, None, status=exc.status_code, type=kind, code=str(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineShutdownError)
    async def _shutting_down(request: Request, exc: EngineShutdownError) -> JSONResponse:
        err = APIError(str(exc), None, status=503, type="service_unavailable_error")
        return JSONResponse(err.body(), status_code=503)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        err = APIError(str(exc), None, status=503, type="service_unavailable_error")
        return JSONResponse(err.body(), status_code=503)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(APIError(str(exc)).body(), status_code=400)

    # The API key, the body's size and any other exception: _Guard, around all of this.
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    # ---- routes ----------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if server.engine is None or not server.engine.is_running:
            err = APIError("the engine is not running", None, status=503, type="service_unavailable_error")
            return JSONResponse(err.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = server.engine.get_stats() if server.engine is not None else SchedulerStats()
        return Response(server.metrics.render(stats), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=server.max_model_len)]).model_dump()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http_request: Request):
        arrival = time.monotonic()
        server.check_model(req.model)
        if req.echo:
            raise APIError("echo is not supported", "echo")
        if req.suffix is not None:
            raise APIError("suffix is not supported", "suffix")
        asked = req.max_tokens if "max_tokens" in req.model_fields_set else None
        server.check_fields(req, asked)
        prompts = await server.prepare(http_request, server.completion_prompts, req)
        params = server.sampling_params(req, prompts, "prompt", "max_tokens")
        request_id = f"cmpl-{server.next_id()}"
        run = await server.add(request_id, prompts, params, "prompt")
        server.metrics.count_tokens(prompt=sum(len(p) for p in prompts))
        created = int(time.time())
        n = params.n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        num_prompt = sum(len(p) for p in prompts)

        def head() -> dict[str, Any]:
            return dict(id=request_id, object="text_completion", created=created, model=model_name)

        if req.stream:

            async def events() -> AsyncIterator[str]:
                sse = _Events(head(), req.include_usage)
                try:
                    async for batch in _merged(http_request, server, run):
                        chunks = []
                        for index, c in _by_choice(batch, n):
                            ch = server.record(choices[index], c, arrival)
                            if params.logprobs is None:
                                if c.finish_reason is None:
                                    if c.text or not text_only:  # else held back: a partial character, a stop string
                                        chunks.append(sse.text(index, c.text))
                                    continue
                                lps = None
                            elif c.logprobs:
                                offset = len(ch.text) - len(c.text)
                                lps = _completion_logprobs(server, c.token_ids, c.logprobs, offset)
                            else:
                                lps = None
                            choice = dict(index=index, text=c.text, logprobs=lps, finish_reason=c.finish_reason)
                            chunks.append(sse.choice(choice))
                        if chunks:
                            yield "".join(chunks)
                    if run.cut:
                        yield _sse(_shutdown_error().body())
                    elif req.include_usage:
                        usage = _usage(num_prompt, sum(len(ch.token_ids) for ch in choices))
                        yield _sse(head() | dict(choices=[], usage=usage))
                except Exception as exc:  # headers are sent: the error goes in the stream, then [DONE]
                    yield _sse(_stream_error(exc).body())
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async for batch in _merged(http_request, server, run):
            for index, c in _by_choice(batch, n):
                server.record(choices[index], c, arrival)
        if run.cut:
            raise _shutdown_error()
        if await http_request.is_disconnected():
            return Response(status_code=499)
        body_choices = []
        for index, ch in enumerate(choices):
            lps = None
            if params.logprobs is not None:
                lps = _completion_logprobs(server, ch.token_ids, ch.logprobs, 0)
            body_choices.append(dict(index=index, text=ch.text, logprobs=lps, finish_reason=ch.finish_reason))
        usage = _usage(num_prompt, sum(len(ch.token_ids) for ch in choices))
        return head() | dict(choices=body_choices, usage=usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http_request: Request):
        arrival = time.monotonic()
        server.check_model(req.model)
        asked, field_name = req.requested_max_tokens
        server.check_fields(req, asked)
        ids = await server.prepare(http_request, server.chat_prompt, req)
        params = server.sampling_params(req, [ids], "messages", field_name)
        top = req.top_logprobs or 0
        request_id = f"chatcmpl-{server.next_id()}"
        run = await server.add(request_id, [ids], params, "messages")
        server.metrics.count_tokens(prompt=len(ids))
        created = int(time.time())
        choices = [_Choice() for _ in range(params.n)]

        def head() -> dict[str, Any]:
            return dict(id=request_id, object="chat.completion.chunk", created=created, model=model_name)

        if req.stream:

            async def events() -> AsyncIterator[str]:
                sse = _Events(head(), req.include_usage)
                try:
                    for index in range(params.n):
                        delta = dict(role="assistant", content="")
                        yield sse.choice(dict(index=index, delta=delta, logprobs=None, finish_reason=None))
                    async for batch in _merged(http_request, server, run):
                        chunks = []
                        for _, c in _by_choice(batch, params.n):
                            server.record(choices[c.index], c, arrival)
                            if not req.logprobs and c.finish_reason is None:
                                if c.text or not text_only:  # else held back: a partial character, a stop string
                                    chunks.append(sse.content(c.index, c.text))
                                continue
                            lps = None
                            if req.logprobs and c.logprobs:
                                lps = _chat_logprobs(server, c.token_ids, c.logprobs, top)
                            delta = dict(content=c.text) if c.text or c.finish_reason is None else {}
                            choice = dict(index=c.index, delta=delta, logprobs=lps, finish_reason=c.finish_reason)
                            chunks.append(sse.choice(choice))
                        if chunks:
                            yield "".join(chunks)
                    if run.cut:
                        yield _sse(_shutdown_error().body())
                    elif req.include_usage:
                        usage = _usage(len(ids), sum(len(ch.token_ids) for ch in choices))
                        yield _sse(head() | dict(choices=[], usage=usage))
                except Exception as exc:  # headers are sent: the error goes in the stream, then [DONE]
                    yield _sse(_stream_error(exc).body())
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async for batch in _merged(http_request, server, run):
            for _, c in _by_choice(batch, params.n):
                server.record(choices[c.index], c, arrival)
        if run.cut:
            raise _shutdown_error()
        if await http_request.is_disconnected():
            return Response(status_code=499)
        body_choices = []
        for index, ch in enumerate(choices):
            lps = _chat_logprobs(server, ch.token_ids, ch.logprobs, top) if req.logprobs else None
            message = dict(role="assistant", content=ch.text)
            body_choices.append(dict(index=index, message=message, logprobs=lps, finish_reason=ch.finish_reason))
        usage = _usage(len(ids), sum(len(ch.token_ids) for ch in choices))
        return head() | dict(object="chat.completion", choices=body_choices, usage=usage)

    return app
