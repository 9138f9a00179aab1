"""Sampler: next tokens from a batch of logits, each row with its own SamplingParams, on the device.

Per row, in vLLM v1's order and with its definitions:

0. structured outputs: the tokens a constrained row's grammar disallows to -inf (vLLM applies its
   grammar bitmask before the sampler too, so logprobs are of the masked logits);
1. logprobs (if asked) from the raw logits: ``log_softmax(logits)`` (vLLM's default "raw_logprobs");
2. token controls: banned tokens to -inf (outside ``allowed_token_ids``; ``bad_words``; EOS and
   ``stop_token_ids`` below ``min_tokens``), then ``+= logit_bias``;
3. penalties: repetition (tokens in prompt or output: positive logits / p, others * p), then
   ``logits -= frequency * count_in_output + presence * (count_in_output > 0)``;
4. greedy rows (temperature 0): argmax;
5. other rows: / temperature, min-p, top-k, top-p, then one draw from the softmax.

Token controls are decided on the host per row from short lists (a row's allowed ids, bias entries,
the bad words whose other tokens end its output) and applied on the device as one (N, V) mask and
one (N, V) bias, built there by a scatter of those (row, token) pairs: nothing loops over the
vocabulary, and a batch where no row uses them pays nothing.

The draw is the Gumbel-max trick: ``argmax(logits / T + g)`` with ``g = -log(-log u)``, a draw from
softmax(logits / T). On CUDA the whole batch is one kernel
(``ops.sampling.gumbel_sample``) whose noise comes from Philox keyed by a seed and counted by a position:
a seeded row passes its request's seed and the position of the token it samples, so its tokens depend
only on the seed, the position and the row's logits, not on the batch they share or on the steps
before; unseeded rows share one fresh seed a step (from torch's global CPU generator: ``LLM(seed=...)``
fixes them) with their row as position. Elsewhere (CPU tensors, the reference forced) the same race
runs on torch's RNG, ``argmax(probs / q)`` with ``q ~ Exponential(1)``: one ``exponential_`` over the
batch, and a seeded row's ``q`` from a generator seeded by its (seed, position): the same guarantee,
other draws than the kernel's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fuseformer.engine.outputs import Logprob, PositionLogprobs
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.structured_outputs import apply_token_bitmask_
from fuseformer.ops.sampling import gumbel_sample
from fuseformer.runtime.backend import choose_backend


def seed_bits(seed: int) -> int:
    """A request's seed (in [-2**63, 2**64)) as the int64 holding its 64 bits (the kernel's key)."""
    return (seed + 2**63) % 2**64 - 2**63


def _generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """torch's RNG for a seeded row's draw at ``position`` (the path off the kernel): seeded by a
    splitmix64 of (seed, position), so each position's noise is its own and the batch plays no part."""
    z = (seed_bits(seed) * 0x9E3779B97F4A7C15 + position + 1) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return torch.Generator(device=device).manual_seed(z ^ (z >> 31))


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
        seeds, positions: (N,) int64, each row's noise key and counter for ``gumbel_sample``: a seeded
            row's seed (``seed_bits``) and its sampled token's position; unseeded rows the step's seed
            and their row. None when every row is greedy.
        seeded: row -> (seed, position) of each seeded non-greedy row (the draw off the kernel).
        max_num_logprobs: the largest ``logprobs`` asked by a row, or None.
        banned: (N, V) bool, True where a row may not sample the token (outside its
            ``allowed_token_ids``, a ``bad_words`` ban, EOS and stop ids below ``min_tokens``).
        logit_bias: (N, V) fp32, the rows' ``logit_bias`` (0 elsewhere).
        bitmask: (R, ceil(V / 32)) int32 on the device, the tokens each constrained row's grammar
            allows (``GrammarCompiler.fill_bitmask``; ``structured_outputs.apply_token_bitmask_``).
        bitmask_rows: (R,) int64 on the device, the row of each bitmask row; None when R == N.
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
    seeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    seeded: dict[int, tuple[int, int]] | None = None
    max_num_logprobs: int | None = None
    banned: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        positions: Sequence[int] | None = None,
        eos_token_ids: Sequence[Iterable[int]] | None = None,
        bad_words_token_ids: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> SamplingMetadata:
        """From one SamplingParams per row. Token ids are needed when a row has penalties, and
        output token ids when it has ``min_tokens`` or ``bad_words``; ``positions[i]`` (the position of
        the token row i samples) when a random row is seeded; ``eos_token_ids[i]`` (masked below ``min_tokens``
        unless ``ignore_eos``) and ``bad_words_token_ids[i]`` (``Request.bad_words_token_ids``) when
        row i has those."""

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

        if random_rows:
            md.seeds, md.positions, md.seeded = _noise_keys(params, greedy, positions, device)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(asked) if asked else None
        if any(p.masks_tokens for p in params):
            md.banned, md.logit_bias = _token_controls(
                params, vocab_size, device, output_token_ids, eos_token_ids, bad_words_token_ids
            )
        return md


