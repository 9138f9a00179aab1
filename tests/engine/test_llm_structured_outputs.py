"""Structured outputs through the engine (``SamplingParams.structured_outputs``): the built-in model's
outputs under a JSON schema parse and validate over 50 seeds at temperature 1, choices and regexes hold,
free requests of the same batch get the tokens they get alone, a request whose grammar compiles is held
back while others run, a bad constraint raises (``generate``) or aborts (``add_request``), preemption
does not advance a matcher twice, each of ``n`` completions has its own matcher, and the sampler masks
only the constrained rows, greedy and sampled."""

import json
import re
import threading

import jsonschema
import pytest
import torch

import fuseformer
from fuseformer import LLM
from fuseformer.engine.cli import DEFAULT_MODEL
from fuseformer.engine.sampler import SamplingMetadata, sample
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.structured_outputs import GrammarCompiler, StructuredOutputsError, StructuredOutputsParams
from fuseformer.testing import CONSTRAINT_CHOICES as CHOICES
from fuseformer.testing import CONSTRAINT_REGEX as REGEX
from fuseformer.testing import CONSTRAINT_SCHEMA as SCHEMA

PROMPT = "def f(x):\n    return"
FREE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Point:"]


@pytest.fixture(scope="module")
def llm():
    with fuseformer.use_backend("reference"):
        yield LLM(DEFAULT_MODEL, device="cpu", num_kv_blocks=800)


def _params(spec=None, **kwargs):
    kwargs.setdefault("max_tokens", 200)
    return SamplingParams(structured_outputs=spec, **kwargs)


@pytest.fixture(scope="module")
def sampled(llm):
    """One generate call at temperature 1: 50 seeds of the schema, 10 of the choice, 10 of the regex."""
    specs = (
        [StructuredOutputsParams(json=SCHEMA)] * 50
        + [StructuredOutputsParams(choice=CHOICES)] * 10
        + [StructuredOutputsParams(regex=REGEX)] * 10
    )
    params = [_params(spec, temperature=1.0, seed=seed) for seed, spec in enumerate(specs)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    texts = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    return {"json": texts[:50], "choice": texts[50:60], "regex": texts[60:]}


@pytest.mark.slow
def test_json_schema_outputs_parse_and_validate_over_50_seeds(sampled):
    for text, reason in sampled["json"]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in sampled["json"]}) > 40  # sampled, not one text


@pytest.mark.slow
def test_choice_and_regex_outputs(sampled):
    for text, reason in sampled["choice"]:
        assert text in CHOICES and reason == "stop"
    assert len({t for t, _ in sampled["choice"]}) > 1
    for text, reason in sampled["regex"]:
        assert re.fullmatch(REGEX, text) and reason == "stop", text


def _same_but_near_ties(alone, beside, tol=1e-3):
    """Greedy outputs equal, or equal up to a position where the two tokens chosen were the top two of
    ``alone``'s logits within ``tol`` (a batch of another shape rounds the CPU's GEMMs differently; a
    leaked mask would pick a token far below the top)."""
    a, b = alone.token_ids, beside.token_ids
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return len(a) == len(b)
    top = alone.logprobs[i]
    return b[i] in top and abs(top[a[i]].logprob - top[b[i]].logprob) < tol


