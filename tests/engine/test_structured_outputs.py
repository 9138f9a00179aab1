"""Structured outputs (engine/structured_outputs.py): the constraint spec and its mapping from request
fields, the background compile and its cache, each step's bitmask against a brute-force check of the
grammar, the mask on the logits (constrained rows only), and outputs of the built-in model sampled at
temperature 1 in a step loop driven here (scheduler, runner forward, mask, sampler): over 50 seeds
every JSON-schema output parses and validates, every choice is one of the choices, every regex output
matches, and the tool-choice grammars give outputs the tool parsers read as calls."""

import ast
import gc
import json
import re
import sys
import threading
import time
import weakref
from pathlib import Path

import jsonschema
import pytest
import torch

import fuseformer
from fuseformer.engine import grammar_xgrammar
from fuseformer.engine import structured_outputs as so
from fuseformer.engine.grammar_xgrammar import XgrammarGrammar, XgrammarMatcher, bounded_strings
from fuseformer.engine.model_runner import CacheConfig, ModelRunner
from fuseformer.engine.request import Request
from fuseformer.engine.sampler import SamplingMetadata, sample
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig
from fuseformer.engine.structured_outputs import (
    GrammarCompiler,
    StructuredOutputsError,
    StructuredOutputsParams,
    apply_token_bitmask_,
    structured_outputs_from_request,
)
from fuseformer.models.loader import load_model
from fuseformer.models.tokenizer import Tokenizer
from fuseformer.serve.tool_parsers import check_tools, tool_parser
from fuseformer.testing import CONSTRAINT_CHOICES as CHOICES
from fuseformer.testing import CONSTRAINT_REGEX as REGEX
from fuseformer.testing import CONSTRAINT_SCHEMA as SCHEMA

BUILTIN = Path(fuseformer.__file__).parent / "assets" / "builtin"
TOOLS = check_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
                    "required": ["city", "days"],
                    "additionalProperties": False,
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(BUILTIN)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer)
    yield c
    c.close()


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask_row.long().unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """(R, V) bool -> (R, ceil(V / 32)) int32 bitmask."""
    r, v = allowed.shape
    words = (v + 31) // 32
    dense = torch.zeros(r, words * 32, dtype=torch.bool)
    dense[:, :v] = allowed
    packed = (dense.view(r, words, 32).long() << torch.arange(32)).sum(-1)
    return (packed - (packed >= 2**31) * 2**32).to(torch.int32)


# ---- the spec ------------------------------------------------------------------------------------


def test_exactly_one_constraint_and_field_errors():
    with pytest.raises(StructuredOutputsError, match="exactly one of .* got none"):
        StructuredOutputsParams()
    with pytest.raises(StructuredOutputsError, match="got json and regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(StructuredOutputsError, match="got regex and json_object"):
        StructuredOutputsParams(regex="a", json_object=True)
    for bad, name in [
        (dict(json="{not json"), "json is not valid JSON"),
        (dict(json=[1]), "json must be a JSON schema"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(choice="yes"), "choice must be a non-empty list"),
        (dict(choice=["a", 1]), "choice must be a list of strings"),
        (dict(grammar=3), "grammar must be a non-empty string"),
        (dict(json_object=1), "json_object must be true or false"),
    ]:
        with pytest.raises(ValueError, match=name):
            StructuredOutputsParams(**bad)
    spec = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    assert spec.json == {"type": "object", "required": ["a"]} and spec.kind == "json"
    # The cache key: the same schema whatever its key order or text form.
    assert spec.key == StructuredOutputsParams(json={"required": ["a"], "type": "object"}).key
    assert spec.key != StructuredOutputsParams(json=spec.json, disable_any_whitespace=True).key


def test_mapping_from_request_fields():
    assert structured_outputs_from_request() is None
    assert structured_outputs_from_request(response_format={"type": "text"}) is None
    spec, param = structured_outputs_from_request(response_format={"type": "json_object"})
    assert spec.json_object and param == "response_format"
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    spec, param = structured_outputs_from_request(response_format=rf)
    assert spec.json == SCHEMA and param == "response_format"
    spec, param = structured_outputs_from_request(structured_outputs={"choice": CHOICES})
    assert spec.choice == CHOICES and param == "structured_outputs"
    for field, kind, value in [
        ("guided_json", "json", SCHEMA),
        ("guided_regex", "regex", REGEX),
        ("guided_choice", "choice", CHOICES),
        ("guided_grammar", "grammar", 'start: "a"'),
    ]:
        spec, param = structured_outputs_from_request(**{field: value})
        assert spec.kind == kind and param == field
    bad = [
        (dict(response_format={"type": "xml"}), "response_format", 'must be "text", "json_object" or "json_schema"'),
        (dict(response_format={"type": "json_schema"}), "response_format", "json_schema must be an object"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
            "response_format",
            "name must be a non-empty string",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "s"}}),
            "response_format",
            "schema must be a JSON schema object",
        ),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one of"),
        (
            dict(structured_outputs={"whitespace_pattern": " "}),
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        (dict(guided_choice="yes"), "guided_choice", "guided_choice: choice must be a non-empty list"),
        (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "cannot both be set"),
    ]
    for kwargs, param, message in bad:
        with pytest.raises(StructuredOutputsError, match=re.escape(message)) as info:
            structured_outputs_from_request(**kwargs)
        assert info.value.param == param, kwargs


