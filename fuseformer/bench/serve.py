"""``fuseformer bench serve``: the HTTP server against the offline engine on the same workload.

Random weights at the Llama-3-8B shape (``bench/engine.py``'s model building), one ``LLM`` shared by
both measurements (the offline run first, then the server wraps the same object), prompts as random
token ids, greedy, EOS ignored. The server runs in this process on a loopback port (uvicorn on a
thread, as ``fuseformer serve`` runs it). The client (asyncio streams, a connection per request, SSE
events counted, not parsed) runs in a process of its own, started once (spawn) and given one phase at
a time, as vLLM's benchmark_serving is a process of its own: a client in the server's process took
the GIL from the server and the engine thread (on the CPU proxy, more of it than the server did).

Records:
- ``offline``: ``LLM.generate`` on N requests -> output tok/s.
- ``server, unlimited rate``: the same N requests sent at once over HTTP (streaming) -> output tok/s,
  and its ratio to offline (issue 6's bar: >= 0.9).
- ``server, lone request``: p50 TTFT (client-side: connect and send -> first token chunk) of requests
  sent one at a time.
- ``server, 1 req/s[, overlap_prefill[ + prefill_stream]]``: p50 TTFT of requests arriving once a second
  (Poisson arrivals would be vLLM's choice; fixed 1 s gaps make runs comparable), and its ratio to the
  lone p50 (the bar: <= 1.1): as served (``as_served``; on CUDA ``fuseformer serve`` launches a new
  request's prefill behind the decode step in flight, ``AsyncEngine.overlap_prefill``, on a stream of
  its own, ``EngineCore.prefill_stream``), and with the other settings beside it.
Every phase is bounded in requests and in wall time (``_PHASE_TIMEOUT_S``)."""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import socket
import statistics
import sys
import threading
import time
import urllib.parse
from typing import Any

import torch

from fuseformer.engine.step_log import p50_max, summarize, totals_since

Record = dict[str, Any]

_PHASE_TIMEOUT_S = 300.0


def _start_server(llm, model_name: str, overlap_prefill: bool = False):
    """Serve an LLM's engine (an AsyncEngine with ``overlap_prefill``) on a loopback port: (url, stop, engine)."""
    import uvicorn

    from fuseformer.engine.async_engine import AsyncEngine
    from fuseformer.serve.app import create_app

    engine = AsyncEngine(llm, start=False, overlap_prefill=overlap_prefill)
    app = create_app(engine, model_name)
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (as
    # uvicorn's own, made by getaddrinfo, do). Without it Nagle held a response's first token chunk
    # behind its headers until the client's delayed ACK, ~40 ms, on reused connections: the lone p50
    # TTFT on the CPU proxy was 45 ms for ~5 ms of work.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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

    return url, stop, engine


async def _one(url: str, model_name: str, prompt: list[int], output_len: int) -> tuple[float, float, int]:
    """(TTFT s, total s, token chunks) of one streamed completion, on a connection of its own (as
    vLLM's benchmark_serving opens one per request). HTTP/1.1 on asyncio streams, not httpx: the
    client counts ``data: {`` in what it reads instead of parsing each line, so that it costs a few
    microseconds per read, not tens per token (httpx's h11 parsing, on the CPU proxy, took more CPU
    per token than the server did, and it must keep up with 256 streams at the engine's rate)."""
    split = urllib.parse.urlsplit(url)
    body = json.dumps(
        dict(model=model_name, prompt=prompt, max_tokens=output_len, temperature=0, ignore_eos=True, stream=True)
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {split.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(split.hostname, split.port)
    ttft, chunks, first, tail, done = None, 0, b"", b"", False
    try:
        writer.write(head + body)
        while data := await reader.read(1 << 16):
            # A marker split across two reads is found once: the tail kept is shorter than "data: {".
            n = (tail[-6:] + data).count(b"data: {")
            if n and ttft is None:
                ttft = time.perf_counter() - start
            chunks += n
            done = done or b"data: [DONE]" in tail + data
            first = first or data
            tail = data[-16:]
    finally:
        writer.close()
    if not first.startswith(b"HTTP/1.1 200") or not done:
        raise RuntimeError(f"bench serve: the request failed: {first[:300]!r}")
    return ttft if ttft is not None else float("nan"), time.perf_counter() - start, chunks


async def _unlimited(url: str, model_name: str, prompts: list[list[int]], output_len: int) -> float:
    await _one(url, model_name, prompts[0][:8], 4)  # warm the path
    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(_one(url, model_name, p, output_len) for p in prompts)), _PHASE_TIMEOUT_S)
    return time.perf_counter() - start


async def _lone(url: str, model_name: str, prompts: list[list[int]], output_len: int) -> list[float]:
    ttfts = []
    deadline = time.monotonic() + _PHASE_TIMEOUT_S
    for p in prompts:
        if time.monotonic() > deadline:
            break
        ttfts.append((await _one(url, model_name, p, output_len))[0])
    return ttfts


async def _at_rate(url: str, model_name: str, prompts: list[list[int]], output_len: int, rate: float) -> list[float]:
    tasks = []
    for p in prompts:
        tasks.append(asyncio.ensure_future(_one(url, model_name, p, output_len)))
        await asyncio.sleep(1.0 / rate)
    results = await asyncio.wait_for(asyncio.gather(*tasks), _PHASE_TIMEOUT_S)
    return [r[0] for r in results]


_PHASES = {"unlimited": _unlimited, "lone": _lone, "rated": _at_rate}


def _client_main(conn, url: str, model_name: str) -> None:
    """The client process: runs the phases the parent sends, ``(name, args)``, until it sends None;
    answers ("ok", result) or ("error", message) for each."""
    conn.send(("ok", "ready"))
    while (msg := conn.recv()) is not None:
        phase, args = msg
        try:
            result = asyncio.run(_PHASES[phase](url, model_name, *args))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("ok", result))
    conn.close()


