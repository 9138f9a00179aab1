"""EngineCore: the step loop over a scheduler, a KV cache and a model runner (vLLM v1's engine core).

One step is ``Scheduler.schedule`` -> ``ModelRunner.launch`` -> ``ModelRunner.collect`` ->
``Scheduler.update_from_output``; the updates go through the output processor (text, stop strings),
and the requests it says a stop string ended are finished before the next step is scheduled. The step
comes in two halves (``launch_step``, ``finish_step``), so that host work can overlap the device's:

- async scheduling (an ``AsyncScheduler``): ``step`` launches the next decode step before reading
  this one's tokens;
- prefill overlap (``step_with_arrivals``): while a CUDA-graph decode step runs on the device, a new
  request's prefill is launched behind it (with ``prefill_stream``, beside it on a second stream).

The core sees token ids only: prompts, text and ``n > 1`` are the output processor's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fuseformer.engine.async_scheduler import AsyncScheduler
from fuseformer.engine.block_pool import PrefixCacheStats
from fuseformer.engine.model_runner import CacheConfig, LaunchedStep, ModelRunner
from fuseformer.engine.output_processor import OutputProcessor
from fuseformer.engine.outputs import RequestOutput
from fuseformer.engine.request import Request, RequestStatus
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SchedulerStats
from fuseformer.engine.step_log import StepLog, StepRecord
from fuseformer.models.config import ModelConfig
from fuseformer.ops.paged_attention import config_query_lengths


@dataclass(slots=True)
class StepHandle:
    """A launched step (``EngineCore.launch_step``): what was scheduled and the runner's enqueued work."""

    scheduler_output: SchedulerOutput
    launched: LaunchedStep
    launch_ms: float = 0.0
    start_event: torch.cuda.Event | None = None  # recorded before the step's first device work

    @property
    def ready(self) -> bool:
        """Its device work has finished (``finish_step`` will not wait)."""
        return self.launched.ready()

    @property
    def overlappable(self) -> bool:
        """A decode step replayed from a CUDA graph that preempted nothing: while it runs on the device,
        a new request's prefill may be launched behind it (its memory is the graph pool's, and the
        blocks were not short)."""
        return self.launched.graphed and not self.scheduler_output.preempted_request_ids


