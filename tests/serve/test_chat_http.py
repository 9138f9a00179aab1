"""Chat over HTTP with the official ``openai`` client: ``add_generation_prompt``,
``continue_final_message``, ``chat_template`` (per request, where the server trusts them; and the
server's own, ``serve --chat-template``), ``chat_template_kwargs``; the built-in model's chat template
(``fuseformer generate --chat`` and ``/v1/chat/completions`` on a fresh install); the Tokenizer's
per-call template and ``continue_final_message``."""

import httpx
import openai
import pytest

import fuseformer
from fuseformer.engine.cli import DEFAULT_MODEL
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.models.tokenizer import ChatTemplateError, Tokenizer

MODEL = "tiny-llama"  # the name tests/serve/conftest.py serves the model as
HI = [{"role": "user", "content": "hi"}]
CONTINUED = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello wor"}]
# A template of this file's own: the last message's text, and a variable of chat_template_kwargs.
OWN_TEMPLATE = "{{ greeting | default('') }}{{ messages[-1]['content'] }}{% if add_generation_prompt %}!{% endif %}"


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(checkpoint, start_server):
    with start_server(checkpoint) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def trusting_server(checkpoint, start_server):
    """A server that takes a request's chat_template, and renders others with OWN_TEMPLATE."""
    app_kwargs = dict(trust_request_chat_template=True, chat_template=OWN_TEMPLATE)
    with start_server(checkpoint, app_kwargs=app_kwargs) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def offline(checkpoint, llm_kwargs):
    with fuseformer.use_backend("reference"):
        yield LLM(checkpoint, **llm_kwargs)


def _greedy_text(offline, text, n=8):
    """The offline engine's greedy completion of the prompt text (tokenized as chat prompts are)."""
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    with fuseformer.use_backend("reference"):
        out = offline.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return len(ids), out[0].outputs[0].text


def _chat(client, messages, stream=False, **extra):
    """(prompt tokens, text) of a greedy chat completion of 8 tokens."""
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    extra = dict(ignore_eos=True) | extra
    if not stream:
        r = client.chat.completions.create(**kwargs, extra_body=extra)
        return r.usage.prompt_tokens, r.choices[0].message.content
    text, usage = "", None
    for chunk in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra
    ):
        usage = chunk.usage or usage
        text += "".join(c.delta.content or "" for c in chunk.choices)
    return usage.prompt_tokens, text


@pytest.mark.parametrize("stream", [False, True])
def test_add_generation_prompt(server, offline, stream):
    client = _client(server[0])
    for add in (True, False):
        rendered = offline.tokenizer.apply_chat_template(HI, add_generation_prompt=add)
        assert _chat(client, HI, stream, add_generation_prompt=add) == _greedy_text(offline, rendered)
    assert _chat(client, HI, stream)[0] == _chat(client, HI, stream, add_generation_prompt=False)[0] + len(
        offline.tokenizer.encode("<|assistant|>", add_special_tokens=False)
    )


@pytest.mark.parametrize("stream", [False, True])
def test_continue_final_message(server, offline, stream):
    """The prompt ends with the assistant's unfinished text: no end of turn, no new turn."""
    client = _client(server[0])
    rendered = offline.tokenizer.apply_chat_template(CONTINUED, add_generation_prompt=False)
    assert rendered.endswith("Hello wor\n")
    continued = rendered.removesuffix("\n")
    assert _chat(client, CONTINUED, stream, continue_final_message=True) == _greedy_text(offline, continued)


@pytest.mark.parametrize(
    "extra, param",
    [
        (dict(continue_final_message=True, add_generation_prompt=True), "continue_final_message"),
        (dict(chat_template="{{ messages }}"), "chat_template"),  # this server does not trust request templates
        (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
        (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
        (dict(chat_template_kwargs={"tools": [{"type": "function"}]}), "chat_template_kwargs"),
        (dict(chat_template_kwargs="not a dict"), "chat_template_kwargs"),
        (dict(add_generation_prompt="maybe"), "add_generation_prompt"),
    ],
)
def test_chat_option_refusals(server, extra, param):
    url, engine = server
    client = _client(url)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CONTINUED, max_tokens=2, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).usage.completion_tokens == 2
    assert engine.num_unfinished_requests == 0 and engine.get_stats().kv_cache_usage == 0


def test_continue_final_message_needs_text_the_template_writes(server):
    client = _client(server[0])
    for messages in ([*HI, {"role": "assistant", "content": ""}],):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, extra_body=dict(continue_final_message=True)
            )
        assert info.value.body["param"] == "continue_final_message"