class _ClientProcess:
    """The benchmark's client in a process of its own (spawned: no copy of the parent's threads or CUDA
    state), so that its CPU time and GIL are not the server's."""

    def __init__(self, url: str, model_name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_client_main, args=(child, url, model_name), daemon=True)
        self._proc.start()
        child.close()
        self._call(None, 120.0)  # started and imported

    def run(self, phase: str, *args: Any) -> Any:
        return self._call((phase, args), _PHASE_TIMEOUT_S + 30)

    def _call(self, msg: Any, timeout: float) -> Any:
        if msg is not None:
            self._conn.send(msg)
        if not self._conn.poll(timeout):
            self.close()
            raise RuntimeError(f"bench serve: the client process did not answer within {timeout:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"bench serve: the client process died (exit code {self._proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"bench serve: the client failed: {value}")
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def run_serve_case(
    shape: dict,
    num_requests: int,
    input_len: int,
    output_len: int,
    *,
    num_lone: int = 10,
    num_rated: int = 20,
    num_unlimited: int = 2,
    rate: float = 1.0,
    rounds: int = 3,
    shape_name: str = "custom",
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    overlap_prefill: bool = False,
    **llm_kwargs: Any,
) -> list[Record]:
    """Offline vs server throughput on ``num_requests`` x (input_len, output_len), the server's run
    ``num_unlimited`` times (each a record: the ratio depends on how arrivals fall on steps); p50 TTFT
    of ``num_rated`` requests at ``rate`` req/s vs ``num_lone`` lone ones (same lengths), interleaved in
    ``rounds`` rounds (``_light_load``). The server (``AsyncEngine``, as ``fuseformer serve`` runs)
    serves with ``overlap_prefill`` (and ``llm_kwargs``' ``prefill_stream``) as given."""
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

    def fresh(count: int) -> list[list[int]]:
        """Prompts of their own for each phase: the prefix cache (on, as served) must not serve one phase's
        prefills from an earlier phase's blocks (a second run of the same prompts skipped its prefills and
        ran at 1.33x the offline figure)."""
        return torch.randint(0, shape["vocab_size"], (count, input_len), generator=gen).tolist()

    warm, prompts = fresh(num_requests), fresh(num_requests)
    case = dict(model=shape_name, requests=num_requests, input_len=input_len, output_len=output_len, dtype=str(dtype))
    case["cuda_graphs"] = bool(llm_kwargs.get("cuda_graphs", False))
    case["async_scheduling"] = bool(llm_kwargs.get("async_scheduling", False))
    case["overlap_prefill"] = overlap_prefill
    case["prefill_stream"] = bool(llm_kwargs.get("prefill_stream", False))
    name = "bench"
    llm = LLM(ours, device=device, max_model_len=input_len + output_len, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    records: list[Record] = []

    # Warm-up on the offline run's shapes (prefill chunks, decode batches): Triton compiles and plan
    # lookups out of the timed runs (a warm-up of 8 prompts left the offline run its 8192-token chunks).
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    sync()
    # With async_scheduling, a synchronous offline run first, on prompts of its own (a record for
    # comparison); the ratios are to the offline run with the server's settings. The same engine runs
    # it: its AsyncScheduler schedules ahead no step of fewer than min_seqs requests.
    core = llm.core
    served_min_seqs = getattr(core.scheduler, "min_seqs", None)
    for ahead in (False, True) if core.async_scheduling else (False,):
        if core.async_scheduling:
            core.scheduler.min_seqs = served_min_seqs if ahead else sys.maxsize
        steps_before, ahead_before = core.step_log.totals(), core.num_steps_ahead
        start = time.perf_counter()
        outs = llm.generate(
            prompts if ahead == case["async_scheduling"] else fresh(num_requests), params, use_tqdm=False
        )
        sync()
        offline_s = time.perf_counter() - start
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        offline_tok_s = num_out / offline_s
        steps = totals_since(core.step_log.totals(), steps_before)
        impl = "offline LLM.generate" + (", async_scheduling" if ahead else "")
        records.append(
            dict(
                bench="serve", impl=impl, **(case | dict(async_scheduling=ahead)), seconds=offline_s,
                output_tok_s=offline_tok_s, steps=steps, steps_ahead=core.num_steps_ahead - ahead_before,
            )
        )  # fmt: skip
        progress(f"{impl}: {offline_tok_s:.0f} output tok/s; steps {steps}")
    progress(f"offline {offline_tok_s:.0f} output tok/s; starting the server")
    spec = dict(
        requests=num_requests,
        output_len=output_len,
        lone=num_lone,
        rated=num_rated,
        rate=rate,
        unlimited=num_unlimited,
        rounds=rounds,
    )

    stop = None
    try:
        url, stop, engine = _start_server(llm, name, overlap_prefill)
        records += _server_phases(url, engine, "server", case, offline_tok_s, fresh, spec, progress)
    finally:
        if stop is not None:
            stop()
    return records


def _server_phases(url, engine, label, case, offline_tok_s, fresh, spec, progress) -> list[Record]:
    """The server phases against one engine: unlimited rate (``spec["unlimited"]`` times), then the
    light-load phases (``_light_load``). ``label`` starts each record's impl ("server")."""
    from fuseformer.serve.cli import serving_process

    num_requests, output_len = spec["requests"], spec["output_len"]
    records: list[Record] = []
    client = None
    with serving_process():  # as `fuseformer serve` runs
        try:
            client = _ClientProcess(url, "bench")
            for attempt in range(spec["unlimited"]):
                before = dict(engine.counters)
                steps_before = engine.step_log.totals()
                seconds = client.run("unlimited", fresh(num_requests), output_len)
                tok_s = num_requests * output_len / seconds
                # What the server cost the engine: its steps, the time in them, the handoffs to the event
                # loop and the time the engine waited in them, the steps whose outputs were held back.
                counters = {k: round(v - before[k], 4) for k, v in engine.counters.items()}
                steps = totals_since(engine.step_log.totals(), steps_before)
                records.append(
                    dict(
                        bench="serve", impl=f"{label}, unlimited rate", **case, attempt=attempt, seconds=seconds,
                        output_tok_s=tok_s, ratio_to_offline=tok_s / offline_tok_s, engine=counters, steps=steps,
                    )
                )  # fmt: skip
                progress(
                    f"{label}, unlimited rate: {tok_s:.0f} output tok/s ({tok_s / offline_tok_s:.3f} of offline); "
                    f"engine {counters}; steps {steps}"
                )
            records += _light_load(client, engine, label, case, fresh, spec, progress)
        finally:
            if client is not None:
                client.close()
    return records


def _light_load(client, engine, label, case, fresh, spec, progress) -> list[Record]:
    """Lone requests (as served) and requests at ``spec["rate"]``: as served, and with the other settings
    of ``AsyncEngine.overlap_prefill`` and, on CUDA, ``EngineCore.prefill_stream``; interleaved in
    ``spec["rounds"]`` rounds of a share of each: the host's speed drifts between phases (a lone p50 of 20 ms in one run, 41 ms in another), so the ratio compares
    samples taken side by side. A variant is (kind, overlap_prefill, prefill_stream)."""
    output_len, rate, rounds = spec["output_len"], spec["rate"], spec["rounds"]
    served = (engine.overlap_prefill, engine.core.prefill_stream)
    variants = [("lone", *served), ("rated", *served)]
    settings = [(False, False), (True, False)]
    if engine.core.runner.device.type == "cuda":
        settings.append((True, True))
    variants += [("rated", *s) for s in settings if s != served]
    times = engine.first_output_times  # RequestStream.times of the engine's first outputs
    got = {v: dict(ttft=[], times=[], steps=[], overlapped=0) for v in variants}
    for r in range(rounds):
        for v in variants:
            kind, overlap, stream = v
            total = spec["lone"] if kind == "lone" else spec["rated"]
            count = total // rounds + (1 if r < total % rounds else 0)
            if not count:
                continue
            engine.overlap_prefill, engine.core.prefill_stream = overlap, stream
            times.clear()
            before, logged = engine.counters["overlapped"], engine.step_log.count
            try:
                args = (rate,) if kind == "rated" else ()
                got[v]["ttft"] += client.run(kind, fresh(count), output_len, *args)
            finally:
                engine.overlap_prefill, engine.core.prefill_stream = served
            got[v]["steps"] += engine.step_log.since(logged)
            got[v]["times"] += [t for t in times if "added" in t]
            got[v]["overlapped"] += engine.counters["overlapped"] - before
    records = []
    lone_p50 = statistics.median(got[variants[0]]["ttft"])
    for v in variants:
        kind, overlap, stream = v
        ttft = got[v]["ttft"]
        p50 = statistics.median(ttft)
        impl = f"{label}, lone request" if kind == "lone" else f"{label}, {rate:g} req/s"
        if kind == "rated":
            impl += (", overlap_prefill" if overlap else "") + (" + prefill_stream" if stream else "")
        record = dict(
            bench="serve", impl=impl, **(case | dict(requests=len(ttft))), rounds=rounds, p50_ttft_ms=1e3 * p50,
            ttft_ms=[round(1e3 * t, 2) for t in ttft], as_served=(overlap, stream) == served,
        )  # fmt: skip
        record.update(overlap_prefill=overlap, prefill_stream=stream)
        if kind == "rated":
            record["ratio_to_lone"] = p50 / lone_p50
        if got[v]["times"]:
            record["engine_ms"] = _breakdown(got[v]["times"])
        record["prefill_steps"] = _prefill_steps(got[v]["steps"])
        if kind == "rated":
            record["overlapped"] = got[v]["overlapped"]
        records.append(record)
        ratio = f" = {p50 / lone_p50:.3f}x lone" if kind == "rated" else ""
        ratio += " (as served)" if kind == "rated" and record["as_served"] else ""
        progress(f"{impl}: p50 TTFT {1e3 * p50:.1f} ms{ratio}")
    return records


def _prefill_steps(records) -> dict[str, dict[str, float]]:
    """Where the steps that ran prompts (the ones that make a request's first token) spent their
    time, by kind ("prefill": prompts alone; "mixed": with decoding requests); see ``StepLog``."""
    by_kind: dict[str, list] = {}
    for r in records:
        if r.kind in ("prefill", "mixed"):
            by_kind.setdefault(r.kind, []).append(r)
    return {kind: dict(steps=len(rs), **summarize(rs)) for kind, rs in by_kind.items()}


def _breakdown(times: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Where the engine side of the time to first token went, over requests (``RequestStream.times``):
    median and max, ms, of: waiting to be added (the step in flight and its handoff), the step that
    made the first token, handing it to the event loop, the event loop picking it up, and all of it
    (the client's TTFT less this is HTTP: parsing before, the SSE write after)."""
    parts = {
        "wait_for_step": [t["added"] - t["queued"] for t in times],
        "first_step": [t["step_s"] for t in times],
        "to_handoff": [t["posted"] - t["step_end"] for t in times],
        "to_stream": [t["pushed"] - t["posted"] for t in times],
        "engine_total": [t["pushed"] - t["queued"] for t in times],
    }
    return {name: p50_max([1e3 * x for x in v]) for name, v in parts.items() if v}


def format_table(records: list[Record]) -> str:
    lines = [f"{'impl':<24} {'output tok/s':>12} {'p50 TTFT ms':>11} {'ratio':>7}"]
    for r in records:
        tok_s = f"{r['output_tok_s']:.0f}" if "output_tok_s" in r else "-"
        ttft = f"{r['p50_ttft_ms']:.1f}" if "p50_ttft_ms" in r else "-"
        ratio = r.get("ratio_to_offline", r.get("ratio_to_lone"))
        lines.append(f"{r['impl']:<24} {tok_s:>12} {ttft:>11} {'-' if ratio is None else f'{ratio:.3f}':>7}")
    return "\n".join(lines)


def bench_serve(
    quick: bool = False,
    *,
    cuda_graphs: bool = True,
    async_scheduling: bool = True,
    overlap_prefill: bool = True,
) -> list[Record]:
    """Issue 6's measurement on a CUDA GPU: 256 requests x (256 in, 256 out) at the Llama-3-8B shape,
    then 30 lone requests and 30 at 1 req/s; ``quick``: the Llama-3.2-1B shape, 64 requests, 4 + 8.

    ``cuda_graphs``: the engine replays decode
    steps as CUDA graphs in both the offline and the server runs, as ``fuseformer serve --cuda-graphs``
    does; at light load a decode step is then short, so a new request waits less for the step in
    flight (the TTFT bar). ``async_scheduling``: ``LLM(async_scheduling=True)`` from ``fuseformer
    serve``'s ``ASYNC_MIN_SEQS`` requests on, as the server runs on CUDA, in the offline run (after a
    synchronous one, recorded too) and the server's (``run_serve_case``). ``overlap_prefill``: the
    server with ``overlap_prefill`` and ``LLM(prefill_stream=True)``, as ``fuseformer serve`` runs on
    CUDA (the other settings are timed at 1 req/s beside it). (Until session 19 these four were read
    from FUSEFORMER_BENCH_* environment variables.)"""
    from fuseformer.bench.engine import SHAPES
    from fuseformer.serve.cli import ASYNC_MIN_SEQS

    ahead = dict(async_scheduling=True, async_scheduling_min_seqs=ASYNC_MIN_SEQS) if async_scheduling else {}
    overlap = overlap_prefill
    name = "llama3.2-1b" if quick else "llama3-8b"
    n, lone, rated = (64, 4, 8) if quick else (256, 30, 30)
    records = run_serve_case(
        SHAPES[name], n, 256, 256, num_lone=lone, num_rated=rated, shape_name=name, cuda_graphs=cuda_graphs,
        overlap_prefill=overlap, prefill_stream=overlap, **ahead,
    )  # fmt: skip
    print(format_table(records))
    return records