class EngineCore:
    """A model's scheduler, KV cache and runner, and the step over them (see the module docstring).

    Args:
        model: a model the registry builds (``fuseformer.models.registry``), on its device, in eval mode.
        config: its config.
        cache_config: KV block size and how many blocks (a count, or the memory to fill).
        max_num_seqs: requests running at once at most.
        max_num_batched_tokens: tokens computed per step at most (prefills are chunked to fit).
        max_model_len: prompt + output tokens of one request at most; None: the model's
            max_position_embeddings, lowered to what the KV cache holds when that is less.
        enable_prefix_caching: share the KV blocks of equal prompt prefixes.
        cuda_graphs: replay decode-only steps as CUDA graphs captured now.
        async_scheduling: schedule with an ``AsyncScheduler`` (steps of at least
            ``async_scheduling_min_seqs`` requests scheduled ahead); else a ``Scheduler``.
        prefill_stream: on CUDA, launch ``step_with_arrivals``' early prefills on a second stream.
        warm_up: run ``warm_up`` now, before the first request; None (default): on CUDA.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        cache_config: CacheConfig,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        cuda_graphs: bool = False,
        async_scheduling: bool = False,
        async_scheduling_min_seqs: int = 1,
        prefill_stream: bool = False,
        warm_up: bool | None = None,
    ) -> None:
        limit = max_model_len or config.max_position_embeddings
        self.runner = ModelRunner(
            model,
            config,
            cache_config,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=limit,
            cuda_graphs=cuda_graphs,
        )
        capacity = (self.runner.num_blocks - 1) * cache_config.block_size
        if max_model_len is None:
            limit = min(limit, capacity)  # the default adapts to the cache; an explicit value is checked
        self.max_model_len = limit
        scheduler_config = SchedulerConfig(
            num_blocks=self.runner.num_blocks,
            block_size=cache_config.block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=limit,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler: Scheduler = (
            AsyncScheduler(scheduler_config, async_scheduling_min_seqs)
            if async_scheduling
            else Scheduler(scheduler_config)
        )
        self.prefill_stream = prefill_stream
        self._side_stream = None  # prefill_stream's CUDA stream, made at first use
        self._ahead: StepHandle | None = None  # a step scheduled ahead, launched, not yet finished
        self.num_steps_ahead = 0  # steps launched ahead of the previous step's tokens
        # Where the steps' time goes, by kind (see fuseformer.engine.step_log): for benchmarks.
        self.step_log = StepLog()
        self.warm_up_seconds = 0.0
        if warm_up if warm_up is not None else self.runner.device.type == "cuda":
            self.warm_up()
            print(f"fuseformer: warmed up (every step kind and token bucket) in {self.warm_up_seconds:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip

    def warm_up(self) -> float:
        """Run every kind of step the engine will meet before the first request does, so that no request
        waits for a kernel's compilation (Triton's JIT, autotune entries, cuBLAS heuristics): prefills of
        each power-of-two token bucket from 16 up to ``max_num_batched_tokens`` (the kernels' configs
        are chosen per bucket) and of one token less (Triton specializes on multiples of 16), over as
        many sequences as the bucket needs when one sequence (``max_model_len``) holds fewer tokens than
        the step (the GEMMs' kernels are chosen by the step's token count: run 143 met its first
        16,384-token steps in requests, 1.2 and 1.0 s launches, after a warm-up that stopped at
        ``max_model_len`` 518), decode steps, a mixed step (a prefill chunk beside a decode) and one at
        the step's budget over many sequences, prefills after a prefix-cache hit, a
        sampled, seeded request with top-k/top-p/min-p and logprobs (fp32 logits), and one at temperature
        1 alone (the logits as they come: the sampler's kernel compiles once per dtype). Paged
        attention's config buckets (``config_query_lengths``) each get a prefill with a short context
        and one after a prefix hit on the longest prompt (a long context: split-K where a lone sequence
        leaves the GPU idle).
        Afterwards nothing of it is left: no request, every block free, no cached prefix, the step log
        and prefix-cache counters at zero, torch's RNG states as they were (the sampler draws from them
        for the whole batch). Returns the seconds it took (also ``warm_up_seconds``). Call it with no
        requests in the engine."""
        if self.has_unfinished_requests():
            raise RuntimeError("EngineCore.warm_up: requests are in the engine; warm up before adding any")
        start = time.perf_counter()
        vocab = self.runner.config.vocab_size
        seq_limit = max(1, self.max_model_len - 2)  # one prompt's tokens at most (room for two new ones)
        max_seqs = self.scheduler.config.max_num_seqs
        limit = max(1, min(self.runner.max_num_batched_tokens, max_seqs * seq_limit))  # a step's tokens
        lengths, p = [1], 16
        while p <= limit:
            lengths += [p - 1, p]
            p *= 2
        if limit not in lengths:
            lengths.append(limit)
        config = self.runner.config
        query_lengths = config_query_lengths(config.num_attention_heads // config.num_key_value_heads)
        lengths += sorted(n for n in query_lengths if n <= seq_limit and n not in lengths)
        greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        counter = iter(range(10**9))

        def prompt(n: int) -> list[int]:  # distinct tokens: no prefix hit unless one is meant
            return [next(counter) % vocab for _ in range(n)]

        def prompts(n: int, at_least: int = 1) -> list[list[int]]:
            """n tokens in as few prompts as hold them (``at_least`` of them); one token less than a bucket
            in one prompt more (Triton specializes the sequence count on multiples of 16 too)."""
            k = max(at_least, -(-n // seq_limit) + (n > seq_limit and n % 16 == 15))
            k = min(k, max_seqs, n)
            return [prompt(n // k + (i < n % k)) for i in range(k)]

        def run(*batches: list[Request]) -> None:
            for i, batch in enumerate(batches):
                self.add_requests(batch)
                if i + 1 < len(batches):
                    self.step(_DISCARD)  # the next batch arrives while these decode: a mixed step
            while self.has_unfinished_requests():
                self.step(_DISCARD)

        sampled = SamplingParams(temperature=1, top_k=8, top_p=0.9, min_p=0.01, seed=0, max_tokens=2, logprobs=2)
        plain = SamplingParams(temperature=1, max_tokens=2)  # the sampler's draw on the logits as they come
        mixed = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with torch.random.fork_rng(devices=[self.runner.device] if self.runner.device.type == "cuda" else []):
            longest: list[int] = []
            for n in lengths:
                batch = prompts(n)
                longest = max(longest, *batch, key=len)
                run([Request(f"warm-up-{n}-{i}", tokens, greedy) for i, tokens in enumerate(batch)])
            run([Request("warm-up-decoding", prompt(min(seq_limit, 40)), mixed)],
                [Request("warm-up-arriving", prompt(min(seq_limit, 24)), greedy)])  # fmt: skip
            # A mixed step at the budget over at least two sequences, as a loaded engine's first steps are:
            # those decoding while as many tokens more arrive (decodes beside a prefill chunk of the rest
            # of the budget); not where the KV pool cannot hold both batches at once.
            bs = self.scheduler.config.block_size
            decoding, arriving = prompts(limit, at_least=2), prompts(limit, at_least=2)
            blocks = sum(-(-(len(t) + 4) // bs) for t in decoding + arriving)  # each sequence's at its end
            if len(decoding) > 1 and blocks <= self.scheduler.kv.pool.num_free_blocks:
                run([Request(f"warm-up-full-{i}", t, mixed) for i, t in enumerate(decoding)],
                    [Request(f"warm-up-full-arriving-{i}", t, greedy) for i, t in enumerate(arriving)])  # fmt: skip
            for n in query_lengths:  # n new tokens after the longest prompt's cached full blocks
                cached = (min(len(longest) - 1, seq_limit - n, limit - n) // bs) * bs
                if cached > 0:
                    run([Request(f"warm-up-prefix-hit-{n}", longest[:cached] + prompt(n), greedy)])
            run([Request("warm-up-sampled", prompt(min(seq_limit, 8)), sampled)])
            run([Request("warm-up-plain", prompt(min(seq_limit, 8)), plain)])

        self.scheduler.kv.reset_prefix_cache()
        self.scheduler.kv.pool.prefix_stats = PrefixCacheStats()
        self.step_log = StepLog()
        self.warm_up_seconds = time.perf_counter() - start
        return self.warm_up_seconds

    @property
    def async_scheduling(self) -> bool:
        """Steps may be scheduled ahead of the previous one's tokens (the scheduler is an ``AsyncScheduler``)."""
        return isinstance(self.scheduler, AsyncScheduler)

    @property
    def step_in_flight(self) -> StepHandle | None:
        """The step scheduled ahead (async scheduling): launched, not yet finished; the next ``step``
        finishes it. None when there is none."""
        return self._ahead

    # ---- requests ------------------------------------------------------------------------------

    def add_requests(self, requests: Iterable[Request]) -> None:
        for req in requests:
            self.scheduler.add_request(req)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests as aborted and free their KV blocks now (unknown or finished ids are ignored)."""
        self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_waiting_requests(self) -> bool:
        """Requests added (or preempted) and not yet running."""
        return bool(self.scheduler.waiting)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    # ---- the step ------------------------------------------------------------------------------

    def step(self, output_processor: OutputProcessor) -> list[RequestOutput]:
        """One step; its updates go through ``output_processor`` (``OutputProcessor.process``), whose
        deltas it returns. With an ``AsyncScheduler`` the next decode step is launched before this
        one's tokens are read (it is the next call's step; its requests' outputs come from that call)."""
        handle = self._take_ahead() or self.launch_step()
        self._launch_ahead(handle)
        return self._finish_with_ahead(handle, output_processor)

    def step_with_arrivals(
        self, arrivals: Callable[[float], bool], output_processor: OutputProcessor, poll_s: float = 2e-4
    ) -> tuple[list[RequestOutput], bool]:
        """``step``, letting requests that arrive meanwhile start early: while a CUDA-graph decode step
        runs on the device (``StepHandle.overlappable``), call ``arrivals(poll_s)``, which waits up to
        ``poll_s`` seconds for new requests, adds them and says whether any came; the first that do get
        their prefill launched at once, behind the decode step in the device's queue. Returns (the
        deltas of both steps, in launch order; whether a prefill was launched early).

        A step that can be scheduled ahead is (as in ``step``), and then arrivals wait for the next
        call: the two overlaps are for large and for small batches."""
        handle = self._take_ahead() or self.launch_step()
        if self._launch_ahead(handle):
            return self._finish_with_ahead(handle, output_processor), False
        admitted = None
        if handle.overlappable:
            while not handle.ready:
                if arrivals(poll_s):
                    if self.has_waiting_requests():
                        admitted = self._launch_admitted()
                    break
        outputs = self.finish_step(handle, output_processor)
        if admitted is not None:
            outputs += self.finish_step(admitted, output_processor)
        return outputs, admitted is not None

    def launch_step(self, admit_only: bool = False) -> StepHandle:
        """The first half of ``step``: schedule and enqueue the device work, without waiting for it.
        ``admit_only``: waiting requests only (``Scheduler.schedule``), for a step launched while
        another is in flight; finish the steps in launch order."""
        if self._ahead is not None and not admit_only:
            raise RuntimeError("launch_step: a step scheduled ahead is in flight (async_scheduling): use step()")
        return self._launch(lambda: self.scheduler.schedule(admit_only=admit_only), None)

    def finish_step(self, handle: StepHandle, output_processor: OutputProcessor) -> list[RequestOutput]:
        """The second half of ``step``: wait for the launched step, apply its tokens, and return the
        deltas ``output_processor`` makes of them; the requests a stop string ended are finished here."""
        self._launch_sampling(handle)  # a step ahead whose sampling is still deferred: launched now
        start = time.perf_counter()
        result = self.runner.collect(handle.launched)
        collected = time.perf_counter()
        sched = self.scheduler
        ahead = self._ahead
        early = ahead is not None and ahead.launched.logits is not None
        if early:
            # The step ahead samples from this step's tokens (deferred_sampling): its grammars take them
            # first, and its bitmask fills beside the update and output processing below.
            start_ahead = time.perf_counter()
            sched.advance_grammars(handle.scheduler_output, result.sampled_token_ids)
            self.runner.start_sampling(ahead.launched)
            ahead.launch_ms += 1e3 * (time.perf_counter() - start_ahead)
        updates = sched.update_from_output(
            handle.scheduler_output, result.sampled_token_ids, result.logprobs, grammars_advanced=early
        )
        outputs, stopped = output_processor.process(updates)
        if stopped:
            sched.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._log_step(handle, 1e3 * (collected - start), 1e3 * (time.perf_counter() - collected))
        return outputs

    def _take_ahead(self) -> StepHandle | None:
        handle, self._ahead = self._ahead, None
        return handle

    def _launch_ahead(self, handle: StepHandle) -> bool:
        """Schedule and launch the step after ``handle`` now, if the scheduler can (``schedule_ahead``).
        A deferred sampling of ``handle``'s (a grammar's mask, filling since ``finish_step`` applied the
        previous tokens) is launched after the scheduling, whose Python runs beside the fill, and
        before the next step, whose input tokens it samples."""
        if handle.launched.output is None and handle.launched.logits is None:
            return False
        ahead = self.scheduler.schedule_ahead(handle.scheduler_output)
        self._launch_sampling(handle)
        if ahead is None:
            return False
        self._ahead = self._launch(lambda: ahead, handle.launched.output.sampled_token_ids)
        self.num_steps_ahead += 1
        return True

    def _finish_with_ahead(self, handle: StepHandle, output_processor: OutputProcessor) -> list[RequestOutput]:
        outputs = self.finish_step(handle, output_processor)
        ahead = self._ahead
        if ahead is not None and ahead.launched.mask_fill is None:
            # Its sampling reads the outputs (deferred_sampling: penalties, min_tokens, ...): they hold
            # handle's tokens now, and its forward is still on the device. One with its grammars' mask
            # filling (finish_step) is launched by the next step's _launch_ahead, after the scheduling.
            self._launch_sampling(ahead)
        if self._ahead is not None and not self.scheduler.has_unfinished_requests():
            # Every request of the step ahead finished: it has nothing to report.
            self.finish_step(self._take_ahead(), output_processor)
        return outputs

    def _launch_sampling(self, handle: StepHandle) -> None:
        """Launch a deferred sampling of ``handle``'s (``ModelRunner.launch_sampling``), if it has one
        waiting: the requests' outputs hold the previous step's tokens by then."""
        if handle.launched.logits is None:
            return
        start = time.perf_counter()
        self.runner.launch_sampling(handle.launched)
        handle.launch_ms += 1e3 * (time.perf_counter() - start)

    def _launch_admitted(self) -> StepHandle:
        """``launch_step(admit_only=True)``; with ``prefill_stream`` on CUDA, on a stream of its own.

        The admitted requests' work touches nothing of the step in flight: their KV blocks are their
        own (a prefix-cache hit is a full block written by an earlier, finished step); the memory of
        their intermediates is the side stream's in the caching allocator; their inputs and results
        go through pinned host memory. ``finish_step`` waits for its event on the host, so the next
        step, on the default stream, starts after it."""
        if not self.prefill_stream or self.runner.device.type != "cuda":
            return self.launch_step(admit_only=True)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.runner.device)
        with torch.cuda.stream(self._side_stream):
            return self.launch_step(admit_only=True)

    def _launch(self, schedule: Callable[[], SchedulerOutput], prev_tokens: torch.Tensor | None) -> StepHandle:
        """Schedule (``schedule()``) and launch a step, timed for ``step_log``; ``prev_tokens``: the
        sampled tokens of the step in flight, for a step scheduled ahead."""
        start = time.perf_counter()
        event = None
        if self.runner.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        scheduler_output = schedule()
        launched = self.runner.launch(scheduler_output, prev_tokens=prev_tokens)
        return StepHandle(scheduler_output, launched, 1e3 * (time.perf_counter() - start), event)

    def _log_step(self, handle: StepHandle, wait_ms: float, post_ms: float) -> None:
        scheduled = handle.scheduler_output.scheduled
        if not scheduled:
            return
        tokens = handle.scheduler_output.num_batched_tokens
        if handle.launched.graphed:
            kind = "graph"
        elif handle.launched.pieces:
            kind = "pieces"
        elif tokens == len(scheduled):
            kind = "decode"
        else:
            kind = "mixed" if any(len(s.token_ids) == 1 for s in scheduled) else "prefill"
        gpu_ms = None
        done = handle.launched.done
        if handle.start_event is not None and done is not None:
            gpu_ms = handle.start_event.elapsed_time(done)
        mask_ms, mask_wait_ms = handle.launched.mask_ms, handle.launched.mask_wait_ms
        record = StepRecord(
            kind, tokens, len(scheduled), handle.launch_ms, wait_ms, post_ms, gpu_ms, mask_ms, mask_wait_ms
        )
        self.step_log.add(record)


class _Discard:
    """The output processor of ``EngineCore.warm_up``: its requests have no text and no stop strings."""

    @staticmethod
    def process(updates: list) -> tuple[list[RequestOutput], list[str]]:
        return [], []


_DISCARD = _Discard()
