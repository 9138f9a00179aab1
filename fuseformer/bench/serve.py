"""``fuseformer bench serve``: the HTTP server against the offline engine on the same workload.

Random weights at the Llama-3-8B shape (``bench/engine.py``'s model building), one ``LLM`` shared by
both measurements (the offline run first, then the server wraps the same object), prompts as random
token ids, greedy, EOS ignored. The server runs in this process on a loopback port (uvicorn on a
thread), and so does the client (asyncio + httpx, streaming, SSE lines counted, not parsed): its CPU
time competes with the server's, as a client on the same host would.

Records:
- ``offline``: ``LLM.generate`` on N requests -> output tok/s.
- ``server, unlimited rate``: the same N requests sent at once over HTTP (streaming) -> output tok/s,
  and its ratio to offline (issue 6's bar: >= 0.9).
- ``server, lone request``: p50 TTFT (client-side: request sent -> first token chunk) of requests sent
  one at a time.
- ``server, 1 req/s``: p50 TTFT of requests arriving once a second (Poisson arrivals would be vLLM's
  choice; fixed 1 s gaps make runs comparable), and its ratio to the lone p50 (the bar: <= 1.1).
Every phase is bounded in requests and in wall time (``_PHASE_TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import statistics
import threading
import time
from typing import Any

import torch

Record = dict[str, Any]

_PHASE_TIMEOUT_S = 300.0


def _start_server(llm, model_name: str):
    import uvicorn

    from fuseformer.engine.async_engine import AsyncEngine
    from fuseformer.serve.app import create_app

    engine = AsyncEngine(llm, start=False)
    app = create_app(engine, model_name)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("bench serve: the server did not start")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def stop() -> None:
        server.should_exit = True
        thread.join(60)
        sock.close()

    return url, stop


async def _one(client, model_name: str, prompt: list[int], output_len: int) -> tuple[float, float, int]:
    """(TTFT s, total s, token chunks) of one streamed completion."""
    body = dict(
        model=model_name, prompt=prompt, max_tokens=output_len, temperature=0, ignore_eos=True, stream=True
    )  # fmt: skip
    start = time.perf_counter()
    ttft, chunks = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"bench serve: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                chunks += 1
    return ttft if ttft is not None else float("nan"), time.perf_counter() - start, chunks


async def _unlimited(url: str, model_name: str, prompts: list[list[int]], output_len: int) -> float:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=_PHASE_TIMEOUT_S, limits=limits) as client:
        await _one(client, model_name, prompts[0][:8], 4)  # warm the connection path
        start = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(_one(client, model_name, p, output_len) for p in prompts)), _PHASE_TIMEOUT_S
        )
        return time.perf_counter() - start


async def _lone(url: str, model_name: str, prompts: list[list[int]], output_len: int) -> list[float]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=_PHASE_TIMEOUT_S) as client:
        ttfts = []
        deadline = time.monotonic() + _PHASE_TIMEOUT_S
        for p in prompts:
            if time.monotonic() > deadline:
                break
            ttfts.append((await _one(client, model_name, p, output_len))[0])
        return ttfts


async def _at_rate(url: str, model_name: str, prompts: list[list[int]], output_len: int, rate: float) -> list[float]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=_PHASE_TIMEOUT_S) as client:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(_one(client, model_name, p, output_len)))
            await asyncio.sleep(1.0 / rate)
        results = await asyncio.wait_for(asyncio.gather(*tasks), _PHASE_TIMEOUT_S)
        return [r[0] for r in results]


def run_serve_case(
    shape: dict,
    num_requests: int,
    input_len: int,
    output_len: int,
    *,
    num_lone: int = 10,
    num_rated: int = 20,
    rate: float = 1.0,
    shape_name: str = "custom",
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    **llm_kwargs: Any,
) -> list[Record]:
    """Offline vs server throughput on ``num_requests`` x (input_len, output_len); p50 TTFT of
    ``num_rated`` requests at ``rate`` req/s vs ``num_lone`` lone ones (same lengths)."""
    from fuseformer.bench.engine import build_models
    from fuseformer.engine.llm import LLM
    from fuseformer.engine.sampling_params import SamplingParams

    def progress(msg: str) -> None:
        print(f"bench serve: {msg}", flush=True)

    progress(f"building {shape_name} ...")
    hf, ours = build_models(shape, device, dtype)
    del hf
    gc.collect()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (num_requests, input_len), generator=gen).tolist()
    light = torch.randint(0, shape["vocab_size"], (num_lone + num_rated, input_len), generator=gen).tolist()
    case = dict(model=shape_name, requests=num_requests, input_len=input_len, output_len=output_len, dtype=str(dtype))
    name = "bench"
    llm = LLM(ours, device=device, max_model_len=input_len + output_len, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    records: list[Record] = []

    llm.generate(prompts[: min(8, num_requests)], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    offline_s = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    offline_tok_s = num_out / offline_s
    records.append(
        dict(bench="serve", impl="offline LLM.generate", **case, seconds=offline_s, output_tok_s=offline_tok_s)
    )
    progress(f"offline {offline_tok_s:.0f} output tok/s; starting the server")

    url, stop = _start_server(llm, name)
    try:
        seconds = asyncio.run(_unlimited(url, name, prompts, output_len))
        tok_s = num_requests * output_len / seconds
        records.append(
            dict(
                bench="serve", impl="server, unlimited rate", **case, seconds=seconds, output_tok_s=tok_s,
                ratio_to_offline=tok_s / offline_tok_s,
            )
        )  # fmt: skip
        progress(f"server, unlimited rate: {tok_s:.0f} output tok/s ({tok_s / offline_tok_s:.3f} of offline)")
        lone = asyncio.run(_lone(url, name, light[:num_lone], output_len))
        lone_p50 = statistics.median(lone)
        records.append(
            dict(
                bench="serve",
                impl="server, lone request",
                **(case | dict(requests=len(lone))),
                p50_ttft_ms=1e3 * lone_p50,
            )
        )
        progress(f"lone requests: p50 TTFT {1e3 * lone_p50:.1f} ms")
        rated = asyncio.run(_at_rate(url, name, light[num_lone:], output_len, rate))
        rated_p50 = statistics.median(rated)
        records.append(
            dict(
                bench="serve", impl=f"server, {rate:g} req/s", **(case | dict(requests=len(rated))),
                p50_ttft_ms=1e3 * rated_p50,
                ratio_to_lone=rated_p50 / lone_p50,
            )
        )  # fmt: skip
    finally:
        stop()
        del llm
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return records


def format_table(records: list[Record]) -> str:
    lines = [f"{'impl':<24} {'output tok/s':>12} {'p50 TTFT ms':>11} {'ratio':>7}"]
    for r in records:
        tok_s = f"{r['output_tok_s']:.0f}" if "output_tok_s" in r else "-"
        ttft = f"{r['p50_ttft_ms']:.1f}" if "p50_ttft_ms" in r else "-"
        ratio = r.get("ratio_to_offline", r.get("ratio_to_lone"))
        lines.append(f"{r['impl']:<24} {tok_s:>12} {ttft:>11} {'-' if ratio is None else f'{ratio:.3f}':>7}")
    return "\n".join(lines)


def bench_serve(quick: bool = False) -> list[Record]:
    """Issue 6's measurement on a CUDA GPU: 256 requests x (256 in, 256 out) at the Llama-3-8B shape,
    then 10 lone requests and 20 at 1 req/s; ``quick``: the Llama-3.2-1B shape, 64 requests, 4 + 8."""
    from fuseformer.bench.engine import SHAPES

    name = "llama3.2-1b" if quick else "llama3-8b"
    n, lone, rated = (64, 4, 8) if quick else (256, 10, 20)
    records = run_serve_case(SHAPES[name], n, 256, 256, num_lone=lone, num_rated=rated, shape_name=name)
    print(format_table(records))
    return records
