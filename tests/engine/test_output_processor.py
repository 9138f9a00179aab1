"""OutputProcessor without a model: prompts and parameters checked before anything is queued; n > 1
fanned out into requests ``<id>#<i>`` seeded seed + i; a scheduler's updates (a real Scheduler fed
chosen tokens) turned into per-prompt deltas: stop strings trimmed (and handed back for the core to
finish), stop tokens and EOS left out of the text, finish reasons and stop reasons, the completions of
a prompt merged and ordered; abort."""

import pytest

from fuseformer.engine.output_processor import OutputProcessor
from fuseformer.engine.request import RequestStatus
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig
from fuseformer.models.tokenizer import Tokenizer
from fuseformer.testing import save_tiny_tokenizer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. Say hello to the engine.",
] * 3
VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path, CORPUS, "{{ messages }}", vocab_size=VOCAB)
    return Tokenizer(path)


def _scheduler():
    return Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)
    )


def _queue(processor, sched, group):
    for req in processor.add(group):
        sched.add_request(req)


def _step(processor, sched, tokens):
    """One step whose sampled tokens are ``tokens`` (request id -> token); the stopped ids finished as
    the core finishes them. Returns (deltas, stopped)."""
    out = sched.schedule()
    updates = sched.update_from_output(out, {s.request_id: [tokens[s.request_id]] for s in out.scheduled if s.sample})
    deltas, stopped = processor.process(updates)
    sched.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
    return deltas, stopped


def test_n_fans_out_into_seeded_requests_and_merges_in_index_order():
    processor = OutputProcessor(None, [7], vocab_size=50, max_model_len=64)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=2, ignore_eos=True)
    group = processor.make_request(None, [1, 2, 3], params)
    assert group.request_id == "0" and processor.make_request(None, [1], params).request_id == "1"
    reqs = group.requests
    assert [r.request_id for r in reqs] == ["0#0", "0#1", "0#2"]
    assert [r.sampling_params.seed for r in reqs] == [5, 6, 7] and {r.sampling_params.n for r in reqs} == {1}
    assert all(r.eos_token_ids == frozenset({7}) for r in reqs)
    unseeded = processor.make_request("u", [1], SamplingParams(n=2, seed=None))
    assert [r.sampling_params.seed for r in unseeded.requests] == [None, None]
    single = processor.make_request("s", [1], SamplingParams())
    assert [r.request_id for r in single.requests] == ["s"]  # n == 1: the prompt's own id

    sched = _scheduler()
    _queue(processor, sched, group)
    with pytest.raises(ValueError, match="request_id '0' is already running"):
        processor.make_request("0", [1], params)
    # Step 1: each completion's first token; step 2: the second, which finishes all by length.
    (first,), _ = _step(processor, sched, {"0#0": 10, "0#1": 11, "0#2": 12})
    assert first.request_id == "0" and first.prompt is None and first.prompt_token_ids == [1, 2, 3]
    assert [c.index for c in first.outputs] == [0, 1, 2] and not first.finished
    assert [c.token_ids for c in first.outputs] == [[10], [11], [12]]
    assert all(c.finish_reason is None and c.text == "" for c in first.outputs)
    # The completions finish in another order in a later step; the delta lists what changed.
    sched.abort("0#1")  # as if completion 1 had gone (the processor is not told)
    (second,), _ = _step(processor, sched, {"0#0": 20, "0#2": 22})
    got = [(c.index, c.token_ids, c.finish_reason) for c in second.outputs]
    assert got == [(0, [20], "length"), (2, [22], "length")]
    assert not second.finished and processor.has_unfinished_requests()  # completion 1 has not finished
    assert processor.abort("0") == ["0#1"]  # only the unfinished completion goes to the core
    final = processor.final_output(group)
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.token_ids for c in final.outputs] == [[10, 20], [11], [12, 22]]
    assert [c.finish_reason for c in final.outputs] == ["length", "abort", "length"] and final.finished


