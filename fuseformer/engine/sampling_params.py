"""SamplingParams: how one request is sampled and when it stops (the fields and meanings of vLLM's).

A validated dataclass: ``__post_init__`` raises ``ValueError`` (or ``TypeError``) naming the field,
so a bad value fails when the request is made, not deep inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fuseformer.engine.structured_outputs import StructuredOutputsParams

# The sampler computes in fp32 (engine/sampler.py), where 1e-40 is subnormal and 1e-50 is 0: a
# temperature of 1e-50 became 0 there and sampled as if it were 1, 1e-40 overflowed logits / T to inf
# (NaN probabilities, empty completions), and so did a top_p or repetition_penalty that rounds to 0.
# Positive values from 1e-6 keep logits / T and logits / penalty below fp32's 3.4e38 for any logit
# under 1e32, and below it every such value already acts as its limit (greedy, top token only).
MIN_SAMPLING_VALUE = 1e-6
MAX_REPETITION_PENALTY = 1e6  # above fp32's max it is inf, and a logit of 0 times inf is NaN
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values, [-100, 100]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Sampling and stopping for one request.

    Args:
        n: completions per prompt (the ``LLM`` layer fans a prompt out into ``n`` requests).
        max_tokens: output tokens at most.
        temperature: 0 is greedy (argmax); otherwise logits are divided by it before sampling; 0 or
            at least ``MIN_SAMPLING_VALUE`` (1e-6).
        top_k: keep the k most likely tokens; -1 or 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p; in
            [``MIN_SAMPLING_VALUE``, 1].
        min_p: drop tokens whose probability is below ``min_p`` times the top token's; in [0, 1].
        repetition_penalty: in [1e-6, 1e6] (``MIN_SAMPLING_VALUE``, ``MAX_REPETITION_PENALTY``); tokens
            seen in the prompt or output have positive logits divided by it and negative ones
            multiplied by it (1 = off).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token in the output.
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it is in the output.
        seed: a per-request seed: the same seed gives the same tokens whatever else is in the batch.
        stop: stop strings (a string or a list); the output is cut before the first one found.
        stop_token_ids: token ids that finish the request (besides EOS).
        ignore_eos: keep going past EOS.
        logprobs: None, or how many top log-probabilities to return per token besides the sampled
            token's (0 returns only the sampled token's).
        skip_special_tokens: leave special tokens out of the output text.
        include_stop_str_in_output: keep the stop string at the end of the output text.
        min_tokens: output tokens before the request may stop: until then EOS and ``stop_token_ids``
            are masked out of the sampling and stop strings are not looked for (vLLM's); at most
            ``max_tokens``.
        logit_bias: token id -> a bias in [-100, 100] added to that token's logit before sampling
            (OpenAI's; -100 in effect bans the token, 100 all but forces it). String keys that are
            integers ("42", as JSON has them) are taken as ids.
        bad_words: words never generated (vLLM's): each is tokenized alone and after a space; a
            word of one token is banned at every step, a longer one has its last token banned
            where the output so far ends with its other tokens.
        allowed_token_ids: every sampled token is one of these (non-empty).
        prompt_logprobs: None, or how many top log-probabilities to return per prompt token besides
            that token's own (``RequestOutput.prompt_logprobs``). The prompt is then computed whole,
            not read from the prefix cache (its logits are needed), as vLLM does.
        truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1), or -1: as many as
            leave room for one output token (``max_model_len - 1``); None keeps the whole prompt.
        structured_outputs: None, or the constraint the output is held to (a JSON schema, a regex,
            choices, a grammar: ``StructuredOutputsParams``, vLLM's field). Each step's logits are
            masked to the tokens it allows, before everything else; once it is complete only EOS is
            allowed (so the request ends, unless ``ignore_eos``).

    Not here (a ``TypeError`` naming it): vLLM's ``best_of`` (removed from vLLM's v1 engine as well),
    ``use_beam_search``, ``logits_processors``, ``guided_decoding`` (vLLM's older name of
    ``structured_outputs``), ``spaces_between_special_tokens``, ``output_kind``, ``detokenize``, ``extra_args``.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def _bad(self, name: str, why: str) -> ValueError:
        return ValueError(f"SamplingParams: {name} {why}, got {getattr(self, name)!r}")

    def __post_init__(self) -> None:
        bad = self._bad
        for name in ("n", "max_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"SamplingParams: {name} must be an int, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                raise TypeError(f"SamplingParams: {name} must be a number, got {getattr(self, name)!r}")
            if getattr(self, name) != getattr(self, name):
                raise bad(name, "must not be NaN")

        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.temperature < 0 or self.temperature == float("inf"):
            raise bad("temperature", "must be finite and >= 0 (0 is greedy)")
        if 0 < self.temperature < MIN_SAMPLING_VALUE:
            raise bad("temperature", f"must be 0 (greedy) or at least {MIN_SAMPLING_VALUE:g} (below, fp32 underflows)")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive count")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_p < MIN_SAMPLING_VALUE:
            raise bad("top_p", f"must be at least {MIN_SAMPLING_VALUE:g} (below, fp32 underflows)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not 0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "must be finite and > 0 (1 is off)")
        if not MIN_SAMPLING_VALUE <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad(
                "repetition_penalty",
                f"must be in [{MIN_SAMPLING_VALUE:g}, {MAX_REPETITION_PENALTY:g}] (outside, fp32 under- or overflows)",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"SamplingParams: seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            # torch.Generator.manual_seed raises outside this range, inside the engine's step.
            raise ValueError(f"SamplingParams: seed must be in [-2**63, 2**64), got {self.seed}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be None or an int >= 0")

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        self._check_token_controls()

    def _check_token_controls(self) -> None:
        """min_tokens, logit_bias, bad_words, allowed_token_ids, prompt_logprobs, truncate_prompt_tokens:
        checked and normalised (lists, int keys). Ids are checked against the vocabulary where it is
        known (``OutputProcessor``)."""
        bad = self._bad
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an int >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            bias = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
                if not _is_int(token) or token < 0:
                    raise bad("logit_bias", f"keys must be token ids >= 0 (key {key!r})")
                if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"values must be numbers in [-100, 100] (token {key!r}: {value!r})")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise bad("bad_words", "must be a list of non-blank strings")
            self.bad_words = words or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty (None allows every token)")
            if not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be a list of token ids >= 0")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be None or an int >= 0")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise bad("truncate_prompt_tokens", "must be None, -1 (as many as fit) or an int >= 1")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "SamplingParams: structured_outputs must be a StructuredOutputsParams or None, "
                f"got {type(self.structured_outputs).__name__}"
            )

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: the argmax token, no randomness (top-k/top-p/min-p do not matter)."""
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def masks_tokens(self) -> bool:
        """Some tokens' logits are changed before sampling: logit_bias, bad_words, allowed_token_ids
        or min_tokens (``sampler.SamplingMetadata``)."""
        return bool(self.logit_bias or self.bad_words or self.allowed_token_ids or self.min_tokens)
