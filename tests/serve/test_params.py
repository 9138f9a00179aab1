"""The one rule for request parameters (fuseformer/serve/parameters.py), end to end with the official
``openai`` client: each parameter the server implements has an observable effect, streaming and not;
each one it does not gets a 400 naming it in ``param`` (and the server keeps serving, its KV cache
empty again); values that ask for what the server does anyway are accepted; unknown names are 400s;
docs/serving.md lists the table."""

import logging
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest

import fuseformer
from fuseformer.engine.cli import DEFAULT_MODEL
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.serve.parameters import REFUSED
from fuseformer.serve.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "tiny-llama"  # the name tests/serve/conftest.py serves the model as
HI = [{"role": "user", "content": "hi"}]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def server(checkpoint, start_server):
    with start_server(checkpoint) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def offline(checkpoint, llm_kwargs):
    with fuseformer.use_backend("reference"):
        yield LLM(checkpoint, **llm_kwargs)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(offline, prompt, n=16):
    with fuseformer.use_backend("reference"):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def _streamed_completion(client, **kwargs):
    """(text, finish_reason, stop_reason) of a streamed completion."""
    text, finish, stop_reason = "", None, None
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.finish_reason is not None:
                finish, stop_reason = c.finish_reason, c.stop_reason
    return text, finish, stop_reason


def _streamed_chat(client, **kwargs):
    text, finish, stop_reason = "", None, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason is not None:
                finish, stop_reason = c.finish_reason, c.stop_reason
    return text, finish, stop_reason


def _assert_serving(client, engine):
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    assert engine.num_unfinished_requests == 0 and engine.get_stats().kv_cache_usage == 0


# ---- wired parameters: each has its effect ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_and_stop_reason_for_a_stop_string(client, offline, stream):
    greedy = _greedy(offline, "Hello").text
    stop = greedy[3:6]
    assert len(greedy) >= 6 and stop
    base = dict(model=MODEL, prompt="Hello", max_tokens=16, temperature=0, stop=[stop])
    for include in (False, True):
        extra = dict(ignore_eos=True, include_stop_str_in_output=include)
        if stream:
            text, finish, stop_reason = _streamed_completion(client, **base, extra_body=extra)
        else:
            c = client.completions.create(**base, extra_body=extra).choices[0]
            text, finish, stop_reason = c.text, c.finish_reason, c.stop_reason
        cut = greedy.index(stop)
        assert text == (greedy[: cut + len(stop)] if include else greedy[:cut])
        assert (finish, stop_reason) == ("stop", stop)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_include_stop_str_in_output(client, offline, stream):
    with fuseformer.use_backend("reference"):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        greedy = offline.chat(HI, params, use_tqdm=False)[0].outputs[0].text
    stop = greedy[2:5]
    base = dict(model=MODEL, messages=HI, max_tokens=16, temperature=0, stop=stop)
    extra = dict(ignore_eos=True, include_stop_str_in_output=True)
    if stream:
        text, finish, stop_reason = _streamed_chat(client, **base, extra_body=extra)
    else:
        c = client.chat.completions.create(**base, extra_body=extra).choices[0]
        text, finish, stop_reason = c.message.content, c.finish_reason, c.stop_reason
    assert text == greedy[: greedy.index(stop) + len(stop)] and (finish, stop_reason) == ("stop", stop)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_is_the_stop_token_id_and_null_at_the_length_limit(client, offline, stream):
    out = _greedy(offline, "Hello")
    token = out.token_ids[4]
    cut = out.token_ids.index(token)  # the first time it comes
    base = dict(model=MODEL, prompt="Hello", max_tokens=16, temperature=0)
    extra = dict(ignore_eos=True, stop_token_ids=[token])
    if stream:
        _, finish, stop_reason = _streamed_completion(client, **base, extra_body=extra)
    else:
        r = client.completions.create(**base, extra_body=extra)
        finish, stop_reason = r.choices[0].finish_reason, r.choices[0].stop_reason
        assert r.usage.completion_tokens == cut + 1
    assert (finish, stop_reason) == ("stop", token)
    r = client.completions.create(**base, extra_body=dict(ignore_eos=True))
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("length", None)