def test_free_requests_get_the_same_tokens_beside_constrained_ones(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = [o.outputs[0] for o in llm.generate(FREE_PROMPTS, free, use_tqdm=False)]
    constrained = [
        _params(StructuredOutputsParams(json=SCHEMA), temperature=0),
        _params(StructuredOutputsParams(choice=CHOICES), temperature=1.0, seed=3),
        _params(StructuredOutputsParams(regex=REGEX), temperature=0),
    ]
    prompts = [PROMPT, FREE_PROMPTS[0], PROMPT, FREE_PROMPTS[1], PROMPT, FREE_PROMPTS[2]]
    params = [constrained[0], free, constrained[1], free, constrained[2], free]
    outs = llm.generate(prompts, params, use_tqdm=False)
    beside = [outs[i].outputs[0] for i in (1, 3, 5)]
    assert all(_same_but_near_ties(a, b) for a, b in zip(alone, beside)), [
        (a.token_ids, b.token_ids) for a, b in zip(alone, beside)
    ]
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    assert outs[2].outputs[0].text in CHOICES
    assert re.fullmatch(REGEX, outs[4].outputs[0].text)


def test_a_bad_constraint_raises_in_generate_and_nothing_runs(llm):
    bad = _params(StructuredOutputsParams(regex="[a-"))
    with pytest.raises(StructuredOutputsError, match="structured_outputs"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_a_bad_constraint_added_with_add_request_aborts_with_the_error(llm):
    llm.add_request("bad", PROMPT, _params(StructuredOutputsParams(regex="[a-")))
    llm.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished, tokens = {}, {"bad": [], "good": []}
    while llm.has_unfinished_requests():
        for out in llm.step():  # deltas
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["bad"].finish_reason == "abort" and tokens["bad"] == []
    assert "structured_outputs" in finished["bad"].stop_reason
    assert finished["good"].finish_reason == "length" and len(tokens["good"]) == 3


def test_a_compiling_request_is_held_back_while_others_run(llm, monkeypatch):
    compiler = llm.output_processor.grammar_compiler
    release = threading.Event()
    compile_ = compiler._compile

    def slow_compile(spec):
        release.wait(30)
        return compile_(spec)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    # A constraint not compiled before (the cache would make it ready at once).
    llm.add_request("held", PROMPT, _params(StructuredOutputsParams(choice=["held back", "let go"]), temperature=0))
    llm.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    tokens = {"held": [], "free": []}
    for _ in range(6):
        for out in llm.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    assert len(tokens["free"]) == 5 and tokens["held"] == []
    assert llm.scheduler.requests["held"].grammar.ready is False
    release.set()
    text = ""
    while llm.has_unfinished_requests():
        for out in llm.step():
            text += out.outputs[0].text
    assert text in ("held back", "let go")


def test_preemption_does_not_advance_a_matcher_twice():
    """A KV cache of 5 blocks of 16 tokens (80 tokens) for 4 requests of 40-60 tokens: requests are
    preempted and recompute their output; the outputs are those of a cache large enough for all."""
    # Both grammar libraries: a free-length name (llguidance), and the schema's maxLength (xgrammar).
    free_name = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string"}}}
    specs = [
        StructuredOutputsParams(json=free_name),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(choice=CHOICES),
    ]
    params = [_params(spec, temperature=0, max_tokens=40) for spec in specs]
    # Distinct prompts of ~20 tokens: no shared prefix blocks.
    prompts = [f"# example {i}\n{PROMPT * 2}" for i in range(4)]
    with fuseformer.use_backend("reference"):
        big = LLM(DEFAULT_MODEL, device="cpu", num_kv_blocks=200)
        expected = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
        small = LLM(DEFAULT_MODEL, device="cpu", num_kv_blocks=6, max_model_len=80)
        outs = small.generate(prompts, params, use_tqdm=False)
    assert small.scheduler.num_preemptions > 0, [len(t) for t in expected]
    assert [o.outputs[0].token_ids for o in outs] == expected
    jsonschema.validate(json.loads(outs[0].outputs[0].text), free_name)
    assert re.fullmatch(REGEX, outs[1].outputs[0].text)
    jsonschema.validate(json.loads(outs[2].outputs[0].text), SCHEMA)
    assert outs[3].outputs[0].text in CHOICES


def test_n_completions_each_have_their_own_matcher(llm):
    params = _params(StructuredOutputsParams(choice=CHOICES), temperature=1.0, seed=11, n=6)
    group = llm.output_processor.make_group(None, None, llm.tokenizer.encode(PROMPT), params)
    assert len({id(r.grammar) for r in group.requests}) == 6
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(out.outputs) == 6 and all(c.text in CHOICES for c in out.outputs)


def test_async_scheduling_runs_constrained_requests_ahead_with_the_synchronous_outputs(monkeypatch):
    """A constrained request is scheduled ahead with its sampling deferred until the previous token has
    advanced its grammar: the same tokens as synchronous steps (greedy and seeded sampling, beside
    free requests), and the steps are scheduled ahead, their bitmasks filled on the fill thread. The step
    log says how long each mask took and how long the host waited for it; steps without a constrained
    request record neither."""
    fills = []
    fill_async = GrammarCompiler.fill_bitmask_async
    monkeypatch.setattr(GrammarCompiler, "fill_bitmask_async", lambda self, *a: fills.append(1) or fill_async(self, *a))
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [_params(spec, temperature=0), _params(spec, temperature=1.0, seed=3)]
    params += [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(FREE_PROMPTS)
    prompts = [PROMPT, PROMPT, *FREE_PROMPTS]
    outs = {}
    with fuseformer.use_backend("reference"):
        for a in (False, True):
            llm = LLM(DEFAULT_MODEL, device="cpu", num_kv_blocks=200, async_scheduling=a)
            outs[a] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if a:
                assert llm.num_steps_ahead > 10 and len(fills) > 10
            else:
                assert not fills
            records = llm.step_log.records
            masked = [r for r in records if r.mask_ms is not None]
            assert len(masked) >= max(len(o) for o in outs[a][:2]) - 1  # every step of a constrained request
            assert all(r.mask_ms > 0 and 0 <= r.mask_wait_ms <= r.launch_ms for r in masked)
            assert all(r.mask_wait_ms is None for r in records if r.mask_ms is None)
            kinds = llm.step_log.totals().values()
            assert sum(t["mask_s"] for t in kinds) == pytest.approx(sum(r.mask_ms for r in masked) / 1e3, abs=1e-3)
    assert outs[True] == outs[False]
    for tokens in outs[True][:2]:
        jsonschema.validate(json.loads(llm.tokenizer.decode(tokens)), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_masks_constrained_rows_only(temperature):
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = [5, 33, 64]  # row 1 only; a word boundary on each side
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= (1 << (t % 32)) - (1 << 32) * (t % 32 == 31)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(3)]
    md = SamplingMetadata.build(params, vocab_size=vocab, device="cpu", positions=[4, 4, 4])
    free = sample(logits.clone(), md).sampled_token_ids
    md = SamplingMetadata.build(params, vocab_size=vocab, device="cpu", positions=[4, 4, 4])
    md.bitmask, md.bitmask_rows = bitmask, torch.tensor([1])
    for i in range(20 if temperature else 1):
        md.positions = torch.full((3,), 5 + i)  # another draw each time
        masked = sample(logits.clone(), md).sampled_token_ids
        assert masked[1].item() in allowed
    md.positions = torch.full((3,), 4)
    masked = sample(logits.clone(), md).sampled_token_ids
    assert masked[0] == free[0] and masked[2] == free[2]  # free rows untouched (same draws)