# ---- compiling -------------------------------------------------------------------------------------


def test_the_module_imports_without_llguidance_and_says_how_to_install_it(tokenizer, monkeypatch):
    """llguidance is optional: no module-level import of it, and a compile without it raises an
    ImportError that names the package and the extra."""
    for module in (so, fuseformer.serve.tool_parsers):
        tree = ast.parse(Path(module.__file__).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not any(name.startswith("llguidance") for name in names), module.__name__
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)
    with pytest.raises(ImportError, match=r"llguidance package: pip install 'fuseformer\[serve\]'"):
        GrammarCompiler(tokenizer).compile(StructuredOutputsParams(regex="a"))


def test_compiles_in_the_background_and_the_request_waits(tokenizer, monkeypatch):
    """compile() returns before the grammar is built; the matcher is not ready (and refuses to mask)
    until it is. Compiled grammars are kept by key, the most recent max_cached."""
    compiler = GrammarCompiler(tokenizer, max_cached=2)
    gate = threading.Event()
    real = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda spec: gate.wait(10) and real(spec))
    spec = StructuredOutputsParams(regex="ab")
    matcher = compiler.matcher(spec)
    assert not matcher.ready
    with pytest.raises(RuntimeError, match="still compiling"):
        matcher.fill_bitmask(compiler.allocate_bitmask(1))
    gate.set()
    compiler.compile(spec).result(timeout=10)
    assert matcher.ready and matcher.error is None
    assert compiler.compile(spec) is compiler.compile(StructuredOutputsParams(regex="ab"))  # cached
    first = compiler.compile(spec)
    compiler.compile(StructuredOutputsParams(regex="c")).result(timeout=10)
    compiler.compile(StructuredOutputsParams(regex="d")).result(timeout=10)
    assert compiler.compile(spec) is not first  # evicted (max_cached=2), compiled again
    compiler.close()


