"""Tools in the chat prompt (serve/chat.py's ``render_chat``): ``tools`` reach the template as
transformers passes them (with ``tool_choice`` and ``parallel_tool_calls`` when given), tool messages
and assistant messages with ``tool_calls`` are rendered (their arguments as the object the JSON string
encodes), and bad tool fields get a 400 naming the field. (Tool calls in the output, over HTTP:
test_tool_calls_http.py.)
"""

from pathlib import Path
from types import SimpleNamespace

import pytest

import fuseformer
from fuseformer.models.tokenizer import Tokenizer
from fuseformer.serve.chat import render_chat
from fuseformer.serve.errors import APIError
from fuseformer.serve.protocol import ChatCompletionRequest

BUILTIN = Path(fuseformer.__file__).parent / "assets" / "builtin"
# A template in the Hermes / Qwen manner: the tools in a system turn, calls as <tool_call> JSON.
TEMPLATE = """\
{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\n' }}
{%- if tool_choice is defined %}choice: {{ tool_choice | tojson }}
{% endif %}{% if parallel_tool_calls is defined %}parallel: {{ parallel_tool_calls }}
{% endif %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls is defined %}<|assistant|>
{%- for tc in m.tool_calls %}<tool_call>{"name": "{{ tc.function.name }}", "arguments": \
{{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\n' }}
{%- elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def server():
    return SimpleNamespace(tokenizer=Tokenizer(BUILTIN), chat_template=TEMPLATE, trust_request_chat_template=False)


def test_tools_tool_calls_and_tool_messages_reach_the_template(server):
    req = ChatCompletionRequest(messages=ROUND_TRIP, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    assert render_chat(server, req) == (
        "<|system|>tools: get_weather now\n"
        'choice: "auto"\n'
        "parallel: False\n"
        "<|user|>Weather in Paris?\n"
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        "<|tool|>chatcmpl-tool-1: sunny, 21 C\n"
        "<|assistant|>"
    )
    named = {"type": "function", "function": {"name": "now"}}
    text = render_chat(server, ChatCompletionRequest(messages=ROUND_TRIP[:1], tools=TOOLS, tool_choice=named))
    assert 'choice: {"type": "function", "function": {"name": "now"}}\n' in text and "parallel" not in text


def test_without_tools_the_template_gets_none(server):
    for req in (
        ChatCompletionRequest(messages=ROUND_TRIP[:1]),
        ChatCompletionRequest(messages=ROUND_TRIP[:1], tools=[], tool_choice="none"),  # empty: asks for nothing
        ChatCompletionRequest(messages=ROUND_TRIP[:1], tools=[], tool_choice="required"),  # as "none" (vLLM's)
    ):
        assert render_chat(server, req) == "<|user|>Weather in Paris?\n<|assistant|>"


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (dict(tools=[{"type": "function"}]), "tools", r"tools\[0\] must be"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "must be"),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "not one of the tools",
        ),
        (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
        (dict(chat_template_kwargs={"tools": TOOLS}), "chat_template_kwargs", "set 'tools' as a field"),
    ],
)
def test_bad_tool_fields_name_the_field(server, fields, param, message):
    with pytest.raises(APIError, match=message) as info:
        render_chat(server, ChatCompletionRequest(messages=ROUND_TRIP[:1], **fields))
    assert info.value.param == param


def test_tool_call_arguments_must_be_json(server):
    messages = [dict(ROUND_TRIP[1], tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{x"}}])]
    with pytest.raises(
        APIError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"
    ) as info:
        render_chat(server, ChatCompletionRequest(messages=messages))
    assert info.value.param == "messages"
    messages = [dict(ROUND_TRIP[1], tool_calls=[{"type": "function"}])]
    with pytest.raises(APIError, match=r"messages\[0\]\.tool_calls\[0\] must be"):
        render_chat(server, ChatCompletionRequest(messages=messages))