def test_finish_reasons_and_stop_tokens(tokenizer):
    """A stop token id: finish "stop" with the id as stop reason, the token kept in token_ids and left
    out of the text; EOS the same, unless ignore_eos; max_tokens: "length"."""
    eos = tokenizer.eos_token_id
    processor = OutputProcessor(tokenizer, [eos], VOCAB, max_model_len=64)
    sched = _scheduler()
    words = tokenizer.encode(" world, this is", add_special_tokens=False)
    stop_id = words[2]
    groups = [
        processor.make_request("stop", "Hello", SamplingParams(temperature=0, stop_token_ids=[stop_id])),
        processor.make_request("eos", "Hello", SamplingParams(temperature=0)),
        processor.make_request("len", "Hello", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),
    ]
    for g in groups:
        _queue(processor, sched, g)
    script = {"stop": words[:3], "eos": [words[0], eos], "len": [eos, words[0]]}
    seen = {k: [] for k in script}
    text = {k: "" for k in script}
    for i in range(3):
        deltas, stopped = _step(processor, sched, {k: v[min(i, len(v) - 1)] for k, v in script.items()})
        assert stopped == []  # token stops are the scheduler's own
        for d in deltas:
            (c,) = d.outputs
            seen[d.request_id].append((c.token_ids, c.finish_reason, c.stop_reason))
            text[d.request_id] += c.text
    assert seen["stop"][-1] == ([stop_id], "stop", stop_id)
    assert seen["eos"] == [([words[0]], None, None), ([eos], "stop", None)]  # EOS: no stop reason (vLLM)
    assert seen["len"][-1] == ([words[0]], "length", None) and len(seen["len"]) == 2
    finals = {g.request_id: processor.final_output(g).outputs[0] for g in groups}
    assert finals["stop"].token_ids == words[:3] and finals["stop"].text == tokenizer.decode(words[:2])
    assert text["stop"] == finals["stop"].text
    assert finals["eos"].text == tokenizer.decode(words[:1]) == text["eos"]
    assert finals["len"].token_ids == [eos, words[0]] and finals["len"].finish_reason == "length"
    assert not processor.has_unfinished_requests() and not sched.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_are_trimmed_and_handed_back(tokenizer, include):
    """A stop string split across tokens ends the request at the token that completes it: the text is
    cut before it (after it with include_stop_str_in_output), never streamed past it; the id is handed
    back for the core to finish, and the finish reason is "stop" with the string as stop reason."""
    processor = OutputProcessor(tokenizer, [], VOCAB, max_model_len=64)
    sched = _scheduler()
    tokens = tokenizer.encode(" world, this is a tiny corpus", add_special_tokens=False)
    full = tokenizer.decode(tokens)
    stop = "s a ti"  # spans the tokens of "is", " a", " tiny"
    assert stop in full and not any(stop in tokenizer.decode([t]) for t in tokens)
    params = SamplingParams(temperature=0, stop=[stop], include_stop_str_in_output=include, ignore_eos=True)
    group = processor.make_request("a", "Hello", params)
    _queue(processor, sched, group)
    streamed, steps, hit_at = "", 0, None
    for t in tokens:
        deltas, stopped = _step(processor, sched, {"a": t})
        steps += 1
        (c,) = deltas[0].outputs
        streamed += c.text
        if stopped:
            assert stopped == ["a"] and (c.finish_reason, c.stop_reason) == ("stop", stop) and deltas[0].finished
            hit_at = steps
            break
        assert c.finish_reason is None and stop[:-1] not in streamed  # its start is held back, too
    cut = full.index(stop)
    expected = full[: cut + len(stop)] if include else full[:cut]
    assert hit_at is not None and hit_at < len(tokens)  # stopped before the tokens ran out
    assert tokenizer.decode(tokens[: hit_at - 1]).find(stop) < 0 <= tokenizer.decode(tokens[:hit_at]).find(stop)
    assert streamed == expected == processor.final_output(group).outputs[0].text
    assert sched.requests == {} and not processor.has_unfinished_requests()


