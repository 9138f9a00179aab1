"""Sampler: next tokens from a batch of logits, each row with its own SamplingParams, on the device.

Per row, in vLLM v1's order and with its definitions:

1. logprobs (if asked) from the raw logits: ``log_softmax(logits)`` (vLLM's default "raw_logprobs");
2. penalties: repetition (tokens in prompt or output: positive logits / p, others * p), then
   ``logits -= frequency * count_in_output + presence * (count_in_output > 0)``;
3. greedy rows (temperature 0): argmax;
4. other rows: / temperature, min-p, top-k, top-p, then one draw from the softmax.

The draw is ``argmax(probs / q)`` with ``q ~ Exponential(1)`` (the Gumbel-max trick in another form):
the whole batch in one kernel from the global RNG, except seeded rows, whose ``q`` comes from their
own ``torch.Generator``: their tokens then depend only on the seed and the row's logits, not on the
batch they share. That is the only per-row Python loop, and only over seeded rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fuseformer.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The RNG of one seeded request; keep it for the request's life (it advances one draw per token)."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(slots=True)
class SamplingMetadata:
    """The batch's SamplingParams as tensors (N rows); an optional field is None when no row needs it.

    Attributes:
        temperature: (N,) fp32, 0 for greedy rows.
        vocab_size: V, the logits' last dimension (token ids are padded with it).
        top_k: (N,) int64, vocab size where off.
        top_p: (N,) fp32, 1 where off.
        min_p: (N,) fp32, 0 where off.
        repetition_penalty, presence_penalty, frequency_penalty: (N,) fp32.
        prompt_token_ids, output_token_ids: (N, L) int64, padded with vocab_size (rows without
            penalties are all padding).
        generators: row -> generator of a seeded non-greedy row.
        max_num_logprobs: the largest ``logprobs`` asked by a row, or None.
    """

    temperature: torch.Tensor
    vocab_size: int
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    generators: dict[int, torch.Generator] | None = None
    max_num_logprobs: int | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SamplingMetadata:
        """From one SamplingParams per row. Token ids are needed when a row has penalties;
        ``generators[i]`` (from ``make_generator``) when row i is seeded."""
        n = len(params)

        def col(values, dtype=torch.float32):
            return to_device(torch.tensor(values, dtype=dtype), device)

        greedy = [p.is_greedy for p in params]
        md = cls(
            temperature=col([p.temperature for p in params]),
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            all_random=not any(greedy),
        )
        random_rows = [p for p in params if not p.is_greedy]
        if any(0 < p.top_k < vocab_size for p in random_rows):
            md.top_k = col([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64)
        if any(p.top_p < 1 for p in random_rows):
            md.top_p = col([p.top_p for p in params])
        if any(p.min_p > 0 for p in random_rows):
            md.min_p = col([p.min_p for p in params])

        penalized = [p.needs_penalties for p in params]
        if any(penalized):
            if prompt_token_ids is None or output_token_ids is None:
                raise ValueError("SamplingMetadata.build: penalties need prompt_token_ids and output_token_ids")
            md.repetition_penalty = col([p.repetition_penalty for p in params])
            md.presence_penalty = col([p.presence_penalty for p in params])
            md.frequency_penalty = col([p.frequency_penalty for p in params])
            # Only penalized rows' tokens are copied: a long prompt costs nothing unless it is penalized.
            md.prompt_token_ids = to_device(_pad(prompt_token_ids, penalized, vocab_size), device)
            md.output_token_ids = to_device(_pad(output_token_ids, penalized, vocab_size), device)

        if generators is not None:
            if len(generators) != n:
                raise ValueError(f"SamplingMetadata.build: {len(generators)} generators for {n} rows")
            md.generators = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]} or None
        asked = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(asked) if asked else None
        return md


def staged(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``x`` (on the CPU) as the source of a copy to ``device`` that never waits for the work queued
    there: pinned when ``device`` is CUDA (a copy from pageable memory first waits for the stream to
    drain, which made every engine step's launch wait for its own forward pass, holding the GIL)."""
    return x.pin_memory() if torch.device(device).type == "cuda" else x


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``x`` (on the CPU) copied to ``device`` without waiting for the work queued there (``staged``)."""
    return staged(x, device).to(device, non_blocking=True)


def _pad(rows: Sequence[Sequence[int]], keep: Sequence[bool], pad: int) -> torch.Tensor:
    """(N, L) int64 of the kept rows' ids, padded with ``pad``; rows not kept are all padding."""
    width = max((len(r) for r, k in zip(rows, keep) if k), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, (r, k) in enumerate(zip(rows, keep)):
        if k and len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out


@dataclass(slots=True)
class SamplerOutput:
    """``sampled_token_ids`` (N,) int64. With logprobs: ``logprob_token_ids`` and ``logprobs``
    (N, 1 + max_num_logprobs), column 0 the sampled token, then the top tokens in order; and
    ``sampled_ranks`` (N,) int64, the sampled token's rank (1 = most likely). A row that asked for
    fewer logprobs uses the first columns."""

    sampled_token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM's definitions) on (N, V) fp32 logits, out of place."""
    n, vocab = logits.shape
    output_counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, md.output_token_ids, torch.ones_like(md.output_token_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]  # column vocab collected the padding
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, md.prompt_token_ids, True)
    seen = seen[:, :vocab] | (output_counts > 0)

    rep = md.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """min-p, top-k, top-p on temperature-scaled (N, V) logits: dropped tokens get -inf."""
    if md.min_p is not None:
        probs = logits.softmax(dim=-1)
        keep_above = md.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < keep_above, float("-inf"))
    if md.top_k is None and md.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if md.top_k is not None:
        # Threshold on the k-th value: tokens tied with it stay (as vLLM and HF do).
        kth = sorted_logits.gather(1, (md.top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if md.top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always has 0 before it
        drop = (mass_before >= md.top_p[:, None]) & (md.top_p < 1)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Sample one token per row.

    Args:
        logits: (N, V) logits of each row's last position; any float dtype (computed in fp32).
        md: the rows' sampling parameters (``SamplingMetadata.build``).
    """
    if logits.dim() != 2 or tuple(logits.shape) != (md.temperature.shape[0], md.vocab_size):
        raise ValueError(
            f"sample: logits must be (num_seqs, vocab_size) = ({md.temperature.shape[0]}, {md.vocab_size}), "
            f"got {tuple(logits.shape)}"
        )
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None

    if md.repetition_penalty is not None:
        logits = apply_penalties(logits, md)
    greedy_ids = None if md.all_random else logits.argmax(dim=-1)

    if md.all_greedy:
        sampled = greedy_ids
    else:
        greedy_rows = md.temperature == 0
        temperature = torch.where(greedy_rows, torch.ones_like(md.temperature), md.temperature)
        probs = _filter(logits / temperature[:, None], md).softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, gen in (md.generators or {}).items():
            q[row].exponential_(generator=gen)
        random_ids = (probs / q).argmax(dim=-1)
        sampled = random_ids if md.all_random else torch.where(greedy_rows, greedy_ids, random_ids)

    out = SamplerOutput(sampled_token_ids=sampled)
    if raw_logprobs is not None:
        sampled_lp = raw_logprobs.gather(1, sampled[:, None])  # (N, 1)
        top_lp, top_ids = raw_logprobs.topk(md.max_num_logprobs, dim=-1) if md.max_num_logprobs else (None, None)
        out.logprob_token_ids = sampled[:, None] if top_ids is None else torch.cat([sampled[:, None], top_ids], 1)
        out.logprobs = sampled_lp if top_lp is None else torch.cat([sampled_lp, top_lp], 1)
        out.sampled_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    return out