def test_compile_errors_and_an_errored_matcher_allows_only_eos(compiler, tokenizer):
    for spec, message in [
        (StructuredOutputsParams(regex="(unclosed"), "regex: .*unclosed group"),
        (StructuredOutputsParams(json={"type": "bogus"}), "json: .*bogus"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar: .*undefined_rule"),
    ]:
        future = compiler.compile(spec)
        assert isinstance(future.exception(timeout=10), StructuredOutputsError)
        assert re.search(message, str(future.exception()), re.S), str(future.exception())
        matcher = compiler.matcher(spec)
        assert matcher.ready and re.search(message, matcher.error, re.S)
        bitmask = compiler.fill_bitmask([matcher])
        assert _allowed(bitmask[0], tokenizer.vocab_size) == tokenizer.eos_token_ids
        assert not matcher.accept_tokens([5])
    matcher = compiler.matcher(StructuredOutputsParams(choice=["yes"]))
    compiler.compile(StructuredOutputsParams(choice=["yes"])).result(timeout=10)
    no = tokenizer.encode("no", add_special_tokens=False)
    assert not matcher.accept_tokens(no) and "not allowed" in matcher.error
    assert _allowed(compiler.fill_bitmask([matcher])[0], tokenizer.vocab_size) == tokenizer.eos_token_ids


@pytest.mark.parametrize(
    "spec, text",
    [
        (StructuredOutputsParams(json=SCHEMA), '{"name": "Al", "age": 7, "tags": ["b"]}'),
        (StructuredOutputsParams(json_object=True), '{"x": [1, {"y": null}], "z": "w"}'),
        (StructuredOutputsParams(regex=REGEX), "Paris-2024"),
        (StructuredOutputsParams(choice=CHOICES), "maybe so"),
        (StructuredOutputsParams(grammar='start: "x" NUM+\nNUM: /[0-9]/'), "x123"),
        (StructuredOutputsParams(grammar='root ::= "yes" | "no"'), "no"),  # GBNF
    ],
    ids=["json", "json_object", "regex", "choice", "lark", "gbnf"],
)
def test_bitmask_matches_a_brute_force_check(compiler, tokenizer, spec, text):
    """At each step along ``text``'s tokens (and once the grammar is complete): every token the bitmask
    allows keeps a matcher alive, and every other one is rejected, except the tokens that split text
    the grammar forces otherwise than the tokenizer would (llguidance keeps forced text canonical);
    EOS ends a complete text, and after it only EOS is allowed."""
    vocab = tokenizer.vocab_size
    ids = tokenizer.encode(text, add_special_tokens=False)
    compiler.compile(spec).result(timeout=10)
    matcher = compiler.matcher(spec)
    bitmask = compiler.allocate_bitmask(1)
    checked = {0, len(ids) // 2, len(ids)}
    for step in range(len(ids) + 1):
        matcher.fill_bitmask(bitmask, 0)
        allowed = set(_allowed(bitmask[0], vocab))
        if step in checked:
            # The library's matcher (llguidance's, or xgrammar's for length-bounded strings): each
            # token tried on a copy.
            state = matcher._live_matcher()
            texts = [tokenizer.decode([t]) for t in allowed]
            for t in range(vocab):
                accepted = state.deep_copy().consume_token(t)
                if t in allowed:
                    assert accepted, (step, t, tokenizer.decode([t]))
                elif accepted:
                    # Text the grammar forces is kept to the tokenizer's own tokens: " " is not allowed
                    # where only " so" can follow, though " " + "so" spells it.
                    text = tokenizer.decode([t])
                    assert any(a.startswith(text) and a != text for a in texts), (step, t, text)
        if step < len(ids):
            assert ids[step] in allowed
            assert matcher.accept_tokens([ids[step]])
    assert set(tokenizer.eos_token_ids) <= allowed  # the text is complete: EOS may end it
    assert matcher.accept_tokens(tokenizer.eos_token_ids[:1]) and matcher.is_terminated
    matcher.fill_bitmask(bitmask, 0)
    assert _allowed(bitmask[0], vocab) == tokenizer.eos_token_ids  # finished: only EOS


def test_a_complete_grammar_allows_only_eos(compiler, tokenizer):
    spec = StructuredOutputsParams(json=SCHEMA)
    compiler.compile(spec).result(timeout=10)
    matcher = compiler.matcher(spec)
    assert matcher.accept_tokens(tokenizer.encode('{"name": "x", "age": 1, "tags": []}', add_special_tokens=False))
    assert _allowed(compiler.fill_bitmask([matcher])[0], tokenizer.vocab_size) == tokenizer.eos_token_ids
    assert matcher.is_terminated  # nothing but EOS can follow
    assert matcher.accept_tokens(tokenizer.eos_token_ids[:1]) and matcher.is_terminated


def test_batch_fill_equals_row_fills_and_vocab_padding(tokenizer):
    """The parallel batch fill writes what each matcher's own fill writes; a vocab wider than the
    tokenizer's (padded logits) never allows the ids past the tokenizer's."""
    compiler = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 40)
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)]
    specs += [StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(json_object=True)]
    prefixes = ['{"name": "A', "Pa", "ma", ""]
    matchers = []
    for spec, prefix in zip(specs, prefixes):
        compiler.compile(spec).result(timeout=10)
        m = compiler.matcher(spec)
        assert m.accept_tokens(tokenizer.encode(prefix, add_special_tokens=False))
        matchers.append(m)
    batch = compiler.fill_bitmask(matchers)
    assert batch.shape == (4, (tokenizer.vocab_size + 40 + 31) // 32)
    for i, m in enumerate(matchers):
        row = compiler.allocate_bitmask(1)
        m.fill_bitmask(row, 0)
        assert torch.equal(row[0], batch[i])
        assert max(_allowed(batch[i], compiler.vocab_size)) < tokenizer.vocab_size
    with pytest.raises(ValueError, match="out must be"):
        compiler.fill_bitmask(matchers, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="below the tokenizer's"):
        GrammarCompiler(tokenizer, vocab_size=100)
    # On the fill thread (the engine's path): the same rows, a row of its own per matcher, repeatedly.
    for rows in (matchers, matchers[1:2], matchers[::-1]):
        fill = compiler.fill_bitmask_async(rows)
        assert torch.equal(fill.result(), compiler.fill_bitmask(rows)) and fill.done()
    errored = compiler.matcher(specs[1])
    assert not errored.accept_tokens(tokenizer.encode("{", add_special_tokens=False))  # only EOS from here
    fill = compiler.fill_bitmask_async([errored])  # no row for llguidance: done at once
    assert fill.done() and _allowed(fill.result()[0], compiler.vocab_size) == tokenizer.eos_token_ids
    with pytest.raises(ValueError, match="out must be"):
        compiler.fill_bitmask_async(matchers, torch.zeros(2, 3, dtype=torch.int32))
    # An error in the fill thread reaches result(): a matcher of a narrower vocabulary's compiler.
    other = GrammarCompiler(tokenizer)
    other.compile(specs[0]).result(timeout=10)
    fill = compiler.fill_bitmask_async([other.matcher(specs[0]), matchers[0]])
    with pytest.raises((ValueError, RuntimeError)):  # llguidance's ValueError, xgrammar's RuntimeError
        fill.result()
    assert torch.equal(compiler.fill_bitmask_async(matchers).result(), batch)  # the thread lives on
    compiler.close()
    other.close()


def test_the_async_fill_runs_beside_the_callers_python(tokenizer, monkeypatch):
    """fill_bitmask_async returns once the fill thread is inside the library (its pool runs with the GIL
    released: here a sleep stands in for it), and the caller's Python runs meanwhile, not stalled
    behind the fill thread for the interpreter's switch interval."""
    compiler = GrammarCompiler(tokenizer)
    spec = StructuredOutputsParams(regex=REGEX)
    compiler.compile(spec).result(timeout=10)
    matchers = [compiler.matcher(spec) for _ in range(3)]
    expected = compiler.fill_bitmask(matchers)
    fill_live = GrammarCompiler._fill_live

    def slow(self, live, out):
        time.sleep(0.3)  # releases the GIL, as llguidance's pool does
        fill_live(self, live, out)

    monkeypatch.setattr(GrammarCompiler, "_fill_live", slow)
    start = time.perf_counter()
    fill = compiler.fill_bitmask_async(matchers)
    handed = time.perf_counter() - start
    spins = 0
    while not fill.done():
        spins += 1
    assert handed < 0.15 and spins > 1000, (handed, spins)
    assert torch.equal(fill.result(), expected)
    compiler.close()


def test_the_switch_interval_is_short_while_a_fill_is_in_flight(tokenizer, monkeypatch):
    """While a batch fill runs on the fill thread the interpreter's switch interval is 0.25 ms (the fill
    thread takes the GIL back from the caller's Python at most that late); it is put back when the last
    fill in flight is done, and a lower one set by the user is left alone."""
    compiler = GrammarCompiler(tokenizer)
    spec = StructuredOutputsParams(regex=REGEX)
    compiler.compile(spec).result(timeout=10)
    matchers = [compiler.matcher(spec) for _ in range(3)]
    fill_live = GrammarCompiler._fill_live
    seen = []

    def slow(self, live, out):
        seen.append(sys.getswitchinterval())
        time.sleep(0.5 if self is other else 0.05)
        fill_live(self, live, out)

    monkeypatch.setattr(GrammarCompiler, "_fill_live", slow)
    other = GrammarCompiler(tokenizer)
    other.compile(spec).result(timeout=10)
    before = sys.getswitchinterval()
    try:
        first = compiler.fill_bitmask_async(matchers)
        second = other.fill_bitmask_async([other.matcher(spec)])  # another engine's fill, overlapping
        assert sys.getswitchinterval() == pytest.approx(2.5e-4)
        first.result()
        assert sys.getswitchinterval() == pytest.approx(2.5e-4)  # the other fill is still in flight
        second.result()
        assert sys.getswitchinterval() == before and seen == [pytest.approx(2.5e-4)] * 2
        sys.setswitchinterval(1e-4)
        compiler.fill_bitmask_async(matchers).result()
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    finally:
        sys.setswitchinterval(before)
        compiler.close()
        other.close()


def test_a_freed_compiler_ends_its_fill_thread(tokenizer):
    """The fill thread holds no reference to its compiler: an LLM dropped without close() leaves
    neither the compiler (its 128k-token tables) nor the thread behind."""

    def fill_threads():
        return {t for t in threading.enumerate() if t.name == "fuseformer-grammar-fill" and t.is_alive()}

    # Judged by this compiler's own thread: an earlier test's compiler may still be waiting for a
    # collection, its thread ending at any time (the count of fill threads is not this test's to assert).
    before = fill_threads()
    compiler = GrammarCompiler(tokenizer)
    spec = StructuredOutputsParams(regex=REGEX)
    compiler.compile(spec).result(timeout=10)
    compiler.fill_bitmask_async([compiler.matcher(spec), compiler.matcher(spec)]).result()
    (thread,) = fill_threads() - before
    gone = weakref.ref(compiler)
    del compiler
    gc.collect()
    thread.join(timeout=5)
    assert gone() is None and not thread.is_alive()


# ---- the mask on the logits --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_apply_bitmask_against_the_reference(dtype, vocab):
    n = 5
    logits = torch.randn(n, vocab).to(dtype)
    allowed = torch.rand(n, vocab) < 0.3
    # All rows constrained.
    out = logits.clone()
    assert apply_token_bitmask_(out, _pack(allowed)) is out
    assert torch.equal(out, logits.masked_fill(~allowed, float("-inf")))
    # Rows 3 and 1 constrained (in that order), the others untouched: a batch with free requests.
    rows = torch.tensor([3, 1])
    out = logits.clone()
    apply_token_bitmask_(out, _pack(allowed[rows]), rows)
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(~allowed[rows], float("-inf"))
    assert torch.equal(out, expected)
    assert torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])


