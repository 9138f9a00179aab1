"""AsyncEngine without HTTP: streams hold what LLM.generate returns; bad input raises at add_request;
leaving a stream early or abort() frees the blocks before the next step; shutdown lets requests
finish within its grace period and aborts the rest; a failed step reaches every caller; the engine
drives the LLM's core, never the LLM."""

import asyncio

import pytest

import fuseformer
from fuseformer.engine.async_engine import AsyncEngine, EngineDeadError, EngineShutdownError
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.testing import collect_staggered, collect_stream, run_bounded

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(params=[False, True], ids=["sync", "async_scheduling"])
def engine(checkpoint, llm_kwargs, request):
    with fuseformer.use_backend("reference"):
        llm = LLM(checkpoint, async_scheduling=request.param, **llm_kwargs)
        yield AsyncEngine(llm)


def test_streams_hold_what_generate_returns(engine):
    prompts = ["Hello world", "The quick brown fox", "Say hello"]
    params = [GREEDY, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True), GREEDY]
    with fuseformer.use_backend("reference"):
        offline = LLM(
            engine.core.runner.model, tokenizer=engine.tokenizer, num_kv_blocks=64, block_size=4, max_model_len=64
        )
        expected = offline.generate(prompts, params, use_tqdm=False)

    async def main():
        streams = [await engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        return await asyncio.gather(*(collect_stream(s) for s in streams))

    results = run_bounded(main())
    for (texts, tokens, finishes, count), out in zip(results, expected):
        assert count > 1  # streamed in steps, not in one piece
        assert [texts[c.index] for c in out.outputs] == [c.text for c in out.outputs]
        assert [tokens[c.index] for c in out.outputs] == [c.token_ids for c in out.outputs]
        assert [finishes[c.index] for c in out.outputs] == ["length"] * len(out.outputs)
    run_bounded(engine.shutdown())
    assert engine.core.scheduler.kv.pool.num_free_blocks == 255


def test_the_engine_drives_the_core_never_the_llm(checkpoint, llm_kwargs):
    """AsyncEngine steps the LLM's core and output processor; none of the LLM's own methods is called
    (each raises here), and a request streams what LLM.generate returns."""
    with fuseformer.use_backend("reference"):
        (expected,) = LLM(checkpoint, **llm_kwargs).generate(["Hello world"], GREEDY, use_tqdm=False)
        llm = LLM(checkpoint, **llm_kwargs)
        for name in (
            "add_request", "abort", "step", "step_with_arrivals", "launch_step", "finish_step", "generate",
            "chat", "has_unfinished_requests", "has_waiting_requests", "get_default_sampling_params",
        ):  # fmt: skip
            setattr(llm, name, lambda *args, _name=name, **kwargs: pytest.fail(f"AsyncEngine called LLM.{_name}"))
        engine = AsyncEngine(llm)
        assert engine.core is llm.core and engine.output_processor is llm.output_processor
        assert engine.default_sampling_params() == SamplingParams()

        async def main():
            stream = await engine.add_request("x", "Hello world", GREEDY)
            other = await engine.add_request("y", "Say hello", SamplingParams(max_tokens=50, ignore_eos=True))
            await other.__anext__()
            engine.abort("y")
            return await collect_stream(stream), [out async for out in other]

        (texts, tokens, finishes, _), rest = run_bounded(main())
        run_bounded(engine.shutdown())
    assert tokens[0] == expected.outputs[0].token_ids and texts[0] == expected.outputs[0].text
    assert finishes == {0: "length"} and rest[-1].outputs[-1].finish_reason == "abort"
    assert engine.core.scheduler.kv.pool.num_free_blocks == 255


def test_bad_input_raises_at_add_request(engine):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request("bad", [5, 100000], GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("long", [5] * 64, GREEDY)
        stream = await engine.add_request("ok", [5, 6], GREEDY)
        with pytest.raises(ValueError, match="already running"):
            await engine.add_request("ok", [5, 6], GREEDY)
        return await collect_stream(stream)

    _, tokens, finishes, _ = run_bounded(main())
    assert len(tokens[0]) == 10 and finishes == {0: "length"}
    run_bounded(engine.shutdown())


def test_leaving_a_stream_or_abort_frees_blocks_at_once(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def wait_idle():
        while engine.get_stats().num_running or engine.get_stats().kv_cache_usage:
            await asyncio.sleep(0.005)

    async def main():
        a = await engine.add_request("a", "Hello world", params)
        b = await engine.add_request("b", "The quick", params)
        c = await engine.add_request("c", "Say hello", params)
        await a.__anext__()
        await a.aclose()  # leave early
        engine.abort("b")  # abort from outside
        outs = [out async for out in b]
        assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "abort"
        started = asyncio.Event()

        async def consume():
            async for _ in c:
                started.set()

        # A consumer cancelled mid-stream aborts too: cancelled once it has taken an output, not after
        # a fixed sleep (on an idle machine the tiny model streams all 50 tokens in 50 ms).
        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(wait_idle(), 5)
        return engine.num_steps

    steps = run_bounded(main())
    assert steps < 50  # none ran to its 50 tokens
    assert engine.core.scheduler.kv.pool.num_free_blocks == 255
    assert not engine.core.has_unfinished_requests() and not engine.output_processor.has_unfinished_requests()
    run_bounded(engine.shutdown())


def test_shutdown_finishes_within_grace_then_aborts(engine):
    """Steps of >= 20 ms: a 3-token request finishes within a 0.5 s grace period, a 60-token one is aborted."""
    import time

    step = engine.core.step
    engine.core.step = lambda processor: (time.sleep(0.02), step(processor))[1]

    async def main():
        short = await engine.add_request("short", "Hello", SamplingParams(temperature=0, max_tokens=3))
        long = await engine.add_request("long", "Hello", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        await engine.shutdown(grace_s=0.5)
        with pytest.raises(EngineShutdownError):
            await engine.add_request("late", "Hello", GREEDY)
        return await collect_stream(short), await collect_stream(long)

    (_, _, short_finish, _), (_, long_tokens, long_finish, _) = run_bounded(main())
    assert short_finish in ({0: "length"}, {0: "stop"})
    assert long_finish == {0: "abort"} and len(long_tokens[0]) < 60
    assert not engine.is_running and engine.core.scheduler.kv.pool.num_free_blocks == 255


def test_a_failed_step_reaches_every_caller(engine):
    def broken_step(processor):
        raise RuntimeError("device lost")

    engine.core.step = broken_step

    async def main():
        stream = await engine.add_request("x", "Hello", GREEDY)
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect_stream(stream)
        with pytest.raises(EngineDeadError):
            await engine.add_request("y", "Hello", GREEDY)

    run_bounded(main())
    assert not engine.is_running


async def _collect_all(stream):
    """Per completion index: tokens, text, logprobs; and the deltas as they came."""
    deltas, tokens, texts, logprobs = [], {}, {}, {}
    async for out in stream:
        deltas.append(out)
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend(c.logprobs)
    return deltas, tokens, texts, logprobs


def test_outputs_held_under_load_are_joined_not_lost(checkpoint, llm_kwargs):
    """An engine whose handoffs always cost more than its budget: after a request's first output, its
    outputs are held and joined until it finishes. The streams still hold what LLM.generate returns
    (tokens, text, logprobs, every completion of n=2), in fewer deltas than tokens."""
    prompts = ["Hello world", "The quick brown fox"]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),
    ]
    with fuseformer.use_backend("reference"):
        expected = LLM(checkpoint, **llm_kwargs).generate(prompts, params, use_tqdm=False)
        engine = AsyncEngine(LLM(checkpoint, **llm_kwargs), max_stream_overhead=1e-12)

        async def main():
            streams = [await engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            return await asyncio.gather(*(_collect_all(s) for s in streams))

        results = run_bounded(main())
        run_bounded(engine.shutdown())
    for (deltas, tokens, texts, logprobs), out, sp in zip(results, expected, params):
        assert all(len(c.token_ids) == 1 for c in deltas[0].outputs)  # the first output is never held
        assert len(deltas) < sp.max_tokens  # the rest came joined
        assert [tokens[c.index] for c in out.outputs] == [c.token_ids for c in out.outputs]
        assert [texts[c.index] for c in out.outputs] == [c.text for c in out.outputs]
        if sp.logprobs is not None:  # close, not equal: the batch differs (requests join the engine one by one)
            for c in out.outputs:
                assert [lp.keys() for lp in logprobs[c.index]] == [lp.keys() for lp in c.logprobs]
                got = [{t: v.logprob for t, v in lp.items()} for lp in logprobs[c.index]]
                assert got == [pytest.approx({t: v.logprob for t, v in lp.items()}, abs=1e-4) for lp in c.logprobs]
        assert deltas[-1].finished and [c.finish_reason for c in deltas[-1].outputs] == ["length"] * sp.n
    assert engine.core.scheduler.kv.pool.num_free_blocks == 255
    # The budget also rations the waits for the event loop: with (almost) none, no handoff waited.
    counters = engine.counters
    assert counters["held_steps"] > 0 and counters["handoffs"] + counters["held_steps"] == counters["steps"]
    assert counters["wait_s"] < 1e-3 * counters["handoffs"]


def test_an_abort_delivers_the_held_outputs_first(checkpoint, llm_kwargs):
    """Outputs held under load reach the stream before its "abort" delta: the text is a prefix of the
    greedy output, nothing lost."""
    import time

    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with fuseformer.use_backend("reference"):
        (expected,) = LLM(checkpoint, **llm_kwargs).generate(["Hello world"], greedy, use_tqdm=False)
        engine = AsyncEngine(LLM(checkpoint, **llm_kwargs), max_stream_overhead=1e-12)
        step = engine.core.step
        engine.core.step = lambda processor: (time.sleep(0.01), step(processor))[1]

        async def main():
            stream = await engine.add_request("x", "Hello world", greedy)
            first = await stream.__anext__()
            await asyncio.sleep(0.15)  # steps whose outputs are held
            engine.abort("x")
            return [first, *[out async for out in stream]]

        deltas = run_bounded(main())
        run_bounded(engine.shutdown())
    tokens = [t for out in deltas for c in out.outputs for t in c.token_ids]
    assert deltas[-1].outputs[-1].finish_reason == "abort" and len(deltas) == 3  # first, held (joined), abort
    assert 1 < len(tokens) < 40 and tokens == expected.outputs[0].token_ids[: len(tokens)]


# --------------------------------------------------------------------------------------------
# overlap_prefill: a new request's prefill launched behind a decode step in flight
# --------------------------------------------------------------------------------------------
def _hold_steps_in_flight(monkeypatch, seconds: float) -> None:
    """Make every launched step report itself unfinished (``StepHandle.ready`` false) for ``seconds``
    after its launch, so that requests arriving meanwhile land in its window whatever the device's
    speed (on the CPU the work is done already; a tiny model's GPU step takes well under a ms)."""
    import time

    from fuseformer.engine.core import EngineCore, StepHandle

    launched_at: dict[int, float] = {}  # id(handle) -> launch time, while the handle is unfinished
    launch, finish = EngineCore._launch, EngineCore.finish_step  # every step's launch goes through _launch

    def timed_launch(self, *args):
        handle = launch(self, *args)
        launched_at[id(handle)] = time.perf_counter()
        return handle

    def timed_finish(self, handle, processor):
        launched_at.pop(id(handle), None)
        return finish(self, handle, processor)

    monkeypatch.setattr(EngineCore, "_launch", timed_launch)
    monkeypatch.setattr(EngineCore, "finish_step", timed_finish)
    ready_later = property(lambda self: time.perf_counter() - launched_at[id(self)] > seconds)
    monkeypatch.setattr(StepHandle, "ready", ready_later)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_overlap_prefill_streams_hold_what_generate_returns(checkpoint, llm_kwargs, monkeypatch, async_scheduling):
    """AsyncEngine(overlap_prefill=True) with the decode step made to look in flight (a graph replay
    whose event is not ready for a while; on the CPU the work is done already): requests that arrive
    meanwhile are launched behind it, and every stream holds what LLM.generate returns. With async
    scheduling from 2 requests on, both overlaps happen: arrivals launched behind a lone request's
    step, steps of two or more scheduled ahead."""
    from fuseformer.engine.core import StepHandle

    monkeypatch.setattr(StepHandle, "overlappable", property(lambda self: bool(self.scheduler_output.scheduled)))
    _hold_steps_in_flight(monkeypatch, 0.05)
    prompts = ["Hello world", "The quick brown fox", "Say hello", "Once upon"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with fuseformer.use_backend("reference"):
        expected = LLM(checkpoint, **llm_kwargs).generate(prompts, params, use_tqdm=False)
        # (prefill_stream: on the CPU there is no stream to use; the admitted step runs as without it)
        ahead = {}
        if async_scheduling:
            ahead = dict(async_scheduling=True, async_scheduling_min_seqs=2, prefill_stream=True)
        engine = AsyncEngine(LLM(checkpoint, **llm_kwargs, **ahead), overlap_prefill=True)

        results = run_bounded(collect_staggered(engine, prompts, params, 0.03))  # arrive while r0 decodes
        run_bounded(engine.shutdown())
    assert engine.counters["overlapped"] >= 1
    assert (engine.core.num_steps_ahead > 0) == async_scheduling
    for (texts, tokens, finishes, _), out in zip(results, expected):
        assert tokens[0] == out.outputs[0].token_ids and texts[0] == out.outputs[0].text
        assert finishes[0] == "length"
    assert engine.core.scheduler.kv.pool.num_free_blocks == 255


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_stream", [False, True])
def test_overlap_prefill_with_cuda_graphs_matches_generate_gpu(checkpoint, gpu_staggered, monkeypatch, prefill_stream):
    """On the GPU with CUDA-graph decode (fp32): requests arriving while others decode are launched
    behind the decode step in flight (or beside it, on a stream of their own), and every stream holds
    what LLM.generate returns."""
    kwargs, prompts, params, expected = gpu_staggered
    # Decode steps look in flight for 50 ms (a tiny model's replay ends before the next request
    # arrives); the requests, 30 ms apart, are launched behind real graph replays.
    _hold_steps_in_flight(monkeypatch, 0.05)
    engine = AsyncEngine(
        LLM(checkpoint, cuda_graphs=True, prefill_stream=prefill_stream, **kwargs), overlap_prefill=True
    )

    results = run_bounded(collect_staggered(engine, prompts, params, 0.03))
    run_bounded(engine.shutdown())
    assert engine.counters["overlapped"] >= 1
    assert all(len(tokens[0]) == 40 and finishes[0] == "length" for _, tokens, finishes, _ in results)
    # Greedy tokens as generate's, but for a rare near-tie (the step's batch differs: a padded graph
    # replay, a prefill in a step of its own).
    same = sum(tokens[0] == out.outputs[0].token_ids for (_, tokens, _, _), out in zip(results, expected))
    assert same >= 3, same
    assert engine.core.scheduler.kv.pool.num_free_blocks == 255
