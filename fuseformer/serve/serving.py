"""``Serving``: what every handler of one app shares: the engine, the tokenizer, the chat template and
the tool-call parser, the checks of a request against the model (its name, the context length),
tokenization (on a worker thread for a large body), adding a request's prompts to the engine, and
recording its outputs (text, tokens, logprobs, finish) and their metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from fuseformer.engine.async_engine import AsyncEngine, EngineShutdownError, RequestStream
from fuseformer.engine.outputs import CompletionOutput, RequestOutput
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.serve.errors import APIError, model_not_found
from fuseformer.serve.metrics import ServerMetrics
from fuseformer.serve.protocol import ChatCompletionRequest, CompletionRequest
from fuseformer.serve.streaming import Choice, Running, first_output_stats
from fuseformer.serve.tool_parsers import tool_parser

logger = logging.getLogger("fuseformer.serve")

# Bodies over this have their prompt prepared (tokenized, the chat template rendered) on a worker
# thread: the tests' byte-level BPE takes ~1 us a character, the 5 MB prompt of issue 30 held the
# event loop, and every client with it, for 12 s. Below it the thread hop (0.1-1 ms while the engine
# thread holds the GIL) would cost more than it saves.
_INLINE_BODY_BYTES = 4096
_PREPARE_THREADS = 4  # large prompts tokenized at once, at most; the others queue
# The format a forcing tool_choice ("required", a named function) holds the output to when the server has
# no --tool-call-parser: llama3_json's is plain JSON, {"name": ..., "parameters": {...}}, the keys of
# vLLM's own forcing schema (vLLM holds "required" to a JSON array of such objects, and a named function
# to its arguments alone; the response's tool_calls are the same).
FORCED_TOOL_CALL_FORMAT = "llama3_json"
# The ASGI scope's keys the app's guard (``app._Guard``) sets: the body's size, the X-Request-Id header.
BODY_BYTES = "fuseformer.body_bytes"
REQUEST_ID = "fuseformer.request_id"


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
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


def check_unicode(text: str, where: str) -> None:
    """400 for a lone surrogate (JSON's ``"\ud800"``): no tokenizer takes it, and it has no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            f"{where} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}", where
        ) from None


