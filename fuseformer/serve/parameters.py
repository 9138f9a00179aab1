"""The one rule for request parameters: each one the server accepts has its effect, or the request
gets a 400 in OpenAI's shape that names it in ``param``.

A request model (``protocol.py``) declares the parameters the server implements; its fields are
typed, and ranges are checked where the request becomes ``SamplingParams``. Every other name in a
body lands in the model's extras (``extra="allow"``), and ``check_extras`` looks each one up in
``REFUSED``:

- a name there, with a value that asks for nothing (null, or a value listed as neutral: the
  server's behaviour anyway, e.g. ``response_format: {"type": "text"}``, ``best_of`` equal to ``n``),
  is accepted: it has its effect, since the server does what it asks;
- a name there with any other value: 400 "``name`` is not supported", ``code`` "unsupported_parameter";
- a name not there: 400 "Unrecognized request argument supplied: ``name``" (OpenAI's own message),
  ``code`` "unrecognized_parameter".

No parameter is accepted and ignored: OpenAI's client sends none unless the caller gives it. Nested
options are names with a dot (``stream_options.continuous_usage_stats``). docs/serving.md lists the
table; tests/serve/test_params.py checks that every name here is refused, and listed there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fuseformer.serve.errors import APIError


def _never(value: Any, req: Any) -> bool:
    return False


def _equals(*values: Any) -> Callable[[Any, Any], bool]:
    """Neutral when the value is one of ``values`` (booleans and numbers kept apart: ``true`` is not 1)."""

    def neutral(value: Any, req: Any) -> bool:
        return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values)

    return neutral


def _empty(value: Any, req: Any) -> bool:
    return value in ([], {}) or value == ""


def _nothing_to_call(tools: str) -> Callable[[Any, Any], bool]:
    """Neutral without ``tools`` (a list the body gives): ``"none"``, ``"auto"`` or a bool (the choice or
    parallel_tool_calls of no tools): there is nothing to call, and nothing is called."""

    def neutral(value: Any, req: Any) -> bool:
        given = getattr(req, tools, None) or (req.model_extra or {}).get(tools)
        return not given and (value in ("none", "auto") or isinstance(value, bool))

    return neutral


def _best_of(value: Any, req: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == getattr(req, "n", 1)


def _no_special_tokens_spaced(value: Any, req: Any) -> bool:
    """The detokenizer joins special tokens without spaces (``false``); ``true`` is met trivially when
    special tokens are left out of the text (``skip_special_tokens``, the default)."""
    return value is False or (value is True and getattr(req, "skip_special_tokens", True))


@dataclass(frozen=True, slots=True)
class Refused:
    """A parameter the server does not implement. ``neutral(value, request)``: the values that ask for
    what the server does anyway (null always does); ``why``: the end of the 400's message."""

    neutral: Callable[[Any, Any], bool] = _never
    why: str = "is not supported by this server"


_STRUCTURED = Refused(
    why="is not supported by this server: its structured outputs use llguidance, with JSON whitespace bounded "
    "(structured_outputs.disable_any_whitespace turns it off)"
)
_CHAT_TOOLS = "is not supported here by this server (tool calling: POST /v1/chat/completions takes it)"
_LEGACY_FUNCTIONS = "is not supported by this server: OpenAI's deprecated function calling (use tools and tool_choice)"
_COMPLETIONS_ONLY = "is not supported for chat completions by this server (POST /v1/completions takes it)"
_OPENAI_ONLY = "is an OpenAI platform option that this server does not implement"

