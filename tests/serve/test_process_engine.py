"""ProcessEngine: the engine in a child process (spawned; models on their PyTorch references through
FUSEFORMER_BACKEND, which the child inherits). Streams hold what LLM.generate returns; bad input
raises at add_request; closing a stream aborts its request and frees its blocks; shutdown aborts what
is still running; a child that cannot build its engine fails start(); the HTTP server runs on it."""

import asyncio
import functools

import httpx
import pytest

import fuseformer
from fuseformer.engine.async_engine import EngineShutdownError
from fuseformer.engine.llm import LLM
from fuseformer.engine.process_engine import ProcessEngine
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.testing import collect_staggered, collect_stream, run_bounded

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def engine(checkpoint, llm_kwargs, monkeypatch):
    monkeypatch.setenv("FUSEFORMER_BACKEND", "reference")
    eng = ProcessEngine(functools.partial(LLM, str(checkpoint), **llm_kwargs))
    yield eng
    if eng.is_running:
        run_bounded(eng.shutdown(), 120)


def test_streams_hold_what_generate_returns(engine, checkpoint, llm_kwargs):
    prompts = ["Hello world", "The quick brown fox", "Say hello"]
    params = [GREEDY, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True), GREEDY]
    with fuseformer.use_backend("reference"):
        expected = LLM(checkpoint, **llm_kwargs).generate(prompts, params, use_tqdm=False)
    assert engine.tokenizer is not None and engine.max_model_len == llm_kwargs["max_model_len"]

    async def main():
        streams = [await engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        return await asyncio.gather(*(collect_stream(s) for s in streams))

    results = run_bounded(main(), 120)
    for (texts, tokens, finishes, count), out in zip(results, expected):
        assert count > 1  # streamed in steps
        assert [tokens[c.index] for c in out.outputs] == [c.token_ids for c in out.outputs]
        assert [texts[c.index] for c in out.outputs] == [c.text for c in out.outputs]
        assert [finishes[c.index] for c in out.outputs] == ["length"] * len(out.outputs)
    assert engine.counters["steps"] > 0 and engine.get_stats().kv_cache_usage == 0.0
    # The child's step records came along, the first a prompt's.
    totals = engine.step_log.totals()
    assert engine.step_log.count >= engine.counters["steps"] and engine.step_log.records[0].kind == "prefill"
    assert sum(t["steps"] for t in totals.values()) == engine.step_log.count and "decode" in totals


def test_bad_input_raises_and_the_engine_goes_on(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("long", list(range(1, 100)), GREEDY)
        with pytest.raises(ValueError, match="already running"):
            s = await engine.add_request("dup", "Hello", SamplingParams(max_tokens=30, ignore_eos=True))
            await engine.add_request("dup", "Hello", GREEDY)
        s.close()
        return await collect_stream(await engine.add_request("ok", "Hello world", GREEDY))

    _, tokens, finishes, _ = run_bounded(main(), 120)
    assert len(tokens[0]) == 10 and finishes == {0: "length"}


def test_closing_a_stream_aborts_and_frees_its_blocks(engine):
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main():
        stream = await engine.add_request("r", "Hello world", long)
        async for out in stream:
            assert out.outputs[0].token_ids
            break  # leaves after the first delta: closes the stream
        for _ in range(500):
            if engine.get_stats().kv_cache_usage == 0.0 and engine.num_unfinished_requests == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert run_bounded(main(), 120)


def test_shutdown_aborts_what_runs_and_refuses_new_requests(engine):
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def main():
        stream = await engine.add_request("r", "Hello world", long)
        await stream.get_batch()
        await engine.shutdown(0.0)
        rest = []
        while batch := await stream.get_batch():
            rest += batch
        with pytest.raises(EngineShutdownError):
            await engine.add_request("late", "Hello", GREEDY)
        return rest

    rest = run_bounded(main(), 120)
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
    assert not engine.is_running


def test_a_child_that_cannot_build_fails_start(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEFORMER_BACKEND", "reference")
    with pytest.raises(RuntimeError, match="building the engine failed"):
        ProcessEngine(functools.partial(LLM, str(tmp_path / "missing"), device="cpu"))


def test_the_server_runs_on_a_process_engine(engine, start_server):
    body = dict(model="tiny-llama", prompt="Hello world", max_tokens=6, temperature=0, ignore_eos=True)
    with start_server(engine) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        streamed = httpx.post(f"{url}/v1/completions", json=body | dict(stream=True), timeout=60)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        bad = httpx.post(f"{url}/v1/completions", json=body | dict(prompt="x " * 200), timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.gpu
def test_process_engine_on_the_gpu_with_graphs_and_overlap(checkpoint, gpu_staggered):
    """On the GPU (Triton kernels, fp32): the child process builds its engine with CUDA-graph decode
    and overlap_prefill; requests arriving while others decode all complete, with LLM.generate's greedy
    tokens but for a rare near-tie."""
    kwargs, prompts, params, expected = gpu_staggered
    engine = ProcessEngine(functools.partial(LLM, str(checkpoint), cuda_graphs=True, **kwargs), overlap_prefill=True)

    async def main():
        results = await collect_staggered(engine, prompts, params, 0.005)
        await engine.shutdown()
        return results

    results = run_bounded(main(), 120)
    assert all(len(tokens[0]) == 40 and finishes[0] == "length" for _, tokens, finishes, _ in results)
    same = sum(tokens[0] == out.outputs[0].token_ids for (_, tokens, _, _), out in zip(results, expected))
    assert same >= 3, same
