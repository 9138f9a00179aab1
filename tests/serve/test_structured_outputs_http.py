"""Structured outputs over HTTP with the official ``openai`` client, the built-in model served: OpenAI's
``response_format`` (json_object, json_schema strict or not), vLLM's ``structured_outputs`` and
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, on completions and chat,
streamed and not; a constraint that is malformed or does not compile is a 400 naming its field."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from fuseformer.engine.cli import DEFAULT_MODEL
from fuseformer.testing import CONSTRAINT_CHOICES as CHOICES
from fuseformer.testing import CONSTRAINT_REGEX as REGEX

MODEL = "tiny-llama"  # conftest's served name
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPT = "def f(x):\n    return"
CHAT = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture(scope="module")
def server(start_server):
    with start_server(DEFAULT_MODEL, num_kv_blocks=400, max_model_len=512) as (url, engine):
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _complete(client, stream, **extra):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=120, temperature=1.0, seed=1, extra_body=extra)
    if not stream:
        r = client.completions.create(**kwargs)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


def _chat(client, stream, response_format=None, **extra):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, seed=2, extra_body=extra)
    if response_format is not None:
        kwargs["response_format"] = response_format
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_completions_guided_fields_and_structured_outputs(server, stream):
    _, client = server
    text, reason = _complete(client, stream, guided_json=SCHEMA)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    text, reason = _complete(client, stream, guided_choice=CHOICES)
    assert text in CHOICES and reason == "stop"
    text, _ = _complete(client, stream, guided_regex=REGEX)
    assert re.fullmatch(REGEX, text), text
    text, _ = _complete(client, stream, structured_outputs={"choice": CHOICES})
    assert text in CHOICES
    text, _ = _complete(client, stream, guided_grammar='start: "ab" | "cd"')
    assert text in ("ab", "cd")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format(server, stream):
    _, client = server
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": strict}}
        text, reason = _chat(client, stream, fmt)
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    text, _ = _chat(client, stream, {"type": "json_object"})
    assert isinstance(json.loads(text), dict)
    text, _ = _chat(client, stream, structured_outputs={"regex": REGEX})
    assert re.fullmatch(REGEX, text), text


BAD = [
    ("completions", dict(guided_regex="[a-"), "guided_regex"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    ("chat", dict(response_format={"type": "xml"}), "response_format"),
    ("chat", dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    ("chat", dict(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
    ("completions", dict(guided_choice=[]), "guided_choice"),
    ("completions", dict(guided_grammar="start: undefined_rule"), "guided_grammar"),
    ("chat", dict(guided_json={"type": "object"}, guided_regex="a"), "guided_regex"),
    ("completions", dict(guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
]


@pytest.mark.parametrize("endpoint, fields, param", BAD, ids=[f"{e}-{p}" for e, _, p in BAD])
def test_a_bad_constraint_is_a_400_naming_its_field(server, endpoint, fields, param):
    url, client = server
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    base = dict(model=MODEL, max_tokens=4) | (dict(prompt=PROMPT) if endpoint == "completions" else dict(messages=CHAT))
    for stream in (False, True):
        r = httpx.post(f"{url}{path}", json=base | fields | dict(stream=stream), timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    # The server goes on serving.
    text, _ = _complete(client, False, guided_choice=CHOICES)
    assert text in CHOICES
