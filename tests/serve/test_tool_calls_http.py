"""Tool calling over HTTP with the official ``openai`` client (serve/chat.py's ``tool_use``, vLLM's rules):
the round trip (tools -> ``tool_calls`` -> a tool message -> an answer), streamed and not, for the
``hermes`` and ``llama3_json`` formats; "required" and a named function held to a call by the real
constraint (arguments valid under the tool's schema, over seeds); "auto" parsing, ``parallel_tool_calls``,
``n`` choices parsed each on its own, "none"; the ``serve`` flags; and each bad tool field a 400 naming
it, the server serving on.

The built-in model writes Python, not tool calls: "auto" outputs are made deterministic with a structured
outputs constraint (``guided_choice``) that holds the model to a text with calls in it, which the server
then parses as it parses any output (the constraint is the request's, not the tool choice's).
"""

import contextlib
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

import fuseformer
from fuseformer.engine.cli import DEFAULT_MODEL
from fuseformer.serve.chat import tool_use
from fuseformer.serve.errors import APIError
from fuseformer.serve.protocol import ChatCompletionRequest
from fuseformer.serve.tool_parsers import tool_parser

MODEL = "tiny-llama"  # conftest's served name
# A template in the Hermes / Qwen manner: the tools' names in a system turn, calls as <tool_call> JSON.
TEMPLATE = """\
{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\n' }}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls is defined %}<|assistant|>{{ m.content or '' }}
{%- for tc in m.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}{{ '\n' }}
{%- elif m.role == 'tool' %}<|tool|>{{ m.content }}
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]
# Outputs with calls, in each format: (text, content, [(name, arguments)]).
HERMES_CALL = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "Let me check.",
    [("get_weather", {"city": "Paris", "days": 2})],
)
HERMES_TWO_CALLS = (
    HERMES_CALL[0] + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "Let me check.",
    [("get_weather", {"city": "Paris", "days": 2}), ("now", {})],
)
LLAMA_TWO_CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
    '{"name": "now", "parameters": {}}',
    None,
    [("get_weather", {"city": "Paris", "days": 2}), ("now", {})],
)
SERVERS = {  # name -> create_app's tool arguments
    "hermes": dict(tool_call_parser="hermes", enable_auto_tool_choice=True),
    "llama3_json": dict(tool_call_parser="llama3_json", enable_auto_tool_choice=True),
    "plain": {},  # no flags: "auto" is a 400; "required" and named functions still work
}


@pytest.fixture(scope="module")
def servers(start_server):
    """name -> (url, openai client, engine): the built-in model served with TEMPLATE and SERVERS' flags."""
    with contextlib.ExitStack() as stack:
        out = {}
        for name, flags in SERVERS.items():
            app_kwargs = dict(chat_template=TEMPLATE) | flags
            url, engine = stack.enter_context(
                start_server(DEFAULT_MODEL, app_kwargs=app_kwargs, num_kv_blocks=800, max_model_len=1024)
            )
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            out[name] = SimpleNamespace(url=url, client=client, engine=engine)
        yield out


def _chat(client, stream, messages=ASK, **kwargs):
    """One chat completion: (message as a dict: content, tool_calls; finish_reason; usage). Streamed, the
    deltas are put together as OpenAI's client does, checking that each call's first delta carries its
    id, type and name and the later ones only argument text."""
    kwargs = dict(model=MODEL, messages=messages, max_tokens=200, temperature=1.0, seed=0) | kwargs
    if not stream:
        r = client.chat.completions.create(**kwargs)
        (choice,) = r.choices
        message = choice.message.model_dump(exclude_none=True)
        return message, choice.finish_reason, r.usage
    content, calls, finish, usage = None, {}, None, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta.content:
                content = (content or "") + c.delta.content
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:  # the call's first delta
                    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = dict(id=tc.id, type="function", function=dict(name=tc.function.name))
                    calls[tc.index]["function"]["arguments"] = tc.function.arguments or ""
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    calls[tc.index]["function"]["arguments"] += tc.function.arguments
            finish = c.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    message = dict(role="assistant") | ({} if content is None else dict(content=content))
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage


def _calls(message):
    """[(name, arguments decoded)] of a message's tool calls."""
    return [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in message.get("tool_calls", [])]


def _assert_serving(server):
    r = server.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, tools=TOOLS, tool_choice="none")
    assert r.usage.completion_tokens == 2
    assert server.engine.num_unfinished_requests == 0 and server.engine.get_stats().kv_cache_usage == 0


# ---- the round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name, case", [("hermes", HERMES_CALL), ("llama3_json", LLAMA_TWO_CALLS)])
def test_a_tool_call_round_trip(servers, name, case, stream):
    """Tools -> tool_calls (auto: the output held to a text with calls) -> the assistant message and a tool
    message sent back -> an answer; the history reaches the template."""
    server = servers[name]
    text, content, expected = case
    message, finish, _ = _chat(server.client, stream, tools=TOOLS, extra_body=dict(guided_choice=[text]))
    assert finish == "tool_calls" and message.get("content") == content and _calls(message) == expected
    ids = [tc["id"] for tc in message["tool_calls"]]
    assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-tool-") for i in ids)

    results = [{"role": "tool", "tool_call_id": i, "content": f"result {k}: sunny, 21 C"} for k, i in enumerate(ids)]
    history = [*ASK, message, *results]
    answer, finish, usage = _chat(server.client, stream, history, tools=TOOLS, max_tokens=8, temperature=0)
    assert finish in ("stop", "length") and isinstance(answer.get("content", ""), str)
    assert "tool_calls" not in answer
    # The prompt it answered: the template's rendering of the calls and their results.
    r = httpx.post(f"{server.url}/tokenize", json=dict(model=MODEL, messages=history, tools=TOOLS), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == usage.prompt_tokens
    prompt = httpx.post(f"{server.url}/detokenize", json=dict(tokens=r.json()["tokens"]), timeout=60).json()["prompt"]
    assert prompt.startswith("<|system|>tools: get_weather now\n<|user|>Weather in Paris")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert all(f"<|tool|>result {k}: sunny, 21 C\n" in prompt for k in range(len(ids)))
    assert prompt.endswith("<|assistant|>")


def test_the_round_trip_with_the_openai_message_object(servers):
    """The assistant message appended as the client returns it (a ChatCompletionMessage), as OpenAI's
    examples do."""
    client = servers["hermes"].client
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, extra_body=dict(guided_choice=[HERMES_CALL[0]])
    )
    call = r.choices[0].message.tool_calls[0]
    history = [*ASK, r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None


# ---- forced calls: the real constraint ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", list(SERVERS))
def test_required_and_a_named_function_are_held_to_a_call(servers, name, stream):
    """Over seeds, at temperature 1: the output is one call (parallel_tool_calls false, or named) of a
    tool, its arguments valid under the tool's schema; "required" ends with "tool_calls", a named function
    with "stop" (OpenAI's, vLLM's). The server without flags holds calls to llama3_json's JSON."""
    client = servers[name].client
    for seed in range(3):
        message, finish, _ = _chat(client, stream, tools=TOOLS, tool_choice=NAMED, seed=seed)
        ((fn, args),) = _calls(message)
        assert fn == "get_weather" and finish == "stop" and "content" not in message, message
        jsonschema.validate(args, WEATHER)
        message, finish, _ = _chat(
            client, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed
        )
        ((fn, args),) = _calls(message)
        assert finish == "tool_calls" and "content" not in message, message
        if fn == "get_weather":
            jsonschema.validate(args, WEATHER)
        else:
            assert (fn, args) == ("now", {})


@pytest.mark.parametrize(
    "name, head", [("hermes", '<tool_call>\n{"'), ("plain", '{"name": "get_weather", "parameters": {"')]
)
def test_a_forced_call_is_written_in_the_servers_format(servers, name, head):
    """A forced call is written in the server's format (hermes), or llama3_json's without a parser: the
    output's tokens (their logprobs' texts) spell it, and that parser reads them as the response's call."""
    r = servers[name].client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200, seed=4, logprobs=True
    )
    text = "".join(t.token for t in r.choices[0].logprobs.content).removesuffix("<|endoftext|>")  # EOS
    assert text.startswith(head), text
    content, calls = tool_parser("hermes" if name == "hermes" else "llama3_json").extract(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        (tc.function.name, tc.function.arguments) for tc in r.choices[0].message.tool_calls
    ]


