"""LLM(async_scheduling=True): the next decode step is scheduled and launched before the current
one's tokens are read (AsyncScheduler.schedule_ahead, launched by the EngineCore; the runner takes its
input tokens from the device).
On the CPU the launch is synchronous, so nothing overlaps, but every path runs: outputs equal those
of async_scheduling=False (greedy, seeded sampling with logprobs, n > 1, stop tokens, penalties,
prefix-cache hits, preemption, the padded decode-graph buffers), no block leaks, and requests aborted
or finished while a step scheduled ahead is in flight leave nothing behind."""

import pytest
import torch

import fuseformer
from fuseformer.engine.async_scheduler import AsyncScheduler
from fuseformer.engine.llm import LLM
from fuseformer.engine.request import Request
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import AHEAD_TOKEN, Scheduler, SchedulerConfig
from fuseformer.testing import TINY_LLAMA, shared_prefix_prompts, tiny_llama

_KW = dict(num_kv_blocks=40, block_size=4, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=12)


def _workload(num, seed=0):
    """``num`` prompts of 1..30 tokens, half behind a shared 12-token prefix; greedy, seeded and
    penalized requests; max_tokens 2..18; some stop at a token id."""
    vocab = TINY_LLAMA["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    prompts, params = shared_prefix_prompts(vocab, num, 30, gen), []
    for i in range(num):
        kind = i % 4
        p = dict(max_tokens=2 + (7 * i) % 17, ignore_eos=True)
        if kind == 0:
            p |= dict(temperature=0, logprobs=2)
        elif kind == 1:
            p |= dict(temperature=0.8, top_p=0.9, seed=100 + i, n=2)
        elif kind == 2:
            p |= dict(temperature=0, stop_token_ids=[int(torch.randint(0, vocab, (1,), generator=gen))])
        else:
            # penalties defer the sampling of the steps scheduled ahead
            penalized = dict(temperature=0.7, seed=200 + i, presence_penalty=0.5, max_tokens=3)
            p |= penalized if i == 3 else dict(temperature=0)
        params.append(SamplingParams(**p))
    return prompts, params


def _flat(outputs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def _logprobs(outputs):
    return [[c.logprobs for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("padded", [False, True])
def test_outputs_equal_those_of_synchronous_steps(padded):
    """12 requests over a cache too small for all (preemption), with prefix hits, every kind of
    sampling: the same tokens, finish reasons and logprobs either way."""
    model, _ = tiny_llama()
    prompts, params = _workload(12)
    with fuseformer.use_backend("reference"):
        runs = []
        for async_scheduling in (False, True):
            llm = LLM(model, async_scheduling=async_scheduling, **_KW)
            if padded:  # the decode-graph buffers, without graphs (the CPU's stand-in for capture)
                llm.core.runner.decode_graphs = llm.core.runner.make_decode_graphs([1, 2, 4, 8], capture=False)
            runs.append((llm, llm.generate(prompts, params, use_tqdm=False)))
    (sync_llm, expected), (llm, got) = runs
    assert _flat(got) == _flat(expected)
    for a, b in zip(_logprobs(got), _logprobs(expected)):
        for ca, cb in zip(a, b):
            if ca is not None:
                assert [list(d) for d in ca] == [list(d) for d in cb]
                assert all(
                    abs(x.logprob - y.logprob) < 1e-5 and x.rank == y.rank
                    for da, db in zip(ca, cb)
                    for x, y in zip(da.values(), db.values())
                )
    assert llm.core.num_steps_ahead > 0 and sync_llm.core.num_steps_ahead == 0
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.scheduler.kv.pool.prefix_stats.hits > 0
    assert llm.core.scheduler.kv.pool.num_free_blocks == 39 and llm.core.step_in_flight is None
    # From 100 requests on: never here.
    with fuseformer.use_backend("reference"):
        few = LLM(model, async_scheduling=True, async_scheduling_min_seqs=100, **_KW)
        assert _flat(few.generate(prompts, params, use_tqdm=False)) == _flat(expected) and few.core.num_steps_ahead == 0
    with pytest.raises(ValueError, match="async_scheduling_min_seqs"):
        LLM(model, async_scheduling=True, async_scheduling_min_seqs=0, **_KW)
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        LLM(model, async_scheduling="yes", **_KW)
    with pytest.raises(ValueError, match="prefill_stream must be a bool"):
        LLM(model, prefill_stream=1, **_KW)
    if padded:
        assert sum(llm.core.runner.decode_graphs.replays.values()) > 0


def test_abort_while_a_step_is_scheduled_ahead():
    """The step API: a request aborted, and another finishing by a stop token, while the next step
    is in flight; the others stream what generate returns; every block comes back."""
    model, _ = tiny_llama()
    prompts, _ = _workload(3, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with fuseformer.use_backend("reference"):
        expected = LLM(model, **_KW).generate(prompts, greedy, use_tqdm=False)
        stop_at = expected[2].outputs[0].token_ids[3]
        llm = LLM(model, async_scheduling=True, **_KW)
        llm.add_request("a", prompts[0], greedy)
        llm.add_request("b", prompts[1], greedy)
        llm.add_request("c", prompts[2], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))
        tokens = {"a": [], "b": [], "c": []}
        steps = 0
        while llm.has_unfinished_requests():
            for out in llm.step():
                tokens[out.request_id] += out.outputs[0].token_ids
            steps += 1
            if steps == 4:
                assert llm.core.step_in_flight is not None  # the next step is on its way
                llm.abort("b")
    assert tokens["a"] == expected[0].outputs[0].token_ids
    assert tokens["b"] == expected[1].outputs[0].token_ids[: len(tokens["b"])] and len(tokens["b"]) < 10
    cut = expected[2].outputs[0].token_ids
    assert tokens["c"] == cut[: cut.index(stop_at) + 1]
    assert llm.core.num_steps_ahead > 0 and llm.core.step_in_flight is None
    assert llm.core.scheduler.kv.pool.num_free_blocks == 39
    with pytest.raises(RuntimeError, match="scheduled ahead"):  # launch_step is not for an ahead step
        llm.add_request("d", prompts[0], greedy)
        llm.step()
        llm.launch_step()


def test_schedule_ahead_only_for_decodes_of_every_running_request():
    """AsyncScheduler.schedule_ahead: None for a prefill or with requests waiting; a request with
    penalties is scheduled ahead with its sampling deferred. A step ahead holds the next position of
    each request, its input the placeholder, a row per request, and the slot of that position
    allocated; a request that finishes by length is left out. The plain Scheduler never schedules
    ahead."""
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    plain = Scheduler(cfg)
    plain.add_request(Request("a", list(range(1, 5)), SamplingParams(max_tokens=8)))
    plain.update_from_output(plain.schedule(), {"a": [7]})
    decode = plain.schedule()
    assert len(decode.scheduled) == 1 and plain.schedule_ahead(decode) is None
    sched = AsyncScheduler(cfg)
    a = Request("a", list(range(1, 5)), SamplingParams(max_tokens=8))
    b = Request("b", list(range(1, 4)), SamplingParams(max_tokens=1))  # finishes with its first token
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    assert sched.schedule_ahead(first) is None  # prompts: their tokens are not one each
    sched.update_from_output(first, {"a": [7], "b": [9]})
    assert b.is_finished
    step = sched.schedule()
    assert [s.request_id for s in step.scheduled] == ["a"] and step.scheduled[0].start_position == 4
    ahead = sched.schedule_ahead(step)
    (s,) = ahead.scheduled
    assert (s.token_ids, s.start_position, ahead.ahead_rows, ahead.num_batched_tokens) == ([AHEAD_TOKEN], 5, [0], 1)
    assert len(a.block_ids) == 2  # positions 0..5 need two blocks of 4
    sched.add_request(Request("c", [1, 2], SamplingParams()))
    assert sched.schedule_ahead(step) is None  # a request waits to be admitted
    pen = AsyncScheduler(cfg)
    pen.add_request(Request("p", [1, 2, 3], SamplingParams(max_tokens=8, frequency_penalty=0.5)))
    out = pen.schedule()
    pen.update_from_output(out, {"p": [4]})
    pen_ahead = pen.schedule_ahead(pen.schedule())  # its sampling reads the output: deferred
    assert pen_ahead.ahead_rows == [0] and pen_ahead.deferred_sampling
    assert not ahead.deferred_sampling
    last = AsyncScheduler(cfg)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    last.add_request(r)
    last.update_from_output(last.schedule(), {"r": [4]})
    assert last.schedule_ahead(last.schedule()) is None  # r finishes by length in that step


def test_schedule_ahead_needs_min_seqs_running():
    """min_seqs: a decode step of fewer running requests is not scheduled ahead; of that many, it is."""
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    sched = AsyncScheduler(cfg, min_seqs=2)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    sched.update_from_output(sched.schedule(), {"a": [4]})
    assert sched.schedule_ahead(sched.schedule()) is None  # one request runs
    sched.add_request(Request("b", [5, 6], SamplingParams(max_tokens=8)))
    step = sched.schedule()  # a's decode, b's prompt
    sched.update_from_output(step, {"a": [7], "b": [8]})
    step = sched.schedule()  # both decode
    ahead = sched.schedule_ahead(step)
    assert ahead is not None and [s.request_id for s in ahead.scheduled] == ["a", "b"]
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="min_seqs must be an int >= 1"):
            AsyncScheduler(cfg, min_seqs=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_async_scheduling_with_cuda_graphs_gpu(dtype):
    """On the GPU with captured decode graphs: 48 requests (preemption, prefix hits, every kind of
    sampling) give the outputs of synchronous steps, steps are launched ahead of the previous one's
    tokens (their input tokens taken on the device), and every block comes back."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, _ = tiny_llama("cuda", dtype)
    prompts, params = _workload(48, seed=2)
    kw = dict(
        device="cuda", num_kv_blocks=60, block_size=4, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=48,
        cuda_graphs=True,
    )  # fmt: skip
    expected = LLM(model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, async_scheduling=True, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    # The same batches in the same order: the same numbers (a rare tie aside).
    same = sum(a == b for a, b in zip(_flat(got), _flat(expected)))
    assert same >= 0.95 * len(prompts), same
    assert llm.core.num_steps_ahead > 0 and sum(llm.core.runner.decode_graphs.replays.values()) > 0
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.scheduler.kv.pool.num_free_blocks == 59
