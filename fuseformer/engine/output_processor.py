"""OutputProcessor: the engine's side that sees prompts and text; the core sees token ids only.

In: a prompt (text, token ids, or vLLM's prompt dicts ``{"prompt": text}`` / ``{"prompt_token_ids":
ids}``) and its ``SamplingParams`` are checked, raising ``ValueError`` before anything is queued, cut to
``truncate_prompt_tokens``, and fanned out into scheduler ``Request``s, one per completion (``n > 1``:
ids ``"<id>#<i>"``, seeds ``seed + i``); ``bad_words`` are tokenized here. Out: each step's
``RequestUpdate``s become one delta ``RequestOutput`` per prompt: new tokens are detokenized, stop
strings searched (a request that hits one is handed back for the core to finish), EOS and stop token
ids left out of the text, logprobs given their tokens' text, and the completions of a prompt merged
into one output. Structured outputs: the one ``GrammarCompiler`` of the engine is made here (it needs
the tokenizer) at the first request that has a constraint, and each request gets its own matcher.
vLLM v1 splits this into an input and an output
processor; here one object holds the prompts, the tokenizer and the detokenizers.

Lengths: a prompt must be shorter than ``max_model_len`` (it must leave room for one output token);
a request whose prompt + ``max_tokens`` passes ``max_model_len`` is not refused but finishes with
"length" when it reaches ``max_model_len`` (vLLM does the same).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fuseformer.engine.detokenizer import IncrementalDetokenizer
from fuseformer.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from fuseformer.engine.request import Request
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import RequestUpdate
from fuseformer.engine.structured_outputs import GrammarCompiler
from fuseformer.models.tokenizer import Tokenizer

# Text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
Prompt = str | list[int] | dict[str, Any]
# The keys of vLLM's prompt dicts that are taken here (others, e.g. multi_modal_data, are refused).
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


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
class Group:
    """A prompt and its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # once the prompt is computed

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    @property
    def requests(self) -> list[Request]:
        """The scheduler requests of its completions."""
        return [s.request for s in self.sequences]


