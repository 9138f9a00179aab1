"""Scheduler: which requests compute how many tokens each step (continuous batching).

Scheduling is by token counts, not phases (vLLM v1): each step has a budget of
``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` running requests. Running requests
are served first, oldest first, each with all its uncomputed tokens (1 for a decode) or what is left
of the budget (a prefill chunk). Then waiting requests are admitted in arrival order while budget,
sequence slots and blocks last; a prefix-cache hit starts them past their cached tokens.

When a running request cannot get a block, the newest running request is preempted: its blocks are
freed, its computed tokens forgotten, and it goes to the front of the waiting queue, to recompute
(prompt and output so far) when it is readmitted. Nothing is ever dropped.

One step: ``schedule()`` -> model runner -> ``update_from_output(output, sampled)``. ``abort`` and
``finish_requests`` may be called between steps, not while a step's output is outstanding.

Scheduling ahead (the engine's ``async_scheduling``, vLLM's name) is a subclass's:
``async_scheduler.AsyncScheduler``. Here ``schedule_ahead`` always says no, so that the engine core
asks every scheduler the same question.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from fuseformer.engine.kv_cache import NO_HIT, KVCacheManager
from fuseformer.engine.outputs import PositionLogprobs
from fuseformer.engine.request import Request, RequestStatus

AHEAD_TOKEN = -1  # the input token of a step scheduled ahead, until the runner takes the real one


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Limits of one engine.

    Args:
        num_blocks: KV blocks in the cache, the null block 0 included.
        block_size: tokens per KV block.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens computed per step at most (all requests together).
        max_model_len: prompt + output tokens of one request at most.
        enable_prefix_caching: reuse the KV blocks of equal prompt prefixes.
        enable_chunked_prefill: split a prompt over steps to fit the budget; without it a prompt
            waits until its whole uncomputed part fits in one step.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig: {name} must be a positive int, got {value!r}")
        if self.num_blocks < 2:
            raise ValueError(
                f"SchedulerConfig: num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}"
            )
        # A lone request of max_model_len tokens must fit, or preemption could never let it finish.
        capacity = (self.num_blocks - 1) * self.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig: num_blocks {self.num_blocks} x block_size {self.block_size} hold {capacity} tokens "
                f"(block 0 reserved), fewer than max_model_len {self.max_model_len}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig: without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len})"
            )


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~3x, and 256 are made per step
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (read it, do not change it: the scheduler owns it).
        token_ids: the tokens to compute this step, at positions ``start_position`` onward.
        start_position: the request's computed tokens before this step (their K/V is cached).
        block_ids: the request's block table, covering positions up to ``start_position + len(token_ids)``.
        sample: whether this step reaches the request's last token, so a token is sampled from the
            logits of its last position (False for a prefill chunk that is not the last).
    """

    request: Request
    token_ids: list[int]
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start_position, self.start_position + len(self.token_ids))


@dataclass(slots=True)
class SchedulerOutput:
    """A step's plan: ``scheduled`` in batch order (running requests first, then newly admitted)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests finished or aborted since the previous step: the runner can drop its state for them.
    finished_request_ids: list[str] = field(default_factory=list)
    # A step scheduled ahead (``AsyncScheduler.schedule_ahead``): row i's input token is row
    # ``ahead_rows[i]`` of the previous step's sampled tokens, on the device (its token_ids hold
    # AHEAD_TOKEN, a placeholder no model accepts).
    ahead_rows: list[int] | None = None
    # A step scheduled ahead whose sampling reads the output so far (``Request.sampling_reads_output``:
    # a grammar, penalties, ...): its forward is launched ahead, its sampler only after the previous
    # step's update (``ModelRunner.launch_sampling``), when the output it reads is complete.
    deferred_sampling: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step did to one request: tokens it appended and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """An engine's load (the defaults: an idle engine, before its first step)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0


