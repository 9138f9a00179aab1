"""Request schemas: the model's defaults fill the fields not given; every out-of-range field becomes an
APIError naming that field (ranges are SamplingParams', the engine's); error bodies are OpenAI's shape."""

import pytest
from pydantic import ValidationError

from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

DEFAULTS = SamplingParams(temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.1)


def test_defaults_then_request_fields():
    params = CompletionRequest(prompt="hi").to_sampling_params(DEFAULTS, 16)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.9, 50, 1.1)
    assert (params.max_tokens, params.n, params.logprobs, params.stop) == (16, 1, None, [])
    req = CompletionRequest(prompt="hi", temperature=0, top_p=0.5, top_k=-1, n=3, seed=7, stop="x", logprobs=2)
    params = req.to_sampling_params(DEFAULTS, 5)
    assert (params.temperature, params.top_p, params.top_k, params.n, params.seed) == (0, 0.5, -1, 3, 7)
    assert (params.stop, params.logprobs, params.max_tokens, params.repetition_penalty) == (["x"], 2, 5, 1.1)


def test_chat_logprobs_and_max_tokens_fields():
    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=messages).to_sampling_params(DEFAULTS, 4).logprobs is None
    req = ChatCompletionRequest(messages=messages, logprobs=True, top_logprobs=3, max_tokens=9)
    assert req.to_sampling_params(DEFAULTS, 4).logprobs == 3 and req.requested_max_tokens == (9, "max_tokens")
    req = ChatCompletionRequest(messages=messages, max_tokens=9, max_completion_tokens=5)
    assert req.requested_max_tokens == (5, "max_completion_tokens")
    with pytest.raises(APIError) as info:
        req.to_sampling_params(DEFAULTS, 0)
    assert info.value.param == "max_completion_tokens" and "max_completion_tokens" in info.value.message


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(n=0), "n"),
        (dict(n=129), "n"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=21), "logprobs"),
        (dict(seed=2**63), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
    ],
)
def test_out_of_range_fields_name_the_field(fields, param):
    with pytest.raises(APIError) as info:
        CompletionRequest(prompt="hi", **fields).to_sampling_params(DEFAULTS, 16)
    err = info.value
    assert (err.status, err.param) == (400, param) and param in err.message
    body = err.body()
    assert body == {"error": {"message": err.message, "type": "invalid_request_error", "param": param, "code": None}}


def test_types_are_checked_by_pydantic():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt={"not": "a prompt"})
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])
    with pytest.raises(APIError) as info:  # an unknown field is a 400 naming it (parameters.py), as OpenAI's
        CompletionRequest(prompt="hi", unknown_field=1)
    assert (info.value.param, info.value.code) == ("unknown_field", "unrecognized_parameter")