def test_apply_bitmask_disallows_tokens_past_the_bitmask_and_checks_its_inputs():
    logits = torch.zeros(2, 70)
    apply_token_bitmask_(logits, torch.full((2, 1), -1, dtype=torch.int32))  # covers tokens 0-31
    assert torch.isinf(logits[:, 32:]).all() and (logits[:, :32] == 0).all()
    apply_token_bitmask_(logits, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    for args, message in [
        ((torch.zeros(2, 70, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32)), "floating point"),
        ((torch.zeros(2, 70), torch.zeros(2, 3)), "int32"),
        ((torch.zeros(3, 70), torch.zeros(2, 3, dtype=torch.int32)), "no rows given"),
        ((torch.zeros(3, 70), torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0])), r"rows must be \(2,\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            apply_token_bitmask_(*args)


# ---- the built-in model, sampled under constraints -----------------------------------------------------


def _run(model, config, tokenizer, compiler, requests, max_tokens):
    """Generate for ``requests`` ((prompt, spec or None, seed), ...) at temperature 1 in one batch, in a
    loop of scheduler, runner forward, bitmask, sampler: what the engine's step does with structured
    outputs (each request's matcher advanced by its sampled token before the next step's mask).
    Returns the outputs' text in order."""
    runner = ModelRunner(model, config, CacheConfig(block_size=16, num_kv_blocks=800))
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=800, block_size=16, max_model_len=512, max_num_batched_tokens=4096)
    )
    matchers, order = {}, []
    for i, (prompt, spec, seed) in enumerate(requests):
        rid = str(i)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)
        req = Request(rid, tokenizer.encode(prompt), params, eos_token_id=tokenizer.eos_token_ids)
        scheduler.add_request(req)
        order.append(req)
        if spec is not None:
            matchers[rid] = compiler.matcher(spec)
    for m in matchers.values():  # the engine holds a request back until its grammar is ready
        m._future.result(timeout=30)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        hidden, rows = runner.forward(out)
        sampling = [s.request for s in out.scheduled if s.sample]
        logits = model.compute_logits(hidden, torch.tensor(rows))
        constrained = [i for i, r in enumerate(sampling) if r.request_id in matchers]
        if constrained:
            bitmask = compiler.fill_bitmask([matchers[sampling[i].request_id] for i in constrained])
            apply_token_bitmask_(logits, bitmask, torch.tensor(constrained))
        md = SamplingMetadata.build(
            [r.sampling_params for r in sampling],
            vocab_size=logits.shape[-1],
            device="cpu",
            positions=[s.start_position + len(s.token_ids) for s in out.scheduled if s.sample],
        )
        tokens = sample(logits, md).sampled_token_ids.tolist()
        for r, t in zip(sampling, tokens):
            if r.request_id in matchers:
                assert matchers[r.request_id].accept_tokens([t]), matchers[r.request_id].error
        scheduler.update_from_output(out, {r.request_id: [t] for r, t in zip(sampling, tokens)})
    return [tokenizer.decode(r.output_token_ids) for r in order], [r.finish_reason for r in order]


