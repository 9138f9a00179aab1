"""What ``LLM.generate`` and ``LLM.step`` return: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes.

From ``generate`` each output is whole: the full text and token ids of every completion. From ``step``
(streaming) an output is a delta: the text and tokens one completion gained in that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class CompletionOutput:
    """One completion of a prompt (``index`` in ``range(n)``).

    Attributes:
        text: the output text (stop strings cut, EOS left out), or the text gained in a step.
        token_ids: the output tokens (EOS or the stop token included), or those gained in a step.
        finish_reason: "stop", "length", "abort", or None while generating.
        stop_reason: the stop token id or stop string that finished it, else None.
        logprobs: with ``SamplingParams.logprobs``: per token, {token id: logprob} holding the sampled
            token and the top ``logprobs`` tokens; else None.
        cumulative_logprob: the sum of the sampled tokens' logprobs (with logprobs), else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True, slots=True)
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request: arrival, first output token, finish."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """A prompt and its completions.

    Attributes:
        request_id: the id given to ``add_request`` (or made by ``generate``).
        prompt: the prompt text (None when the prompt was given as token ids).
        prompt_token_ids: the prompt's tokens.
        outputs: the completions (all ``n`` from ``generate``; those that changed from ``step``).
        finished: every completion of the prompt has finished.
        metrics: timings of the first completion's request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