class Serving:
    """The state of one app's handlers (see the module docstring).

    Args:
        engine: the AsyncEngine.
        model_name: the id clients give as ``model``.
        chat_template: the chat template of chat requests (``serve --chat-template``); None: the model's.
        trust_request_chat_template: accept a request's own ``chat_template`` (it runs in the jinja2
            sandbox, but a template can loop for as long as it likes, holding a thread).
        tool_call_parser: the format of tool calls in the model's output (``serve --tool-call-parser``,
            a ``tool_parsers.TOOL_PARSERS`` name), also the one a forcing ``tool_choice`` is held to;
            None: no parsing of "auto" outputs, and forced calls in ``FORCED_TOOL_CALL_FORMAT``.
        enable_auto_tool_choice: parse tool calls from outputs the model wrote freely (``tool_choice``
            "auto", the default with tools; ``serve --enable-auto-tool-choice``): needs
            ``tool_call_parser``, ValueError without it (as vLLM).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        if chat_template is None and self.tokenizer is not None:
            chat_template = self.tokenizer.chat_template
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (serve --tool-call-parser)")
        self.tool_parser = None if tool_call_parser is None else tool_parser(tool_call_parser)
        self.forced_tool_parser = self.tool_parser or tool_parser(FORCED_TOOL_CALL_FORMAT)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # The tokenizer's special tokens (text -> id): tool-call markers that are one are matched as that
        # token by the forcing grammars, and kept in the output text for the parser.
        self.special_tokens: dict[str, int] = getattr(self.tokenizer, "special_tokens", None) or {}
        self._default_params: SamplingParams | None = None
        self.running: set[Running] = set()
        self.ended = False  # end_unfinished ran: no new requests
        self._pool: ThreadPoolExecutor | None = None
        # Response ids: a random prefix per server and a counter, not uuid4 per request (its urandom
        # call releases the GIL, and the engine thread then holds it for the switch interval, 5 ms).
        self._id_prefix = secrets.token_hex(8)
        self._ids = itertools.count()

    def next_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):016x}"

    def request_ids(self, http_request: Request, req: Any, kind: str) -> tuple[str, str]:
        """(the response's id, the engine's request id): ``kind-<X-Request-Id>`` when the client sent the
        header (else its body's ``request_id``), else a fresh one. The engine's id gets a counter after a
        client's id, so that a client reusing one for concurrent requests does not collide."""
        given = http_request.scope.get(REQUEST_ID) or getattr(req, "request_id", None)
        if given is None:
            rid = f"{kind}-{self.next_id()}"
            return rid, rid
        return f"{kind}-{given}", f"{kind}-{given}-{self.next_id()}"

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
        if http_request.scope.get(BODY_BYTES, 0) <= _INLINE_BODY_BYTES:
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
            raise model_not_found(model, self.model_name)

    def check_fields(self, req: Any, asked: int | None) -> None:
        """Raise the APIError of a sampling field out of range, before any prompt is tokenized (and so
        before a length error). ``asked``: the max tokens the request gave, else None (then as many
        as ``min_tokens`` stand in for it: what fits is known once the prompt is)."""
        req.to_sampling_params(self.default_params(), max(1, req.min_tokens) if asked is None else asked)

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

    def truncated(self, ids: list[int], req: Any) -> list[int]:
        """``ids`` cut to the request's ``truncate_prompt_tokens`` (the last k; -1: as many as leave
        room for one output token), as the engine cuts them."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return ids
        return ids[-(self.max_model_len - 1 if keep == -1 else keep) :]

    def sampling_params(self, req: Any, prompts: list[list[int]], where: str, field: str) -> SamplingParams:
        """The request's SamplingParams, max_tokens as ``check_lengths`` gives it (its fields' ranges
        were checked by ``check_fields``). The prompts are first cut to ``truncate_prompt_tokens`` in
        place, so that the handler sends and counts (usage) the prompts the engine runs."""
        for ids in prompts:
            ids[:] = self.truncated(ids, req)
        return req.to_sampling_params(self.default_params(), self.check_lengths(prompts, req, where, field))

    # ---- prompts -----------------------------------------------------------------------------------

    def encode(self, text: str, where: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError("the model has no tokenizer.json: give the prompt as token ids", where)
        check_unicode(text, where)
        try:
            return encode_text(self.tokenizer, text, add_special_tokens)
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
            self.check_prompt_length(len(self.truncated(item, req)), "prompt")
        out = []
        for item in items:
            ids = self.encode(item, "prompt", req.add_special_tokens) if isinstance(item, str) else list(item)
            if not ids:
                raise APIError("prompt must not be empty", "prompt")
            ids = self.truncated(ids, req)
            self.check_prompt_length(len(ids), "prompt")
            out.append(ids)
        return out

    def echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """The text ``echo`` puts before each prompt's choices: the prompt as given, or its tokens
        decoded (special tokens kept) when it was token ids or was truncated."""
        given = (
            [req.prompt] if isinstance(req.prompt, str) or not isinstance(req.prompt[0], (str, list)) else req.prompt
        )
        texts = []
        for item, ids in zip(given, prompts):
            if isinstance(item, str) and req.truncate_prompt_tokens is None:
                texts.append(item)
            else:
                texts.append(
                    self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""
                )
        return texts

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- running requests ------------------------------------------------------------------------

    async def compile_structured_outputs(self, params: SamplingParams, param: str | None) -> None:
        """Compile the request's constraint (``params.structured_outputs``) before it is added, on the
        engine's compile thread, without holding the event loop: one that does not compile is a 400
        naming ``param`` (the field that asked for it), and the engine's request starts with its grammar
        ready (it is cached). Nothing to do without a constraint."""
        spec = params.structured_outputs
        if spec is None:
            return
        param = param or "structured_outputs"
        try:
            future = self.engine.output_processor.grammar_compiler.compile(spec)
            await asyncio.wrap_future(future)
        except ImportError as exc:
            raise APIError(f"{param}: {exc}", param) from exc
        except ValueError as exc:  # StructuredOutputsError, or no tokenizer
            message = str(exc).removeprefix("LLM: ")
            raise APIError(message if message.startswith(param) else f"{param}: {message}", param) from exc

    async def add(
        self, engine_id: str, prompts: list[list[int]], params: SamplingParams, where: str, user: str | None = None
    ) -> Running:
        """Add each prompt to the engine (ids ``engine_id``, or ``engine_id-i`` for several)."""
        if self.ended:
            raise EngineShutdownError("the server is shutting down")
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = engine_id if len(prompts) == 1 else f"{engine_id}-{i}"
                streams.append(await self.engine.add_request(rid, ids, params))
        except ValueError as exc:
            for s in streams:
                s.close()
            raise _engine_error(exc, where) from exc
        except BaseException:
            for s in streams:
                s.close()
            raise
        if user is not None:
            logger.info("request %s: user %r", engine_id, user)
        for ids in prompts:
            self.metrics.observe_prompt(len(ids))
        run = Running(streams)
        self.running.add(run)
        return run

    def note(self, run: Running, batch: list[tuple[int, RequestOutput]]) -> None:
        """Read what a prompt's first output reports: its prefix-cache hit and its queue time; and its
        prompt logprobs, in whichever output brings them."""
        for i, out in batch:
            if out.prompt_logprobs is not None:
                run.prompt_logprobs[i] = out.prompt_logprobs
            if i not in run.seen:
                run.seen.add(i)
                cached, queued = first_output_stats(out)
                if cached is not None:
                    run.cached_tokens[i] = cached
                if queued is not None:
                    self.metrics.observe_queue_time(queued)

    def record(self, choice: Choice, c: CompletionOutput, arrival: float) -> Choice:
        """Add an engine delta ``c`` to ``choice`` (text, tokens, logprobs, finish) and count it in the
        latency and token metrics. Returns ``choice``."""
        now = time.monotonic()
        num_new = len(c.token_ids)
        if num_new:
            if choice.last_token_time is None:
                self.metrics.observe_first_token(now - arrival)
                if num_new > 1:
                    self.metrics.observe_inter_token(0.0, num_new - 1)
            else:
                self.metrics.observe_inter_token(now - choice.last_token_time, num_new)
            choice.last_token_time = now
            self.metrics.count_tokens(num_new)
        choice.text += c.text
        choice.token_ids += c.token_ids
        if c.logprobs:
            choice.logprobs += c.logprobs
        if c.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
            self.metrics.count_finished(c.finish_reason, now - arrival, len(choice.token_ids))
        return choice


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _engine_error(exc: ValueError, where: str) -> APIError:
    """The engine's refusal of a request ("LLM: logit_bias [900] are outside the vocabulary ...") as a
    400 naming the SamplingParams field its message starts with, else ``where`` (the prompt)."""
    message = str(exc).removeprefix("LLM: ")
    m = re.match(r"(\w+)", message)
    return APIError(message, m.group(1) if m and m.group(1) in _SAMPLING_FIELDS else where)