@pytest.fixture(scope="module")
def sampled(tokenizer, compiler):
    """One batch of the built-in model at temperature 1: 50 seeds of the JSON schema, 10 each of choice,
    regex and the tool-choice grammars, and 4 free requests beside them (~8 s on 2 cores)."""
    hermes, llama = tool_parser("hermes"), tool_parser("llama3_json")
    groups = {
        "json": [StructuredOutputsParams(json=SCHEMA)] * 50,
        "choice": [StructuredOutputsParams(choice=CHOICES)] * 10,
        "regex": [StructuredOutputsParams(regex=REGEX)] * 10,
        # One call (parallel_tool_calls false): with more allowed, the built-in model goes on calling.
        "hermes_required": [hermes.tool_choice_structured_outputs(TOOLS, "required", False)] * 10,
        "llama3_named": [
            llama.tool_choice_structured_outputs(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
        ]
        * 10,
        "free": [None] * 4,
    }
    requests = [("def f(x):\n    return", spec, seed) for specs in groups.values() for seed, spec in enumerate(specs)]
    with fuseformer.use_backend("reference"):
        model, config = load_model(BUILTIN, torch.float32)
        texts, reasons = _run(model, config, tokenizer, compiler, requests, max_tokens=200)
    out, i = {}, 0
    for name, specs in groups.items():
        out[name] = list(zip(texts[i : i + len(specs)], reasons[i : i + len(specs)]))
        i += len(specs)
    return out


@pytest.mark.slow  # the sampled batch: ~8 s on 2 cores, once for the four
def test_json_schema_outputs_always_parse_and_validate(sampled):
    for text, reason in sampled["json"]:
        assert reason == "stop", text  # EOS, which only a complete value allows
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in sampled["json"]}) > 40  # sampled, not one text