class OutputProcessor:
    """Prompts in, ``RequestOutput``s out (see the module docstring).

    Args:
        tokenizer: for text prompts and output text; None: prompts are token ids and texts stay empty.
        eos_token_ids: the ids that end a request unless ``ignore_eos`` (generation_config.json).
        vocab_size: token ids are checked against it.
        max_model_len: prompt + output tokens of one request at most (the core's).
    """

    def __init__(
        self, tokenizer: Tokenizer | None, eos_token_ids: list[int], vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._groups: dict[str, Group] = {}  # unfinished prompts by request id
        self._sequences: dict[str, _Sequence] = {}  # unfinished completions by scheduler request id
        self._counter = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()  # the server compiles from its event loop's thread too

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's compiler of structured-output constraints, made at first use (its compile
        thread and the grammar library's view of the vocabulary come with it)."""
        if self.tokenizer is None:
            raise ValueError("LLM: structured_outputs need a tokenizer (the model has no tokenizer.json)")
        with self._grammar_lock:
            if self._grammar_compiler is None:
                vocab = max(self.vocab_size, self.tokenizer.vocab_size)
                self._grammar_compiler = GrammarCompiler(self.tokenizer, vocab)
            return self._grammar_compiler

    def prepare_grammars(self) -> None:
        """Build the grammar libraries' views of the vocabulary in the background now (``LLM`` on CUDA,
        beside the server's start), so that the first constrained request does not wait ~1-3 s for
        them. Nothing without a tokenizer, its EOS (the compiler refuses one without: structured outputs
        then fail at their request, as before) or a grammar library."""
        libraries = ("llguidance", "xgrammar")
        if self.tokenizer is None or not self.tokenizer.eos_token_ids:
            return
        if any(importlib.util.find_spec(m) is not None for m in libraries):
            self.grammar_compiler.prepare()

    # ---- defaults and checks -----------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
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

    def prompt_ids(self, prompt: Any, where: str, params: SamplingParams | None = None) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids) of a prompt given as text, token ids or a vLLM prompt
        dict, cut to ``params.truncate_prompt_tokens`` and checked."""
        text = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - _PROMPT_KEYS)
            if unknown:
                raise ValueError(
                    f"LLM: {where} has keys this engine does not take: {unknown} (it takes prompt, prompt_token_ids)"
                )
            if "prompt_token_ids" in prompt:
                text, prompt = prompt.get("prompt"), prompt["prompt_token_ids"]
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"LLM: {where}['prompt'] must be a string, got {type(text).__name__}")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise ValueError(f"LLM: {where}['prompt'] must be a string, got {type(prompt).__name__}")
            else:
                raise ValueError(f"LLM: {where} is a dict without 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"LLM: {where} is text but the model has no tokenizer.json; give token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(
                f"LLM: {where} must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"LLM: {where} is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"LLM: {where} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        keep = params.truncate_prompt_tokens if params is not None else None
        if keep is not None:
            ids = ids[-(self.max_model_len - 1 if keep == -1 else keep) :]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"LLM: {where} has {len(ids)} tokens; max_model_len {self.max_model_len} leaves room for at most "
                f"{self.max_model_len - 1} prompt tokens (one output token must fit)"
            )
        return text, ids

    def params_list(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt from None (the defaults), one for all, or one per prompt; checked."""
        if sampling_params is None:
            params = [self.default_sampling_params()] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError(
                f"LLM: sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise ValueError(f"LLM: {len(params)} sampling_params for {n} prompts; give one, or one per prompt")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"LLM: sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        for p in params:
            self._check_params(p)
        return params

    def _check_params(self, params: SamplingParams) -> None:
        """Checks that need the model: the vocabulary, the tokenizer, max_model_len. Messages start
        with the field's name (the server names it in its 400)."""
        if params.stop and self.tokenizer is None:
            raise ValueError("LLM: stop strings need a tokenizer (the model has no tokenizer.json); use stop_token_ids")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("LLM: structured_outputs need a tokenizer (the model has no tokenizer.json)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("LLM: bad_words need a tokenizer (the model has no tokenizer.json); use logit_bias")
        vocab = self.vocab_size
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = [t for t in getattr(params, name) or () if t >= vocab]
            if bad:
                raise ValueError(f"LLM: {name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                # torch.topk would raise inside the engine's step, taking every other request with it.
                raise ValueError(f"LLM: {name} {k} is more than the vocabulary size {vocab}")
        keep = params.truncate_prompt_tokens
        if keep is not None and keep >= self.max_model_len:
            raise ValueError(
                f"LLM: truncate_prompt_tokens {keep} leaves no room for an output token in max_model_len "
                f"{self.max_model_len}; give at most {self.max_model_len - 1} (or -1)"
            )
        if params.n > 1 and params.seed is not None and params.seed + params.n - 1 >= 2**64:
            # The n completions are seeded seed, seed+1, ..., seed+n-1 (see make_group).
            raise ValueError(
                f"LLM: seed {params.seed} with n={params.n} seeds the completions up to {params.seed + params.n - 1}, "
                f"past 2**64 - 1; give a seed at most {2**64 - params.n}"
            )

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """The token ids of each bad word, as vLLM tokenizes them: the word alone, and after a space
        when that gives other tokens of the same count (a word inside the text, for tokenizers that
        mark a space on the next word)."""
        out: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out += [alone] if alone else []
            if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
                out.append(spaced)
        bad = [t for w in out for t in w if t >= self.vocab_size]
        if bad:
            raise ValueError(f"LLM: bad_words tokenize to ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return out

    # ---- requests in -------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Group:
        """One prompt (text, token ids or a prompt dict) and its parameters (None: the defaults),
        checked, as a group not yet added."""
        params = self.params_list(sampling_params, 1)[0]
        text, ids = self.prompt_ids(prompt, "prompt", params)
        return self.make_group(request_id, text, ids, params, arrival_time)

    def make_group(
        self,
        request_id: str | None,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Group:
        """The prompt's group and its ``params.n`` requests, built (so checked) but not yet added;
        ``ids`` as ``prompt_ids`` returns them (truncated); ``request_id`` None: one is made."""
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self._groups:
            raise ValueError(f"LLM: request_id {request_id!r} is already running")
        arrival = time.time() if arrival_time is None else arrival_time
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else []
        group = Group(request_id, text, ids)
        for i in range(params.n):
            child = params
            if params.n > 1:  # fanned out: n requests of one completion each, seeds seed, seed+1, ...
                # (dataclasses.replace: a copy that SamplingParams.__post_init__ checks again). Each
                # computes prompt_logprobs, so that whichever samples first has them for the group's
                # first output (admitted together, they could not share prefix blocks anyway).
                child = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            spec = child.structured_outputs
            grammar = self.grammar_compiler.matcher(spec) if spec is not None else None  # one per completion
            req = Request(
                rid,
                ids,
                child,
                eos_token_id=self.eos_token_ids,
                arrival_time=arrival,
                bad_words_token_ids=bad_words,
                grammar=grammar,
            )
            detok = IncrementalDetokenizer(self.tokenizer, ids, child) if self.tokenizer is not None else None
            group.sequences.append(_Sequence(req, request_id, i, detok, RequestMetrics(arrival_time=arrival)))
        return group

    def add(self, group: Group) -> list[Request]:
        """Follow ``group`` from now on; returns its requests, for the core to schedule."""
        for seq in group.sequences:
            self._sequences[seq.request.request_id] = seq
        self._groups[group.request_id] = group
        return group.requests

    def abort(self, request_id: str | Sequence[str]) -> list[str]:
        """Forget prompts (unknown or finished ids are ignored); returns the scheduler ids of their
        unfinished completions, for the core to abort."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = []
        for gid in ids:
            group = self._groups.pop(gid, None)
            if group is None:
                continue
            for seq in group.sequences:
                if seq.finish_reason is None:
                    aborted.append(seq.request.request_id)
                    self._finish(seq, "abort")
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- outputs -----------------------------------------------------------------------------

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """A step's updates as delta RequestOutputs: per prompt whose completions changed, each changed
        completion with the text and tokens it gained. Also returns the requests a stop string ended,
        which the scheduler must finish (FINISHED_STOPPED) before the next step."""
        now = time.time()
        deltas: dict[str, RequestOutput] = {}
        stopped: list[str] = []
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
                        stopped.append(u.request_id)
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
                    num_cached_tokens=_cached_tokens(group),
                )
            if group.prompt_logprobs is None and self._take_prompt_logprobs(group):
                out.prompt_logprobs = group.prompt_logprobs  # once, in the first delta that can have it
            req = seq.request
            lps = req.logprobs[-len(u.new_token_ids) :] if req.logprobs is not None else None
            if lps and self.tokenizer is not None:
                self._decode_logprobs(lps)
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
        return list(deltas.values()), stopped

    @staticmethod
    def final_output(group: Group) -> RequestOutput:
        """The whole output of a group: every completion's full text and tokens."""
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
            prompt_logprobs=group.prompt_logprobs,
            outputs=outputs,
            finished=group.finished,
            metrics=group.sequences[0].metrics,
            num_cached_tokens=_cached_tokens(group),
        )

    def _take_prompt_logprobs(self, group: Group) -> bool:
        """Set ``group.prompt_logprobs`` from a completion whose request has computed the prompt
        (vLLM's list: None for the first token, then one dict per token); False before any has."""
        complete = len(group.prompt_token_ids) - 1
        lists = [s.request.prompt_logprobs for s in group.sequences]
        computed = next((lp for lp in lists if lp is not None and len(lp) >= complete), None)
        if computed is None:
            return False
        if self.tokenizer is not None:
            self._decode_logprobs(computed)
        group.prompt_logprobs = [None, *computed]
        return True

    def _decode_logprobs(self, positions: list[PositionLogprobs]) -> None:
        """Fill each Logprob's ``decoded_token``: its token's text alone, special tokens kept."""
        decode = self.tokenizer.decode
        for position in positions:
            for token, lp in position.items():
                lp.decoded_token = decode([token], skip_special_tokens=False)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        self._sequences.pop(seq.request.request_id, None)


def _cached_tokens(group: Group) -> int | None:
    """The prefix-cache hit of the group's first completion, None before it was scheduled."""
    cached = group.sequences[0].request.num_cached_tokens
    return cached if cached >= 0 else None
