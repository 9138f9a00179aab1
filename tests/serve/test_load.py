"""The server under load and faults: 64 concurrent streaming clients (each completes exactly once, with
the offline engine's text, and the KV cache is empty afterwards); clients that drop mid-stream or
mid-request are aborted at once and leave no running request and no used block; SIGTERM on a
server subprocess lets an in-flight request finish and exits 0."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

import fuseformer
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams

MODEL = "tiny-llama"  # the name tests/serve/conftest.py serves the model as


def _wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_64_concurrent_streaming_clients(checkpoint, start_server, read_metric, llm_kwargs):
    """64 streams at once on 255 blocks of 4 tokens: more than fit (so requests are preempted and
    recomputed); every request completes exactly once with its own text, none lost or duplicated."""
    num_clients, max_tokens = 64, 12
    prompts = [f"Hello {i} the quick fox {i * 7}" for i in range(num_clients)]
    with fuseformer.use_backend("reference"):
        offline = LLM(checkpoint, **llm_kwargs)
        params = SamplingParams(temperature=0.7, seed=1, max_tokens=max_tokens, ignore_eos=True)
        expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]

    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens, temperature=0.7, seed=1, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, ids, finishes, usage = "", set(), [], None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                if c.finish_reason is not None:
                    finishes.append(c.finish_reason)
        return i, ids, text, finishes, usage

    async def run(url):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(num_clients))), 90)

    with start_server(checkpoint, max_num_seqs=64) as (url, engine):
        start = time.monotonic()
        results = asyncio.run(run(url))
        seconds = time.monotonic() - start
        response_ids = [next(iter(r[1])) for r in results]
        assert all(len(r[1]) == 1 for r in results) and len(set(response_ids)) == num_clients
        for i, _, text, finishes, usage in results:
            assert finishes == ["length"], (i, finishes)  # finished exactly once
            assert usage.completion_tokens == max_tokens
            assert text == expected[i], i  # its own text: nothing crossed between requests
        assert engine.core.scheduler.num_preemptions > 0  # the cache was over-subscribed
        _wait_until(lambda: read_metric(url, "fuseformer_kv_cache_usage_perc") == 0.0, 5, "KV usage 0")
        assert read_metric(url, "fuseformer_num_requests_running") == 0
        assert read_metric(url, "fuseformer_num_requests_waiting") == 0
        assert read_metric(url, "fuseformer_generation_tokens_total") == num_clients * max_tokens
        assert engine.core.scheduler.kv.pool.num_free_blocks == 255
    assert seconds < 90


def _slow_steps(engine, seconds):
    """Make each engine step take at least ``seconds`` and record finished and aborted request ids."""
    core, processor = engine.core, engine.output_processor
    step, abort = core.step, processor.abort
    finished, aborted = [], []

    def slow_step(output_processor):
        time.sleep(seconds)
        outs = step(output_processor)
        finished.extend(o.request_id for o in outs if o.finished)
        return outs

    def recording_abort(request_id):
        aborted.append(request_id)
        return abort(request_id)

    core.step, processor.abort = slow_step, recording_abort
    return finished, aborted


def test_clients_that_drop_mid_stream_are_aborted(checkpoint, start_server):
    """8 streaming clients read two chunks and hang up; 4 non-streaming clients time out. Each request
    is aborted (not finished) and afterwards no request runs and no block is used."""
    with start_server(checkpoint) as (url, engine):
        finished, aborted = _slow_steps(engine, 0.02)  # 50 tokens take >= 1 s: the drops come first
        body = dict(model=MODEL, prompt="Hello world", max_tokens=50, extra_body=None)
        del body["extra_body"]

        async def drop_streaming(client, i):
            async with client.stream("POST", "/v1/completions", json=body | dict(stream=True, seed=i)) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if chunks == 2:
                            return json.loads(line[6:])["id"]

        async def drop_waiting(client, i):
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body | dict(seed=100 + i), timeout=0.3)

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                ids = await asyncio.gather(*(drop_streaming(client, i) for i in range(8)))
                await asyncio.gather(*(drop_waiting(client, i) for i in range(4)))
                return ids

        ids = asyncio.run(run())
        _wait_until(lambda: len(aborted) == 12, 5, "12 aborts")
        assert set(ids) <= set(aborted) and len(set(aborted)) == 12
        assert not set(aborted) & set(finished)  # aborted, not run to the end
        _wait_until(lambda: engine.get_stats().kv_cache_usage == 0, 5, "KV usage 0")
        stats = engine.get_stats()
        assert (stats.num_running, stats.num_waiting, engine.num_unfinished_requests) == (0, 0, 0)
        assert engine.core.scheduler.kv.pool.num_free_blocks == 255 and not engine.core.scheduler.requests
        # and it still serves
        r = httpx.post(f"{url}/v1/completions", json=body | dict(max_tokens=3), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
@pytest.mark.parametrize("finishes", [True, False], ids=["in-flight-finishes", "past-timeout-aborted"])
def test_sigterm_stops_accepting_and_exits_0(checkpoint, finishes, async_scheduling):
    """SIGTERM mid-stream: the in-flight request finishes (within --shutdown-timeout) or, past it, is
    aborted and its stream ends with an error event and [DONE]; new connections are refused; the
    process exits 0."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"FUSEFORMER_BACKEND": "reference"}
    cmd = [
        sys.executable, "-m", "fuseformer.serve.cli", "serve", "--model", str(checkpoint), "--port", str(port),
        "--host", "127.0.0.1", "--device", "cpu", "--num-kv-blocks", "2048", "--block-size", "4",
        "--max-model-len", "64", "--served-model-name", MODEL, "--log-level", "critical",
        "--shutdown-timeout", "30" if finishes else "0.1",
    ] + (["--async-scheduling"] if async_scheduling else [])  # fmt: skip
    # 40 tokens; or 128 completions x 60 tokens, which take well over 0.1 s on the CPU
    body = dict(model=MODEL, prompt="Hello", max_tokens=40, stream=True)
    if not finishes:
        body |= dict(n=128, max_tokens=60, ignore_eos=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy():
            assert proc.poll() is None, proc.communicate()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        _wait_until(healthy, 60, "the server to start")
        rest = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            try:
                rest = [line for line in lines if line.startswith("data: ")]
                cut = False
            except httpx.RemoteProtocolError:  # the server cancelled the response
                cut = True
        if finishes:
            assert not cut and rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        else:
            assert not cut and rest[-1] == "data: [DONE]", rest[-3:]
            assert json.loads(rest[-2][6:])["error"]["code"] == "server_shutdown"
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "args, match",
    [
        ([], "no --model"),
        (["--model", "/nonexistent/dir"], "is not a directory"),
        (["--port", "70000"], "--port"),
        (["--max-stream-overhead", "1.5"], "--max-stream-overhead"),
        (["--device", "cpu", "--cuda-graphs"], "--cuda-graphs needs a CUDA device"),
    ],
)
def test_serve_cli_bad_arguments_exit_2(args, match, checkpoint, capsys, monkeypatch):
    from fuseformer.serve import cli

    # Without --model, serve takes the built-in model when one is installed (and would serve it on port
    # 8000 until killed): the "no --model" error is the case without one.
    monkeypatch.setattr("fuseformer.engine.cli.DEFAULT_MODEL", None)
    if args and args[0] in ("--port", "--max-stream-overhead", "--device"):
        args = ["--model", str(checkpoint), *args]
    assert cli.main(["serve", *args]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, cuda_available, expected",
    [
        ([], False, False),
        ([], True, True),
        (["--device", "cpu"], True, False),
        (["--device", "cuda:0"], True, True),
        (["--no-cuda-graphs"], True, False),
        (["--cuda-graphs"], True, True),
        (["--enforce-eager"], True, False),
        (["--enforce-eager", "--cuda-graphs"], True, True),
    ],
)
def test_serve_cuda_graphs_default_on_with_a_cuda_device(argv, cuda_available, expected, monkeypatch):
    import argparse

    import torch

    from fuseformer.serve import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers(dest="command"))
    assert cli._use_cuda_graphs(parser.parse_args(["serve", *argv])) is expected
    # --async-scheduling, --overlap-prefill and --prefill-stream follow the same rule.
    for flag in ("async-scheduling", "overlap-prefill", "prefill-stream"):
        args = parser.parse_args(["serve", *(a.replace("cuda-graphs", flag) for a in argv)])
        if args.enforce_eager and getattr(args, flag.replace("-", "_")):
            continue  # the flag given, on, beside --enforce-eager: checked above for --cuda-graphs
        assert cli._on_cuda_unless_set(args, getattr(args, flag.replace("-", "_"))) is expected


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cuda_graphs, async_scheduling, overlap",
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
    ids=["eager", "graphs", "async", "served"],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_256_concurrent_streams_at_real_layer_sizes(
    dtype, cuda_graphs, async_scheduling, overlap, start_server, read_metric
):
    """On the GPU (Triton kernels): hidden 1024, head dim 128, GQA 8/2, vocab 4096, random weights;
    256 streaming clients with prompts of 20-700 tokens (half sharing a 300-token prefix) on a cache
    too small for all of them at once: every request completes exactly once with its max_tokens, the
    prefix cache hits, and the cache is empty afterwards. Also with async scheduling, as
    ``fuseformer serve`` runs on CUDA (from 8 running requests on), and ("served") with every default of
    ``fuseformer serve`` on CUDA: that and ``overlap_prefill`` with ``prefill_stream``."""
    import torch

    from fuseformer.bench.engine import build_models

    shape = dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=4096, tie_word_embeddings=False,
    )  # fmt: skip
    _, model = build_models(shape, "cuda", getattr(torch, dtype))
    llm = LLM(
        model, device="cuda", max_model_len=1024, num_kv_blocks=1 + 64 * 16, block_size=16, cuda_graphs=cuda_graphs,
        async_scheduling=async_scheduling, async_scheduling_min_seqs=8, prefill_stream=overlap,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 4096, (300,), generator=gen).tolist()
    lengths = torch.randint(20, 400, (256,), generator=gen).tolist()
    prompts = [
        (prefix if i % 2 else []) + torch.randint(0, 4096, (n,), generator=gen).tolist() for i, n in enumerate(lengths)
    ]
    max_tokens = [int(t) for t in torch.randint(1, 200, (256,), generator=gen)]

    async def one(client, i):
        body = dict(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0.8, seed=i, stream=True,
                    ignore_eos=True, stream_options={"include_usage": True})  # fmt: skip
        finishes, usage = [], None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    finishes += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
        return finishes, usage

    async def run(url):
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(256))), 300)

    with start_server(llm, backend="auto", overlap_prefill=overlap) as (url, engine):
        results = asyncio.run(run(url))
        for i, (finishes, usage) in enumerate(results):
            assert finishes == ["length"], (i, finishes)
            assert usage["completion_tokens"] == max_tokens[i] and usage["prompt_tokens"] == len(prompts[i])
        _wait_until(lambda: read_metric(url, "fuseformer_kv_cache_usage_perc") == 0.0, 10, "KV usage 0")
        assert read_metric(url, "fuseformer_prefix_cache_hit_rate") > 0.2
        assert engine.core.scheduler.num_preemptions > 0
        assert (engine.core.num_steps_ahead > 0) == async_scheduling


def test_serving_process_settings_are_restored():
    import gc
    import sys

    from fuseformer.serve.cli import SWITCH_INTERVAL_S, serving_process

    before = sys.getswitchinterval()
    with serving_process():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert gc.get_freeze_count() > 0
    assert sys.getswitchinterval() == pytest.approx(before) and gc.get_freeze_count() == 0
