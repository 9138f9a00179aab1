"""Tokenizer: a byte-level BPE trained in the test (nothing downloaded), its config files, chat templates
rendered as transformers renders them, and errors naming the file."""

import json

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from fuseformer.models.tokenizer import Tokenizer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Fused kernels keep intermediates in registers instead of HBM.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "héllo wörld, ça va? 你好，世界",
    "def f(x):\n    return x * 2  # code too",
]
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
# ChatML with a BOS, a system default and a check that raises through raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _make(tmp_path, *, post_processor_bos=False, config=None, template_file=None, generation=None):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES, trainer)
    if post_processor_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


BASE_CONFIG = {
    "bos_token": "<s>",
    "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "special": True},
    "pad_token": "<pad>",
    "add_bos_token": True,
    "chat_template": CHAT_TEMPLATE,
}


@pytest.fixture
def tok_dir(tmp_path):
    return _make(tmp_path, config=BASE_CONFIG, generation={"eos_token_id": [4, 1], "temperature": 0.6, "top_p": 0.9})


@pytest.mark.parametrize("text", SENTENCES + ["", "unseen wörds ünïcode 🙂 and    spaces\t\n"])
def test_round_trip(text, tok_dir):
    tok = Tokenizer(tok_dir)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0  # add_bos_token
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_special_tokens_and_generation_config(tok_dir):
    tok = Tokenizer(tok_dir)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == [4, 1]  # generation_config's list; the tokenizer's EOS is in it already
    assert tok.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    ids = tok.encode("the fox")
    assert tok.decode(ids + [1], skip_special_tokens=False) == "<s>the fox</s>"
    assert tok.decode(ids + [1]) == "the fox"
    assert tok.vocab_size == 400


def test_eos_int_in_generation_config_and_tokenizer_eos_added(tmp_path):
    tok = Tokenizer(_make(tmp_path, config=BASE_CONFIG, generation={"eos_token_id": 4}))
    assert tok.eos_token_ids == [4, 1]


def test_post_processor_bos_is_not_doubled(tmp_path):
    tok = Tokenizer(_make(tmp_path, post_processor_bos=True, config=BASE_CONFIG))
    ids = tok.encode("the fox")
    assert ids[0] == 0 and ids[1] != 0
    assert tok.encode("the fox", add_special_tokens=False)[0] != 0


def test_no_bos_without_config(tmp_path):
    tok = Tokenizer(_make(tmp_path))
    assert tok.bos_token is None and tok.chat_template is None and tok.eos_token_ids == []
    assert tok.encode("the fox") == tok.encode("the fox", add_special_tokens=False)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


MESSAGES = [
    {"role": "user", "content": "What is a paged KV cache?"},
    {"role": "assistant", "content": "Blocks of keys and values."},
    {"role": "user", "content": "Ça marche? 你好"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(add_generation_prompt, tok_dir):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tok_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    expected = (
        "<s><|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nWhat is a paged KV cache?<|im_end|>\n"
        "<|im_start|>assistant\nBlocks of keys and values.<|im_end|>\n"
        "<|im_start|>user\nÇa marche? 你好<|im_end|>\n"
    ) + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    assert text == expected
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    hf.chat_template = CHAT_TEMPLATE
    assert text == hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids[:2] == [0, 3] and tok.decode(ids, skip_special_tokens=False) == text
    assert ids == hf.encode(text, add_special_tokens=False)


def test_chat_template_helpers(tmp_path):
    template = (
        "{{ strftime_now('%Y') }}|{{ messages | tojson }}|{{ tools | tojson }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    tok = Tokenizer(_make(tmp_path, template_file=template))  # from chat_template.jinja
    text = tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "user", "content": "x"}], tools=[1])
    year, messages, tools = text.split("|")
    assert year.isdigit() and len(year) == 4
    assert messages == '[{"role": "user", "content": "é"}, {"role": "user", "content": "x"}]'  # non-ASCII kept
    assert tools == "[1]é"


def test_chat_template_raise_exception(tok_dir):
    tok = Tokenizer(tok_dir)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path):
    tok = Tokenizer(_make(tmp_path, template_file="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(jinja2.exceptions.TemplateError) as info:
        tok.apply_chat_template([])
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)


def test_named_chat_templates_pick_default(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config = {**BASE_CONFIG, "chat_template": named}
    assert Tokenizer(_make(tmp_path, config=config)).apply_chat_template([]) == "D"


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json does not exist"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_file_names_the_file(name, tmp_path):
    path = _make(tmp_path, config=BASE_CONFIG, generation={"eos_token_id": 1})
    (path / name).write_text("{not json")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        Tokenizer(path)


def test_non_utf8_chat_template_file_names_the_file(tmp_path):
    path = _make(tmp_path)
    (path / "chat_template.jinja").write_bytes(b"{{ '\xe9t\xe9' }}")  # Latin-1
    with pytest.raises(ValueError, match=r"chat_template\.jinja is not UTF-8"):
        Tokenizer(path)


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        ("{{ 1 + 'a' }}", "TypeError"),
        ("{% for m in messages %}", "does not compile"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ],
)
def test_chat_template_failures_are_value_errors(template, match, tmp_path):
    """Every failure of a template (its raise_exception, a type error inside it, a syntax error,
    the sandbox's refusal) is a ValueError, the error type of bad input, which the CLI reports;
    it stays a jinja2.TemplateError for callers that catch that."""
    from fuseformer.models.tokenizer import ChatTemplateError

    tok = Tokenizer(_make(tmp_path, template_file=template))
    with pytest.raises(ChatTemplateError, match=match) as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert isinstance(info.value, ValueError) and isinstance(info.value, jinja2.TemplateError)
