"""The OpenAI-compatible HTTP app: ``create_app(engine, model_name, api_key=None, ...)`` (FastAPI).

Routes: ``POST /v1/completions`` (``completions.py``) and ``POST /v1/chat/completions`` (``chat.py``),
each streaming as server-sent events ``data: {...}`` ending in ``data: [DONE]``, or not;
``GET /v1/models`` and ``GET /v1/models/{id}``; vLLM's ``POST /tokenize`` and ``POST /detokenize``;
``GET /version``; ``GET /health`` and ``GET|POST /ping`` (200 while the engine runs, else 503);
``GET /metrics`` (Prometheus, under fuseformer's and vLLM's names). docs/serving.md has them all.

Request parameters: each one the server accepts has its effect; any other gets a 400 naming it
(``parameters.py``: the one rule and its table).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter
(``param`` names the field), malformed JSON, text that is not valid Unicode, a prompt over the context
length, a ``max_tokens`` that does not fit, a chat template that fails on the messages; 401 without
the API key (when one is set: every ``/v1`` path, ``/tokenize`` and ``/detokenize``, checked from the
headers before the body is read; ``/health``, ``/ping``, ``/version`` and ``/metrics`` stay open for
probes and scrapers, as in vLLM); 404 ``model_not_found`` for a model this server does not serve, as
OpenAI and vLLM answer; 404/405 for wrong routes; 413 for a body over ``max_body_bytes``; 503 while
shutting down, and for requests still running when the shutdown timeout ends them (a stream gets an
error event, then ``data: [DONE]``). User input never gives a 500; an unexpected error gives a 500 in
the same shape and the connection stays usable.

``X-Request-Id``: a request's header is echoed on its response (errors included), and the response's
id is ``cmpl-<it>`` / ``chatcmpl-<it>`` (vLLM's rule; the engine's own id gets a counter after it).

Limits (each a client's 4xx, not a slow or stuck server): the body (``max_body_bytes``, 16 MiB by
default), stop strings (``protocol.MAX_STOP_STRINGS`` of at most ``MAX_STOP_STRING_CHARS``),
completions (``MAX_N``) and logprobs per request. The prompt of a large body is tokenized, and its
chat template rendered, on a worker thread with the GIL released (``Serving.prepare``); token-id
prompts over the context length are refused before any text is tokenized, and a list of prompts
stops at the first that is too long.

A client that disconnects has its requests aborted, and their KV blocks freed, at once: a watcher
task per request waits on the ASGI receive channel for "http.disconnect" and closes the request's
streams (``streaming.merged``). The lifespan's exit runs ``engine.shutdown``: uvicorn on SIGTERM stops
accepting, waits for in-flight requests (up to its graceful timeout, then cancels them, which aborts
them), then exits the lifespan.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fuseformer.engine.async_engine import AsyncEngine, EngineDeadError, EngineShutdownError
from fuseformer.engine.scheduler import SchedulerStats
from fuseformer.models.tokenizer import compile_chat_template
from fuseformer.serve.chat import create_chat_completion, render_chat
from fuseformer.serve.completions import create_completion
from fuseformer.serve.errors import APIError, model_not_found, unavailable
from fuseformer.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from fuseformer.serve.serving import BODY_BYTES, REQUEST_ID, Serving
from fuseformer.serve.serving import encode_text as _encode_text  # noqa: F401  (tests/serve/test_faults.py)

logger = logging.getLogger("fuseformer.serve")

# Bodies over this get 413 (``create_app(max_body_bytes=)``, ``serve --max-body-bytes``): 16x the body
# of the longest prompt of a 128K-token model (~1 MB as JSON token ids, about as much as text), so that
# a 1M-token model's longest prompt fits too. JSON parsing stays on the event loop (~0.1 s at 16 MiB).
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# Paths that need the API key when one is set: the API, and vLLM's tokenizer endpoints (they run the
# tokenizer and the chat template on the server's CPU for anyone who can reach it; vLLM leaves them open).
_KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# Union members' tags in pydantic's error locations ("prompt", "list[int]", 0): not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


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


async def _send_error(send: Any, err: APIError) -> None:
    body = err.encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Guard:
    """The app's outer layer (ASGI), before FastAPI reads anything:

    - the API key, on the keyed paths, from the headers before the body is read: ``Bearer`` in any
      case, compared as SHA-256 digests with ``hmac.compare_digest`` (the time taken says nothing
      about the key, its length included);
    - the body's size: 413 from Content-Length before reading, else once the chunks read pass it; the
      body is read here once and handed on (its size in the scope, for ``Serving.prepare``);
    - ``X-Request-Id``: put in the scope for the handlers, and echoed on the response;
    - an exception nothing else handled: a 500 in OpenAI's shape, logged, with the connection kept
      (Starlette's own error middleware re-raises, and uvicorn then closes the connection).

    The send channel is wrapped only for a request with ``X-Request-Id`` (else it is a call per
    streamed chunk for nothing): a response already started is seen as the error sending the 500
    raises, and the exception then goes on to uvicorn."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.key_digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(reversed(scope["headers"]))  # the first of each name (names are lower case)
        request_id = headers.get(b"x-request-id")
        if request_id is not None:
            scope[REQUEST_ID] = request_id.decode("latin-1")
            send = _echoing(send, request_id)
        error = self._refusal(scope, headers)
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
        scope[BODY_BYTES] = size
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

    def _refusal(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> APIError | None:
        """The error to answer from the headers alone, or None."""
        path = scope.get("path", "")
        if self.key_digest is not None and (path == "/v1" or path.startswith(_KEYED_PREFIXES)):
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


def _echoing(send: Any, request_id: bytes) -> Any:
    """``send`` with ``X-Request-Id: request_id`` added to the response's headers."""

    async def echo(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = message | {"headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
        await send(message)

    return echo


def create_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    shutdown_grace_s: float = 0.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
):
    """The FastAPI app serving ``engine`` as ``model_name``.

    Args:
        engine: the AsyncEngine (started on the app's startup if it is not yet; shut down on exit).
        model_name: the id clients give as ``model`` (and ``/v1/models`` lists).
        api_key: when set, the ``/v1`` paths, ``/tokenize`` and ``/detokenize`` need ``Authorization:
            Bearer <api_key>`` (else 401; the scheme's case does not matter). ValueError for a key no
            client can send (``check_api_key``).
        shutdown_grace_s: at shutdown, seconds the engine lets unfinished requests run before aborting
            them (uvicorn has already waited for its in-flight requests by then).
        max_body_bytes: larger request bodies get 413, unread.
        chat_template: the chat template (jinja2 source) for chat requests instead of the model's;
            ValueError (a ChatTemplateError) when it does not compile.
        trust_request_chat_template: accept a request's own ``chat_template`` (else a 400 naming it).
        tool_call_parser: the format tool calls are parsed from (``serve --tool-call-parser``:
            ``tool_parsers.TOOL_PARSERS``' names; ValueError for another).
        enable_auto_tool_choice: parse tool calls from outputs the model wrote freely (``tool_choice``
            "auto"); ValueError without ``tool_call_parser``.
    """
    from fuseformer import __version__

    check_api_key(api_key)
    if not (isinstance(max_body_bytes, int) and max_body_bytes > 0):
        raise ValueError(f"create_app: max_body_bytes must be a positive int, got {max_body_bytes!r}")
    if chat_template is not None:
        compile_chat_template(chat_template)
    server = Serving(
        engine, model_name, chat_template, trust_request_chat_template, tool_call_parser, enable_auto_tool_choice
    )

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
    @app.exception_handler(EngineDeadError)
    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(unavailable(str(exc)).body(), status_code=503)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(APIError(str(exc)).body(), status_code=400)

    # The API key, the body's size, X-Request-Id and any other exception: _Guard, around all of this.
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    # ---- probes, metadata, metrics -----------------------------------------------------------------

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        if server.engine is None or not server.engine.is_running:
            return JSONResponse(unavailable("the engine is not running").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = server.engine.get_stats() if server.engine is not None else SchedulerStats()
        return Response(server.metrics.render(stats), media_type=server.metrics.content_type)

    def card() -> ModelCard:
        return ModelCard(id=model_name, root=model_name, max_model_len=server.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise model_not_found(model_id, model_name)
        return card().model_dump()

    # ---- generation --------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http_request: Request):
        return await create_completion(server, req, http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http_request: Request):
        return await create_chat_completion(server, req, http_request)

    # ---- tokenizer (vLLM's shapes) -----------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, http_request: Request) -> dict[str, Any]:
        server.check_model(req.model)

        def run() -> list[int]:
            if req.messages is not None:
                add = False if req.add_special_tokens is None else req.add_special_tokens
                return server.encode(render_chat(server, req), "messages", add)
            return server.encode(
                req.prompt, "prompt", True if req.add_special_tokens is None else req.add_special_tokens
            )

        ids = await server.prepare(http_request, run)
        strs = [server.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return dict(count=len(ids), max_model_len=server.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, http_request: Request) -> dict[str, Any]:
        server.check_model(req.model)
        if server.tokenizer is None:
            raise APIError("the model has no tokenizer.json", "tokens")
        vocab = server.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens has ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
        text = await server.prepare(http_request, server.tokenizer.decode, req.tokens, False)
        return dict(prompt=text)

    return app