# ---- the sampling controls (issue 29 item 2): each as the offline engine does it ---------------------


def _completion(client, stream, **kwargs):
    """(text, finish_reason, stop_reason, completion tokens) of a completion, streamed or not."""
    if not stream:
        r = client.completions.create(**kwargs)
        c = r.choices[0]
        return c.text, c.finish_reason, c.stop_reason, r.usage.completion_tokens
    text, finish, stop_reason, tokens = "", None, None, None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options=dict(include_usage=True)):
        for c in chunk.choices:
            text += c.text
            if c.finish_reason is not None:
                finish, stop_reason = c.finish_reason, c.stop_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, finish, stop_reason, tokens


def _offline_run(offline, prompt, **kwargs):
    with fuseformer.use_backend("reference"):
        return offline.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_allowed_token_ids_and_bad_words(client, offline, stream):
    """-100 removes greedy's first token; allowed_token_ids restricts a seeded random completion to
    four tokens; bad_words bans greedy's first token as a word: each the offline engine's output."""
    greedy = _greedy(offline, "Hello")
    first = greedy.token_ids[0]
    word = offline.tokenizer.decode([first])
    assert [first] in offline.output_processor.bad_words_token_ids([word])
    allowed = sorted(set(greedy.token_ids[1:5]))
    base = dict(max_tokens=12, ignore_eos=True)
    cases = [
        (dict(temperature=0, logit_bias={first: -100}), dict(logit_bias={str(first): -100})),
        (dict(temperature=1.5, seed=4, allowed_token_ids=allowed), dict(allowed_token_ids=allowed)),
        (dict(temperature=0, bad_words=[word]), dict(bad_words=[word])),
    ]
    for offline_kwargs, body in cases:
        expected = _offline_run(offline, "Hello", **base, **offline_kwargs).outputs[0]
        kwargs = {k: v for k, v in offline_kwargs.items() if k in ("temperature", "seed")}
        text, finish, _, _ = _completion(
            client,
            stream,
            model=MODEL,
            prompt="Hello",
            **kwargs,
            max_tokens=12,
            extra_body=dict(ignore_eos=True) | body,
        )
        assert (text, finish) == (expected.text, "length"), body
        assert text != greedy.text[: len(text)] or not text
    assert first not in _offline_run(offline, "Hello", **base, **cases[0][0]).outputs[0].token_ids
    assert set(_offline_run(offline, "Hello", **base, **cases[1][0]).outputs[0].token_ids) <= set(allowed)
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=8, temperature=0, extra_body=dict(ignore_eos=True)
    )
    biased = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=8,
        temperature=0,
        logit_bias={str(t): -100 for t in offline.tokenizer.encode(chat.choices[0].message.content)[:1]},
        extra_body=dict(ignore_eos=True),
    )
    assert biased.choices[0].message.content != chat.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_off_a_stop_token(client, offline, stream):
    """A stop token id that greedy samples first ends the completion at once; min_tokens 5 holds it off
    five tokens (and then stop_reason names it if it comes)."""
    first = _greedy(offline, "Hello").token_ids[0]
    base = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)
    text, finish, stop_reason, tokens = _completion(client, stream, **base, extra_body=dict(stop_token_ids=[first]))
    assert (text, finish, stop_reason, tokens) == ("", "stop", first, 1)
    extra = dict(stop_token_ids=[first], min_tokens=5, ignore_eos=True)
    expected = _offline_run(offline, "Hello", max_tokens=12, temperature=0, **extra).outputs[0]
    text, finish, stop_reason, tokens = _completion(client, stream, **base, extra_body=extra)
    assert (text, finish, stop_reason, tokens) == (
        expected.text,
        expected.finish_reason,
        expected.stop_reason,
        len(expected.token_ids),
    )
    assert tokens > 5 and text


