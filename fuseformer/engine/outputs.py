"""What ``LLM.generate`` and ``LLM.step`` return: vLLM's ``RequestOutput`` / ``CompletionOutput`` /
``Logprob`` shapes.

From ``generate`` each output is whole: the full text and token ids of every completion. From ``step``
(streaming) an output is a delta: the text and tokens one completion gained in that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``vllm.sequence.Logprob``).

    Attributes:
        logprob: ``log_softmax`` of the raw logits (before penalties, biases and masks, as vLLM's
            default "raw_logprobs").
        rank: 1 for the most likely token, 2 for the next, ...
        decoded_token: the token's text on its own (special tokens kept); None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, token id -> Logprob: the chosen (sampled, or prompt) token first, then the top tokens.
PositionLogprobs = dict[int, Logprob]


@dataclass(kw_only=True, slots=True)
class CompletionOutput:
    """One completion of a prompt (``index`` in ``range(n)``).

    Attributes:
        text: the output text (stop strings cut, EOS left out), or the text gained in a step.
        token_ids: the output tokens (EOS or the stop token included), or those gained in a step.
        finish_reason: "stop", "length", "abort", or None while generating.
        stop_reason: the stop token id or stop string that finished it; None for EOS, the length
            limit, or while generating (vLLM's).
        logprobs: with ``SamplingParams.logprobs``: per token, {token id: Logprob} holding the sampled
            token and the top ``logprobs`` tokens; else None.
        cumulative_logprob: the sum of the sampled tokens' logprobs (with logprobs), else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
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
        prompt_token_ids: the prompt's tokens (after ``truncate_prompt_tokens``).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token, {token id:
            Logprob} holding that token and the top ``prompt_logprobs`` tokens; the first entry is
            None (nothing predicts the first token), as vLLM's. From ``step`` it comes once, in the
            first output after the prompt is computed; else None.
        outputs: the completions (all ``n`` from ``generate``; those that changed from ``step``).
        finished: every completion of the prompt has finished.
        metrics: timings of the first completion's request.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache (the first completion's;
            None before it was scheduled).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
