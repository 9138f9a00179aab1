"""LLM: offline generation over the engine (``LLM(model=path).generate(prompts, SamplingParams(...))``).

One engine step is ``Scheduler.schedule`` -> ``ModelRunner.execute`` -> ``Scheduler.update_from_output``,
then each request's detokenizer takes its new tokens (stop strings finish a request from here).
``generate``/``chat`` run steps until their requests finish; ``add_request``/``step``/``abort`` are the
same loop driven from outside, for streaming (the CLI, later the server).

Every input is checked before anything is scheduled: a bad prompt or parameter in a batch raises
``ValueError`` and no request of that batch runs. Lengths: a prompt must be shorter than
``max_model_len`` (it must leave room for one output token); a request whose prompt + ``max_tokens``
passes ``max_model_len`` is not refused but finishes with "length" when it reaches ``max_model_len``
(vLLM does the same).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fuseformer.engine.detokenizer import IncrementalDetokenizer
from fuseformer.engine.model_runner import CacheConfig, LaunchedStep, ModelRunner
from fuseformer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fuseformer.engine.request import Request, RequestStatus
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from fuseformer.engine.step_log import StepLog, StepRecord
from fuseformer.models.config import ModelConfig
from fuseformer.models.llama import LlamaForCausalLM
from fuseformer.models.loader import load_model
from fuseformer.models.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "half": torch.float16}
_DTYPES |= {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Prompt = str | list[int]


@dataclass(slots=True)
class _Sequence:
    """Engine-side state of one completion (one scheduler Request)."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Group:
    """A prompt and its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@dataclass(slots=True)
class StepHandle:
    """A launched step (``LLM.launch_step``): what was scheduled and the runner's enqueued work."""

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


def _resolve_dtype(dtype: str | torch.dtype, checkpoint: torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return checkpoint or torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"LLM: dtype must be 'auto', float32, float16 or bfloat16, got {dtype!r}")
    return _DTYPES[dtype]


def _eos_ids_of(path: Path | None, tokenizer: Tokenizer | None) -> list[int]:
    """EOS ids: the tokenizer's (generation_config.json and tokenizer_config.json), else generation_config.json."""
    if tokenizer is not None:
        return list(tokenizer.eos_token_ids)
    if path is None or not (path / "generation_config.json").is_file():
        return []
    try:
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"LLM: {path / 'generation_config.json'} is not valid JSON: {exc}") from exc
    return [eos] if isinstance(eos, int) else list(eos or [])