@pytest.mark.parametrize("stream", [False, True])
def test_truncate_prompt_tokens(client, offline, stream):
    """The last 3 prompt tokens only: usage counts 3, the text is that of the cut prompt; a prompt past
    the context length is served once cut (completions)."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = offline.tokenizer.encode(prompt)
    expected = _offline_run(offline, ids[-3:], max_tokens=6, temperature=0, ignore_eos=True).outputs[0]
    base = dict(model=MODEL, max_tokens=6, temperature=0, extra_body=dict(ignore_eos=True, truncate_prompt_tokens=3))
    text, _, _, _ = _completion(client, stream, prompt=prompt, **base)
    assert text == expected.text
    r = client.completions.create(prompt=[7] * 100, **base)
    assert r.usage.prompt_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(messages=HI, **base)
    assert r.usage.prompt_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_echo_and_prompt_logprobs(client, offline, stream):
    """echo: the prompt's text before the output, and with logprobs its tokens before the output's,
    the first one's null (OpenAI's shape); prompt_logprobs: vLLM's list, None then per token
    {id: {logprob, rank, decoded_token}}, equal to the offline engine's."""
    ids = offline.tokenizer.encode("Hello world")
    expected = _offline_run(
        offline, "Hello world", max_tokens=4, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    base = dict(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, logprobs=1)
    body = dict(ignore_eos=True, prompt_logprobs=1)
    if stream:
        chunks = [
            c
            for chunk in client.completions.create(**base, echo=True, extra_body=body, stream=True)
            for c in chunk.choices
        ]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        token_logprobs = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
        prompt_logprobs = chunks[0].prompt_logprobs
        assert all(getattr(c, "prompt_logprobs", None) is None for c in chunks[1:])
    else:
        c = client.completions.create(**base, echo=True, extra_body=body).choices[0]
        text, tokens, token_logprobs, prompt_logprobs = (
            c.text,
            c.logprobs.tokens,
            c.logprobs.token_logprobs,
            c.prompt_logprobs,
        )
        assert c.logprobs.text_offset[0] == 0 and c.logprobs.top_logprobs[0] is None
    out = expected.outputs[0]
    assert text == "Hello world" + out.text
    assert tokens == [offline.tokenizer.decode([t], skip_special_tokens=False) for t in ids + out.token_ids]
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids) + len(out.token_ids)
    assert token_logprobs[1:] == pytest.approx(
        [expected.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
        + [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)],
        abs=1e-5,
    )
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for position, want in zip(prompt_logprobs[1:], expected.prompt_logprobs[1:]):
        assert list(position) == [str(t) for t in want]
        for t, lp in want.items():
            got = position[str(t)]
            assert got["logprob"] == pytest.approx(lp.logprob, abs=1e-5) and got["rank"] == lp.rank
            assert got["decoded_token"] == lp.decoded_token
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, echo=True)
    assert (
        plain.choices[0].text
        == "Hello world" + _greedy(offline, "Hello world", 4).text[: len(plain.choices[0].text) - 11]
    )
    assert plain.choices[0].text.startswith("Hello world")


# (endpoint, body fields, the param named): values out of range, as clients might send them.
BAD_VALUES = [
    ("completions", dict(logit_bias={"5": 200}), "logit_bias"),
    ("chat", dict(logit_bias={"abc": 1}), "logit_bias"),
    ("completions", dict(logit_bias={"900": 1}), "logit_bias"),  # past the vocabulary (320)
    ("completions", dict(allowed_token_ids=[]), "allowed_token_ids"),
    ("completions", dict(allowed_token_ids=[5, 900]), "allowed_token_ids"),
    ("completions", dict(allowed_token_ids=list(range(1025))), "allowed_token_ids"),
    ("completions", dict(min_tokens=5), "min_tokens"),  # max_tokens is 2
    ("chat", dict(min_tokens=-1), "min_tokens"),
    ("completions", dict(bad_words=["ok", " "]), "bad_words"),
    ("completions", dict(bad_words=["w"] * 65), "bad_words"),
    ("completions", dict(prompt_logprobs=21), "prompt_logprobs"),
    ("completions", dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ("completions", dict(truncate_prompt_tokens=64), "truncate_prompt_tokens"),  # leaves no room (64)
]


@pytest.mark.parametrize(
    "endpoint, fields, param", BAD_VALUES, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_VALUES)]
)
def test_bad_sampling_control_values_are_400_naming_them(server, client, endpoint, fields, param):
    url, engine = server
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(f"{url}{path}", json=_body(endpoint, fields))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    _assert_serving(client, engine)


