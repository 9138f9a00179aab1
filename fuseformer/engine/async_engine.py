"""AsyncEngine: the ``LLM`` step loop on a background thread, driven from asyncio (the server's engine).

A model step is blocking compute (seconds on a CPU, milliseconds on a GPU), so it runs on its own
thread and never on the event loop. All ``LLM`` calls happen on that thread: ``add_request`` and
``abort`` from the event loop are queued as commands, which the thread applies between steps (at
once when it is idle), so the scheduler is never touched by two threads. Outputs go back to each
request's asyncio queue with ``loop.call_soon_threadsafe``.

    engine = AsyncEngine(LLM(path))
    stream = await engine.add_request("req-1", "Hello", SamplingParams(max_tokens=8))  # ValueError if bad
    async for delta in stream:  # RequestOutput deltas, as LLM.step returns them; the last has finished=True
        ...

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
from typing import Any

from fuseformer.engine.llm import LLM, Prompt
from fuseformer.engine.outputs import CompletionOutput, RequestOutput
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import SchedulerStats


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

    Closing it (``aclose``, or a task cancelled while it waits) before the end aborts the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.n = n
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._done_indexes: set[int] = set()  # completions that finished (engine thread only)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it finished (safe to call more than once, from the loop's thread)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    # ---- engine thread -------------------------------------------------------------------------

    def _put(self, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
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


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._queue.put_nowait(out)


class AsyncEngine:
    """An ``LLM`` stepped on a background thread (see the module docstring).

    Args:
        llm: the engine to drive; from now on only this object's thread may call it.
        start: start the thread now (else on the first ``add_request`` or ``start()``).
    """

    def __init__(self, llm: LLM, start: bool = True) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._commands: collections.deque[_Add | tuple[str, str]] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False  # no new requests
        self._stop = False  # the thread exits at its next turn
        self.error: BaseException | None = None
        self._stats = llm.scheduler.get_stats()
        self.num_steps = 0
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fuseformer-engine", daemon=True)
            self._thread.start()

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
        bad prompt or parameter (as ``LLM.add_request``), ``EngineShutdownError`` once shutting down,
        ``EngineDeadError`` after a failed step."""
        self._check_alive()
        self.start()
        loop = asyncio.get_running_loop()
        n = sampling_params.n if sampling_params is not None else 1
        stream = RequestStream(self, request_id, n, loop)
        done = loop.create_future()
        self._command(_Add(request_id, prompt, sampling_params, stream, done))
        try:
            await done  # raises what LLM.add_request raised
        except asyncio.CancelledError:  # the caller left while the add was queued: do not leave it running
            self.abort(request_id)
            raise
        return stream

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
        llm = self.llm
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._commands and not llm.has_unfinished_requests():
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
                if llm.has_unfinished_requests():
                    outputs = llm.step()
                    self.num_steps += 1
                # Stats before outputs: a client that has its last token sees its blocks freed.
                self._stats = llm.scheduler.get_stats()
                self._deliver(outputs)
        except BaseException as exc:  # a failed step: every waiting caller gets the error, not a hang
            self.error = exc
            for stream in self._streams.values():
                stream._put(EngineDeadError(f"AsyncEngine: the engine failed: {type(exc).__name__}: {exc}"))
            self._streams.clear()
            for command in self._commands:
                if isinstance(command, _Add):
                    self._resolve(command, EngineDeadError(f"AsyncEngine: the engine failed: {exc}"))
        finally:
            self._stats = llm.scheduler.get_stats()

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
                    self.llm.add_request(command.request_id, command.prompt, command.params)
                    self._streams[command.request_id] = command.stream
                    error = None
                except (ValueError, TypeError) as exc:
                    error = exc
            self._resolve(command, error)
        else:
            _, request_id = command
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self.llm.abort(request_id)
                self._stats = self.llm.scheduler.get_stats()
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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per request
        (at 256 requests a step, 256 ``call_soon_threadsafe`` calls cost more than the step's scheduling)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            for c in out.outputs:
                if c.finished:
                    stream._done_indexes.add(c.index)
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _abort_all(self) -> None:
        for request_id, stream in list(self._streams.items()):
            self.llm.abort(request_id)
            stream._put(stream._abort_output())
        self._streams.clear()