def test_streamed_logprobs_all_arrive(servers):
    """Streamed with logprobs, the tokens' logprobs all arrive in order, those of text held back or of a
    call left out (parallel_tool_calls false) on a later chunk."""
    text, _, expected = HERMES_TWO_CALLS
    tokens = []
    stream = servers["hermes"].client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=200, logprobs=True,
        stream=True, extra_body=dict(guided_choice=[text]),
    )  # fmt: skip
    calls = {}
    for chunk in stream:
        for c in chunk.choices:
            tokens += [t.token for t in (c.logprobs.content if c.logprobs else [])]
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, []).append(tc.function.arguments)
    assert "".join(tokens) == text + "<|endoftext|>"
    assert list(calls) == [0] and json.loads("".join(calls[0])) == expected[0][1]


# ---- auto, parallel_tool_calls, n, none ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name, case", [("hermes", HERMES_TWO_CALLS), ("llama3_json", LLAMA_TWO_CALLS)])
def test_parallel_tool_calls_false_keeps_the_first_call(servers, name, case, stream):
    client = servers[name].client
    text, content, expected = case
    message, finish, _ = _chat(client, stream, tools=TOOLS, extra_body=dict(guided_choice=[text]))
    assert _calls(message) == expected and finish == "tool_calls"
    message, finish, _ = _chat(
        client, stream, tools=TOOLS, parallel_tool_calls=False, extra_body=dict(guided_choice=[text])
    )
    assert _calls(message) == expected[:1] and message.get("content") == content and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_a_call_is_content(servers, stream):
    text = "No tool needed: <tool is a word, and so is call."
    message, finish, _ = _chat(servers["hermes"].client, stream, tools=TOOLS, extra_body=dict(guided_choice=[text]))
    assert message == dict(role="assistant", content=text) and finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_parsed_each_on_its_own(servers, stream):
    """n = 6 choices between a text with calls and one without: each choice's message and finish_reason
    are its own text's; call ids differ across choices."""
    client = servers["hermes"].client
    plain = "Sunny, I guess."
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        n=6,
        seed=3,
        max_tokens=100,
        extra_body=dict(guided_choice=[HERMES_CALL[0], plain]),
    )
    if not stream:
        choices = [
            (c.message.model_dump(exclude_none=True), c.finish_reason)
            for c in client.chat.completions.create(**kwargs).choices
        ]
    else:
        parts = {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                part = parts.setdefault(c.index, dict(content="", calls={}, finish=None))
                part["content"] += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    call = part["calls"].setdefault(
                        tc.index, dict(id=tc.id, function=dict(name=tc.function.name, arguments=""))
                    )
                    call["function"]["arguments"] += tc.function.arguments or ""
                part["finish"] = c.finish_reason or part["finish"]
        choices = []
        for i in sorted(parts):
            p = parts[i]
            message = dict(role="assistant", content=p["content"])
            if p["calls"]:
                message["tool_calls"] = list(p["calls"].values())
            choices.append((message, p["finish"]))
    assert len(choices) == 6
    ids = []
    for message, finish in choices:
        if "tool_calls" in message:
            assert message["content"] == "Let me check." and finish == "tool_calls"
            assert _calls(message) == HERMES_CALL[2]
            ids.append(message["tool_calls"][0]["id"])
        else:
            assert message == dict(role="assistant", content=plain) and finish == "stop"
    assert ids and len(set(ids)) == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_parses_nothing(servers, stream):
    """The tools reach the template; the output, calls and all, is content."""
    message, finish, usage = _chat(
        servers["hermes"].client,
        stream,
        tools=TOOLS,
        tool_choice="none",
        extra_body=dict(guided_choice=[HERMES_CALL[0]]),
    )
    assert message == dict(role="assistant", content=HERMES_CALL[0]) and finish == "stop"
    _, _, without = _chat(servers["hermes"].client, stream, max_tokens=1)
    assert usage.prompt_tokens > without.prompt_tokens  # the tools' system turn


# ---- 400s -------------------------------------------------------------------------------------------


def _fn(**function):
    """A tools list of one function "f" with these fields."""
    return [{"type": "function", "function": {"name": "f", **function}}]


BAD_PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}, "required": ["a"]}
NOPE = {"type": "function", "function": {"name": "nope"}}
AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"
CHAT_ONLY = "POST /v1/chat/completions"
REFUSALS = [
    # (server, endpoint, fields, param, words of the message)
    ("hermes", "chat", dict(tools=TOOLS, tool_choice=NOPE), "tool_choice", "not one of the tools"),
    ("hermes", "chat", dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
    ("hermes", "chat", dict(tool_choice="required"), "tool_choice", "needs tools"),
    ("hermes", "chat", dict(tools=[{"type": "function"}]), "tools", "tools[0] must be"),
    ("hermes", "chat", dict(tools="get_weather"), "tools", "tools"),
    ("hermes", "chat", dict(tools=["get_weather"]), "tools", "tools[0] must be"),
    ("hermes", "chat", dict(tools=_fn(parameters="x")), "tools", "parameters"),
    ("hermes", "chat", dict(tools=_fn(description=3)), "tools", "description"),
    ("hermes", "chat", dict(tools=TOOLS + TOOLS[:1]), "tools", "given twice"),
    ("hermes", "chat", dict(tools=TOOLS, parallel_tool_calls="x"), "parallel_tool_calls", "parallel_tool_calls"),
    ("hermes", "chat", dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice", "response_format"),
    ("hermes", "chat", dict(tools=TOOLS, tool_choice=NAMED, guided_regex="a+"), "tool_choice", "guided_regex"),
    ("hermes", "chat", dict(tools=_fn(parameters=BAD_PATTERN), tool_choice="required"), "tools", "tools"),
    ("hermes", "chat", dict(functions=[{"name": "f"}]), "functions", "deprecated function calling"),
    ("hermes", "chat", dict(function_call={"name": "f"}), "function_call", "deprecated function calling"),
    ("hermes", "completions", dict(tools=TOOLS), "tools", CHAT_ONLY),
    ("hermes", "completions", dict(tool_choice="required"), "tool_choice", CHAT_ONLY),
    ("plain", "chat", dict(tools=TOOLS), "tool_choice", AUTO_FLAGS),
    ("plain", "chat", dict(tools=TOOLS, tool_choice="auto"), "tool_choice", AUTO_FLAGS),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, endpoint, fields, param, words", REFUSALS, ids=[f"{r[0]}-{r[3]}-{i}" for i, r in enumerate(REFUSALS)]
)
def test_a_bad_tool_field_is_a_400_naming_it(servers, name, endpoint, fields, param, words):
    server = servers[name]
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    body = dict(model=MODEL, max_tokens=2) | (dict(prompt="hi") if endpoint == "completions" else dict(messages=ASK))
    for stream in (False, True):
        r = httpx.post(f"{server.url}{path}", json=body | fields | dict(stream=stream), timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    if endpoint == "chat":  # the official client's 400 too
        known = {
            k: fields[k] for k in ("tools", "tool_choice", "parallel_tool_calls", "response_format") if k in fields
        }
        extra = {k: v for k, v in fields.items() if k not in known}
        with pytest.raises(openai.BadRequestError) as info:
            server.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=extra, **known)
        assert info.value.body["param"] == param
    _assert_serving(server)


def test_tools_on_tokenize(servers):
    """/tokenize takes tools with messages (vLLM's), counting the prompt chat completions run."""
    server = servers["hermes"]
    r = httpx.post(f"{server.url}/tokenize", json=dict(model=MODEL, messages=ASK, tools=TOOLS), timeout=60)
    _, _, usage = _chat(server.client, False, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.status_code == 200 and r.json()["count"] == usage.prompt_tokens
    r = httpx.post(f"{server.url}/tokenize", json=dict(model=MODEL, prompt="hi", tools=TOOLS), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# ---- tool_use, without a server ---------------------------------------------------------------------


def _serving(parser=None, auto=False, special_tokens=()):
    """What tool_use reads of a Serving."""
    forced = tool_parser(parser or "llama3_json")
    return SimpleNamespace(
        tool_parser=tool_parser(parser) if parser else None,
        forced_tool_parser=forced,
        enable_auto_tool_choice=auto,
        special_tokens={t: 100 + i for i, t in enumerate(special_tokens)},
    )


def test_auto_names_the_flag_that_is_missing():
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    with pytest.raises(APIError, match="needs the server started with --enable-auto-tool-choice;") as info:
        tool_use(_serving("hermes"), req)
    assert info.value.param == "tool_choice"
    use = tool_use(_serving("hermes", auto=True), req)
    assert use.parser.name == "hermes" and not use.named and not use.first_only
    assert req.skip_special_tokens  # <tool_call> is no special token here: the text is as asked


def test_forced_calls_take_the_servers_format_or_llama3_json():
    for parser, grammar_start in (("hermes", "<tool_call>"), (None, "call")):
        req = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        use = tool_use(_serving(parser), req)
        assert use.parser.name == (parser or "llama3_json") and use.first_only and not use.named
        grammar = req._structured_outputs().grammar
        assert grammar_start in grammar and req.structured_param == "tools"
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice=NAMED)
    assert tool_use(_serving(), req).named
    # none: nothing parsed, no constraint; no tools at all: the same.
    for req in (
        ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="none"),
        ChatCompletionRequest(messages=ASK, tools=[], tool_choice="required"),
    ):
        assert tool_use(_serving("hermes", auto=True), req) is None and req._structured_outputs() is None


@pytest.mark.parametrize("parser, marker", [("hermes", "<tool_call>"), ("llama3_json", "<|python_tag|>")])
def test_special_token_markers_keep_special_tokens_in_the_text(parser, marker):
    """Where the format's marker is a special token, the text the parser reads keeps it (vLLM's
    adjust_request); an explicit skip_special_tokens: true is a 400 naming it."""
    server = _serving(parser, auto=True, special_tokens=[marker, "<|eot_id|>"])
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    tool_use(server, req)
    assert req.skip_special_tokens is False
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required")
    tool_use(server, req)
    assert req.skip_special_tokens is False
    if parser == "hermes":  # the forcing grammar names the tag by its id (llama3_json's writes no tag)
        assert "<[100]>" in req._structured_outputs().grammar
    with pytest.raises(APIError, match="skip_special_tokens: true would leave") as info:
        tool_use(server, ChatCompletionRequest(messages=ASK, tools=TOOLS, skip_special_tokens=True))
    assert info.value.param == "skip_special_tokens"
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="none", skip_special_tokens=True)
    assert tool_use(server, req) is None and req.skip_special_tokens  # nothing parsed: as asked


# ---- serve's flags ----------------------------------------------------------------------------------


def test_serve_tool_flags(checkpoint, capsys, monkeypatch):
    from fuseformer.serve import app as app_module
    from fuseformer.serve import cli

    assert cli.main(["serve", "--model", str(checkpoint), "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--model", str(checkpoint), "--tool-call-parser", "pythonic"])
    assert info.value.code == 2 and "invalid choice: 'pythonic'" in capsys.readouterr().err

    class Built(Exception):
        pass

    def create_app(engine, name, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(app_module, "create_app", create_app)
    args = ["serve", "--model", str(checkpoint), "--device", "cpu", "--num-kv-blocks", "16", "--max-model-len", "64"]
    for flags, expected in (
        ([], dict(tool_call_parser=None, enable_auto_tool_choice=False)),
        (["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"],
         dict(tool_call_parser="llama3_json", enable_auto_tool_choice=True)),
    ):  # fmt: skip
        with pytest.raises(Built) as built, fuseformer.use_backend("reference"):
            cli.main([*args, *flags])
        assert {k: built.value.args[0][k] for k in expected} == expected


def test_create_app_checks_the_tool_arguments(checkpoint, llm_kwargs):
    from fuseformer.engine.async_engine import AsyncEngine
    from fuseformer.engine.llm import LLM
    from fuseformer.serve.app import create_app

    engine = AsyncEngine(LLM(checkpoint, **llm_kwargs), start=False)
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        create_app(engine, MODEL, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, llama3_json"):
        create_app(engine, MODEL, tool_call_parser="pythonic")