@pytest.fixture(scope="module")
def builtin_server(start_server):
    """The built-in model: it writes EOS (<|endoftext|>, a special token) at the end of a file."""
    if DEFAULT_MODEL is None:
        pytest.skip("no built-in model installed")
    with start_server(DEFAULT_MODEL, max_model_len=256) as (url, engine):
        yield url, engine


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_and_include_stop_str_with_eos(builtin_server, stream):
    """The built-in model ends this prompt at once with EOS: its text shows only when it is kept
    (include_stop_str_in_output) and special tokens are not skipped. EOS: stop_reason null (vLLM's)."""
    client = openai.OpenAI(base_url=f"{builtin_server[0]}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "if __name__ == '__main__':\n    main()\n"
    base = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    texts = {}
    for include in (False, True):
        for skip in (False, True):
            extra = dict(include_stop_str_in_output=include, skip_special_tokens=skip)
            if stream:
                text, finish, stop_reason = _streamed_completion(client, **base, extra_body=extra)
            else:
                c = client.completions.create(**base, extra_body=extra).choices[0]
                text, finish, stop_reason = c.text, c.finish_reason, c.stop_reason
            assert (finish, stop_reason) == ("stop", None)
            texts[include, skip] = text
    assert texts == {(False, False): "", (False, True): "", (True, False): "<|endoftext|>", (True, True): ""}


def test_add_special_tokens(checkpoint, start_server, tmp_path):
    """A tokenizer that adds BOS: completions add it unless add_special_tokens is false; chat adds it
    only when asked (the template writes the special tokens)."""
    path = tmp_path / "bos"
    shutil.copytree(checkpoint, path)
    config = (path / "tokenizer_config.json").read_text()
    (path / "tokenizer_config.json").write_text(config.replace('{"bos_token"', '{"add_bos_token": true, "bos_token"'))
    with start_server(path) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        counts = {}
        for add in (True, False):
            r = client.completions.create(
                model=MODEL, prompt="Hello", max_tokens=1, extra_body=dict(add_special_tokens=add)
            )
            counts["completion", add] = r.usage.prompt_tokens
            r = client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=1, extra_body=dict(add_special_tokens=add)
            )
            counts["chat", add] = r.usage.prompt_tokens
        default = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).usage.prompt_tokens
        chat_default = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).usage.prompt_tokens
    assert counts["completion", True] == counts["completion", False] + 1 == default
    assert counts["chat", True] == counts["chat", False] + 1 == chat_default + 1


def test_user_is_written_to_the_log(client, caplog):
    with caplog.at_level(logging.INFO, logger="fuseformer.serve"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, user="alice-42")
    assert any("alice-42" in r.getMessage() for r in caplog.records)


def test_request_id_field_names_the_response(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body=dict(request_id="job-7"))
    assert r.id == "cmpl-job-7"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, extra_body=dict(request_id="job-8"))
    assert r.id == "chatcmpl-job-8"


# ---- refused parameters: a 400 naming them ------------------------------------------------------

