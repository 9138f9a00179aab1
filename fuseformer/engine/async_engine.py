"""AsyncEngine: an ``EngineCore``'s steps on a background thread, driven from asyncio (the server's engine).

A model step is blocking compute (seconds on a CPU, milliseconds on a GPU), so it runs on its own
thread and never on the event loop. All calls of the core and its ``OutputProcessor`` happen on that
thread: ``add_request`` and ``abort`` from the event loop are queued as commands, which the thread
applies between steps (at once when it is idle), so the scheduler is never touched by two threads.
A step's outputs go back to the event loop in one ``loop.call_soon_threadsafe`` call (not one per
request: at 256 requests a step those calls cost more than the step's scheduling), which appends each
delta to its request's buffer and wakes that request's reader; the thread then waits for the event
loop to finish that work (the handoff), and under load hands outputs over every few steps instead of
every step (``AsyncEngine`` says why: the two threads share the GIL).

    engine = AsyncEngine(LLM(path))  # the LLM's core and output processor; the LLM itself is not called
    stream = await engine.add_request("req-1", "Hello", SamplingParams(max_tokens=8))  # ValueError if bad
    async for delta in stream:  # RequestOutput deltas, as LLM.step returns them; the last has finished=True
        ...
    batch = await stream.get_batch()  # or: every delta that arrived since the last call ([] at the end)

Leaving the stream early (``break``, a cancelled task, ``await stream.aclose()``) aborts the request,
and its KV blocks are freed before the next step. ``await engine.shutdown(grace_s)`` stops accepting
requests, lets running ones finish for ``grace_s`` seconds, aborts the rest (their streams end with
finish_reason "abort") and stops the thread.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fuseformer.engine.output_processor import Prompt
from fuseformer.engine.outputs import CompletionOutput, RequestOutput
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import SchedulerStats

if TYPE_CHECKING:
    from fuseformer.engine.llm import LLM


class EngineDeadError(RuntimeError):
    """The step loop failed (a bug or a device error); the engine serves no more requests."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams | None
    stream: RequestStream
    done: asyncio.Future


