"""``fuseformer serve --model DIR``: the OpenAI-compatible server on uvicorn.

``add_serve_parser(subparsers)`` adds the subcommand to the ``fuseformer`` command; ``run_serve`` runs
it (exit code 0 after a graceful shutdown, SIGTERM or Ctrl-C included; 2 for bad arguments; 1 when
the model cannot be loaded or the port cannot be bound). ``python -m fuseformer.serve.cli serve ...``
runs it alone.

Shutdown: uvicorn stops accepting connections and waits up to ``--shutdown-timeout`` seconds for
in-flight requests to finish; the app then ends the rest with an error in OpenAI's shape (a 503, or
an SSE error event and ``data: [DONE]``), aborting them in the engine; ``_FLUSH_S`` later uvicorn
cancels what is left (a client not reading), and the app's lifespan stops the engine.

Connections: one that sends no complete request head (request line and headers) within
``--header-timeout`` seconds of opening, or of the head's first bytes, is closed; so is one idle for
``--timeout-keep-alive`` seconds after a response (uvicorn's). A head over the HTTP parser's limit
(h11: 16 KiB) gets uvicorn's 400, a body over ``--max-body-bytes`` a 413.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fuseformer.engine.cli import add_enforce_eager, add_quantization
from fuseformer.serve.tool_parsers import TOOL_PARSERS

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# --async-scheduling schedules ahead steps of this many requests or more: below, the host work hidden
# is ~1 ms a step at the 8B shape, and a request arriving would wait for the step scheduled ahead too
# (run 30: 1 req/s p50 TTFT 1.27x a lone request's with every step scheduled ahead).
ASYNC_MIN_SEQS = 8
# Connection timeouts (seconds). The request head: nginx's client_header_timeout is 60 s, Node's
# headersTimeout 60 s; a client on the same network sends it in milliseconds, so 10 s closes a
# connection that sends nothing, or trickles its headers, well before it matters. Keep-alive: uvicorn's.
HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0
# From ending the requests left at --shutdown-timeout to uvicorn cancelling what is left: time for
# their error responses (a few hundred bytes each) to go out.
_FLUSH_S = 1.0


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve`` to a ``fuseformer`` subcommand set."""
    p = subparsers.add_parser("serve", help="serve a local model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default=None, help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the /v1 routes (printable ASCII, no spaces; default: none)",
    )
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="weights' dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per request at most")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="requests running at once at most (default: 1024 on a CUDA GPU of >= 70 GiB but an A100, else 256)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens computed per step at most")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides the memory-based sizing)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks of equal prefixes")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps as CUDA graphs captured at start (default: on with a CUDA device, as vLLM's; "
        "2.6x the output tok/s of eager at the Llama-3-8B shape on an H200); --no-cuda-graphs runs eagerly",
    )
    add_enforce_eager(p)
    add_quantization(p)
    p.add_argument(
        "--overlap-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch a new request's prefill while the CUDA-graph decode step in flight runs instead of after "
        "it (default: on with a CUDA device; with --prefill-stream, at the Llama-3-8B shape on an H200 the p50 "
        "time to first token at 1 req/s was 0.95-1.00x a lone request's, against 0.84-1.08x without either)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"launch each decode step of {ASYNC_MIN_SEQS} or more requests before the previous one's tokens are "
        "read, so that the host's per-step work overlaps the GPU's (vLLM's --async-scheduling; default: on with a "
        "CUDA device; at the Llama-3-8B shape on an H200 it raised the offline engine's output tok/s 11-22%%)",
    )
    p.add_argument(
        "--prefill-stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --overlap-prefill on CUDA, run that prefill on a second CUDA stream, beside the decode step "
        "in flight rather than queued behind it (default: on with a CUDA device)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument(
        "--chat-template",
        default=None,
        help="the chat template of /v1/chat/completions instead of the model's: a file, or the template itself "
        "(jinja2 source, told apart by its '{{' or '{%%')",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own chat_template (sandboxed, but a template may loop for as long as it likes; "
        "default: a 400 naming chat_template, as vLLM)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format of tool calls in the model's output, parsed into tool_calls: hermes (Hermes 2 Pro, "
        'Qwen 2.5 / 3: <tool_call> JSON), llama3_json (Llama 3.1 / 3.2 JSON); also the format a "required" '
        "or named tool_choice holds the output to (default: none; those then write llama3_json's plain JSON)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls from outputs the model writes freely: tool_choice "auto", the default when a '
        "request gives tools (needs --tool-call-parser; default: such a request gets a 400, as vLLM)",
    )
    p.add_argument(
        "--max-stream-overhead",
        type=float,
        default=0.05,
        help="share of the engine's time that streaming outputs to clients may take; above it, under load, "
        "tokens go out every few steps in larger chunks (0: every step; default 0.05)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish at shutdown; then each gets a 503 error (a stream: an "
        "error event and [DONE]) (default 30)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="request bodies over this many bytes get 413 (default 16 MiB: 16x the longest prompt of a "
        "128K-token model). Per request also: at most 16 stop strings of 256 characters, 64 stop_token_ids, "
        "n up to 128, 20 logprobs",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        help=f"close a connection whose request line and headers have not all arrived within this many seconds "
        f"(default {HEADER_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=KEEP_ALIVE_S,
        help=f"close a connection idle this many seconds after a response (default {KEEP_ALIVE_S:g})",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run_serve)
    return p


def _error(message: str, code: int) -> int:
    print(f"fuseformer serve: error: {message}", file=sys.stderr)
    return code


def read_chat_template(value: str) -> str:
    """``--chat-template``'s template: the file ``value`` names, else ``value`` itself when it reads as a
    template (it has ``{{`` or ``{%``); ValueError otherwise, or when the template does not compile."""
    from fuseformer.models.tokenizer import compile_chat_template

    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a name too long for the file system: an inline template
        is_file = False
    if is_file:
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"no file {value!r} (a template given inline must have '{{{{' or '{{%')")
    compile_chat_template(template)  # ChatTemplateError (a ValueError) when it does not compile
    return template


# The GIL's switch interval while serving (Python's default: 5 ms). The event loop and the engine thread
# both run Python; when one wants the GIL that the other holds, it waits up to the interval. Set on the
# guess that such waits made the lone TTFT's slow mode on the H200 (~20 ms and ~27-45 ms modes); with
# it (run 23, 2026-11-30) the two modes stayed, so that guess was wrong; neither throughput nor TTFT was
# measured without it under otherwise equal conditions.
SWITCH_INTERVAL_S = 0.5e-3


@contextlib.contextmanager
def serving_process() -> Iterator[None]:
    """The process settings of a server, restored on exit: the objects built so far (model, engine,
    imports: they live as long as the process) frozen out of the collector's generations, so that a
    full collection under load does not walk them (vLLM does the same after start-up); and a short
    GIL switch interval (``SWITCH_INTERVAL_S``)."""
    interval = sys.getswitchinterval()
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.unfreeze()


def _use_cuda_graphs(args: argparse.Namespace) -> bool:
    """--cuda-graphs as given; unset, on when the server runs on a CUDA device (--device, else CUDA
    when one is available)."""
    return _on_cuda_unless_set(args, args.cuda_graphs)


def _on_cuda_unless_set(args: argparse.Namespace, value: bool | None) -> bool:
    """A flag's value as given; unset (None), whether the server runs on a CUDA device (and not
    --enforce-eager)."""
    if value is not None:
        return value
    if args.enforce_eager:
        return False
    import torch

    if args.device is not None:
        return args.device.startswith("cuda")
    return torch.cuda.is_available()


def make_uvicorn_server(
    app: Any,
    *,
    shutdown_timeout: float = 30.0,
    header_timeout: float = HEADER_TIMEOUT_S,
    timeout_keep_alive: float = KEEP_ALIVE_S,
    **config: Any,
) -> Any:
    """A ``uvicorn.Server`` for ``app`` (``create_app``'s), with uvicorn's ``Config`` keywords ``config``,
    that at shutdown ends the requests left after ``shutdown_timeout`` seconds with an error
    (``_Server.end_unfinished``) and closes connections that do not send a request head within
    ``header_timeout`` seconds (the module doc says when)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    end_unfinished = app.state.server.end_unfinished

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(shutdown_timeout, end_unfinished)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(
        uvicorn.Config(
            app,
            http=_with_header_timeout(AutoHTTPProtocol, header_timeout),
            timeout_keep_alive=timeout_keep_alive,
            timeout_graceful_shutdown=shutdown_timeout + _FLUSH_S,
            **config,
        )
    )


def _with_header_timeout(base: type, timeout_s: float) -> type:
    """uvicorn's HTTP protocol ``base``, closing a connection whose request head has not all arrived
    ``timeout_s`` after the connection opened or the head's first bytes arrived: uvicorn has no such
    limit (its keep-alive timeout ends when a request's first bytes arrive), so a client that connects
    and sends nothing, or one header byte a minute, held its connection forever. Uses uvicorn's
    ``cycle`` (the request being answered; both its h11 and httptools protocols have it)."""

    class Protocol(base):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self._between_requests():  # a later request's first bytes
                self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)
            super().data_received(data)
            if self._head_timer is not None and not self._between_requests():  # the head is in
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def run_serve(args: argparse.Namespace) -> int:
    """Run ``fuseformer serve``; returns the exit code."""
    from fuseformer.engine.cli import check_model_args

    model, error = check_model_args(args)  # the same --model default and checks as `fuseformer generate`
    if error is not None:
        return _error(error, 2)
    if not 0 <= args.port < 65536:
        return _error(f"--port must be in [0, 65535], got {args.port}", 2)
    from fuseformer.serve.app import check_api_key

    try:
        check_api_key(args.api_key)
    except ValueError as exc:
        return _error(f"--api-key: {exc}", 2)
    if not 0 <= args.max_stream_overhead < 1:
        return _error(f"--max-stream-overhead must be in [0, 1), got {args.max_stream_overhead}", 2)
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        return _error(f"--max-body-bytes must be at least 1, got {args.max_body_bytes}", 2)
    for flag in ("shutdown_timeout", "header_timeout", "timeout_keep_alive"):
        if not getattr(args, flag) > 0:
            return _error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}", 2)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return _error("--enable-auto-tool-choice needs --tool-call-parser", 2)
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = read_chat_template(args.chat_template)
        except ValueError as exc:
            return _error(f"--chat-template: {exc}", 2)

    from fuseformer.engine.async_engine import AsyncEngine
    from fuseformer.engine.llm import LLM
    from fuseformer.serve.app import create_app

    llm_kwargs = dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,  # None: LLM's default for the device (batch_limits)
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        seed=args.seed,
        cuda_graphs=_use_cuda_graphs(args),
        async_scheduling=_on_cuda_unless_set(args, args.async_scheduling),
        async_scheduling_min_seqs=ASYNC_MIN_SEQS,
        prefill_stream=_on_cuda_unless_set(args, args.prefill_stream),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    overlap_prefill = _on_cuda_unless_set(args, args.overlap_prefill)
    name = args.served_model_name or Path(model).resolve().name
    try:
        llm = LLM(model, **llm_kwargs)
    except (FileNotFoundError, ValueError) as exc:
        return _error(str(exc), 1)
    try:  # generation_config.json's values in SamplingParams' ranges (its types: checked at load)
        llm.get_default_sampling_params()
    except (TypeError, ValueError) as exc:
        return _error(f"{Path(model) / 'generation_config.json'}: {exc}", 1)
    engine = AsyncEngine(
        llm, start=False, max_stream_overhead=args.max_stream_overhead, overlap_prefill=overlap_prefill
    )
    body = {} if args.max_body_bytes is None else dict(max_body_bytes=args.max_body_bytes)
    app = create_app(
        engine,
        name,
        api_key=args.api_key,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        **body,
    )
    server = make_uvicorn_server(
        app,
        shutdown_timeout=args.shutdown_timeout,
        header_timeout=args.header_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
    )
    # uvicorn handles SIGTERM/SIGINT itself (graceful shutdown), then restores the handlers it found and
    # raises the signal again, so that the process would die by it (exit status -15). After a graceful
    # shutdown we exit 0: the handlers it finds and restores are these no-ops.
    handled = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled} if main_thread else {}
    try:
        with serving_process():
            server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind or start
        return int(exc.code or 0)
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuseformer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