# (endpoint, body fields, the param named): realistic values, as clients send them.
REFUSALS = [
    # Tool calling is chat's (its 400s: tests/serve/test_tool_calls_http.py); OpenAI's deprecated functions are not.
    ("completions", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    ("completions", dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    ("chat", dict(functions=[{"name": "f", "parameters": {}}]), "functions"),
    ("chat", dict(function_call={"name": "f"}), "function_call"),
    ("completions", dict(best_of=3), "best_of"),
    ("completions", dict(best_of=2, n=1), "best_of"),
    ("chat", dict(prompt_logprobs=0), "prompt_logprobs"),
    ("chat", dict(echo=True), "echo"),
    ("completions", dict(stream_options={"include_usage": True, "continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats"),
    ("completions", dict(suffix="end"), "suffix"),
    ("completions", dict(use_beam_search=True), "use_beam_search"),
    ("completions", dict(spaces_between_special_tokens=True, skip_special_tokens=False),
     "spaces_between_special_tokens"),
    ("chat", dict(modalities=["text", "audio"]), "modalities"),
    ("chat", dict(store=True), "store"),
    ("chat", dict(reasoning_effort="low"), "reasoning_effort"),
    ("completions", dict(priority=1), "priority"),
    ("chat", dict(guided_decoding_backend="xgrammar"), "guided_decoding_backend"),
    ("completions", dict(no_such_parameter=1), "no_such_parameter"),
    ("chat", dict(stream_options={"what": 1}), "stream_options.what"),
    ("chat", dict(prompt="a completions field"), "prompt"),
    ("completions", dict(messages=HI), "messages"),
]  # fmt: skip


def _body(endpoint, fields):
    base = dict(model=MODEL, max_tokens=2) | (dict(prompt="hi") if endpoint == "completions" else dict(messages=HI))
    return base | fields


@pytest.mark.parametrize("endpoint, fields, param", REFUSALS, ids=[p for _, _, p in REFUSALS])
def test_refused_parameter_is_400_naming_it(server, client, endpoint, fields, param):
    url, engine = server
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    for stream in (False, True):
        r = httpx.post(f"{url}{path}", json=_body(endpoint, fields) | dict(stream=stream))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param and param in error["message"], error
        assert error["code"] in ("unsupported_parameter", "unrecognized_parameter")
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    body = _body(endpoint, fields)
    own = ("model", "max_tokens", "prompt" if endpoint == "completions" else "messages")
    known = {k: body.pop(k) for k in own}
    with pytest.raises(openai.BadRequestError) as info:
        create(**known, extra_body=body)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    _assert_serving(client, engine)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_refused_name_is_a_400_for_a_value_that_asks_for_something(server, name):
    """Each name of the table, given a value it cannot take as neutral, on both endpoints."""
    url, _ = server
    head, _, tail = name.partition(".")
    fields = {head: {tail: "x"}} if tail else {head: "x"}
    for endpoint in ("completions", "chat"):
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        r = httpx.post(f"{url}{path}", json=_body(endpoint, fields))
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


NEUTRAL = [
    ("completions", dict(logit_bias={})),
    ("chat", dict(response_format={"type": "text"})),
    ("chat", dict(tools=[], tool_choice="none", parallel_tool_calls=False)),
    ("chat", dict(tool_choice="auto")),
    ("completions", dict(tools=[], tool_choice="none", parallel_tool_calls=True)),
    ("chat", dict(functions=[], function_call="auto")),
    ("completions", dict(min_tokens=0, best_of=1, echo=False, use_beam_search=False, length_penalty=1.0)),
    ("chat", dict(echo=False, min_tokens=0, bad_words=[], truncate_prompt_tokens=None)),
    ("completions", dict(n=2, best_of=2)),
    ("chat", dict(stream_options={"include_usage": True, "continuous_usage_stats": False}, stream=True)),
    ("chat", dict(logit_bias=None, response_format=None, tools=None, structured_outputs=None, prompt_logprobs=None)),
    ("chat", dict(store=False, modalities=["text"], service_tier="auto")),
    ("completions", dict(spaces_between_special_tokens=True)),  # special tokens skipped: nothing to space
    ("completions", dict(spaces_between_special_tokens=False, skip_special_tokens=False)),
]


@pytest.mark.parametrize("endpoint, fields", NEUTRAL, ids=[str(f)[:50] for _, f in NEUTRAL])
def test_a_value_that_asks_for_what_the_server_does_is_accepted(server, endpoint, fields):
    url, _ = server
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(f"{url}{path}", json=_body(endpoint, fields))
    assert r.status_code == 200, r.text


def test_docs_list_every_parameter():
    """docs/serving.md's tables name every field the request models take and every refused name."""
    text = DOCS.read_text()
    listed = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)?)`", text))
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert not (fields - listed), fields - listed
    assert not (set(REFUSED) - listed), set(REFUSED) - listed


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_options_without_stream_is_400(server, endpoint):
    """OpenAI and vLLM refuse stream_options on a request that does not stream: it would have no effect."""
    url, _ = server
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    body = _body(endpoint, dict(stream_options={"include_usage": True}))
    r = httpx.post(f"{url}{path}", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stream_options" and "stream: true" in error["message"], error
    assert httpx.post(f"{url}{path}", json=body | dict(stream=True)).status_code == 200
