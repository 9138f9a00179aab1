"""Tokenizer of a local Hugging Face model directory, without transformers.

Reads ``tokenizer.json`` (the ``tokenizers`` library does the work), ``tokenizer_config.json``
(special tokens, ``add_bos_token``/``add_eos_token``, ``chat_template``), a ``chat_template.jinja``
(or ``chat_template.json``) beside it, and ``generation_config.json`` (EOS ids, sampling defaults).
Chat templates render in a sandboxed jinja2 environment with the helpers transformers gives them
(``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
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


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # As transformers defines it: jinja2's own tojson escapes HTML characters and non-ASCII text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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

        eos = generation.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.eos_token_id is not None and self.eos_token_id not in eos_ids:
            eos_ids.append(self.eos_token_id)
        self.eos_token_ids: list[int] = eos_ids
        self.generation_defaults = {k: generation[k] for k in GENERATION_DEFAULT_KEYS if k in generation}

    @staticmethod
    def _find_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _read_json(directory / "chat_template.json").get("chat_template")
        return template

    # ----------------------------------------------------------------------------------------
    def token_to_id(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token is not None else None

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

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("Tokenizer: no chat template (tokenizer_config.json, chat_template.jinja or .json)")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Returns the prompt text, or its ids when ``tokenize`` (encoded without adding special tokens:
        the template writes them). Extra keyword arguments (``tools``, ``documents``,
        ``enable_thinking``, ...) reach the template as variables.
        """
        # As transformers does: the special tokens that are set, then the caller's variables.
        special = {name: getattr(self, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        variables = {k: v for k, v in special.items() if v is not None} | kwargs
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text