@pytest.mark.parametrize("stream", [False, True])
def test_the_servers_template_and_chat_template_kwargs(trusting_server, offline, stream):
    """create_app(chat_template=...) (serve --chat-template) renders the chats; kwargs reach it."""
    client = _client(trusting_server[0])
    assert _chat(client, HI, stream) == _greedy_text(offline, "hi!")
    got = _chat(client, HI, stream, chat_template_kwargs={"greeting": "Say "}, add_generation_prompt=False)
    assert got == _greedy_text(offline, "Say hi")


@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_chat_template(trusting_server, offline, stream):
    client = _client(trusting_server[0])
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    assert _chat(client, HI, stream, chat_template=template) == _greedy_text(offline, "[user] hi ")
    url = trusting_server[0]
    tokens = httpx.post(f"{url}/tokenize", json=dict(messages=HI, chat_template=template)).json()["tokens"]
    assert tokens == offline.tokenizer.encode("[user] hi ", add_special_tokens=False)
    for bad in ("{% for %}", "{{ raise_exception('no') }}"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body=dict(chat_template=bad))
        assert info.value.body["param"] == "chat_template"


# ---- serve --chat-template ----------------------------------------------------------------------------


def test_read_chat_template_takes_a_file_or_the_template(tmp_path):
    from fuseformer.serve.cli import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(OWN_TEMPLATE)
    assert read_chat_template(str(path)) == OWN_TEMPLATE
    assert read_chat_template(OWN_TEMPLATE) == OWN_TEMPLATE
    with pytest.raises(ValueError, match="no file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        read_chat_template("{% for %}")


@pytest.mark.parametrize("value", ["missing.jinja", "{% if %}"])
def test_serve_refuses_a_bad_chat_template(checkpoint, value, capsys):
    from fuseformer.serve import cli

    assert cli.main(["serve", "--model", str(checkpoint), "--device", "cpu", "--chat-template", value]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_create_app_refuses_a_template_that_does_not_compile(checkpoint, llm_kwargs):
    from fuseformer.engine.async_engine import AsyncEngine
    from fuseformer.serve.app import create_app

    with fuseformer.use_backend("reference"):
        engine = AsyncEngine(LLM(checkpoint, **llm_kwargs), start=False)
    with pytest.raises(ValueError, match="does not compile"):
        create_app(engine, MODEL, chat_template="{{ unclosed")


# ---- the built-in model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin():
    if DEFAULT_MODEL is None:
        pytest.skip("no built-in model installed")
    return DEFAULT_MODEL


def test_builtin_model_has_a_chat_template_of_its_own_tokens(builtin):
    tok = Tokenizer(builtin)
    assert tok.chat_template is not None
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Thanks"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == (
        "system: You write Python.\nuser: Add two numbers.\nassistant: def add(a, b):\n    return a + b"
        "<|endoftext|>\nuser: Thanks\nassistant:"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.eos_token_id in ids and max(ids) < tok.vocab_size  # the end of a turn is the model's EOS
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_builtin_model_chats_over_http(builtin, start_server):
    with start_server(builtin, max_model_len=256) as (url, _):
        client = _client(url)
        messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=1)
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
        assert r.usage.completion_tokens >= 1
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_builtin_model_generate_chat(builtin, capsys):
    from fuseformer.engine import cli

    argv = ["generate", "--chat", "Write a function that adds two numbers.", "--max-tokens", "8", "--device", "cpu"]
    assert cli.main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().out.strip()


# ---- the Tokenizer's side ---------------------------------------------------------------------------


def test_tokenizer_template_per_call_and_continue_final_message(checkpoint):
    tok = Tokenizer(checkpoint)
    assert tok.apply_chat_template(HI, chat_template=OWN_TEMPLATE) == "hi!"
    assert tok.apply_chat_template(HI, chat_template=OWN_TEMPLATE, greeting="Say ") == "Say hi!"
    assert tok.apply_chat_template(HI) == "<|user|>hi\n<|assistant|>"  # the model's stays
    text = tok.apply_chat_template(CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|user|>Say hello\n<|assistant|>Hello wor"
    parts = [CONTINUED[0], {"role": "assistant", "content": [{"type": "text", "text": "Hello wor"}]}]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'][0]['text'] if m['content'] is not string else m['content'] }}\n{% endfor %}"  # noqa: E501
    assert tok.apply_chat_template(parts, False, chat_template=template, continue_final_message=True).endswith(
        "assistant: Hello wor"
    )
    with pytest.raises(ValueError, match="cannot both"):
        tok.apply_chat_template(CONTINUED, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not write"):
        tok.apply_chat_template(CONTINUED, False, chat_template="{{ 'nothing' }}", continue_final_message=True)
