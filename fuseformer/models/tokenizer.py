"""Tokenizer of a local Hugging Face model directory, without transformers.

Reads ``tokenizer.json`` (the ``tokenizers`` library does the work), ``tokenizer_config.json``
(special tokens, ``add_bos_token``/``add_eos_token``, ``chat_template``), a ``chat_template.jinja``
(or ``chat_template.json``) beside it, and ``generation_config.json`` (EOS ids, sampling defaults).
Chat templates render in a sandboxed jinja2 environment with the helpers transformers gives them
(``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text); a template given
per call (``apply_chat_template(chat_template=...)``, the server's ``--chat-template``) is compiled
once and kept (``compile_chat_template``).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

# generation_config.json keys that are sampling defaults (engine/SamplingParams reads them).
GENERATION_DEFAULT_KEYS = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)


def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"Tokenizer: {path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"Tokenizer: {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"Tokenizer: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """The chat template failed to compile or render: a ValueError (bad input, as every input error
    of the library) that is also the jinja2.TemplateError that callers catch for templates."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # As transformers defines it: jinja2's own tojson escapes HTML characters and non-ASCII text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# Templates given per call are few (the model's, a server's --chat-template, a client's own): 32 kept
# compiled (a compile is ~1 ms for a 4 KB template; a render of a short conversation ~50 us).
@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """The chat template ``source`` compiled in the sandboxed environment (see the module docstring);
    ChatTemplateError when it does not compile."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def _final_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last message (a string, or its last text part), for continue_final_message."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, (list, tuple)):
        texts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message: the final message has no text to continue")
    return content


# The type each sampling default must have (JSON: bool, a number, an integer).
_GENERATION_TYPES = dict.fromkeys(GENERATION_DEFAULT_KEYS, "a number") | {
    "do_sample": "true or false",
    "top_k": "an integer",
    "max_new_tokens": "an integer",
}


def _generation_config(path: Path, generation: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """(EOS ids, sampling defaults) of generation_config.json's contents, each field's type checked
    at load: a wrong one (``"temperature": "hot"``) raises ValueError naming the file and the field,
    instead of failing every request later. A null value counts as absent. Value ranges are
    SamplingParams' to check (the engine builds its defaults from these)."""

    def bad(key: str, expected: str) -> ValueError:
        return ValueError(f"Tokenizer: {path}: {key} must be {expected}, got {generation[key]!r}")

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    eos = generation.get("eos_token_id")
    if eos is not None and not is_int(eos) and not (isinstance(eos, list) and all(is_int(t) for t in eos)):
        raise bad("eos_token_id", "a token id or a list of token ids")
    eos_ids = [] if eos is None else [eos] if is_int(eos) else list(eos)
    defaults = {}
    for key, expected in _GENERATION_TYPES.items():
        value = generation.get(key)
        if value is None:
            continue
        if expected == "true or false":
            ok = isinstance(value, bool)
        elif expected == "an integer":
            ok = is_int(value)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN
        if not ok:
            raise bad(key, expected)
        defaults[key] = value
    return eos_ids, defaults


class Tokenizer:
    """encode/decode and chat templates for the model directory ``path`` (or a tokenizer.json path)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        directory = path.parent if path.name == "tokenizer.json" else path
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"Tokenizer: {tok_file} does not exist")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
            raise ValueError(f"Tokenizer: cannot read {tok_file}: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")

        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.unk_token = _token_text(config.get("unk_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self.chat_template = self._find_chat_template(directory, config)

        eos_ids, self.generation_defaults = _generation_config(directory / "generation_config.json", generation)
        if self.eos_token_id is not None and self.eos_token_id not in eos_ids:
            eos_ids.append(self.eos_token_id)
        self.eos_token_ids: list[int] = eos_ids

    @staticmethod
    def _find_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"Tokenizer: {jinja_file} is not UTF-8 text: {exc}") from exc
        if template is None:
            template = _read_json(directory / "chat_template.json").get("chat_template")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"Tokenizer: the chat template must be a string, got {type(template).__name__}")
        return template

    # ----------------------------------------------------------------------------------------
    def token_to_id(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token is not None else None

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (byte-level BPE: ``"Ġhello"``), None outside it."""
        return self._tok.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        """The added tokens marked special (text -> id): the ones ``decode`` skips, and that a grammar
        must name as tokens rather than spell as text (structured outputs, tool-call formats)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids of ``special_tokens`` (computed once: detokenizers ask for them per request)."""
        return frozenset(self.special_tokens.values())

    def to_str(self) -> str:
        """tokenizer.json's text, as the tokenizers library writes it: for libraries that build their own
        view of the vocabulary (the grammar library of structured outputs)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With special tokens: the tokenizer's post-processor runs, and a BOS
        (EOS) is added when tokenizer_config.json asks for it and the post-processor did not."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            if self.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
                ids = [*ids, eos]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Args:
            messages: the conversation.
            add_generation_prompt: end with the template's opening of an assistant turn.
            tokenize: return the ids (encoded without adding special tokens: the template writes them).
            chat_template: a template to use instead of the model's (compiled once, then kept).
            continue_final_message: end the prompt with the last message's text, its turn left open, so
                that the model continues it (as transformers: the rendering is cut after that text's
                last occurrence). Not with ``add_generation_prompt``.
            kwargs: more template variables (``tools``, ``documents``, ``enable_thinking``, ...).

        Raises ValueError when there is no template or both ``add_generation_prompt`` and
        ``continue_final_message`` are set, and ChatTemplateError (a ValueError and a
        jinja2.TemplateError) when the template fails to compile or render these messages.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("Tokenizer: continue_final_message and add_generation_prompt cannot both be set")
        source = self.chat_template if chat_template is None else chat_template
        if source is None:
            raise ValueError("Tokenizer: no chat template (tokenizer_config.json, chat_template.jinja or .json)")
        template = compile_chat_template(source)
        # As transformers does: the special tokens that are set, then the caller's variables.
        special = {name: getattr(self, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        variables = {k: v for k, v in special.items() if v is not None} | kwargs
        try:
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:  # raise_exception(), undefined names, the sandbox's refusals
            raise ChatTemplateError(str(exc)) from exc
        except Exception as exc:  # the template's own faults met by these messages (1 + "a", range limits)
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
        if continue_final_message:
            final = _final_text(messages)
            end = text.rfind(final)
            if end < 0:  # templates that strip the content (transformers falls back the same way)
                final = final.strip()
                end = text.rfind(final)
            if end < 0:
                raise ChatTemplateError("continue_final_message: the template does not write the final message's text")
            text = text[: end + len(final)]
        return self.encode(text, add_special_tokens=False) if tokenize else text