class RequestStream:
    """The deltas of one request, in order; async-iterable. The last delta has ``finished=True``.

    ``get_batch()`` returns every delta that arrived since the previous call at once: a reader that
    falls behind the engine (the server, writing to many clients) catches up in one wake-up, not one
    per step. Closing the stream (``aclose``, or a task cancelled while it waits) before the end aborts
    the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.n = n
        self.finished = False
        self._loop = loop
        self._items: collections.deque[RequestOutput] = collections.deque()  # loop thread only
        self._error: BaseException | None = None  # raised once the items before it are read
        self._waiter: asyncio.Future | None = None
        self._done_indexes: set[int] = set()  # completions that finished (engine thread only)
        self._handed_any = False  # an output was handed to the loop (engine thread only)
        # The first output's path (time.perf_counter): "queued" (add_request called), "added" (the engine
        # thread applied it, between steps), "step_end" and "step_s" (the step that made the first
        # output), "posted" (handed to the event loop), "pushed" (the event loop put it in the stream).
        # Complete records go to ``AsyncEngine.first_output_times``.
        self.times: dict[str, float] = {}

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._items and self._error is None:
            await self._wait()
        if self._items:
            item = self._items.popleft()
            if item.finished:
                self.finished = True
            return item
        self._raise_error()
        raise StopAsyncIteration  # closed while waiting

    async def get_batch(self) -> list[RequestOutput]:
        """Every delta that arrived since the last call, waiting for one if none has; ``[]`` once the
        stream has ended (or was closed). An engine error is raised after the deltas before it."""
        if not self._items and self._error is None:
            await self._wait()
        if self._items:
            batch = list(self._items)
            self._items.clear()
            if batch[-1].finished:
                self.finished = True
            return batch
        self._raise_error()
        return []

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self.finished = True
            raise error

    async def _wait(self) -> None:
        if self.finished:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        except asyncio.CancelledError:
            self.close()
            raise
        finally:
            self._waiter = None

    def close(self) -> None:
        """Abort the request unless it finished (safe to call more than once, from the loop's thread).
        A reader waiting on the stream wakes and sees it end."""
        if not self.finished:
            self.finished = True
            self._items.clear()
            self._error = None
            self.engine.abort(self.request_id)
            self._wake()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    # ---- event loop, called from the engine thread's call_soon_threadsafe --------------------------

    def _push(self, item: RequestOutput | BaseException) -> None:
        if self.finished:  # closed by the reader: the rest is dropped
            return
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._items.append(item)
            if "pushed" not in self.times and "posted" in self.times:
                self.times["pushed"] = time.perf_counter()
                self.engine.first_output_times.append(self.times)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- engine thread -------------------------------------------------------------------------

    def _put(self, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._push, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _abort_output(self) -> RequestOutput:
        """A last delta for an aborted request: every unfinished completion ends with "abort"."""
        outputs = [
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
            for i in range(self.n)
            if i not in self._done_indexes
        ]
        return RequestOutput(
            request_id=self.request_id, prompt=None, prompt_token_ids=[], outputs=outputs, finished=True
        )


# Two callbacks in a row this close together: nothing ran between them, the event loop is idle. An idle
# loop turns around in ~5-15 us (an epoll_wait with no timeout and the callback).
_IDLE_GAP_S = 50e-6
# The least time a handoff may take, however short the step was (a thread wake-up is ~50 us).
_MIN_HANDOFF_S = 1e-3
# With overlap_prefill: how often the engine thread checks for new requests while a decode step runs
# on the device (a new request waits at most this long before its prefill is launched).
_POLL_S = 2e-4


class _Handoff:
    """Set (``done``) once an event loop has handled a step's outputs and then had nothing left to do
    (the engine waits on it with its own timeout). Idleness is seen from the loop's side: a callback
    that re-schedules itself runs again at once when nothing else is ready. ``busy_s``: how long the
    loop took from the post to idleness (set when it got there, whether or not the engine waited)."""

    __slots__ = ("loop", "done", "_last", "posted", "busy_s", "superseded")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.done = threading.Event()
        self._last = 0.0
        self.posted = time.perf_counter()
        self.busy_s: float | None = None
        self.superseded = False  # a later handoff to the same loop exists: nobody reads busy_s any more

    def deliver(self, items: list[tuple[RequestStream, RequestOutput]]) -> None:
        """In the loop: hand the outputs to their streams, then watch for idleness."""
        for stream, out in items:
            stream._push(out)
        self._last = time.perf_counter()
        self.loop.call_soon(self._probe)  # runs after the readers woken above, which were scheduled first

    def _probe(self) -> None:
        now = time.perf_counter()
        if now - self._last < _IDLE_GAP_S:
            self.busy_s = now - self.posted
            self.done.set()
        elif not self.superseded:  # a later handoff's probe took over (a loop never idle would
            self._last = now  # otherwise gather one probe per urgent handoff)
            self.loop.call_soon(self._probe)


def take_stream(streams: dict[str, RequestStream], out: RequestOutput) -> RequestStream | None:
    """The stream ``out`` goes to (None: nobody listens any more), with ``out``'s finished completions
    marked on it; a finished request's stream leaves ``streams`` (the engine's side of a step's output)."""
    stream = streams.get(out.request_id)
    if stream is None:
        return None
    for c in out.outputs:
        if c.finished:
            stream._done_indexes.add(c.index)
    if out.finished:
        del streams[out.request_id]
    return stream


def _join(into: RequestOutput, out: RequestOutput) -> None:
    """Append delta ``out`` to the held delta ``into`` of the same request (objects of the engine
    thread's own, from ``EngineCore.step``)."""
    by_index = {c.index: c for c in into.outputs}
    for c in out.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            into.outputs.append(c)
            continue
        prev.text += c.text
        prev.token_ids += c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
        prev.cumulative_logprob = c.cumulative_logprob
    into.finished = out.finished
    into.metrics = out.metrics


class AsyncEngine:
    """An ``EngineCore`` stepped on a background thread (see the module docstring).

    Args:
        llm: the engine to drive, as ``LLM(...)`` built it: its ``core`` and ``output_processor`` are
            driven from now on, by this object's thread only (the LLM's own methods are not called).
        start: start the thread now (else on the first ``add_request`` or ``start()``).
        max_stream_overhead: the share of the engine's time that handing outputs to the event loop may
            take (see "Under load" below); ``None`` or 0: every step's outputs are handed over at once.

    The handoff: the engine's host work (scheduling, inputs, sampling, outputs: Python) and the event
    loop's (an SSE write per stream per step, parsing new requests) share the GIL. Run at the same
    time they share it badly: each socket call in the event loop releases the GIL, the engine thread
    takes it, and the event loop waits for the switch interval (5 ms) to get it back. So after a step
    with outputs the engine thread may wait (GIL released) until each event loop has handled them and
    has nothing left to do (new requests parsed and queued too: they join the next step), for at most
    as long as the step took (1 ms at least). Waiting is rationed: the waits take at most
    ``max_stream_overhead`` of the engine's time (a credit of that share of each step's time, at most
    one step's worth saved up). At light load every handoff waits (a new request's first token goes
    out before the next step starts); under load the rest are posted without a wait, and the event
    loop runs while the engine waits on the GPU (a CUDA-graph decode step is mostly that; with the
    engine's GIL-holding eager steps the loop gets less, and the outputs coalesce, below). Before the
    ration (2026-11-30, H200, 8B shape, 256 streams, CUDA graphs) every urgent handoff waited: the
    server's throughput ran at 0.70-0.98 of the offline engine's, depending on how the arrivals
    spread the requests' first and last tokens over steps.

    Under load: the event loop's work per handoff grows with the number of streams (one SSE write
    each through Starlette, uvicorn and h11: ~25 ms for 256 streams on the 2-core CPU-proxy machine,
    ~100 us a write) while a step's time grows less. While the event loop has not finished the last
    handoff, or when that one kept it busy for more than ``max_stream_overhead`` of the engine's time
    since, outputs are held and joined per request (text, tokens, logprobs) and handed over with a
    later step's: the same text, in fewer, larger chunks. A request's first output, a finished one
    and an abort are never held.

    ``overlap_prefill`` (off by default here; ``fuseformer serve`` turns it on with ``LLM(prefill_stream=True)``
    on CUDA: on an H200 the 1 req/s p50 time to first token was then 0.95-1.00x a lone request's, runs
    31-33, against 0.84-1.08x without either): while a CUDA-graph decode step
    runs on the device, the engine thread watches for new requests instead of blocking on the step's
    result; one that arrives has its prefill launched at once, behind the decode step in the device's
    queue (``EngineCore.step_with_arrivals``), and both steps finish in order. A new request then
    no longer waits for the rest of the decode step in flight before its prefill's host work starts
    (~5 ms a step at batch 1-2 of an 8B model on an H200, against a ~20 ms lone time to first token).

    ``counters``: steps, seconds in steps, handoffs, seconds waited in handoffs, steps whose outputs
    were held (for benchmarks: how much the server cost the engine), prefills launched behind a
    decode step in flight.
    """

    def __init__(
        self, llm: LLM, start: bool = True, max_stream_overhead: float | None = 0.05, overlap_prefill: bool = False
    ) -> None:
        self.core = llm.core
        self.output_processor = llm.output_processor
        self.overlap_prefill = overlap_prefill
        self.tokenizer = self.output_processor.tokenizer
        self.max_model_len = self.core.max_model_len
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._commands: collections.deque[_Add | tuple[str, str]] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False  # no new requests
        self._stop = False  # the thread exits at its next turn
        self.error: BaseException | None = None
        self._stats = self.core.get_stats()
        self.num_steps = 0
        self.max_stream_overhead = max_stream_overhead
        # Outputs not yet handed over, joined per request (engine thread only); the steps they cover;
        # how long the last handoff of all held outputs kept the engine waiting.
        self._held: dict[str, tuple[RequestStream, RequestOutput]] = {}
        self._held_steps = 0
        self._handoffs: list[_Handoff] = []  # the last handoff's, one per event loop
        self._wait_credit = 0.0  # seconds the engine may still spend waiting on event loops
        self.counters = dict(steps=0, step_s=0.0, handoffs=0, wait_s=0.0, held_steps=0, overlapped=0)
        # RequestStream.times of the last requests whose first output reached their stream (benchmarks:
        # where a request's time to first token goes).
        self.first_output_times: collections.deque[dict[str, float]] = collections.deque(maxlen=4096)
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fuseformer-engine", daemon=True)
            self._thread.start()

    @property
    def step_log(self):
        """The core's ``step_log`` (read it from another thread only for benchmarks)."""
        return self.core.step_log

    @property
    def is_running(self) -> bool:
        """The step loop is alive and accepts requests."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.error is None

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop accepting requests; let running ones finish for up to ``grace_s`` seconds; abort the
        rest (their streams get a last "abort" delta); stop the thread."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            if not self._streams and not self._commands:
                break
            await asyncio.sleep(0.01)
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ---- requests ------------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> RequestStream:
        """Queue a prompt (text or token ids); returns its stream of deltas. Raises ``ValueError`` for a
        bad prompt or parameter (``OutputProcessor.make_request``), ``EngineShutdownError`` once shutting down,
        ``EngineDeadError`` after a failed step."""
        self._check_alive()
        self.start()
        loop = asyncio.get_running_loop()
        n = sampling_params.n if sampling_params is not None else 1
        stream = RequestStream(self, request_id, n, loop)
        stream.times["queued"] = time.perf_counter()
        done = loop.create_future()
        self._command(_Add(request_id, prompt, sampling_params, stream, done))
        try:
            await done  # raises what OutputProcessor.make_request raised
        except asyncio.CancelledError:  # the caller left while the add was queued: do not leave it running
            self.abort(request_id)
            raise
        return stream

    def default_sampling_params(self) -> SamplingParams:
        """The model's defaults (generation_config.json) for requests that leave a parameter unset."""
        return self.output_processor.default_sampling_params()

    def abort(self, request_id: str) -> None:
        """Abort a request: it is removed and its blocks freed before the next step. Safe from any thread."""
        self._command(("abort", request_id))

    def get_stats(self) -> SchedulerStats:
        """Running/waiting requests, KV usage, prefix hit rate: as of the last step or command applied."""
        return self._stats

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"AsyncEngine: the engine failed: {type(self.error).__name__}: {self.error}")
        if self._stopping:
            raise EngineShutdownError("AsyncEngine: the engine is shutting down")

    def _command(self, command: _Add | tuple[str, str]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    # ---- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        core, processor = self.core, self.output_processor
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._commands and not processor.has_unfinished_requests():
                        self._wake.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stop = self._stop
                for command in commands:
                    self._apply(command)
                if stop:
                    self._abort_all()
                    return
                outputs = []
                start = time.perf_counter()
                if processor.has_unfinished_requests():
                    outputs = self._overlapped_step() if self.overlap_prefill else core.step(processor)
                    self.num_steps += 1
                # Stats before outputs: a client that has its last token sees its blocks freed.
                self._stats = core.get_stats()
                self._deliver(outputs, time.perf_counter() - start)
        except BaseException as exc:  # a failed step: every waiting caller gets the error, not a hang
            self.error = exc
            for stream in self._streams.values():
                stream._put(EngineDeadError(f"AsyncEngine: the engine failed: {type(exc).__name__}: {exc}"))
            self._streams.clear()
            for command in self._commands:
                if isinstance(command, _Add):
                    self._resolve(command, EngineDeadError(f"AsyncEngine: the engine failed: {exc}"))
        finally:
            self._stats = core.get_stats()

    def _overlapped_step(self) -> list[RequestOutput]:
        """``EngineCore.step``, with new requests' prefill launched behind a graph-replayed decode step
        in flight (``overlap_prefill``): their outputs follow the decode step's."""

        def arrivals(timeout: float) -> bool:
            with self._wake:
                if not self._commands and not self._stop:
                    self._wake.wait(timeout)
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                self._apply(command)
            return bool(commands)

        outputs, early = self.core.step_with_arrivals(arrivals, self.output_processor, _POLL_S)
        self.counters["overlapped"] += early
        return outputs

    def _apply(self, command: _Add | tuple[str, str]) -> None:
        if isinstance(command, _Add):
            if self._stop or command.request_id in self._streams:
                error: BaseException | None = (
                    EngineShutdownError("AsyncEngine: the engine is shutting down")
                    if self._stop
                    else ValueError(f"AsyncEngine: request_id {command.request_id!r} is already running")
                )
            else:
                try:
                    processor = self.output_processor
                    group = processor.make_request(command.request_id, command.prompt, command.params)
                    self.core.add_requests(processor.add(group))
                    self._streams[command.request_id] = command.stream
                    command.stream.times["added"] = time.perf_counter()
                    error = None
                except (ValueError, TypeError) as exc:
                    error = exc
            self._resolve(command, error)
        else:
            _, request_id = command
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self.core.abort(self.output_processor.abort(request_id))
                self._stats = self.core.get_stats()
                self._put_abort(stream)

    def _put_abort(self, stream: RequestStream) -> None:
        """The stream's held outputs, then its last "abort" delta."""
        held = self._held.pop(stream.request_id, None)
        if held is not None:
            stream._put(held[1])
        stream._put(stream._abort_output())

    @staticmethod
    def _resolve(command: _Add, error: BaseException | None) -> None:
        def set_result() -> None:
            if command.done.done():
                return
            if error is None:
                command.done.set_result(None)
            else:
                command.done.set_exception(error)

        try:
            command.stream._loop.call_soon_threadsafe(set_result)
        except RuntimeError:
            pass

    def _deliver(self, outputs: list[RequestOutput], step_s: float) -> None:
        """Hold a step's outputs or hand them, with those held, to their streams (see the class doc):
        one wake-up per event loop, not one per request (at 256 requests a step, 256
        ``call_soon_threadsafe`` calls cost more than the step's scheduling); then the handoff."""
        urgent = False
        step_end = time.perf_counter()
        for out in outputs:
            stream = take_stream(self._streams, out)
            if stream is None:
                continue
            if not stream._handed_any:
                urgent = True
                if "step_end" not in stream.times:  # the step of its first output
                    stream.times["step_end"], stream.times["step_s"] = step_end, step_s
            elif out.finished:
                urgent = True
            held = self._held.get(out.request_id)
            if held is None:
                self._held[out.request_id] = (stream, out)
            else:
                _join(held[1], out)
        counters = self.counters
        budget = self.max_stream_overhead
        if outputs:
            counters["steps"] += 1
            counters["step_s"] += step_s
            if budget:
                self._wait_credit = min(self._wait_credit + budget * step_s, max(step_s, _MIN_HANDOFF_S))
        if not self._held:
            return
        self._held_steps += 1
        if not urgent and budget and self._loops_behind(budget * step_s * self._held_steps):
            counters["held_steps"] += 1
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        start = time.perf_counter()
        for stream, out in self._held.values():
            if not stream._handed_any:
                stream.times["posted"] = start
            stream._handed_any = True
            by_loop.setdefault(stream._loop, []).append((stream, out))
        self._held.clear()
        self._held_steps = 0
        wait_s = max(step_s, _MIN_HANDOFF_S)
        if budget:
            wait_s = min(wait_s, self._wait_credit)
        handoffs = []
        for loop, items in by_loop.items():
            handoff = _Handoff(loop)
            try:
                loop.call_soon_threadsafe(handoff.deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                continue
            handoffs.append(handoff)
        for old in self._handoffs:
            old.superseded = True
        self._handoffs = handoffs
        counters["handoffs"] += 1
        if wait_s > 0:
            for handoff in handoffs:
                handoff.done.wait(max(0.0, start + wait_s - time.perf_counter()))
            waited = time.perf_counter() - start
            counters["wait_s"] += waited
            if budget:
                self._wait_credit -= waited

    def _loops_behind(self, allowed_s: float) -> bool:
        """An event loop has not finished the last handoff, or it took more than ``allowed_s``."""
        for handoff in self._handoffs:
            busy = handoff.busy_s
            if busy is None or busy > allowed_s:
                return True
        return False

    def _abort_all(self) -> None:
        for request_id, stream in list(self._streams.items()):
            self.core.abort(self.output_processor.abort(request_id))
            self._put_abort(stream)
        self._streams.clear()