# Every name a body may hold besides the request model's fields. Chat and completions share the
# table: a name of the other endpoint is refused here in the same words.
REFUSED: dict[str, Refused] = {
    # Fields of completions that chat does not have (vLLM's chat echoes the last message and
    # returns prompt logprobs at the top level; here neither).
    "echo": Refused(_equals(False), _COMPLETIONS_ONLY),
    "prompt_logprobs": Refused(why=_COMPLETIONS_ONLY),
    # best_of (n sampled, the best kept by cumulative logprob) is not implemented: vLLM's v1 engine
    # dropped it too. best_of = n asks for nothing more than n.
    "best_of": Refused(_best_of, "is not supported by this server unless it equals n"),
    "use_beam_search": Refused(_equals(False), "is not supported by this server: there is no beam search"),
    "length_penalty": Refused(_equals(1, 1.0), "is not supported by this server: there is no beam search"),
    "spaces_between_special_tokens": Refused(
        _no_special_tokens_spaced, "is not supported by this server: special tokens are joined without spaces"
    ),
    "logits_processors": Refused(_empty),
    "priority": Refused(_equals(0), "is not supported by this server: requests are scheduled first come, first served"),
    "return_tokens_as_token_ids": Refused(_equals(False)),
    # Completions: insertion.
    "suffix": Refused(_empty),
    # Structured outputs: response_format, structured_outputs and guided_json/regex/choice/grammar are
    # fields (protocol.py); the grammar library and the JSON whitespace are the server's.
    "guided_decoding_backend": _STRUCTURED,
    "guided_whitespace_pattern": _STRUCTURED,
    # Tool calling: tools, tool_choice and parallel_tool_calls are chat's fields (and tools /tokenize's);
    # on completions refused. functions / function_call, OpenAI's deprecated form, are not implemented
    # (vLLM has neither).
    "tools": Refused(_empty, _CHAT_TOOLS),
    "tool_choice": Refused(_nothing_to_call("tools"), _CHAT_TOOLS),
    "parallel_tool_calls": Refused(_nothing_to_call("tools"), _CHAT_TOOLS),
    "functions": Refused(_empty, _LEGACY_FUNCTIONS),
    "function_call": Refused(_nothing_to_call("functions"), _LEGACY_FUNCTIONS),
    # Streaming.
    "stream_options.continuous_usage_stats": Refused(
        _equals(False), "is not supported by this server: usage comes in the last chunk (include_usage)"
    ),
    # vLLM's extras for multimodal inputs, documents, disaggregation, reasoning.
    "documents": Refused(_empty),
    "mm_processor_kwargs": Refused(_empty),
    "cache_salt": Refused(),
    "kv_transfer_params": Refused(),
    "vllm_xargs": Refused(_empty),
    "include_reasoning": Refused(_equals(False)),
    # OpenAI platform options.
    "store": Refused(_equals(False), _OPENAI_ONLY),
    "metadata": Refused(_empty, _OPENAI_ONLY),
    "modalities": Refused(lambda v, r: v == ["text"], _OPENAI_ONLY),
    "audio": Refused(why=_OPENAI_ONLY),
    "prediction": Refused(why=_OPENAI_ONLY),
    "service_tier": Refused(_equals("auto", "default"), _OPENAI_ONLY),
    "reasoning_effort": Refused(why=_OPENAI_ONLY),
    "verbosity": Refused(why=_OPENAI_ONLY),
    "web_search_options": Refused(why=_OPENAI_ONLY),
    "prompt_cache_key": Refused(why=_OPENAI_ONLY),
    "prompt_cache_retention": Refused(why=_OPENAI_ONLY),
    "safety_identifier": Refused(why=_OPENAI_ONLY),
    "moderation": Refused(why=_OPENAI_ONLY),
}


def check_extras(model: BaseModel, prefix: str = "") -> None:
    """Raise the 400 of the first parameter of ``model`` (a request model, or an option object in one,
    its names under ``prefix``) that is not one of its fields and not accepted by ``REFUSED``."""
    for name, value in (model.model_extra or {}).items():
        key = prefix + name
        rule = REFUSED.get(key)
        if rule is None:
            raise APIError(f"Unrecognized request argument supplied: {key}", key, code="unrecognized_parameter")
        if value is not None and not rule.neutral(value, model):
            raise APIError(f"{key} {rule.why}", key, code="unsupported_parameter")