def _noise_keys(
    params: Sequence[SamplingParams], greedy: Sequence[bool], positions: Sequence[int] | None, device
) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[int, int]] | None]:
    """(seeds, positions) as one copy to ``device``, and the seeded random rows' (seed, position)."""
    n = len(params)
    seeded = {i: p.seed for i, p in enumerate(params) if p.seed is not None and not greedy[i]}
    if seeded and positions is None:
        raise ValueError("SamplingMetadata.build: seeded rows need positions (each sampled token's position)")
    if positions is not None and len(positions) != n:
        raise ValueError(f"SamplingMetadata.build: {len(positions)} positions for {n} rows")
    step_seed = int(torch.randint(-(2**63), 2**63 - 1, ()))  # torch's global CPU generator
    keys = [[step_seed] * n, list(range(n))]
    for i, seed in seeded.items():
        keys[0][i], keys[1][i] = seed_bits(seed), positions[i]
    both = to_device(torch.tensor(keys, dtype=torch.int64), device)
    return both[0], both[1], {i: (seed, positions[i]) for i, seed in seeded.items()} or None


def _token_controls(
    params: Sequence[SamplingParams],
    vocab: int,
    device: torch.device | str,
    output_token_ids: Sequence[Sequence[int]] | None,
    eos_token_ids: Sequence[Iterable[int]] | None,
    bad_words_token_ids: Sequence[Sequence[Sequence[int]]] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(banned (N, V) bool or None, bias (N, V) fp32 or None) on ``device`` for the rows' token
    controls (see the module docstring): the (row, token) pairs are listed here, on the host, and
    scattered there, all ids in one copy."""
    restricted: list[int] = []  # rows with allowed_token_ids
    allowed: tuple[list[int], list[int]] = ([], [])  # their (row, token) pairs
    bans: tuple[list[int], list[int]] = ([], [])
    biased: tuple[list[int], list[int]] = ([], [])
    bias_values: list[float] = []
    for i, p in enumerate(params):
        if not p.masks_tokens:
            continue
        if p.allowed_token_ids:
            restricted.append(i)
            allowed[0].extend([i] * len(p.allowed_token_ids))
            allowed[1].extend(p.allowed_token_ids)
        if p.logit_bias:
            biased[0].extend([i] * len(p.logit_bias))
            biased[1].extend(p.logit_bias)
            bias_values.extend(p.logit_bias.values())
        if not (p.min_tokens or p.bad_words):
            continue
        if output_token_ids is None:
            raise ValueError("SamplingMetadata.build: min_tokens and bad_words need output_token_ids")
        output = output_token_ids[i]
        banned = []
        if len(output) < p.min_tokens:
            if eos_token_ids is None and not p.ignore_eos:
                raise ValueError("SamplingMetadata.build: min_tokens needs eos_token_ids")
            banned += p.stop_token_ids if p.ignore_eos else {*p.stop_token_ids, *eos_token_ids[i]}
        if p.bad_words:
            if bad_words_token_ids is None:
                raise ValueError("SamplingMetadata.build: bad_words need bad_words_token_ids")
            banned += _bad_word_bans(bad_words_token_ids[i], output)
        bans[0].extend([i] * len(banned))
        bans[1].extend(banned)
    lists = (restricted, *allowed, *bans, *biased)
    if not any(lists):
        return None, None
    ids = to_device(torch.tensor([x for part in lists for x in part], dtype=torch.int64), device)
    restricted_rows, allowed_rows, allowed_ids, ban_rows, ban_ids, bias_rows, bias_ids = ids.split(
        [len(part) for part in lists]
    )
    n = len(params)
    mask = None
    if restricted or bans[0]:
        mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        mask[restricted_rows] = True
        mask[allowed_rows, allowed_ids] = False
        mask[ban_rows, ban_ids] = True
    bias = None
    if bias_values:
        bias = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        bias[bias_rows, bias_ids] = to_device(torch.tensor(bias_values, dtype=torch.float32), device)
    return mask, bias


def _bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens ``words`` ban after ``output`` (vLLM's rule): a one-token word's token always; a
    longer word's last token where the output ends with its other tokens."""
    banned = []
    for w in words:
        k = len(w) - 1
        if k == 0 or (k <= len(output) and list(output[len(output) - k :]) == list(w[:k])):
            banned.append(w[-1])
    return banned


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
    width = max(max((len(r) for r, k in zip(rows, keep) if k), default=0), 1)
    # From Python lists (one thread): a torch.full of this size is an OpenMP region, whose threads then
    # spin on every core while the engine's step goes on (perf-notes, session 31).
    padded = [[*r, *[pad] * (width - len(r))] if k else [pad] * width for r, k in zip(rows, keep)]
    return torch.tensor(padded, dtype=torch.int64).view(len(rows), width)


def position_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], rank: int) -> PositionLogprobs:
    """{token id: Logprob} of one position from a row of the sampler's logprob layout: column 0 the
    chosen token (its rank ``rank``), then the top tokens (ranks 1, 2, ...); a chosen token that is
    also a top one keeps its first place (vLLM's dict)."""
    out = {token_ids[0]: Logprob(logprobs[0], rank)}
    for r, (t, lp) in enumerate(zip(token_ids[1:], logprobs[1:]), 1):
        out[t] = Logprob(lp, r)
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
    # The kernel on CUDA; torch's RNG elsewhere (interpreted, the kernel costs seconds a step at 8k tokens).
    kernel = logits.is_cuda and choose_backend("gumbel_sample", logits.device) == "triton"
    transformed = md.bitmask is not None or md.banned is not None or md.logit_bias is not None
    if not kernel or transformed or md.repetition_penalty is not None or md.max_num_logprobs is not None:
        logits = logits.float()  # (in place from here on when the logits are fp32 already)
    if md.bitmask is not None:
        apply_token_bitmask_(logits, md.bitmask, md.bitmask_rows)
    raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None

    if md.banned is not None:
        logits = logits.masked_fill(md.banned, float("-inf"))
    if md.logit_bias is not None:
        logits = logits + md.logit_bias
    if md.repetition_penalty is not None:
        logits = apply_penalties(logits, md)

    if md.all_greedy:
        sampled = logits.argmax(dim=-1)
    else:
        temperature = md.temperature
        if md.top_k is not None or md.top_p is not None or md.min_p is not None:
            # Filtered at the rows' temperatures; a greedy row (T = 1 here) keeps its argmax, the top token.
            greedy_rows = temperature == 0
            logits = _filter(logits.float() / torch.where(greedy_rows, 1.0, temperature)[:, None], md)
            temperature = (~greedy_rows).float()  # 0: greedy; 1: scaled already
        if kernel:
            sampled = gumbel_sample(logits, temperature, md.seeds, md.positions)
        else:
            sampled = _race(logits, temperature, md)

    out = SamplerOutput(sampled_token_ids=sampled)
    if raw_logprobs is not None:
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = _logprobs_of(
            raw_logprobs, sampled, md.max_num_logprobs
        )
    return out


