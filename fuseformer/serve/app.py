"""The OpenAI-compatible HTTP app: ``create_app(engine, model_name, api_key=None)`` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each streaming as server-sent events
``data: {...}`` ending in ``data: [DONE]``, or not), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter
(``param`` names the field), malformed JSON, a prompt over the context length, a ``max_tokens`` that
does not fit, an unknown model; 401 without the API key (when one is set: the ``/v1`` routes only;
``/health`` and ``/metrics`` stay open for probes and scrapers, as in vLLM); 404/405 for wrong
routes; 503 while shutting down. User input never gives a 500.

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
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import jinja2
from fastapi import Depends, FastAPI, Request
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

    # ---- checks ----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                code="model_not_found",
            )

    def check_lengths(self, prompts: list[list[int]], req: Any, where: str, max_tokens_field: str) -> int:
        """The max_tokens every prompt gets: as asked (400 when prompt + it does not fit), else what fits."""
        asked = req.requested_max_tokens[0] if isinstance(req, ChatCompletionRequest) else req.max_tokens
        explicit = max_tokens_field in req.model_fields_set
        longest = max(len(p) for p in prompts)
        if longest >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the {where} has {longest} "
                f"tokens (at most {self.max_model_len - 1}, to leave room for one output token)",
                where,
                code="context_length_exceeded",
            )
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

    def sampling_params(self, req: Any, prompts: list[list[int]], where: str, field: str, asked: int | None):
        """The request's SamplingParams, max_tokens as ``check_lengths`` gives it. A field out of range
        is reported before a length error (``asked``: the max tokens the request gave, else None)."""
        try:
            max_tokens = self.check_lengths(prompts, req, where, field)
        except APIError:
            if asked is not None:
                req.to_sampling_params(self.default_params(), asked)  # raises the range error, if any
            raise
        return req.to_sampling_params(self.default_params(), max_tokens)

    def encode(self, text: str, where: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError("the model has no tokenizer.json: give the prompt as token ids", where)
        return self.tokenizer.encode(text)

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [self.encode(p, "prompt")]
        if not p:
            raise APIError("prompt must not be empty", "prompt")
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        out = []
        for item in p:
            if isinstance(item, str):
                out.append(self.encode(item, "prompt"))
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                out.append(list(item))
            else:
                raise APIError("prompt must be a string, a list of token ids, or a list of either", "prompt")
        if any(not ids for ids in out):
            raise APIError("prompt must not be empty", "prompt")
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
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **(req.chat_template_kwargs or {}))
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise APIError(f"messages: the chat template failed: {exc}", "messages") from exc
        if not ids:
            raise APIError("messages render to an empty prompt", "messages")
        return ids

    # ---- running requests ------------------------------------------------------------------------

    async def add(self, base_id: str, prompts: list[list[int]], params: SamplingParams, where: str):
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
        return streams

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
    http_request: Request, streams: list[RequestStream]
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Batches of (prompt index, delta) from all streams: each batch is everything that arrived since
    the previous one (one write per batch when the client falls behind). Leaving early, the client
    disconnecting (a watcher task closes the streams) or a cancellation aborts every unfinished stream."""
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


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, shutdown_grace_s: float = 0.0):
    """The FastAPI app serving ``engine`` as ``model_name``.

    Args:
        engine: the AsyncEngine (started on the app's startup if it is not yet; shut down on exit).
        model_name: the id clients give as ``model`` (and ``/v1/models`` lists).
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>`` (else 401).
        shutdown_grace_s: at shutdown, seconds the engine lets unfinished requests run before aborting
            them (uvicorn has already waited for its in-flight requests by then).
    """
    from fuseformer import __version__

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

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(f"{type(exc).__name__}: {exc}", None, status=500, type="internal_server_error")
        return JSONResponse(err.body(), status_code=500)

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), api_key.encode())):
            raise APIError(
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                None,
                status=401,
                code="invalid_api_key",
            )

    auth = [Depends(check_key)]

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

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=server.max_model_len)]).model_dump()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, http_request: Request):
        arrival = time.monotonic()
        server.check_model(req.model)
        if req.echo:
            raise APIError("echo is not supported", "echo")
        if req.suffix is not None:
            raise APIError("suffix is not supported", "suffix")
        prompts = server.completion_prompts(req)
        asked = req.max_tokens if "max_tokens" in req.model_fields_set else None
        params = server.sampling_params(req, prompts, "prompt", "max_tokens", asked)
        request_id = f"cmpl-{server.next_id()}"
        streams = await server.add(request_id, prompts, params, "prompt")
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
                    async for batch in _merged(http_request, streams):
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
                    if req.include_usage:
                        usage = _usage(num_prompt, sum(len(ch.token_ids) for ch in choices))
                        yield _sse(head() | dict(choices=[], usage=usage))
                except (EngineDeadError, EngineShutdownError) as exc:
                    yield _sse(APIError(str(exc), None, status=503, type="service_unavailable_error").body())
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async for batch in _merged(http_request, streams):
            for index, c in _by_choice(batch, n):
                server.record(choices[index], c, arrival)
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

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, http_request: Request):
        arrival = time.monotonic()
        server.check_model(req.model)
        ids = server.chat_prompt(req)
        asked, field_name = req.requested_max_tokens
        params = server.sampling_params(req, [ids], "messages", field_name, asked)
        top = req.top_logprobs or 0
        request_id = f"chatcmpl-{server.next_id()}"
        streams = await server.add(request_id, [ids], params, "messages")
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
                    async for batch in _merged(http_request, streams):
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
                    if req.include_usage:
                        usage = _usage(len(ids), sum(len(ch.token_ids) for ch in choices))
                        yield _sse(head() | dict(choices=[], usage=usage))
                except (EngineDeadError, EngineShutdownError) as exc:
                    yield _sse(APIError(str(exc), None, status=503, type="service_unavailable_error").body())
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async for batch in _merged(http_request, streams):
            for _, c in _by_choice(batch, params.n):
                server.record(choices[c.index], c, arrival)
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