@pytest.mark.slow
def test_choice_and_regex_outputs(sampled):
    for text, reason in sampled["choice"]:
        assert text in CHOICES and reason == "stop"
    assert len({t for t, _ in sampled["choice"]}) > 1
    for text, reason in sampled["regex"]:
        assert re.fullmatch(REGEX, text) and reason == "stop", text


@pytest.mark.slow
def test_free_requests_beside_constrained_ones_are_not_constrained(sampled):
    """The free rows of the same batches write Python (newlines, spaces), not JSON or a choice."""
    for text, _ in sampled["free"]:
        assert text and text not in CHOICES
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


@pytest.mark.slow
def test_tool_choice_grammars_give_calls_the_parsers_read(sampled):
    for text, reason in sampled["hermes_required"]:
        content, calls = tool_parser("hermes").extract(text)
        assert reason == "stop" and content is None and len(calls) == 1, text
        for call in calls:
            assert call.name in ("get_weather", "now")
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
            else:
                assert args == {}
    for text, reason in sampled["llama3_named"]:
        content, calls = tool_parser("llama3_json").extract(text)
        assert reason == "stop" and content is None and [c.name for c in calls] == ["get_weather"], text
        jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0]["function"]["parameters"])


def test_bounded_strings_finds_a_length_bound_anywhere():
    assert bounded_strings(SCHEMA)  # "name": maxLength
    assert bounded_strings({"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 2}]}})
    assert not bounded_strings({"type": "object", "properties": {"s": {"type": "string"}, "n": {"maximum": 3}}})
    assert not bounded_strings({"properties": {"maxLength": {"type": "string"}}})  # a property's name


def test_length_bounded_schemas_compile_with_xgrammar_the_rest_with_llguidance(tokenizer, monkeypatch):
    """xgrammar masks inside maxLength strings ~5x faster than llguidance: those schemas go to it; other
    constraints, a schema it does not compile, or no xgrammar installed: llguidance."""
    pytest.importorskip("xgrammar")
    free = {"type": "object", "properties": {"s": {"type": "string"}}}
    compiler = GrammarCompiler(tokenizer)
    try:
        assert isinstance(compiler.compile(StructuredOutputsParams(json=SCHEMA)).result(10), XgrammarGrammar)
        for spec in (StructuredOutputsParams(json=free), StructuredOutputsParams(regex=REGEX)):
            assert not isinstance(compiler.compile(spec).result(10), XgrammarGrammar)

        def refuse(*args, **kwargs):
            raise RuntimeError("not supported")

        monkeypatch.setattr(compiler._xgrammar._compiler, "compile_json_schema", refuse)
        spec = StructuredOutputsParams(json={**SCHEMA, "title": "another key"})
        assert not isinstance(compiler.compile(spec).result(10), XgrammarGrammar)
    finally:
        compiler.close()
    monkeypatch.setattr(grammar_xgrammar, "xgrammar_module", lambda: None)
    compiler = GrammarCompiler(tokenizer)
    try:
        matcher = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
        assert matcher.wait(10) is None and not isinstance(matcher._live_matcher(), XgrammarMatcher)
    finally:
        compiler.close()


def test_prepare_builds_the_vocabulary_views_before_the_first_compile(tokenizer):
    """``prepare`` (LLM on CUDA calls it at start) builds both libraries' views on the compile thread; the
    first compile then uses them, and a second ``prepare`` changes nothing."""
    pytest.importorskip("xgrammar")
    compiler = GrammarCompiler(tokenizer)
    try:
        assert compiler._lltokenizer is None and compiler._xgrammar._compiler is None
        compiler.prepare().result(timeout=60)
        views = compiler._lltokenizer, compiler._xgrammar._compiler
        assert all(v is not None for v in views)
        # Each library's first compile and batch fill ran (their executors made), and nothing of the
        # warm-up is left in the grammar cache that requests' constraints share.
        executors = compiler._xgr_executor, compiler._parallel
        assert all(e is not None for e in executors) and not compiler._cache
        compiler.prepare().result(timeout=60)
        assert (compiler._xgr_executor, compiler._parallel) == executors
        for spec in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)):
            assert compiler.compile(spec).result(timeout=10) is not None
        assert (compiler._lltokenizer, compiler._xgrammar._compiler) == views
    finally:
        compiler.close()


