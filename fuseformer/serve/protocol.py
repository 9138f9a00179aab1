"""Request and response bodies of the OpenAI API subset that ``fuseformer serve`` speaks (pydantic 2).

Requests: ``/v1/completions`` and ``/v1/chat/completions`` with the fields OpenAI documents, plus
``top_k`` (as vLLM accepts it). Types are checked here; value ranges are checked by ``SamplingParams``
(one place for them: the engine's), and ``to_sampling_params`` names the request field that failed.
Unknown fields are ignored, as OpenAI's API does.

Responses are built as plain dicts in OpenAI's shape (``app.py``); the models here document them and
give the error body.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fuseformer.engine.sampling_params import SamplingParams

# Most completions per request, and top logprobs per token (OpenAI allows 20 for chat).
MAX_N = 128
MAX_LOGPROBS = 20
# Stop strings per request and characters per stop string, and stop token ids per request (OpenAI
# takes 4 stop strings). Every output token of the request searches its new text for each stop string
# (~0.2 us a string plus ~0.01 us a character on the CPU the probe used) and its token among the
# stop ids: 100,000 stop strings slowed every concurrent request ~4x. These bounds keep it under
# ~6 us a token.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI returns it."""

    error: ErrorInfo


class APIError(Exception):
    """An error to return to the client in OpenAI's shape (400 unless said otherwise)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        # A message may quote the client's text: a lone surrogate there ("\ud800") would make the
        # response's UTF-8 encoding fail, a 500. It is written as its escape instead.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def _sampling_params(self, defaults: SamplingParams, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request: the model's defaults, then the fields given. Raises APIError
        naming the request field that is out of range."""
        kwargs: dict[str, Any] = {
            f: getattr(defaults, f) for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, f) is not None:
                kwargs[f] = getattr(self, f)
        kwargs |= dict(
            n=self.n,
            max_tokens=max_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            longest = max(len(s) for s in stops)
            raise APIError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got {longest}", "stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            n = len(self.stop_token_ids)
            raise APIError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {n}", "stop_token_ids")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # the engine's generators take int64
            raise APIError(f"seed must be a 64-bit signed integer, got {self.seed}", "seed")
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            name = "logprobs" if isinstance(self, CompletionRequest) else "top_logprobs"
            raise APIError(f"{name} must be in [0, {MAX_LOGPROBS}], got {logprobs}", name)
        try:
            return SamplingParams(**kwargs)
        except (TypeError, ValueError) as exc:
            raise _param_error(exc) from exc

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _param_error(exc: Exception) -> APIError:
    """A SamplingParams error ("SamplingParams: top_p must be in (0, 1], got 1.5") as a 400 naming the field."""
    message = str(exc)
    m = re.match(r"SamplingParams: (\w+) ", message)
    return APIError(message.removeprefix("SamplingParams: "), m.group(1) if m else None)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: a prompt (text or token ids; a list of them completes each)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_sampling_params(self, defaults: SamplingParams, max_tokens: int) -> SamplingParams:
        return self._sampling_params(defaults, max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the chat template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, defaults: SamplingParams, max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", "top_logprobs")
        try:
            return self._sampling_params(defaults, max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        except APIError as exc:
            if exc.param == "max_tokens":  # name the field the client used
                name = self.requested_max_tokens[1]
                exc.param, exc.message = name, exc.message.replace("max_tokens", name, 1)
            raise

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(max tokens asked for, the field that asked): max_completion_tokens wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fuseformer"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
