"""AsyncScheduler: a Scheduler that schedules the next decode step before the current one's tokens are
known (the engine's ``async_scheduling``; vLLM v1's ``AsyncScheduler``).

While a decode step is on the device, the next one is scheduled for the same requests: each computes,
at the next position, the token the step in flight samples (the runner takes it from the device:
``SchedulerOutput.ahead_rows``; the scheduled input is the placeholder ``AHEAD_TOKEN``). The engine
core launches it at once, so that the host's per-step work (reading tokens, detokenizing, outputs,
scheduling) overlaps the device's next step instead of leaving the device idle.

``update_from_output`` of the two steps comes in launch order; a request that finished in the first
has its row in the second ignored. Its blocks may be freed (and handed to another request) while the
second step is still writing its last slot: the device runs the steps in launch order on one stream,
so the other request's writes come after.
"""

from __future__ import annotations

from fuseformer.engine.request import RequestStatus
from fuseformer.engine.scheduler import AHEAD_TOKEN, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput


class AsyncScheduler(Scheduler):
    """A Scheduler whose ``schedule_ahead`` schedules (see the module docstring).

    Args:
        config: the limits, as for ``Scheduler``.
        min_seqs: schedule ahead only steps of at least this many running requests (at a small batch
            the host work hidden is small, and a request that arrives waits for the step ahead too).
    """

    def __init__(self, config: SchedulerConfig, min_seqs: int = 1) -> None:
        if isinstance(min_seqs, bool) or not isinstance(min_seqs, int) or min_seqs < 1:
            raise ValueError(f"AsyncScheduler: min_seqs must be an int >= 1, got {min_seqs!r}")
        super().__init__(config)
        self.min_seqs = min_seqs

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``prev`` (launched, its update not applied yet), scheduled now: every request
        of ``prev`` that cannot finish by length in it computes one token at its next position, the
        token ``prev`` samples for it (``ahead_rows``). None when the next step must be scheduled
        normally, after ``prev``'s update: fewer than ``min_seqs`` requests run, ``prev`` is not a
        decode step of all running requests, it preempted, requests wait to be admitted, every request
        finishes by length in ``prev``, or the blocks are short. When a request's sampling reads its
        output (``Request.sampling_reads_output``: a grammar, penalties, a bad word of several tokens,
        ``min_tokens`` not reached) the step is ``deferred_sampling``: its forward runs ahead, its
        sampler is launched after ``prev``'s update (one token short before it)."""
        if len(self.running) < self.min_seqs:
            return None
        running = RequestStatus.RUNNING
        live = [(row, s) for row, s in enumerate(prev.scheduled) if s.request.status is running]
        if self.waiting or prev.preempted_request_ids or len(live) != len(self.running):
            return None  # (requests that finished since prev was scheduled are left out)
        cfg = self.config
        out = SchedulerOutput()
        rows = []
        for row, s in live:
            req = s.request
            if len(s.token_ids) != 1 or not s.sample or req.num_computed_tokens != s.start_position:
                return None
            # After prev's token: at max_tokens or max_model_len it finishes whatever it samples.
            if req.num_output_tokens + 1 >= req.sampling_params.max_tokens or req.num_tokens + 1 >= cfg.max_model_len:
                continue
            if self.kv.allocate_slots(req, 2) is None:  # prev's token and this one's
                return None
            out.scheduled.append(
                ScheduledRequest(req, [AHEAD_TOKEN], req.num_tokens, tuple(req.block_ids), sample=True)
            )
            rows.append(row)
            out.deferred_sampling = out.deferred_sampling or req.sampling_reads_output
        if not rows:
            return None
        out.ahead_rows = rows
        out.num_batched_tokens = len(rows)
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        return out
