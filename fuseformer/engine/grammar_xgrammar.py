"""xgrammar for the JSON schemas whose strings are length-bounded (``GrammarCompiler`` routes them here).

llguidance (``structured_outputs``) masks a position inside a free-length JSON string in ~0.03-0.15 ms a
row at a 128k vocabulary (its token slices and its mask cache), but a position inside a ``maxLength``
string walks the whole token trie: 1.1-1.8 ms a row, and on an H100 the steps of a half-constrained batch
of 256 waited for those fills (cost 17-27% against <= 5% with free strings). xgrammar's masks there are
5x faster (0.2-0.35 ms a row; 128 rows on 2 threads: 7.2 ms p50 against 35) and 6x slower in free
strings (12.9 against 2.0 ms), so only schemas with a string length bound come here (docs/perf-notes.md,
session 31). Everything else, and any schema xgrammar does not compile, stays with llguidance.

The classes below give xgrammar's matcher the calls ``GrammarMatcher`` makes of llguidance's
(``deep_copy``, ``consume_token``, ``get_error``, ``is_stopped``); batch fills go through ``fill_rows``.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Between two tokens of the JSON text at most this many whitespace characters, as llguidance's
# ``JSON_WHITESPACE`` allows ([\x20\x0A\x0D\x09]{0,16}).
_MAX_WHITESPACE = 16


def xgrammar_module():
    """xgrammar, or None when it is not installed (llguidance then compiles every constraint). Installed
    but failing to import (a missing dependency: run 137's device host had no pydantic) also gives None,
    with a warning naming the error, once: the length-bounded schemas then take llguidance's slower masks."""
    try:
        import xgrammar
    except ImportError as exc:
        if getattr(exc, "name", None) != "xgrammar":
            _warn_broken(f"{type(exc).__name__}: {exc}")
        return None
    return xgrammar


@functools.cache
def _warn_broken(error: str) -> None:
    warnings.warn(
        f"xgrammar is installed but does not import ({error}); length-bounded JSON schemas use llguidance",
        RuntimeWarning,
        stacklevel=3,
    )


def bounded_strings(schema: Any) -> bool:
    """Whether a JSON schema bounds the length of a string anywhere (``maxLength`` or ``minLength``)."""
    if isinstance(schema, dict):
        if any(isinstance(schema.get(k), int) for k in ("maxLength", "minLength")):
            return True
        return any(bounded_strings(v) for v in schema.values())
    if isinstance(schema, list):
        return any(bounded_strings(v) for v in schema)
    return False


class XgrammarCompiler:
    """xgrammar's compiler for one tokenizer, its vocabulary view built at the first compile (call it
    from the compile thread: ~0.1 s at 128k tokens)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None

    def prepare(self):
        """xgrammar's compiler, its view of the vocabulary built at the first call (xgrammar installed)."""
        if self._compiler is None:
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast  # xgrammar's own dependency

            xgr = xgrammar_module()
            hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self.tokenizer.to_str()))
            eos = list(self.tokenizer.eos_token_ids)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=eos)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, schema: dict, any_whitespace: bool) -> XgrammarGrammar | None:
        """The compiled schema, or None when xgrammar is missing or cannot compile it."""
        if xgrammar_module() is None:
            return None
        compiler = self.prepare()
        kwargs = dict(any_whitespace=any_whitespace, strict_mode=True)
        if any_whitespace:
            kwargs["max_whitespace_cnt"] = _MAX_WHITESPACE
        try:
            compiled = compiler.compile_json_schema(json.dumps(schema), **kwargs)
        except Exception:  # a feature xgrammar lacks: llguidance compiles it (or says why not)
            return None
        grammar = XgrammarGrammar(compiled, tuple(self.tokenizer.eos_token_ids), self.vocab_size)
        # One mask of the start state here, on the compile thread: a grammar's first fill pays a one-time
        # cost (112 ms for the SO benchmark's schema on an H100 host, run 140) that would otherwise stall
        # the first engine step filling its rows, every request of the batch waiting with it.
        grammar.deep_copy().inner.fill_next_token_bitmask(
            torch.empty(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        )
        return grammar


class XgrammarGrammar:
    """A compiled schema; ``deep_copy`` is a new request's matcher at its start (llguidance's name)."""

    def __init__(self, compiled, eos: tuple[int, ...], vocab_size: int) -> None:
        self.compiled = compiled
        self.eos = eos
        self.vocab_size = vocab_size

    def deep_copy(self) -> XgrammarMatcher:
        inner = xgrammar_module().GrammarMatcher(self.compiled, override_stop_tokens=list(self.eos))
        return XgrammarMatcher(inner, self.eos, self.vocab_size)


class XgrammarMatcher:
    """One request's xgrammar matcher with llguidance's calls. After the grammar's end (an EOS accepted)
    only EOS is allowed, and accepted again (``ignore_eos`` requests go on sampling it)."""

    __slots__ = ("inner", "eos", "vocab_size", "_error")

    def __init__(self, inner, eos: tuple[int, ...], vocab_size: int) -> None:
        self.inner = inner
        self.eos = eos
        self.vocab_size = vocab_size
        self._error = ""

    def consume_token(self, token: int) -> bool:
        if self.inner.is_terminated():
            return token in self.eos
        if self.inner.accept_token(token):
            return True
        self._error = "xgrammar rejected the token"
        return False

    def get_error(self) -> str:
        return self._error

    def is_stopped(self) -> bool:
        """Ended (EOS accepted), or complete with nothing but EOS allowed next (llguidance's meaning;
        the second case fills a mask to tell: not for the step's path)."""
        if self.inner.is_terminated():
            return True
        if not self.inner.is_completed():
            return False
        row = torch.empty(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.inner.fill_next_token_bitmask(row, 0)
        bits = ((row[0].view(torch.uint8)[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()
        return set(bits.nonzero().flatten().tolist()) <= set(self.eos)

    def deep_copy(self) -> XgrammarMatcher:
        """A copy at the same place, advanced independently (as llguidance's ``deep_copy``)."""
        copy = XgrammarMatcher(self.inner.fork(), self.eos, self.vocab_size)
        copy._error = self._error
        return copy


def fill_rows(
    executor,
    matchers: Sequence[XgrammarMatcher],
    rows: Sequence[int],
    out: torch.Tensor,
    eos_only: Callable[[torch.Tensor, Sequence[int]], None],
) -> None:
    """Rows ``rows`` of ``out`` ((N, ceil(V / 32)) int32, CPU): the tokens each matcher allows next,
    the live ones in parallel on ``executor`` (an ``xgrammar.BatchGrammarMatcher``), the ended ones
    EOS only (``eos_only(row, eos)``)."""
    live, live_rows = [], []
    for m, i in zip(matchers, rows):
        if m.inner.is_terminated():
            eos_only(out[i], m.eos)
        else:
            live.append(m.inner)
            live_rows.append(i)
    if live:
        executor.batch_fill_next_token_bitmask(live, out, indices=live_rows)
