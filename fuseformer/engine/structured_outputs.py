"""Structured outputs: outputs held to a JSON schema, a regex, a list of choices or a grammar (vLLM's
``structured_outputs``; OpenAI's ``response_format``), by masking the logits of every step to the tokens
the constraint allows.

Four parts, each usable alone:

- ``StructuredOutputsParams``: the constraint of one request (vLLM's fields; exactly one is set), and
  ``structured_outputs_from_request``, which reads it from a request body's fields (OpenAI's
  ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``).
- ``GrammarCompiler``: compiles constraints for one tokenizer on a background thread and keeps the
  compiled grammars by constraint, so the engine's step never waits for a compile: a request's
  ``GrammarMatcher`` is ``ready`` once its grammar is (the scheduler holds the request back until then).
- ``GrammarMatcher``: a request's place in its grammar; it accepts the sampled tokens and fills its row
  of the step's bitmask (bit ``t % 32`` of word ``t // 32`` set: token ``t`` is allowed). A grammar that
  is complete allows only EOS; a matcher in error (a rejected token) allows only EOS too, so that the
  request ends instead of running unconstrained.
- ``apply_token_bitmask_``: -inf, in place on the logits' device, for the tokens a row's bitmask
  disallows, on the constrained rows only: free rows of the same batch are untouched.

The grammar library is llguidance (chosen by measurement on this project's tokenizers:
docs/perf-notes.md, 2026-12-04; ``benchmarks/structured_outputs.py``), except for JSON schemas that
bound a string's length, which xgrammar masks ~5x faster (``grammar_xgrammar``; llguidance when
xgrammar is not installed or does not compile the schema). Both are optional dependencies (the
``serve`` extra): this module imports without them, and compiling a constraint without llguidance
raises an ImportError that says how to install it. ``grammar`` takes llguidance's Lark dialect or
llama.cpp's GBNF (told apart by ``::=``).
"""

from __future__ import annotations

import functools
import json
import os
import queue
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from fuseformer.engine.grammar_xgrammar import (
    XgrammarCompiler,
    XgrammarMatcher,
    bounded_strings,
    fill_rows,
    xgrammar_module,
)
from fuseformer.models.tokenizer import Tokenizer

# Whitespace the JSON constraints allow between tokens of the JSON text: any, as JSON does, but at most
# 16 characters at a time (a newline and a 15-space indent: pretty-printed JSON 7 levels deep at indent 2).
# Unbounded (vLLM's default), a model may loop in whitespace until max_tokens and return unparseable
# text: the built-in model (trained on Python) did so in 46 of 50 seeds at temperature 1 and 200 tokens
# on tests/engine/test_structured_outputs.py's schema, and in none with this bound (docs/perf-notes.md,
# 2026-12-04). ``disable_any_whitespace`` allows none.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# What ``GrammarCompiler.prepare`` compiles to warm xgrammar (a length-bounded string routes a schema there).
_WARM_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"]}
_INSTALL = "structured outputs need the llguidance package: pip install 'fuseformer[serve]' (or llguidance)"