class Scheduler:
    """Continuous batching over one KVCacheManager (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self._finished_ids: list[str] = []
        self._grammar_errors: list[RequestUpdate] = []  # requests finished because their grammar failed
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"add_request: request_id {request.request_id!r} is already scheduled")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"add_request: {request!r} is not a new request")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"add_request: request {request.request_id!r} has {request.num_tokens} tokens, "
                f"more than max_model_len {self.config.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Finish requests as aborted and free their blocks now. Unknown or finished ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests with ``status`` (e.g. FINISHED_STOPPED when the detokenizer found a stop
        string) and free their blocks. Returns the requests finished by this call."""
        if not status.is_finished:
            raise ValueError(f"finish_requests: status must be a finished one, got {status}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_hit_rate=self.kv.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions,
        )

    # ---- one step --------------------------------------------------------------------------

    def schedule(self, admit_only: bool = False) -> SchedulerOutput:
        """The next step: running requests first (preempting the newest when blocks run out), then
        waiting ones while the token budget, ``max_num_seqs`` and the blocks allow.

        ``admit_only``: waiting requests only, nothing preempted. For a step launched while another
        step is in flight (its running requests' tokens are not known yet): the in-flight step's
        requests are left alone, and ``update_from_output`` of the two outputs may come in launch order.
        """
        cfg = self.config
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = cfg.max_num_batched_tokens

        # Running requests first, oldest first; preempt from the newest end when blocks run out.
        i = len(self.running) if admit_only else 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
                i += 1

        # Then waiting ones in order, unless this step had to preempt (then blocks are short anyway).
        # A request whose grammar is still compiling is passed over (it keeps its place); one whose
        # grammar failed is finished ("abort", the error in its stop_reason).
        k = 0  # waiting requests passed over
        while (
            len(self.waiting) > k
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
            and not out.preempted_request_ids
        ):
            req = self.waiting[k]
            if req.grammar is not None and not req.grammar.ready:
                k += 1
                continue
            if req.grammar is not None and req.grammar.error is not None and not req.output_token_ids:
                del self.waiting[k]
                req.stop_reason = f"structured_outputs: {req.grammar.error}"
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                self._grammar_errors.append(RequestUpdate(req.request_id, [], True, "abort", req.stop_reason))
                continue
            # A request that wants its prompt's logprobs computes its whole prompt (vLLM's rule).
            computed = self.kv.get_computed_blocks(req) if req.prompt_logprobs is None else NO_HIT
            num_new = req.num_tokens - computed.num_tokens
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, computed) is None:
                break
            del self.waiting[k]
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = computed.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed.num_tokens
            out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``prev`` scheduled before ``prev``'s tokens are known: never here (each step is
        scheduled after the previous one's update); ``AsyncScheduler`` does."""
        return None

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        logprobs: dict[str, list[PositionLogprobs]] | None = None,
        grammars_advanced: bool = False,
    ) -> list[RequestUpdate]:
        """Advance the step's requests by their computed tokens; append the sampled tokens of those
        whose last token was reached (``sample``); finish those that hit a stop condition.

        Args:
            sampled_token_ids: request id -> tokens sampled this step (one, without speculative
                decoding); entries for requests that did not sample are ignored.
            logprobs: request id -> per sampled token, {token id: Logprob}, holding at least the
                sampled token (for requests that asked for logprobs).
            grammars_advanced: ``advance_grammars`` has given these tokens to the grammars already.

        Returns: an update for every request that appended tokens or finished (those whose grammar
        failed to compile since the last call first). A request with a grammar has it advanced by
        its tokens.
        """
        updates, self._grammar_errors = self._grammar_errors, []
        running = RequestStatus.RUNNING
        for s in scheduler_output.scheduled:
            req = s.request
            if req.status is not running or self.requests.get(req.request_id) is not req:
                continue  # finished or aborted since the step was scheduled
            req.num_computed_tokens += len(s.token_ids)
            if not s.sample:
                continue
            new_tokens = sampled_token_ids.get(req.request_id)
            if not new_tokens:
                raise ValueError(f"update_from_output: no sampled token for request {req.request_id!r}")
            lps = logprobs.get(req.request_id) if logprobs else None
            status = None
            if req.grammar is not None and not grammars_advanced:
                req.grammar.accept_tokens(new_tokens)  # a rejected token: only EOS is allowed next
            for j, tok in enumerate(new_tokens):
                req.output_token_ids.append(tok)
                req.all_token_ids.append(tok)
                if lps is not None and req.logprobs is not None:
                    req.logprobs.append(lps[j])
                    req.cumulative_logprob += lps[j][tok].logprob
                status = self._check_stop(req, tok)
                if status is not None:
                    new_tokens = new_tokens[: j + 1]
                    self.running.remove(req)
                    self._finish(req, status)
                    break
            finish_reason = None if status is None else status.value
            updates.append(
                RequestUpdate(req.request_id, list(new_tokens), status is not None, finish_reason, req.stop_reason)
            )
        return updates

    def advance_grammars(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> None:
        """Give the step's sampled tokens to its requests' grammars now, before ``update_from_output``
        (then called with ``grammars_advanced=True``), so that the next step's bitmask can fill while
        the rest of the update runs (``EngineCore.finish_step``). The same requests as there."""
        running = RequestStatus.RUNNING
        for s in scheduler_output.scheduled:
            req = s.request
            if not s.sample or req.grammar is None or req.status is not running:
                continue
            if self.requests.get(req.request_id) is req and sampled_token_ids.get(req.request_id):
                req.grammar.accept_tokens(sampled_token_ids[req.request_id])

    # ---- helpers ---------------------------------------------------------------------------

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request=req,
            token_ids=req.all_token_ids[start : start + num_new],
            start_position=start,
            block_ids=tuple(req.block_ids),
            sample=start + num_new == req.num_tokens,
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)  # before forgetting num_computed_tokens: its written full blocks get cached
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.kv.free(req)
        req.status = status
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def _check_stop(self, req: Request, last: int) -> RequestStatus | None:
        """The status ``req`` finishes with now that ``last`` was appended, or None. Below
        ``min_tokens`` only the length limits stop it (vLLM's; the sampler masks EOS and stop ids there)."""
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
