"""ProcessEngine: the ``LLM`` step loop in a process of its own, driven from asyncio.

``AsyncEngine`` steps the engine on a thread of the server's process, so the engine's host work
(scheduling, inputs, sampling, detokenizing: Python) and the event loop's (HTTP, one SSE write per
stream per step) share one GIL. On an H200 at the Llama-3-8B shape with CUDA-graph decode, that
sharing left the server at 0.88-0.97 of the offline engine's throughput from run to run (BENCHMARKS.md,
issue 6). Here the engine runs in a child process (spawned: no copy of the parent's CUDA state), as
vLLM's engine core does; the server's process only parses, streams and forwards. Measured since (runs
24-26): no better than the engine thread (0.84-0.94 of offline), so it stays opt-in
(``fuseformer serve --engine-process``).

    engine = ProcessEngine(functools.partial(LLM, "/path/to/model", cuda_graphs=True))  # the child builds it
    stream = await engine.add_request("req-1", [1, 2, 3], SamplingParams(max_tokens=8))  # ValueError if bad
    async for delta in stream:  # RequestOutput deltas (prompt and prompt_token_ids left empty)
        ...

The same surface as ``AsyncEngine`` for the server (``add_request``, ``abort``, ``shutdown``,
``get_stats``, ``tokenizer``, ``max_model_len``, ``default_sampling_params``, ``is_running``) and the
same ``RequestStream`` objects. ``factory`` must be picklable (a module-level function or a
``functools.partial`` of one, e.g. of ``LLM`` with a model directory): the child calls it.

Wire: two pipes. Parent -> child: ("add", id, prompt, params), ("abort", id), ("stop", grace_s). Child ->
parent, written by a sender thread so that the engine never waits on the parent: ("ready", info),
("added", id, error or None), ("step", stats, step_s, outputs, step records), ("aborted", id, stats),
("dead", message). A step's outputs travel lean: per request its id, finished flag and completions'
deltas (no prompt tokens). In the parent a reader thread receives them and hands each event loop its share in one
``call_soon_threadsafe`` per message.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import astuple
from typing import Any

from fuseformer.engine.async_engine import EngineDeadError, EngineShutdownError, RequestStream, take_stream
from fuseformer.engine.outputs import CompletionOutput, RequestOutput
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import SchedulerStats
from fuseformer.engine.step_log import StepLog, StepRecord

_START_TIMEOUT_S = 600.0  # building the model in the child (a checkpoint load, CUDA graph capture)


def _pack(out: RequestOutput) -> tuple:
    cs = [
        (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
        for c in out.outputs
    ]
    return out.request_id, out.finished, cs


def _unpack(packed: tuple) -> RequestOutput:
    rid, finished, cs = packed
    outputs = [
        CompletionOutput(
            index=i, text=text, token_ids=ids, finish_reason=fr, stop_reason=sr, logprobs=lp, cumulative_logprob=cl
        )
        for i, text, ids, fr, sr, lp, cl in cs
    ]
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[], outputs=outputs, finished=finished)


def _child_main(commands, results, factory: Callable[[], Any], overlap_prefill: bool = False) -> None:
    """The engine process: build the LLM, then step it, applying commands between steps."""
    # Shutdown is the parent's to run (a "stop" command, or the command pipe closing when the parent
    # dies): a Ctrl-C or a SIGTERM sent to the whole process group must not kill the engine under the
    # requests the parent is still finishing.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send_all() -> None:  # the engine thread never blocks on a slow parent
        while (msg := outbox.get()) is not None:
            try:
                results.send(msg)
            except (BrokenPipeError, OSError):
                return

    sender = threading.Thread(target=send_all, name="fuseformer-engine-sender", daemon=True)
    sender.start()
    try:
        llm = factory()
    except BaseException as exc:
        outbox.put(("dead", f"building the engine failed: {type(exc).__name__}: {exc}"))
        outbox.put(None)
        sender.join(30)
        return
    outbox.put(("ready", dict(
        tokenizer=llm.tokenizer, max_model_len=llm.max_model_len, defaults=llm.get_default_sampling_params(),
        stats=llm.scheduler.get_stats(),
    )))  # fmt: skip
    live: set[str] = set()
    state = dict(deadline=None)  # "stop" sets it: running requests finish until then, the rest are aborted

    def apply_commands(timeout: float | None) -> bool:
        """Wait up to ``timeout`` (None: until one comes) for commands and apply all that came."""
        if not commands.poll(timeout):
            return False
        while True:
            try:
                msg = commands.recv()
            except EOFError:  # the parent is gone: stop
                state["deadline"] = time.monotonic()
                return True
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params = msg
                try:
                    llm.add_request(rid, prompt, params)
                except (ValueError, TypeError) as exc:
                    outbox.put(("added", rid, (type(exc).__name__, str(exc))))
                else:
                    live.add(rid)
                    outbox.put(("added", rid, None))
            elif kind == "abort":
                if msg[1] in live:
                    live.discard(msg[1])
                    llm.abort(msg[1])
                    outbox.put(("aborted", msg[1], llm.scheduler.get_stats()))
            elif kind == "stop":
                state["deadline"] = time.monotonic() + msg[1]
            if not commands.poll(0):
                return True

    logged = llm.step_log.count  # step records already sent
    try:
        while True:
            idle = not llm.has_unfinished_requests()
            deadline = state["deadline"]
            if deadline is not None and (idle or time.monotonic() >= deadline):
                for rid in sorted(live):
                    llm.abort(rid)
                    outbox.put(("aborted", rid, llm.scheduler.get_stats()))
                break
            if idle:
                apply_commands(None if deadline is None else max(0.0, deadline - time.monotonic()))
                continue
            apply_commands(0.0)
            if not llm.has_unfinished_requests():
                continue
            start = time.perf_counter()
            if overlap_prefill:
                outputs, _ = llm.step_with_arrivals(apply_commands)
            else:
                outputs = llm.step()
            step_s = time.perf_counter() - start
            for out in outputs:
                if out.finished:
                    live.discard(out.request_id)
            records = [astuple(r) for r in llm.step_log.since(logged)]
            logged = llm.step_log.count
            outbox.put(("step", llm.scheduler.get_stats(), step_s, [_pack(o) for o in outputs], records))
    except BaseException as exc:  # a failed step: the parent fails every request
        outbox.put(("dead", f"{type(exc).__name__}: {exc}"))
    finally:
        outbox.put(None)
        sender.join(30)


class ProcessEngine:
    """An ``LLM`` built and stepped in a child process (see the module docstring).

    Args:
        factory: picklable; called in the child, returns the ``LLM`` to serve.
        start: start the child now and wait until it is ready (else at ``start()``).
        overlap_prefill: as ``AsyncEngine``'s (``LLM.step_with_arrivals`` in the child).
    """

    def __init__(self, factory: Callable[[], Any], start: bool = True, overlap_prefill: bool = False) -> None:
        self._factory = factory
        self._overlap_prefill = overlap_prefill
        self._proc: multiprocessing.Process | None = None
        self._commands = None
        self._results = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()  # the tables below: event loops add, the reader thread removes
        self._send_lock = threading.Lock()  # one writer at a time on the command pipe
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self.tokenizer = None
        self.max_model_len = 0
        self._defaults: SamplingParams | None = None
        self._stats = SchedulerStats()
        self.counters = dict(steps=0, step_s=0.0)
        self.step_log = StepLog()  # the child's steps (LLM.step_log), as they arrive
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child and wait until its engine is built (raises RuntimeError if that fails)."""
        if self._proc is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._results, res_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_child_main,
            args=(cmd_recv, res_send, self._factory, self._overlap_prefill),
            name="fuseformer-engine",
            daemon=True,
        )
        self._proc.start()
        cmd_recv.close()
        res_send.close()
        if not self._results.poll(_START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"ProcessEngine: the engine process was not ready within {_START_TIMEOUT_S:.0f} s")
        try:
            kind, info = self._results.recv()
        except EOFError:
            self._proc.join(10)
            raise RuntimeError(f"ProcessEngine: the engine process died (exit code {self._proc.exitcode})") from None
        if kind != "ready":
            self._proc.join(30)
            raise RuntimeError(f"ProcessEngine: {info}")
        self.tokenizer, self.max_model_len = info["tokenizer"], info["max_model_len"]
        self._defaults, self._stats = info["defaults"], info["stats"]
        self._reader = threading.Thread(target=self._read, name="fuseformer-engine-reader", daemon=True)
        self._reader.start()

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and not self._stopping and self.error is None

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop accepting requests; let running ones finish for up to ``grace_s`` seconds; abort the
        rest (their streams get a last "abort" delta); stop the child."""
        self._stopping = True
        if self._proc is None:
            return
        try:
            self._send(("stop", float(grace_s)))
        except (BrokenPipeError, OSError):
            pass
        await asyncio.to_thread(self._proc.join, grace_s + 60)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 10)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 10)

    # ---- requests ------------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return self._defaults if self._defaults is not None else SamplingParams()

    async def add_request(
        self, request_id: str, prompt: Any, sampling_params: SamplingParams | None = None
    ) -> RequestStream:
        """Queue a prompt (token ids, or text when the model has a tokenizer); returns its stream.
        Raises ``ValueError`` for a bad prompt or parameter, ``EngineShutdownError`` once shutting
        down, ``EngineDeadError`` after the engine failed."""
        if self.error is not None:
            raise EngineDeadError(f"ProcessEngine: the engine failed: {self.error}")
        if self._stopping:
            raise EngineShutdownError("ProcessEngine: the engine is shutting down")
        if self._proc is None:
            self.start()
        loop = asyncio.get_running_loop()
        n = sampling_params.n if sampling_params is not None else 1
        stream = RequestStream(self, request_id, n, loop)
        done = loop.create_future()
        with self._lock:
            if request_id in self._streams or request_id in self._adds:
                raise ValueError(f"ProcessEngine: request_id {request_id!r} is already running")
            self._streams[request_id] = stream
            self._adds[request_id] = (loop, done)
        try:
            self._send(("add", request_id, prompt, sampling_params))
            await done
        except (BrokenPipeError, OSError) as exc:
            self._forget(request_id)
            raise EngineDeadError(f"ProcessEngine: the engine process is gone: {exc}") from None
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the child's next step. Safe from any thread."""
        try:
            self._send(("abort", request_id))
        except (BrokenPipeError, OSError, AttributeError):
            pass

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._commands.send(msg)

    def get_stats(self) -> SchedulerStats:
        return self._stats

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._adds.pop(request_id, None)

    # ---- the reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        results = self._results
        try:
            while True:
                try:
                    msg = results.recv()
                except (EOFError, OSError):
                    if self.error is None and not self._stopping:
                        code = self._proc.exitcode if self._proc is not None else None
                        self._fail(f"the engine process exited (exit code {code})")
                    break
                kind = msg[0]
                if kind == "step":
                    self._on_step(*msg[1:])
                elif kind == "added":
                    self._on_added(msg[1], msg[2])
                elif kind == "aborted":
                    self._stats = msg[2]
                    self._on_aborted(msg[1])
                elif kind == "dead":
                    self._fail(msg[1])
        finally:
            # Whatever is still open gets an end: aborted at shutdown, or the engine's error.
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
                adds, self._adds = list(self._adds.values()), {}
            dead = EngineDeadError(f"ProcessEngine: the engine failed: {self.error}") if self.error else None
            for stream in streams:
                stream._put(dead if dead is not None else stream._abort_output())
            for loop, fut in adds:
                _settle(loop, fut, dead or EngineShutdownError("ProcessEngine: the engine is shutting down"))

    def _on_step(self, stats: SchedulerStats, step_s: float, packed: list, records: list[tuple]) -> None:
        self._stats = stats
        self.counters["steps"] += 1
        self.counters["step_s"] += step_s
        for record in records:
            self.step_log.add(StepRecord(*record))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        outputs = [_unpack(p) for p in packed]
        with self._lock:
            for out in outputs:
                stream = take_stream(self._streams, out)
                if stream is not None:
                    by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _on_added(self, request_id: str, error: tuple[str, str] | None) -> None:
        with self._lock:
            loop, fut = self._adds.pop(request_id, (None, None))
            if error is not None:
                self._streams.pop(request_id, None)
        if loop is None:
            return
        exc = None
        if error is not None:
            name, message = error
            exc = TypeError(message) if name == "TypeError" else ValueError(message)
        _settle(loop, fut, exc)

    def _on_aborted(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(stream._abort_output())

    def _fail(self, message: str) -> None:
        """The engine failed: nothing more is accepted, and once the child's pipe closes (it exits
        after saying so) every open stream and add gets the error (``_read``'s ``finally``)."""
        self.error = RuntimeError(message)


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._push(out)


def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, error: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