class StructuredOutputsError(ValueError):
    """A constraint that is malformed or does not compile; ``param`` names the request field at fault
    (``response_format``, ``structured_outputs``, ``guided_json``, ...) where it is known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(kw_only=True, slots=True)
class StructuredOutputsParams:
    """The constraint of one request's output (vLLM's ``StructuredOutputsParams``). Exactly one of the
    first five is set.

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it.
        regex: the output matches this regular expression (Rust ``regex`` syntax, anchored at both ends).
        choice: the output is one of these strings.
        grammar: the output is a sentence of this grammar: llguidance's Lark dialect, or llama.cpp's GBNF
            (rules written ``name ::= ...``).
        json_object: the output is a JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        disable_any_whitespace: JSON without whitespace between its tokens (else up to
            ``JSON_WHITESPACE``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> StructuredOutputsError:
            return StructuredOutputsError(f"StructuredOutputsParams: {name} {why}, got {getattr(self, name)!r}")

        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"StructuredOutputsParams: exactly one of {', '.join(_KINDS)} must be set, got "
                + (" and ".join(given) if given else "none")
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise StructuredOutputsError(f"StructuredOutputsParams: json is not valid JSON: {exc}") from exc
        if self.json is not None and not isinstance(self.json, dict):
            raise bad("json", "must be a JSON schema: an object (a dict, or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice:
                raise bad("choice", "must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise bad("choice", "must be a list of strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """Equal for constraints that compile to the same grammar: the compiled-grammar cache's key."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, text, self.disable_any_whitespace


# ---- request fields -> StructuredOutputsParams ---------------------------------------------------

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = frozenset(("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"))


def structured_outputs_from_request(
    *,
    response_format: Mapping[str, Any] | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
    **guided: Any,
) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint a request body asks for, and the field that asked; None when it asks for none.

    Args:
        response_format: OpenAI's: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
            ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
            (``strict`` false is enforced too: the schema is all there is to follow).
        structured_outputs: vLLM's: a dict of ``StructuredOutputsParams``' fields.
        guided: vLLM's older fields, ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

    Raises StructuredOutputsError naming the field (``param``): a malformed value, an unknown
    ``response_format.type`` or ``structured_outputs`` field, or two fields that both constrain.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None:
        fields = _from_response_format(response_format)
        if fields is not None:
            found.append(("response_format", fields))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, Mapping):
            raise StructuredOutputsError("structured_outputs must be an object", "structured_outputs")
        for name in structured_outputs:
            if name not in _STRUCTURED_FIELDS:
                param = f"structured_outputs.{name}"
                raise StructuredOutputsError(f"{param} is not supported by this server", param)
        found.append(("structured_outputs", dict(structured_outputs)))
    for name, value in guided.items():
        if name not in _GUIDED:
            raise TypeError(f"structured_outputs_from_request: unknown field {name!r}")
        if value is not None:
            found.append((name, {_GUIDED[name]: value}))
    if not found:
        return None
    if len(found) > 1:
        raise StructuredOutputsError(f"{found[0][0]} and {found[1][0]} cannot both be set", found[1][0])
    param, fields = found[0]
    try:
        return StructuredOutputsParams(**fields), param
    except StructuredOutputsError as exc:
        message = str(exc).removeprefix("StructuredOutputsParams: ")
        raise StructuredOutputsError(f"{param}: {message}", param) from exc


def _from_response_format(value: Any) -> dict[str, Any] | None:
    """``StructuredOutputsParams`` fields of OpenAI's ``response_format`` (None for ``text``)."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise StructuredOutputsError(
            f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise StructuredOutputsError(
            "response_format.json_schema must be an object with name and schema", "response_format"
        )
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise StructuredOutputsError("response_format.json_schema.name must be a non-empty string", "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise StructuredOutputsError(
            "response_format.json_schema.schema must be a JSON schema object", "response_format"
        )
    return {"json": dict(schema)}


# ---- compiling -------------------------------------------------------------------------------------


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return llguidance


def grammar_source(spec: StructuredOutputsParams) -> str:
    """``spec`` as an llguidance grammar (its serialized form, what ``LLMatcher`` compiles)."""
    llg = _llguidance()
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        if spec.disable_any_whitespace:
            options = {"whitespace_flexible": False}
        else:
            options = {"whitespace_pattern": JSON_WHITESPACE}
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(spec.choice))
    try:
        return llg.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise StructuredOutputsError(f"grammar: {exc}") from exc


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one model's tokenizer, off the caller's thread.

    The llguidance view of the vocabulary is built on the first compile (28 ms at 8k tokens, 680 ms at
    128k), in the background too. Compiled grammars are kept by ``StructuredOutputsParams.key``, the
    ``max_cached`` most recently used; a request's matcher is a copy of its grammar's start state (~3 us).

    Args:
        tokenizer: the model's tokenizer (its EOS ids end a finished grammar).
        vocab_size: the logits' width (the model's vocab size, at least the tokenizer's): the bitmask's
            tokens; ids the tokenizer lacks are never allowed.
        max_cached: compiled grammars kept.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, *, max_cached: int = 256) -> None:
        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"GrammarCompiler: vocab_size {vocab_size} is below the tokenizer's {tokenizer.vocab_size}"
            )
        if not tokenizer.eos_token_ids:
            raise ValueError("GrammarCompiler: the tokenizer has no EOS token, which ends a finished grammar")
        if max_cached < 1:
            raise ValueError(f"GrammarCompiler: max_cached must be at least 1, got {max_cached}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._lltokenizer = None  # built on the worker thread at the first compile
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fuseformer-grammar")
        self._parallel = None  # llguidance's LLExecutor for batch masks, made at first use
        self._xgrammar = XgrammarCompiler(tokenizer, vocab_size)  # length-bounded JSON strings
        self._xgr_executor = None  # xgrammar's BatchGrammarMatcher, made at first use
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._fills: queue.SimpleQueue[MaskFill | None] | None = None  # fill_bitmask_async's thread's jobs
        self._stop_fills: weakref.finalize | None = None  # ends that thread (close, or this compiler freed)

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec``, as a Future (done at once when cached). Its exception, when
        the constraint does not compile, is a StructuredOutputsError saying why. Raises ImportError at
        once when llguidance is not installed."""
        _llguidance()
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return future

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A new request's matcher for ``spec`` (its grammar compiling in the background if not cached)."""
        return GrammarMatcher(self.compile(spec), self.tokenizer.eos_token_ids, self)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A (num_rows, ceil(vocab_size / 32)) int32 CPU bitmask, every token allowed; pinned when CUDA
        is there (the copy to the GPU then never waits for the device)."""
        shape = (num_rows, (self.vocab_size + 31) // 32)
        return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], out: torch.Tensor | None = None) -> torch.Tensor:
        """Row i of the returned (len(matchers), ceil(V / 32)) int32 CPU bitmask: the tokens
        ``matchers[i]`` allows next (each must be ``ready``). ``out``: a bitmask to fill instead (at least
        that many rows). Several rows are filled in parallel by llguidance's thread pool."""
        out, live = self._prepare_fill(matchers, out)
        if live:
            self._fill_live(live, out)
        return out

    def fill_bitmask_async(self, matchers: Sequence[GrammarMatcher], out: torch.Tensor | None = None) -> MaskFill:
        """``fill_bitmask``, returning once the grammar library has taken the rows: they fill on a
        thread of this compiler's (llguidance's pool, the GIL released) while the caller's Python goes
        on, and ``MaskFill.result()`` waits for the bitmask. The matchers must not be used
        (``accept_tokens``, another fill) until then. The hand-over costs the caller ~0.1 ms: it waits,
        the GIL released, until the fill thread is inside llguidance (else the fill thread would wait
        for the GIL up to the interpreter's 5 ms switch interval). While the fill is in flight the switch
        interval is 0.25 ms (``_ShortSwitches``): when the library returns, the fill thread needs the GIL
        back from the caller's Python to say it is done."""
        out, live = self._prepare_fill(matchers, out)
        fill = MaskFill(out)
        if not live:
            fill._done.set()
            return fill
        fill._work = functools.partial(self._fill_live, live, out)  # dropped once done: no ref to self kept
        if self._fills is None:
            self._fills = queue.SimpleQueue()
            threading.Thread(
                target=_fill_loop, args=(self._fills,), name="fuseformer-grammar-fill", daemon=True
            ).start()
            self._stop_fills = weakref.finalize(self, self._fills.put, None)
        _SHORT_SWITCHES.enter()  # left by the fill thread when the fill is done
        self._fills.put(fill)
        fill._started.wait()
        return fill

    def close(self) -> None:
        """Stop the compile thread (compiles in progress finish first) and the fill thread."""
        self._executor.shutdown(wait=True)
        if self._stop_fills is not None:
            self._stop_fills()
            self._fills = self._stop_fills = None

    def _prepare_fill(self, matchers: Sequence[GrammarMatcher], out: torch.Tensor | None) -> tuple[torch.Tensor, list]:
        """``out`` checked (allocated when None), the rows that allow only EOS written, and the others
        returned as (library matcher, row) pairs: llguidance's, or ``XgrammarMatcher``."""
        words = (self.vocab_size + 31) // 32
        if out is None:
            # Not allocate_bitmask: every row is written below or by llguidance (whole rows), and
            # torch.full's fill of a batch's bitmask is an OpenMP region whose threads then spin on
            # every core, slowing the fill's threads and the engine's own Python (perf-notes, session 31).
            out = torch.empty(len(matchers), words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        if out.dtype != torch.int32 or out.dim() != 2 or out.shape[1] != words or out.shape[0] < len(matchers):
            raise ValueError(
                f"fill_bitmask: out must be ({len(matchers)}+, {words}) int32, got {tuple(out.shape)} {out.dtype}"
            )
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("fill_bitmask: out must be a contiguous CPU tensor")
        live = []
        for i, m in enumerate(matchers):
            inner = m._live_matcher()
            if inner is None:
                m._fill_eos_only(out[i])
            else:
                live.append((inner, i))
        return out, live

    def _fill_live(self, live: list, out: torch.Tensor) -> None:
        words = out.shape[1]
        xgr_rows = [(m, i) for m, i in live if isinstance(m, XgrammarMatcher)]
        if xgr_rows:  # the schemas with length-bounded strings (grammar_xgrammar.py)
            if self._xgr_executor is None:
                self._xgr_executor = xgrammar_module().BatchGrammarMatcher()
            fill_rows(self._xgr_executor, *zip(*xgr_rows), out, _eos_only)
            live = [(m, i) for m, i in live if not isinstance(m, XgrammarMatcher)]
            if not live:
                return
        if len(live) == 1:
            inner, i = live[0]
            inner.unsafe_compute_mask_ptr(out[i].data_ptr(), words * 4)
            return
        # 64 rows, 2 cores: 0.28 ms against 0.34 ms one by one; more with more cores
        if self._parallel is None:
            self._parallel = _llguidance().LLExecutor()
        self._parallel.unsafe_compute_mask_ptr(live, out.data_ptr(), words * 4, out.shape[0])

    def prepare(self) -> Future:
        """Build the grammar libraries' views of the vocabulary now, on the compile thread, instead of at
        the first compile (at 128k tokens ~0.7 s for llguidance's, ~2 s for xgrammar's with its imports,
        which the first constrained request would wait for), and warm each library's first compile and
        batch fill (``_prepare``). Libraries not installed are skipped."""
        return self._executor.submit(self._prepare)

    def _prepare(self) -> None:
        """The vocabulary views, then a tiny schema compiled and a batch filled by each library: their first
        compile and first batch fill pay one-time costs (their thread pools, caches; ~20-50 ms on a 2-core
        CPU at 128k tokens) that the first constrained request would otherwise wait for."""
        rows = 2 * (os.cpu_count() or 1)  # rows for every thread of the libraries' pools (xgrammar's: half the cores)
        out = torch.empty(rows, (self.vocab_size + 31) // 32, dtype=torch.int32)
        if xgrammar_module() is not None:
            self._xgrammar.prepare()
            grammar = self._xgrammar.compile(_WARM_SCHEMA, any_whitespace=True)
            if grammar is not None:
                executor = self._xgr_executor or xgrammar_module().BatchGrammarMatcher()
                fill_rows(executor, [grammar.deep_copy() for _ in range(rows)], range(rows), out, _eos_only)
                self._xgr_executor = executor
        try:
            lltokenizer = self._llguidance_tokenizer()
        except ImportError:
            return
        source = grammar_source(StructuredOutputsParams(json={"type": "object"}))
        matcher = _llguidance().LLMatcher(lltokenizer, source, log_level=0)
        if not matcher.is_error():
            self._fill_live([(matcher.deep_copy(), i) for i in range(rows)], out)

    def _llguidance_tokenizer(self):
        if self._lltokenizer is None:
            self._lltokenizer = _llguidance().LLTokenizer(
                self.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(self.tokenizer.eos_token_ids)
            )
        return self._lltokenizer

    def _compile(self, spec: StructuredOutputsParams):
        if spec.kind == "json" and bounded_strings(spec.json):
            compiled = self._xgrammar.compile(spec.json, any_whitespace=not spec.disable_any_whitespace)
            if compiled is not None:
                return compiled
        llg = _llguidance()
        lltokenizer = self._llguidance_tokenizer()
        source = grammar_source(spec)
        compiled = llg.LLMatcher(lltokenizer, source, log_level=0)
        if compiled.is_error():
            raise StructuredOutputsError(f"{spec.kind}: {compiled.get_error().strip()}")
        return compiled


class _ShortSwitches:
    """The interpreter's switch interval lowered while any batch fill is in flight, then put back.

    A fill thread holds the GIL only to start and to finish; the library's work runs without it. But when
    the library returns, the thread must take the GIL back from the engine's thread, which is running
    Python (launching the next step) and gives it up only at the switch interval, 5 ms by default. A
    constrained step of the SO benchmark filled 128 rows in 11.0 ms p50 on an H100 host where the same
    fills took 4.5 ms without an engine beside (run 141); on a 2-core CPU, 128 rows beside a busy Python
    thread: 10.5-12.2 ms at 5 ms, 3.0-3.3 ms at 0.2 ms, 3.3-3.6 with the other thread asleep
    (benchmarks/so_gil_handoff.py). Outside fills nothing changes."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._in_flight = 0
        self._saved: float | None = None  # the interval to put back, when this lowered it

    def enter(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                current = sys.getswitchinterval()
                self._saved = current if current > self.seconds else None
                if self._saved is not None:
                    sys.setswitchinterval(self.seconds)
            self._in_flight += 1

    def exit(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0 and self._saved is not None:
                sys.setswitchinterval(self._saved)
                self._saved = None


_SHORT_SWITCHES = _ShortSwitches(2.5e-4)


def _fill_loop(jobs: queue.SimpleQueue) -> None:
    """The fill thread of a GrammarCompiler (a function: the thread holds no reference to the compiler,
    which stops it when freed or closed)."""
    while (fill := jobs.get()) is not None:
        fill._started.set()
        start = time.perf_counter()
        try:
            fill._work()
        except BaseException as exc:  # re-raised by result()
            fill._error = exc
        finally:
            fill.seconds = time.perf_counter() - start
            fill._work = None
            _SHORT_SWITCHES.exit()
            fill._done.set()


class MaskFill:
    """A batch's bitmask filling on ``GrammarCompiler``'s fill thread (``fill_bitmask_async``);
    ``seconds``: how long the grammar library took, once done (0.0 when no row needed it)."""

    __slots__ = ("bitmask", "seconds", "_work", "_started", "_done", "_error")

    def __init__(self, bitmask: torch.Tensor) -> None:
        self.bitmask = bitmask
        self.seconds = 0.0
        self._work: Callable[[], None] | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> torch.Tensor:
        """Wait for the fill (the GIL released) and return the bitmask; re-raises the fill's error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self.bitmask


class GrammarMatcher:
    """One request's place in its grammar (``GrammarCompiler.matcher``).

    ``ready`` once the grammar compiled or failed to; ``error`` says why it failed, or which token was
    rejected. Tokens go in with ``accept_tokens`` in the order sampled (EOS included; a request that was
    preempted and recomputes keeps its matcher as it is).
    """

    __slots__ = ("_future", "_matcher", "_eos", "_error", "compiler")

    def __init__(self, compiled: Future, eos_token_ids: Sequence[int], compiler: GrammarCompiler) -> None:
        self._future = compiled
        self.compiler = compiler  # the compiler it came from: it fills a batch's rows in parallel
        self._matcher = None  # the request's copy of the compiled grammar, made when first needed
        self._eos = tuple(eos_token_ids)
        self._error: str | None = None

    @property
    def ready(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until ``ready`` (at most ``timeout`` seconds: TimeoutError past it); returns ``error``."""
        if _wait_futures([self._future], timeout).not_done:
            raise TimeoutError(f"GrammarMatcher: the grammar did not compile in {timeout} s")
        return self.error

    @property
    def error(self) -> str | None:
        """Why this matcher allows only EOS: its grammar did not compile, or a token was rejected."""
        if self._error is None and self._future.done() and self._future.exception() is not None:
            self._error = str(self._future.exception())
        return self._error

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and only EOS can follow (or EOS was accepted)."""
        inner = self._live_matcher()
        return inner is not None and inner.is_stopped()

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by the tokens sampled; False when one is not allowed (the matcher is then in error,
        ``error`` says which, and it allows only EOS from then on)."""
        inner = self._live_matcher()
        if inner is None:
            return False
        for t in token_ids:  # (EOS after the end is accepted again: ignore_eos)
            if not inner.consume_token(t):
                self._error = f"token {t} is not allowed by the grammar: {inner.get_error().strip()}"
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` ((N, ceil(V / 32)) int32, CPU,
        contiguous). One row at a time; ``GrammarCompiler.fill_bitmask`` fills a batch in parallel."""
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
            raise ValueError(
                f"fill_bitmask: bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} on {bitmask.device}"
            )
        target = bitmask[row]
        if not target.is_contiguous():
            raise ValueError("fill_bitmask: bitmask rows must be contiguous")
        inner = self._live_matcher()
        if inner is None:
            self._fill_eos_only(target)
        else:
            self.compiler._fill_live([(inner, row)], bitmask)

    def _live_matcher(self):
        """The library's matcher (llguidance's, or an ``XgrammarMatcher``), or None when the grammar failed
        or a token was rejected. The grammar must be ready (the scheduler runs a constrained request
        only then)."""
        if self._matcher is None:
            if not self._future.done():
                raise RuntimeError("GrammarMatcher: the grammar is still compiling (wait until ready)")
            if self._future.exception() is not None:
                return None
            self._matcher = self._future.result().deep_copy()
        return None if self._error is not None else self._matcher

    def _fill_eos_only(self, row: torch.Tensor) -> None:
        _eos_only(row, self._eos)


def _eos_only(row: torch.Tensor, eos: Sequence[int]) -> None:
    """A bitmask row allowing only the tokens ``eos``."""
    row.zero_()
    for t in eos:
        if t < 32 * row.numel():
            row[t // 32] |= _bit(t % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value torch stores (bit 31 is the sign bit)."""
    return (1 << j) - (1 << 32) * (j == 31)


# ---- the mask on the logits --------------------------------------------------------------------------


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set to -inf, in place, the logits of the tokens each constrained row's bitmask disallows.

    Args:
        logits: (N, V) logits of the step's sampling rows, any float dtype, on any device.
        bitmask: (R, W) int32 on the logits' device: bit ``t % 32`` of word ``t // 32`` set when token
            ``t`` is allowed (``GrammarCompiler.fill_bitmask``, then copied over as the sampler copies
            its metadata, ``sampler.to_device``). Tokens at and past 32 * W are disallowed.
        rows: (R,) int64 on the logits' device, the logits row of each bitmask row; None when R == N
            (every row constrained). Rows not listed are left as they are.

    Returns ``logits``. The bits are unpacked one byte per token ((R, V) uint8, and a bool mask of the
    same size: 2 bytes a token, 64 MiB at R = 256, V = 128k), a handful of elementwise kernels.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"apply_token_bitmask_: logits must be (N, V) floating point, got {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(
            f"apply_token_bitmask_: bitmask must be (R, W) int32, got {tuple(bitmask.shape)} {bitmask.dtype}"
        )
    n, vocab = logits.shape
    r, words = bitmask.shape
    device = logits.device
    if bitmask.device != device or (rows is not None and rows.device != device):
        raise ValueError(f"apply_token_bitmask_: bitmask and rows must be on the logits' device {device}")
    if rows is None and r != n:
        raise ValueError(f"apply_token_bitmask_: {r} bitmask rows for {n} logits rows and no rows given")
    if rows is not None and (rows.dim() != 1 or rows.numel() != r or rows.dtype != torch.int64):
        raise ValueError(f"apply_token_bitmask_: rows must be ({r},) int64, got {tuple(rows.shape)} {rows.dtype}")
    if r == 0:
        return logits
    # Little-endian bytes of word w hold tokens 32w..32w+31 in order: byte k bit b is token 32w + 8k + b.
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    allowed = ((bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(r, words * 32)
    if words * 32 >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - words * 32))
    disallowed = allowed == 0
    if rows is None:
        return logits.masked_fill_(disallowed, float("-inf"))
    return logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(disallowed, float("-inf")))