def _race(logits: torch.Tensor, temperature: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``gumbel_sample``'s draw on torch's RNG (off the kernel): argmax(probs / q), q ~ Exponential(1), a
    seeded row's q from its (seed, position) generator; rows at temperature 0 take the argmax."""
    greedy_rows = temperature == 0
    probs = (logits / torch.where(greedy_rows, 1.0, temperature)[:, None]).softmax(dim=-1)
    q = torch.empty_like(probs)
    seeded = md.seeded or {}
    if len(seeded) < q.shape[0]:  # (a CPU draws ~40 ns a token: no batch draw when every row is seeded)
        q.exponential_()
    for row, (seed, position) in seeded.items():
        q[row].exponential_(generator=_generator(seed, position, logits.device))
    random_ids = (probs / q).argmax(dim=-1)
    return random_ids if md.all_random else torch.where(greedy_rows, logits.argmax(dim=-1), random_ids)


def _logprobs_of(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From (R, V) logprobs and the (R,) chosen tokens: ids (R, 1 + k) int64 and their logprobs
    (R, 1 + k), column 0 the chosen token, then the top k in order; the chosen token's rank (R,)."""
    chosen_lp = logprobs.gather(1, chosen[:, None])  # (R, 1)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    if not k:
        return chosen[:, None], chosen_lp, ranks
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen[:, None], top_ids], 1), torch.cat([chosen_lp, top_lp], 1), ranks


def prompt_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of prompt tokens (``SamplingParams.prompt_logprobs``), from the raw logits as the
    sampled tokens' are.

    Args:
        logits: (R, V) logits of the positions before the tokens, any float dtype.
        token_ids: (R,) int64, the prompt token each row predicts.
        k: top tokens per row.

    Returns: ids (R, 1 + k) int64 and logprobs (R, 1 + k) fp32, column 0 the prompt token, then the
    top k; the prompt token's rank (R,) int64.
    """
    return _logprobs_of(logits.float().log_softmax(dim=-1), token_ids, k)
