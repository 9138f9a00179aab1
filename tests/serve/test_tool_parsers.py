"""Tool-call parsers (serve/tool_parsers.py): hermes and llama3_json on well-formed output, on malformed
output (left as content, verbatim), and streamed in random splits (the deltas, accumulated as OpenAI's
client does, equal the non-streaming result; each call's first delta carries id, type and name); the
tools check; and the tool-choice grammars, which accept the format and nothing else."""

import json
import random
import re
from pathlib import Path

import pytest

import fuseformer
from fuseformer.engine.structured_outputs import GrammarCompiler
from fuseformer.models.tokenizer import Tokenizer
from fuseformer.serve.tool_parsers import TOOL_PARSERS, ToolCallError, check_tools, make_tool_call_id, tool_parser

BUILTIN = Path(fuseformer.__file__).parent / "assets" / "builtin"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = check_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "now", "description": "the time"}},
    ]
)

HERMES_WELL_FORMED = [
    # (text, content, [(name, arguments)])
    (
        'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"x": "}"}]}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
        "Let me look.",
        [("get_weather", '{"city": "Paris", "n": [1, {"x": "}"}]}'), ("now", "{}")],
    ),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),  # no arguments: {}
    (
        '<tool_call>\n{"name": "f", "arguments": {"q": "a \\"b\\" <tool_call>"}}\n',
        None,
        [("f", '{"q": "a \\"b\\" <tool_call>"}')],
    ),
    ('<tool_call>{"name": "f", "arguments": {"a": true}}</tool_call>\nDone.', "Done.", [("f", '{"a": true}')]),
    ("No tools needed: 2 < 3 and <tool is a word.  \n", "No tools needed: 2 < 3 and <tool is a word.  \n", []),
]
HERMES_MALFORMED = [
    # Left as content, exactly as written; the well-formed call beside one is still a call.
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    (
        'x <tool_call>{"name": 5, "arguments": {}}</tool_call>',
        'x <tool_call>{"name": 5, "arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
        [],
    ),
    ('<tool_call>{"name": "f"} junk</tool_call>', '<tool_call>{"name": "f"} junk</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1', '<tool_call>{"name": "f", "arguments": {"a": 1', []),  # cut off
    (
        'A\n<tool_call>oops</tool_call>\n<tool_call>{"name": "g"}</tool_call>',
        "A\n<tool_call>oops</tool_call>",
        [("g", "{}")],
    ),
]
LLAMA_WELL_FORMED = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    (
        ' <|python_tag|>{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "arguments": {}}',
        None,
        [("f", '{"a": "x;y"}'), ("g", "{}")],
    ),
    ('{"name": "f", "parameters": {"a": 1}}\nThat is all.', "That is all.", [("f", '{"a": 1}')]),
    ("Hello, {not a call}", "Hello, {not a call}", []),
    ("  plain text\n", "  plain text\n", []),
]
LLAMA_MALFORMED = [
    ('{"name": "f", "parameters": 3}', '{"name": "f", "parameters": 3}', []),
    ('{"name": "f", "parameters"', '{"name": "f", "parameters"', []),
    ('{"name": "f", "parameters": {}}; {"oops"}', '; {"oops"}', [("f", "{}")]),
]


def _accumulate(deltas):
    """(content, [(id, name, arguments)]) from OpenAI deltas, as the openai client accumulates them."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:  # the first delta of a call: id, type, name
                assert tc["type"] == "function" and tc["function"]["arguments"] == "", tc
                assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", tc["id"])
                calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
            calls[tc["index"]][2] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _streamed(parser, text, seed):
    """``text`` fed in random pieces (1-6 characters, or one at a time for seed 0)."""
    rng = random.Random(seed)
    stream, deltas, i = parser.stream(), [], 0
    while i < len(text):
        n = 1 if seed == 0 else rng.randint(1, 6)
        deltas += stream.feed(text[i : i + n])
        i += n
    deltas += stream.finish()
    return _accumulate(deltas), stream.result()


@pytest.mark.parametrize(
    "name, cases",
    [
        ("hermes", HERMES_WELL_FORMED + HERMES_MALFORMED),
        ("llama3_json", LLAMA_WELL_FORMED + LLAMA_MALFORMED),
    ],
)
def test_extract(name, cases):
    parser = tool_parser(name)
    for text, content, calls in cases:
        got_content, got_calls = parser.extract(text)
        assert got_content == content, text
        assert [(c.name, c.arguments) for c in got_calls] == calls, text
        for c in got_calls:
            json.loads(c.arguments)
            assert c.to_openai() == {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }


@pytest.mark.parametrize("name, cases", [("hermes", HERMES_WELL_FORMED), ("llama3_json", LLAMA_WELL_FORMED)])
def test_streamed_deltas_equal_the_whole_result(name, cases):
    """Any split of a well-formed output streams to extract's content and calls; the stream's own
    result is extract's too, ids included."""
    parser = tool_parser(name)
    for text, content, calls in cases:
        for seed in range(12):
            (streamed_content, streamed_calls), result = _streamed(parser, text, seed)
            assert streamed_content == (content or ""), (text, seed)
            assert [(n, a) for _, n, a in streamed_calls] == calls, (text, seed)
            assert result[0] == content
            assert [(c.id, c.name, c.arguments) for c in result[1]] == streamed_calls


