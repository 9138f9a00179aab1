"""Request and response bodies of the OpenAI API subset that ``fuseformer serve`` speaks (pydantic 2),
with vLLM's extras (``top_k``, ``stop_token_ids``, ``skip_special_tokens``, ``min_tokens``,
``bad_words``, ``allowed_token_ids``, ``prompt_logprobs``, the chat-template options, ``/tokenize``, ...).

A request model's fields are the parameters the server implements; their types are checked here and
their ranges by ``SamplingParams`` (one place for them: the engine's), ``to_sampling_params`` naming
the request field that failed. Any other name in a body is answered by ``parameters.check_extras``
(the one rule: accepted only where it asks for what the server does; else a 400 naming it).

Responses are built as plain dicts in OpenAI's shape (``completions.py``, ``chat.py``, ``app.py``);
the models here document them.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.structured_outputs import StructuredOutputsError, structured_outputs_from_request
from fuseformer.serve.errors import APIError
from fuseformer.serve.parameters import check_extras

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "TokenizeRequest"]

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
# Token ids in logit_bias and in allowed_token_ids, and bad words: every step of the request lists them
# on the host for the sampler's mask (~0.1 us an id, ~0.3 us a bad word, 2 CPU cores; the probe of
# 2026-12-05): these bounds keep a request under ~0.1 ms a step.
MAX_TOKEN_ID_LIST = 1024
MAX_BAD_WORDS = 64


class _Checked(BaseModel):
    """A body (or an option object in one) whose names outside its fields go through the one rule."""

    model_config = ConfigDict(extra="allow")
    _prefix: str = ""  # the object's names in errors: "stream_options." + name

    @model_validator(mode="after")
    def _check_extras(self) -> _Checked:
        check_extras(self, self._prefix)
        return self


class StreamOptions(_Checked):
    _prefix = "stream_options."

    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ...: passed to the chat template

    role: str
    content: str | list[dict[str, Any]] | None = None


class _ChatTemplateOptions(BaseModel):
    """How messages become the prompt (vLLM's fields): ``chat.render_chat`` applies them."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # OpenAI's; checked by tool_parsers.check_tools (its errors name "tools")


class _SamplingRequest(_Checked):
    """Fields shared by both generation endpoints."""

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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the end user, written to the server's log with the request id
    request_id: str | None = None  # the response id's suffix (an X-Request-Id header wins)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (at most one;
    # engine/structured_outputs.py reads them, and its errors name the field).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # The field that asked for the request's constraint (the 400 of a constraint that does not compile names it).
    _structured_param: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        # OpenAI and vLLM refuse them too: without a stream they would have no effect.
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options can only be given with stream: true", "stream_options")
        return self

    def _sampling_params(
        self, defaults: SamplingParams, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
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
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )
        for name in ("logit_bias", "allowed_token_ids"):
            if len(getattr(self, name) or ()) > MAX_TOKEN_ID_LIST:
                raise APIError(
                    f"{name} takes at most {MAX_TOKEN_ID_LIST} token ids, got {len(getattr(self, name))}", name
                )
        words = self.bad_words or []
        if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_STRING_CHARS for w in words):
            raise APIError(
                f"bad_words takes at most {MAX_BAD_WORDS} words of at most {MAX_STOP_STRING_CHARS} characters",
                "bad_words",
            )
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise APIError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}", "prompt_logprobs")
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
        kwargs["structured_outputs"] = self._structured_outputs()
        try:
            return SamplingParams(**kwargs)
        except (TypeError, ValueError) as exc:
            raise _param_error(exc) from exc

    def _structured_outputs(self) -> Any:
        """The ``StructuredOutputsParams`` the request's fields ask for (None: none); APIError naming the field."""
        try:
            found = structured_outputs_from_request(
                response_format=self.response_format,
                structured_outputs=self.structured_outputs,
                guided_json=self.guided_json,
                guided_regex=self.guided_regex,
                guided_choice=self.guided_choice,
                guided_grammar=self.guided_grammar,
            )
        except StructuredOutputsError as exc:
            raise APIError(str(exc), exc.param) from exc
        if found is None:
            return None
        spec, self._structured_param = found
        return spec

    @property
    def structured_param(self) -> str | None:
        """The field that asked for the request's constraint (after ``to_sampling_params``)."""
        return self._structured_param

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _param_error(exc: Exception) -> APIError:
    """A SamplingParams error ("SamplingParams: top_p must be in (0, 1], got 1.5") as a 400 naming the field."""
    message = str(exc)
    m = re.match(r"SamplingParams: (\w+) ", message)
    return APIError(message.removeprefix("SamplingParams: "), m.group(1) if m else None)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: a prompt (text or token ids; a list of them completes each).
    ``echo`` puts the prompt before each choice's text (with ``logprobs``, its tokens before the
    choice's, the first one's logprob null, as OpenAI); ``prompt_logprobs`` (vLLM's) gives each
    choice its prompt's logprobs."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True  # text prompts: the tokenizer's BOS/EOS rule

    def to_sampling_params(self, defaults: SamplingParams, max_tokens: int) -> SamplingParams:
        # Echo with logprobs needs the prompt's (vLLM: as many top ones as logprobs asks).
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        return self._sampling_params(defaults, max_tokens, self.logprobs, prompt_logprobs)


class ChatCompletionRequest(_ChatTemplateOptions, _SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False  # the template writes the special tokens
    # Tool calling (``tools`` is a template option): "none", "auto", "required" or a named function
    # (checked by tool_parsers.check_tools), and whether more than one call may be made.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # The constraint of a forcing tool_choice ("required", a named function): chat.tool_use sets it.
    _tool_calls_constraint: Any = PrivateAttr(None)

    def hold_to_tool_calls(self, spec: Any) -> None:
        """Hold the output to ``spec``, the ``StructuredOutputsParams`` of a forcing ``tool_choice``, in
        place of the structured-outputs fields (a request that sets one too: a 400 naming tool_choice)."""
        self._tool_calls_constraint = spec

    def _structured_outputs(self) -> Any:
        spec = super()._structured_outputs()
        if self._tool_calls_constraint is None:
            return spec
        if spec is not None:
            raise APIError(
                f"tool_choice {json.dumps(self.tool_choice)} holds the output to tool calls: it cannot be "
                f"combined with {self._structured_param}",
                "tool_choice",
            )
        self._structured_param = "tools"  # a constraint that does not compile: a tool's parameters schema
        return self._tool_calls_constraint

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


class TokenizeRequest(_ChatTemplateOptions, _Checked):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or ``messages`` rendered as chat completions renders
    them (the chat-template options apply to messages only)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give either prompt or messages", "prompt" if self.prompt is None else "messages")
        if self.prompt is not None:
            for name in _ChatTemplateOptions.model_fields:
                if name in self.model_fields_set:
                    raise APIError(f"{name} applies to messages, not to a prompt", name)
        return self


class DetokenizeRequest(_Checked):
    """``POST /detokenize`` (vLLM's): token ids to text (special tokens kept)."""

    model: str | None = None
    tokens: list[int]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fuseformer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