def test_output_processor_prepares_grammars_only_with_a_tokenizer(tokenizer):
    from fuseformer.engine.output_processor import OutputProcessor

    without = OutputProcessor(None, [0], 100, 64)
    without.prepare_grammars()  # no tokenizer: nothing, and no error
    assert without._grammar_compiler is None
    no_eos = Tokenizer(BUILTIN)
    no_eos.eos_token_ids = []
    without = OutputProcessor(no_eos, [], no_eos.vocab_size, 64)
    without.prepare_grammars()  # a tokenizer without EOS: nothing (LLM still starts), and no error
    assert without._grammar_compiler is None
    with_tokenizer = OutputProcessor(tokenizer, tokenizer.eos_token_ids, tokenizer.vocab_size, 64)
    with_tokenizer.prepare_grammars()
    compiler = with_tokenizer._grammar_compiler
    try:
        assert compiler is not None
        compiler._executor.submit(lambda: None).result(timeout=60)  # after the prepare job
        assert compiler._lltokenizer is not None
    finally:
        compiler.close()


def test_xgrammar_broken_install_warns_once(monkeypatch):
    """xgrammar installed but failing to import (a missing dependency) falls back to llguidance with one
    warning naming the error; xgrammar not installed falls back silently."""
    import builtins
    import warnings

    from fuseformer.engine import grammar_xgrammar

    real_import = builtins.__import__
    missing = {"name": "pydantic"}

    def fake_import(name, *args, **kwargs):
        if name == "xgrammar":
            raise ModuleNotFoundError(f"No module named '{missing['name']}'", name=missing["name"])
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.delitem(sys.modules, "xgrammar", raising=False)
    grammar_xgrammar._warn_broken.cache_clear()
    with pytest.warns(RuntimeWarning, match="pydantic"):
        assert grammar_xgrammar.xgrammar_module() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grammar_xgrammar.xgrammar_module() is None  # once
        missing["name"] = "xgrammar"
        grammar_xgrammar._warn_broken.cache_clear()
        assert grammar_xgrammar.xgrammar_module() is None  # not installed: silent