def test_bad_prompts_and_params_raise_before_anything_is_added(tokenizer):
    plain = OutputProcessor(None, [], vocab_size=50, max_model_len=8)
    cases = [
        (lambda: plain.make_request(None, "text", None), "is text but the model has no tokenizer.json"),
        (lambda: plain.make_request(None, [], None), "prompt is empty"),
        (lambda: plain.make_request(None, [1, 50], None), r"outside the vocabulary \[0, 50\): \[50\]"),
        (lambda: plain.make_request(None, [1] * 8, None), "8 tokens; max_model_len 8"),
        (lambda: plain.make_request(None, [1], SamplingParams(stop=["x"])), "stop strings need a tokenizer"),
        (lambda: plain.make_request(None, [1], SamplingParams(stop_token_ids=[60])), "stop_token_ids"),
        (lambda: plain.make_request(None, [1], SamplingParams(logprobs=51)), "logprobs 51"),
        (lambda: plain.params_list([SamplingParams()], 2), "1 sampling_params for 2 prompts"),
        (lambda: plain.params_list("greedy", 1), "must be a SamplingParams"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()
    assert not plain.has_unfinished_requests()
    assert plain.prompt_ids([1, 2], "p") == (None, [1, 2])
    text = OutputProcessor(tokenizer, [], VOCAB, max_model_len=64)
    assert text.prompt_ids("Hello", "p") == ("Hello", tokenizer.encode("Hello"))
    assert text.default_sampling_params() == SamplingParams()


def test_prompt_dicts_truncation_and_token_control_checks(tokenizer):
    """vLLM's prompt dicts; truncate_prompt_tokens keeps the last k (the length checked after it);
    ids of logit_bias / allowed_token_ids / bad words checked against the vocabulary, naming the field."""
    plain = OutputProcessor(None, [], vocab_size=50, max_model_len=8)
    assert plain.prompt_ids({"prompt_token_ids": [1, 2]}, "p") == (None, [1, 2])
    assert plain.prompt_ids({"prompt_token_ids": [1, 2], "prompt": "ab"}, "p") == ("ab", [1, 2])
    keep3 = SamplingParams(truncate_prompt_tokens=3)
    assert plain.prompt_ids(list(range(20)), "p", keep3) == (None, [17, 18, 19])  # 20 tokens fit once cut
    assert plain.prompt_ids(list(range(20)), "p", SamplingParams(truncate_prompt_tokens=-1))[1] == list(range(13, 20))
    group = plain.make_request(None, list(range(10)), keep3)
    assert group.prompt_token_ids == group.requests[0].prompt_token_ids == [7, 8, 9]
    text = OutputProcessor(tokenizer, [], VOCAB, max_model_len=64)
    assert text.prompt_ids({"prompt": "Hello"}, "p") == ("Hello", tokenizer.encode("Hello"))
    cases = [
        (lambda: plain.prompt_ids({"prompt_token_ids": [1], "multi_modal_data": {}}, "p"), "multi_modal_data"),
        (lambda: plain.prompt_ids({}, "p"), "without 'prompt'"),
        (lambda: plain.prompt_ids({"prompt": [1]}, "p"), r"\['prompt'\] must be a string"),
        (lambda: plain.make_request(None, [1], SamplingParams(logit_bias={50: 1})), "logit_bias"),
        (lambda: plain.make_request(None, [1], SamplingParams(allowed_token_ids=[3, 60])), "allowed_token_ids"),
        (lambda: plain.make_request(None, [1], SamplingParams(prompt_logprobs=51)), "prompt_logprobs 51"),
        (lambda: plain.make_request(None, [1], SamplingParams(truncate_prompt_tokens=8)), "truncate_prompt_tokens 8"),
        (lambda: plain.make_request(None, [1], SamplingParams(bad_words=["x"])), "bad_words need a tokenizer"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()


def test_bad_words_tokenized_alone_and_after_a_space(tokenizer):
    """vLLM's rule: the word, and " word" when that is other tokens of the same count."""
    text = OutputProcessor(tokenizer, [], VOCAB, max_model_len=64)
    ids = text.bad_words_token_ids(["fox", " hello"])
    alone = tokenizer.encode("fox", add_special_tokens=False)
    spaced = tokenizer.encode(" fox", add_special_tokens=False)
    expected = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    assert ids[: len(expected)] == expected and tokenizer.encode("hello", add_special_tokens=False) in ids
    group = text.make_request(None, "Say", SamplingParams(n=2, bad_words=["fox"], prompt_logprobs=1))
    assert all(r.bad_words_token_ids == ids[: len(expected)] for r in group.requests)
    assert all(r.prompt_logprobs == [] for r in group.requests)  # each completion computes them