@pytest.mark.parametrize("name, cases", [("hermes", HERMES_MALFORMED), ("llama3_json", LLAMA_MALFORMED)])
def test_streamed_malformed_output_loses_nothing(name, cases):
    """A call found malformed before anything of it streamed is content, as in extract; one found
    malformed later (cut off by the end, JSON broken late) stays the partial call that streamed, and
    the text after the break is content: every character is in one or the other."""
    parser = tool_parser(name)
    for text, _, _ in cases:
        whole, whole_calls = parser.extract(text)
        for seed in range(12):
            (streamed_content, streamed_calls), _ = _streamed(parser, text, seed)
            if len(streamed_calls) == len(whole_calls):
                assert streamed_content == (whole or ""), (text, seed)
            else:  # a partial call streamed: its name and arguments are in the text, and the rest is content
                for _, fn_name, args in streamed_calls:
                    assert fn_name in text and args in text
                assert streamed_content in text


def test_first_delta_carries_the_name_before_any_argument():
    stream = tool_parser("hermes").stream()
    assert stream.feed('<tool_call>\n{"arguments": {"city": "Pa') == []  # no name yet: nothing
    deltas = stream.feed('ris"}, "name": "get_weather"}')
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["index"] == 0
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert stream.feed("\n</tool_call>") == []
    assert stream.finish() == []
    content, calls = stream.result()
    assert content is None and calls[0].id == first["id"]


def test_ids_and_parser_names():
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", make_tool_call_id())
    assert make_tool_call_id() != make_tool_call_id()
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json"]
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, llama3_json, got 'mistral'"):
        tool_parser("mistral")


def test_check_tools():
    assert TOOLS[0]["function"]["name"] == "get_weather"
    fn = {"type": "function", "function": {"name": "f"}}
    for tools, choice, parallel, param, message in [
        ([], None, None, "tools", "non-empty list"),
        ([{"type": "code"}], None, None, "tools", r"tools\[0\] must be"),
        ([{"type": "function", "function": {"name": ""}}], None, None, "tools", "name must be a non-empty string"),
        ([fn, fn], None, None, "tools", "given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "tools", "JSON schema"),
        ([fn], "always", None, "tool_choice", "must be"),
        ([fn], {"type": "function", "function": {"name": "g"}}, None, "tool_choice", "not one of the tools"),
        ([fn], "auto", "yes", "parallel_tool_calls", "true or false"),
    ]:
        with pytest.raises(ToolCallError, match=message) as info:
            check_tools(tools, choice, parallel)
        assert info.value.param == param


@pytest.fixture(scope="module")
def compiler():
    c = GrammarCompiler(Tokenizer(BUILTIN))
    yield c
    c.close()


def _accepts(compiler, spec, text):
    compiler.compile(spec).result(timeout=10)
    matcher = compiler.matcher(spec)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_tokens(ids + compiler.tokenizer.eos_token_ids[:1])


def test_tool_choice_grammars(compiler):
    hermes, llama = tool_parser("hermes"), tool_parser("llama3_json")
    for parser in (hermes, llama):
        assert parser.tool_choice_structured_outputs(TOOLS, "auto") is None
        assert parser.tool_choice_structured_outputs(TOOLS, "none") is None
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>'
    required = hermes.tool_choice_structured_outputs(TOOLS, "required")
    assert _accepts(compiler, required, one) and _accepts(compiler, required, two)
    assert not _accepts(compiler, required, "Sure, " + one)  # a call, nothing else
    assert not _accepts(compiler, required, one.replace("get_weather", "get_wether"))
    assert not _accepts(compiler, required, one.replace('"city": "Paris"', '"town": "Paris"'))
    assert not _accepts(compiler, required, one.replace(", ", ",  "))  # the templates' separators only
    single = hermes.tool_choice_structured_outputs(TOOLS, "required", parallel_tool_calls=False)
    assert _accepts(compiler, single, one) and not _accepts(compiler, single, two)
    named = hermes.tool_choice_structured_outputs(TOOLS, {"type": "function", "function": {"name": "now"}})
    assert _accepts(compiler, named, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not _accepts(compiler, named, one)
    assert not _accepts(compiler, named, '<tool_call>\n{"name": "now", "arguments": {"x": 1}}\n</tool_call>')

    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    required = llama.tool_choice_structured_outputs(TOOLS, "required")
    assert _accepts(compiler, required, call) and _accepts(
        compiler, required, call + '; {"name": "now", "parameters": {}}'
    )
    assert not _accepts(compiler, required, call.replace("parameters", "arguments"))
    named = llama.tool_choice_structured_outputs(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert _accepts(compiler, named, call) and not _accepts(compiler, named, call + "; " + call)
    for text, parser in ((two, hermes), (call, llama)):
        assert parser.extract(text)[1]  # what the grammar writes, the parser reads


def test_a_marker_that_is_a_special_token_is_matched_as_that_token(compiler):
    """With ``<tool_call>`` a special token of the tokenizer, the grammar names it by id (the built-in
    tokenizer's EOS, id 0, stands in for it here)."""
    spec = tool_parser("hermes").tool_choice_structured_outputs(TOOLS, "required", False, {"<tool_call>": 0})
    assert "<[0]>" in spec.grammar
    compiler.compile(spec).result(timeout=10)
    matcher = compiler.matcher(spec)
    rest = compiler.tokenizer.encode('\n{"name": "now", "arguments": {}}\n</tool_call>', add_special_tokens=False)
    assert matcher.accept_tokens([0, *rest]), matcher.error