class LLM:
    """A Llama-family model with a paged KV cache and continuous batching.

    Args:
        model: a Hugging Face model directory (config.json, safetensors, tokenizer files,
            generation_config.json), or an already built ``LlamaForCausalLM`` (then no tokenizer
            unless ``tokenizer`` is given: prompts must be token ids).
        dtype: "auto" (the checkpoint's, else float32), "float32", "float16", "bfloat16" or a torch dtype.
        max_model_len: prompt + output tokens of one request at most; default the model's
            max_position_embeddings, lowered to what the KV cache holds when that is less.
        gpu_memory_utilization: on CUDA, the share of GPU memory for weights, activations and KV cache.
        enable_prefix_caching: share the KV blocks of equal prompt prefixes.
        max_num_seqs: requests running at once at most.
        max_num_batched_tokens: tokens computed per step at most (prefills are chunked to fit).
        num_kv_blocks: KV blocks to allocate, overriding the memory-based sizing.
        block_size: tokens per KV block.
        device: default "cuda" when available, else "cpu".
        seed: seeds torch's global RNG (the draws of unseeded sampled requests).
        cpu_kv_cache_gib: the KV cache size on the CPU.
        tokenizer: a directory (or Tokenizer) to take the tokenizer from instead of ``model``'s.
        cuda_graphs: replay decode-only steps as CUDA graphs captured at start (vLLM's default; its
            ``enforce_eager=True`` is ``cuda_graphs=False`` here, our default until the graphs have
            run in production). Needs a CUDA device: True with another device raises ValueError.
            Capture takes a few seconds and ~0.1 GiB at the 8B shape, taken from the KV cache.
        async_scheduling: in ``step`` (and so ``generate``), schedule and launch the next decode step
            before the current one's tokens are read (``Scheduler.schedule_ahead``; vLLM's
            ``async_scheduling``): the host's per-step work (reading tokens, detokenizing, outputs,
            scheduling) overlaps the device's next step instead of leaving the device idle. Outputs
            are the same; a request that finishes has one step of device work done for nothing.
            Steps of requests with penalties, or with requests waiting, are not scheduled ahead.
        async_scheduling_min_seqs: schedule ahead only steps of at least this many requests. At a
            small batch the host work hidden is small (~1 ms at batch 1–2 at the 8B shape) and a
            request that arrives waits for the step scheduled ahead too (``fuseformer serve`` uses 8).
        prefill_stream: on CUDA, a prefill that ``step_with_arrivals`` launches while a decode step is
            in flight runs on a second stream, beside that step instead of queued behind it (the
            prefill is host-bound, the decode step memory-bound: they share the GPU well). On by
            default in ``fuseformer serve`` on CUDA (H200, 8B shape: 1 req/s p50 time to first token
            0.95-1.00x a lone request's with ``AsyncEngine.overlap_prefill``, runs 31-33).
    """

    def __init__(
        self,
        model: str | Path | LlamaForCausalLM,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        device: str | torch.device | None = None,
        seed: int = 0,
        cpu_kv_cache_gib: float = 1.0,
        tokenizer: str | Path | Tokenizer | None = None,
        cuda_graphs: bool = False,
        async_scheduling: bool = False,
        async_scheduling_min_seqs: int = 1,
        prefill_stream: bool = False,
    ) -> None:
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"LLM: async_scheduling must be a bool, got {async_scheduling!r}")
        if not isinstance(async_scheduling_min_seqs, int) or async_scheduling_min_seqs < 1:
            raise ValueError(f"LLM: async_scheduling_min_seqs must be an int >= 1, got {async_scheduling_min_seqs!r}")
        if not isinstance(prefill_stream, bool):
            raise ValueError(f"LLM: prefill_stream must be a bool, got {prefill_stream!r}")
        self.async_scheduling = async_scheduling
        self.async_scheduling_min_seqs = async_scheduling_min_seqs
        self.prefill_stream = prefill_stream
        self._side_stream = None  # prefill_stream's CUDA stream, made at first use
        self._ahead: StepHandle | None = None  # a step scheduled ahead, launched, not yet finished
        self.num_steps_ahead = 0  # steps launched ahead of the previous step's tokens
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"LLM: max_model_len must be an int >= 2 or None, got {max_model_len!r}")
        cache_config = CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_gib=cpu_kv_cache_gib,
        )
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"LLM: cuda_graphs must be a bool, got {cuda_graphs!r}")
        if cuda_graphs and device.type != "cuda":  # before loading: the mistake costs no load time
            raise ValueError(f"LLM: cuda_graphs=True needs a CUDA device, got device {str(device)!r}")
        torch.manual_seed(seed)
        path = None
        if isinstance(model, LlamaForCausalLM):
            self.model, self.model_config = model.eval(), model.config
        else:
            path = Path(model)
            checkpoint_dtype = ModelConfig.from_file(path / "config.json").torch_dtype if path.is_dir() else None
            self.model, self.model_config = load_model(path, _resolve_dtype(dtype, checkpoint_dtype), device)
        if isinstance(tokenizer, Tokenizer):
            self.tokenizer: Tokenizer | None = tokenizer
        elif tokenizer is not None:
            self.tokenizer = Tokenizer(tokenizer)
        elif path is not None and (path / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer(path)
        else:
            self.tokenizer = None
        self.eos_token_ids = _eos_ids_of(path, self.tokenizer)

        config = self.model_config
        limit = max_model_len or config.max_position_embeddings
        self.runner = ModelRunner(
            self.model,
            config,
            cache_config,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=limit,
            cuda_graphs=cuda_graphs,
        )
        capacity = (self.runner.num_blocks - 1) * block_size
        if max_model_len is None:
            limit = min(limit, capacity)  # the default adapts to the cache; an explicit value is checked
        self.max_model_len = limit
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=limit,
                enable_prefix_caching=enable_prefix_caching,
            )
        )
        self._groups: dict[str, _Group] = {}  # unfinished prompts by request id
        self._sequences: dict[str, _Sequence] = {}  # unfinished completions by scheduler request id
        self._counter = itertools.count()
        # Where the steps' time goes, by kind (see fuseformer.engine.step_log): for benchmarks.
        self.step_log = StepLog()

    # ---- defaults and validation -------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json (do_sample false -> greedy), else vLLM's defaults."""
        g = self.tokenizer.generation_defaults if self.tokenizer is not None else {}
        kwargs: dict[str, Any] = {
            k: g[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty") if k in g
        }
        if g.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        if "top_k" in kwargs and kwargs["top_k"] == 0:
            kwargs["top_k"] = -1
        if isinstance(g.get("max_new_tokens"), int) and g["max_new_tokens"] > 0:
            kwargs["max_tokens"] = g["max_new_tokens"]
        return SamplingParams(**kwargs)

    def _prompt_ids(self, prompt: Any, where: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"LLM: {where} is text but the model has no tokenizer.json; give token ids")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"LLM: {where} must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"LLM: {where} is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"LLM: {where} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"LLM: {where} has {len(ids)} tokens; max_model_len {self.max_model_len} leaves room for at most "
                f"{self.max_model_len - 1} prompt tokens (one output token must fit)"
            )
        return text, ids

    @staticmethod
    def _params_list(sampling_params: Any, n: int, default: SamplingParams) -> list[SamplingParams]:
        if sampling_params is None:
            return [default] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(
                f"LLM: sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"LLM: {len(params)} sampling_params for {n} prompts; give one, or one per prompt")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"LLM: sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        return params

    def _check_params(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError("LLM: stop strings need a tokenizer (the model has no tokenizer.json); use stop_token_ids")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"LLM: stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            # torch.topk would raise inside the engine's step, taking every other request with it.
            raise ValueError(f"LLM: logprobs {params.logprobs} is more than the vocabulary size {vocab}")
        if params.n > 1 and params.seed is not None and params.seed + params.n - 1 >= 2**64:
            # The n completions are seeded seed, seed+1, ..., seed+n-1 (see _make_group).
            raise ValueError(
                f"LLM: seed {params.seed} with n={params.n} seeds the completions up to {params.seed + params.n - 1}, "
                f"past 2**64 - 1; give a seed at most {2**64 - params.n}"
            )

    # ---- streaming API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a prompt (text or token ids) for ``step``; returns its request id (made when None)."""
        params = self._params_list(sampling_params, 1, self.get_default_sampling_params())[0]
        self._check_params(params)
        text, ids = self._prompt_ids(prompt, "prompt")
        return self._add(request_id, text, ids, params, arrival_time)

    def _add(self, request_id, text, ids, params, arrival_time=None) -> str:
        group = self._make_group(request_id, text, ids, params, arrival_time)
        self._queue(group)
        return group.request_id

    def _make_group(self, request_id, text, ids, params, arrival_time=None) -> _Group:
        """The prompt's group and its ``params.n`` requests, built (so checked) but not yet queued."""
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self._groups:
            raise ValueError(f"LLM: request_id {request_id!r} is already running")
        arrival = time.time() if arrival_time is None else arrival_time
        group = _Group(request_id, text, ids)
        for i in range(params.n):
            child = params
            if params.n > 1:  # fanned out: n requests of one completion each, seeds seed, seed+1, ...
                child = _replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, child, eos_token_id=self.eos_token_ids, arrival_time=arrival)
            detok = IncrementalDetokenizer(self.tokenizer, ids, child) if self.tokenizer is not None else None
            group.sequences.append(_Sequence(req, request_id, i, detok, RequestMetrics(arrival_time=arrival)))
        return group

    def _queue(self, group: _Group) -> None:
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
            self._sequences[seq.request.request_id] = seq
        self._groups[group.request_id] = group

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Stop requests now and free their KV blocks (unknown or finished ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for gid in ids:
            group = self._groups.pop(gid, None)
            if group is None:
                continue
            for seq in group.sequences:
                if seq.finish_reason is None:
                    self.scheduler.abort(seq.request.request_id)
                    self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def has_waiting_requests(self) -> bool:
        """Requests added (or preempted) and not yet running."""
        return bool(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns, per prompt whose completions changed, a delta RequestOutput: each
        of its ``outputs`` holds the text and tokens that completion gained in this step.

        With ``async_scheduling`` the next decode step is launched before this one's tokens are read
        (it is this method's next step; its requests' outputs come from the next call)."""
        handle = self._take_ahead() or self.launch_step()
        self._launch_ahead(handle)
        return self._finish_with_ahead(handle)

    def _take_ahead(self) -> StepHandle | None:
        handle, self._ahead = self._ahead, None
        return handle

    def _launch_ahead(self, handle: StepHandle) -> bool:
        """With ``async_scheduling``, schedule and launch the step after ``handle`` now, if it can be."""
        if (
            not self.async_scheduling
            or handle.launched.output is None
            or len(self.scheduler.running) < self.async_scheduling_min_seqs
        ):
            return False
        ahead = self.scheduler.schedule_ahead(handle.scheduler_output)
        if ahead is None:
            return False
        self._ahead = self._launch(lambda: ahead, handle.launched.output.sampled_token_ids)
        self.num_steps_ahead += 1
        return True

    def _finish_with_ahead(self, handle: StepHandle) -> list[RequestOutput]:
        outputs = self.finish_step(handle)
        if self._ahead is not None and not self.scheduler.has_unfinished_requests():
            self.finish_step(self._take_ahead())  # every request of it finished: nothing to report
        return outputs

    def step_with_arrivals(
        self, arrivals: Callable[[float], bool], poll_s: float = 2e-4
    ) -> tuple[list[RequestOutput], bool]:
        """``step``, letting requests that arrive meanwhile start early: while a CUDA-graph decode step
        runs on the device (``StepHandle.overlappable``), call ``arrivals(poll_s)``, which waits up to
        ``poll_s`` seconds for new requests, adds them (``add_request``) and says whether any came; the
        first that do get their prefill launched at once, behind the decode step in the device's queue.
        Returns (the deltas of both steps, in launch order; whether a prefill was launched early).

        With ``async_scheduling``, a step that can be scheduled ahead is (as in ``step``), and then
        arrivals wait for the next call: the two overlaps are for large and for small batches."""
        handle = self._take_ahead() or self.launch_step()
        if self._launch_ahead(handle):
            return self._finish_with_ahead(handle), False
        admitted = None
        if handle.overlappable:
            while not handle.ready:
                if arrivals(poll_s):
                    if self.has_waiting_requests():
                        admitted = self._launch_admitted()
                    break
        outputs = self.finish_step(handle)
        if admitted is not None:
            outputs += self.finish_step(admitted)
        return outputs, admitted is not None

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

    def launch_step(self, admit_only: bool = False) -> StepHandle:
        """The first half of ``step``: schedule and enqueue the device work, without waiting for it.
        ``admit_only``: waiting requests only (``Scheduler.schedule``), for a step launched while
        another is in flight; finish the steps in launch order."""
        if self._ahead is not None and not admit_only:
            raise RuntimeError("LLM.launch_step: a step scheduled ahead is in flight (async_scheduling): use step()")
        return self._launch(lambda: self.scheduler.schedule(admit_only=admit_only), None)

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

    def finish_step(self, handle: StepHandle) -> list[RequestOutput]:
        """The second half of ``step``: wait for the launched step and return its deltas."""
        sched = self.scheduler
        scheduler_output = handle.scheduler_output
        start = time.perf_counter()
        result = self.runner.collect(handle.launched)
        collected = time.perf_counter()
        updates = sched.update_from_output(scheduler_output, result.sampled_token_ids, result.logprobs)
        now = time.time()
        deltas: dict[str, RequestOutput] = {}
        for u in updates:
            seq = self._sequences[u.request_id]
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            text = ""
            finish_reason, stop_reason = u.finish_reason, u.stop_reason
            if seq.detokenizer is not None:
                detok = seq.detokenizer
                hit = detok.update(u.new_token_ids, stop_terminated=u.finished and u.finish_reason == "stop")
                if hit is not None:  # a stop string: the request ends here whatever else it reached
                    if not u.finished:
                        sched.finish_requests(u.request_id, RequestStatus.FINISHED_STOPPED)
                    finish_reason, stop_reason = "stop", hit
                elif u.finished and u.finish_reason == "length":
                    detok.flush()
                text = detok.get_next_output_text(finish_reason is not None)
            if finish_reason is not None:
                seq.stop_reason = stop_reason
                self._finish(seq, finish_reason)
            group = self._groups.get(seq.parent_id)
            if group is None:
                continue
            out = deltas.get(group.request_id)
            if out is None:
                out = deltas[group.request_id] = RequestOutput(
                    request_id=group.request_id,
                    prompt=group.prompt,
                    prompt_token_ids=group.prompt_token_ids,
                    metrics=group.sequences[0].metrics,
                )
            req = seq.request
            lps = req.logprobs[-len(u.new_token_ids) :] if req.logprobs is not None else None
            out.outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(u.new_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=lps,
                    cumulative_logprob=req.cumulative_logprob if lps is not None else None,
                )
            )
        for out in deltas.values():
            group = self._groups[out.request_id]
            out.finished = group.finished
            if out.finished:
                del self._groups[out.request_id]
        self._log_step(handle, 1e3 * (collected - start), 1e3 * (time.perf_counter() - collected))
        return list(deltas.values())

    def _log_step(self, handle: StepHandle, wait_ms: float, post_ms: float) -> None:
        scheduled = handle.scheduler_output.scheduled
        if not scheduled:
            return
        tokens = handle.scheduler_output.num_batched_tokens
        if handle.launched.graphed:
            kind = "graph"
        elif tokens == len(scheduled):
            kind = "decode"
        else:
            kind = "mixed" if any(len(s.token_ids) == 1 for s in scheduled) else "prefill"
        gpu_ms = None
        done = handle.launched.done
        if handle.start_event is not None and done is not None:
            gpu_ms = handle.start_event.elapsed_time(done)
        self.step_log.add(StepRecord(kind, tokens, len(scheduled), handle.launch_ms, wait_ms, post_ms, gpu_ms))

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        self._sequences.pop(seq.request.request_id, None)

    # ---- offline API ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids); outputs in the order of ``prompts``.

        Args:
            prompts: one prompt (a string or a list of token ids) or a list of them.
            sampling_params: one for all prompts, or one per prompt; None: the model's defaults
                (generation_config.json).
            use_tqdm: show a progress bar.

        It steps the engine until no request is left: requests added with ``add_request`` and not yet
        finished run along, and their outputs are not returned here (do not mix the two APIs).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        checked = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        return self._run(checked, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete one conversation ([{"role": ..., "content": ...}, ...]) or a list of them, rendered
        with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat: the model has no tokenizer.json")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        checked = []
        for i, conv in enumerate(conversations):
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            _, ids = self._prompt_ids(self.tokenizer.encode(text, add_special_tokens=False), f"conversation {i}")
            checked.append((text, ids))
        return self._run(checked, sampling_params, use_tqdm)

    def _run(self, checked, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        params = self._params_list(sampling_params, len(checked), self.get_default_sampling_params())
        for p in params:
            self._check_params(p)
        # Every group is built (each request made, so checked) before any is queued: an error in the
        # batch leaves nothing behind to run, unseen, in the next call.
        groups = [self._make_group(None, text, ids, p) for (text, ids), p in zip(checked, params)]
        for group in groups:
            self._queue(group)
        from tqdm.auto import tqdm

        total = sum(len(g.sequences) for g in groups)
        start, num_out = time.perf_counter(), 0
        with tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    for c in out.outputs:
                        num_out += len(c.token_ids)
                        if c.finished:
                            bar.update(1)
                    bar.set_postfix_str(f"{num_out / max(time.perf_counter() - start, 1e-9):.0f} tok/s out")
        return [self._final_output(g) for g in groups]

    @staticmethod
    def _final_output(group: _Group) -> RequestOutput:
        outputs = []
        for seq in group.sequences:
            req = seq.request
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.output_text if seq.detokenizer is not None else "",
                    token_ids=list(req.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=req.logprobs,
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=group.finished,
            metrics=group.sequences[0].metrics,
        )


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    """A copy of ``params`` with ``changes`` (slots dataclass: dataclasses.replace re-validates it)."""
    import dataclasses

    return dataclasses.replace(params, **changes)
