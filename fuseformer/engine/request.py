"""Request: one prompt being generated, with its tokens, progress and status.

There is no prefill or decode phase. A request has ``num_tokens`` tokens (prompt + output) of which
``num_computed_tokens`` have their K/V in the cache; each step the scheduler gives it some of the
rest to compute. When all are computed the model samples one more token, which is appended, and
the request again has one token left to compute. Chunked prefill, prefix caching (a prefix hit starts
``num_computed_tokens`` above 0) and recomputation after preemption all follow from that one rule.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

from fuseformer.engine.outputs import PositionLogprobs
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.structured_outputs import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; it recomputes from 0
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self is _STOPPED or self is _LENGTH or self is _ABORTED  # identity: ~10x cheaper than `in`

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason``: "stop", "length", "abort", or None while unfinished."""
        return self.value if self.is_finished else None


_STOPPED, _LENGTH, _ABORTED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
)


class Request:
    """One sequence: ``prompt_token_ids`` followed by the tokens generated so far.

    Args:
        request_id: unique among the unfinished requests of a scheduler.
        prompt_token_ids: at least one token.
        sampling_params: how to sample and when to stop.
        eos_token_id: the model's EOS id, or several (generation_config.json may list several), or None.
        arrival_time: seconds (``time.time()``); defaults to now.
        bad_words_token_ids: ``sampling_params.bad_words`` tokenized (``OutputProcessor``): each
            word's token ids, banned as the sampler's ``bad_words`` rule says.
        grammar: the matcher of ``sampling_params.structured_outputs`` (``OutputProcessor``: one per
            request, so each of ``n`` completions has its own). The scheduler admits the request once it
            is ``ready``; the runner masks each step's logits with it; ``update_from_output`` advances it
            by the tokens sampled. A preempted request keeps it as it is (its output tokens are kept).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        arrival_time: float | None = None,
        bad_words_token_ids: Sequence[Sequence[int]] = (),
        grammar: GrammarMatcher | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"Request {request_id!r}: prompt_token_ids is empty")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output, kept in step
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset((eos_token_id,))
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.bad_words_token_ids: list[list[int]] = [list(w) for w in bad_words_token_ids]
        self.grammar = grammar

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.block_ids: list[int] = []  # the block table, kept by the KVCacheManager
        # Chain hashes of the full blocks of all_token_ids, kept by the KVCacheManager (computed
        # once per block, reused after preemption).
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] | None = [] if self.sampling_params.logprobs is not None else None
        # With prompt_logprobs: entry i is prompt token i + 1's, appended by the model runner as the
        # prefill computes the positions before it (``ModelRunner.collect``: the core hands the
        # scheduler sampled tokens only, and these are no sampled token's).
        self.prompt_logprobs: list[PositionLogprobs] | None = (
            [] if self.sampling_params.prompt_logprobs is not None else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def sampling_reads_output(self) -> bool:
        """Sampling its next token reads its output so far: penalties (token counts), a bad word of
        several tokens (the output's last tokens), ``min_tokens`` not yet reached (the output's
        length), or a grammar (its mask follows the previous token). A step scheduled ahead
        (``AsyncScheduler``) with such a request defers its sampler until the previous token is
        appended (``SchedulerOutput.deferred_sampling``)."""
        params = self.sampling_params
        return (
            self.grammar is not None
            or params.needs_penalties
            or self.num_output_tokens < params.min_tokens
            or any(len(w) > 1 for w in self.bad_words_token_ids)
        )

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for t in token_ids:
            self.output_token_ids.append(t)
            self.all_token_ids.append(t)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_prompt_tokens}"
            f"+{self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
