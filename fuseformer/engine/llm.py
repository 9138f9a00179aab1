"""LLM: offline generation (``LLM(model=path).generate(prompts, SamplingParams(...))``).

The offline API over the engine: it loads the model and tokenizer, builds an ``EngineCore`` (the step
over scheduler, KV cache and runner) and an ``OutputProcessor`` (prompts in, text out), and runs
steps until its requests finish. ``add_request``/``step``/``abort`` are the same loop driven from
outside, for streaming (the ``generate`` CLI); the server drives the core itself (``AsyncEngine``).

Every input is checked before anything is scheduled: a bad prompt or parameter in a batch raises
``ValueError`` and no request of that batch runs.

It reads as vLLM's ``LLM``: prompts as text, token ids or vLLM's prompt dicts, ``SamplingParams`` of the
same names, ``RequestOutput``/``CompletionOutput``/``Logprob`` of the same shapes, ``get_tokenizer()``.
vLLM's constructor arguments for what this engine does not have are taken only at the value that is
its behaviour anyway (``_VLLM_ONLY``); any other value, or a name neither has, raises naming it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fuseformer.engine.core import EngineCore, StepHandle
from fuseformer.engine.model_runner import CacheConfig, ModelRunner
from fuseformer.engine.output_processor import Group, OutputProcessor, Prompt
from fuseformer.engine.outputs import RequestOutput
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler
from fuseformer.engine.step_log import StepLog
from fuseformer.engine.structured_outputs import StructuredOutputsError
from fuseformer.models.config import ModelConfig
from fuseformer.models.loader import load_model
from fuseformer.models.quantization import is_fp8_model, quantize_model_fp8, wants_fp8
from fuseformer.models.registry import model_class
from fuseformer.models.tokenizer import Tokenizer

__all__ = ["LLM", "Prompt", "StepHandle"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "half": torch.float16}
_DTYPES |= {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# vLLM's LLM arguments for features this engine does not have: name -> (the values that ask for what
# it does anyway, what it does). ``LLM(tensor_parallel_size=1)`` from a vLLM script runs; ``2`` raises.
_VLLM_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "tensor_parallel_size": ((1,), "an engine runs on one device (no tensor parallelism)"),
    "pipeline_parallel_size": ((1,), "an engine runs on one device (no pipeline parallelism)"),
    "data_parallel_size": ((1,), "an engine runs on one device (no data parallelism)"),
    "trust_remote_code": ((False,), "models are the registry's (fuseformer.models.registry): no checkpoint code runs"),
    "enable_chunked_prefill": ((None, True), "prefills are always chunked to max_num_batched_tokens"),
    "swap_space": ((0,), "preempted requests recompute (as vLLM v1's): there is no CPU swap space"),
    "cpu_offload_gb": ((0,), "weights stay on the device"),
    "tokenizer_mode": (("auto",), "the tokenizer is the model directory's tokenizer.json"),
    "skip_tokenizer_init": ((False,), "the tokenizer is loaded when the model directory has one"),
    "revision": ((None,), "the model is a local directory"),
    "tokenizer_revision": ((None,), "the tokenizer is a local directory"),
}


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


def batch_limits(device: torch.device) -> tuple[int, int]:
    """The default (``max_num_seqs``, ``max_num_batched_tokens``) on ``device``, vLLM's ``LLM`` class's: on a
    CUDA GPU of at least 70 GiB that is not an A100, 1024 requests and 16,384 tokens a step; elsewhere 256
    and 8,192 (``fuseformer serve`` keeps 8,192 tokens, as vLLM's server does there). On an H200 the mix of
    512 requests is admitted in a few steps instead of a few prompts beside each step of 256 decodes
    (docs/perf-notes.md, runs 116-117)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
            return 1024, 16384
    return 256, 8192


def _check_model(model: nn.Module) -> ModelConfig:
    """The config of an already built model, which must be the registry's class for its architecture."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise ValueError(
            f"LLM: model must be a model directory or a model built by fuseformer.models.registry.build_model "
            f"(with a ModelConfig as .config), got a {type(model).__name__}"
        )
    expected = model_class(config)
    if not isinstance(model, expected):
        raise ValueError(
            f"LLM: a model of architecture {config.architecture!r} must be a {expected.__name__} "
            f"(fuseformer.models.registry), got a {type(model).__name__}"
        )
    return config


class LLM:
    """A model of the registry (``fuseformer.models.registry``) with a paged KV cache and continuous batching.

    Args:
        model: a Hugging Face model directory (config.json, safetensors, tokenizer files,
            generation_config.json), or an already built model (``registry.build_model``; then no
            tokenizer unless ``tokenizer`` is given: prompts must be token ids).
        dtype: "auto" (the checkpoint's, else float32), "float32", "float16", "bfloat16" or a torch dtype.
        max_model_len: prompt + output tokens of one request at most; default the model's
            max_position_embeddings, lowered to what the KV cache holds when that is less.
        gpu_memory_utilization: on CUDA, the share of GPU memory for weights, activations and KV cache.
        enable_prefix_caching: share the KV blocks of equal prompt prefixes.
        max_num_seqs: requests running at once at most; default (None) 1024 on a CUDA GPU of
            >= 70 GiB but an A100, else 256 (``batch_limits``: vLLM's defaults).
        max_num_batched_tokens: tokens computed per step at most (prefills are chunked to fit); default
            (None) 16,384 where ``max_num_seqs`` defaults to 1024, else 8,192.
        num_kv_blocks: KV blocks to allocate, overriding the memory-based sizing.
        block_size: tokens per KV block.
        device: default "cuda" when available, else "cpu".
        seed: seeds torch's global RNG (the draws of unseeded sampled requests).
        cpu_kv_cache_gib: the KV cache size on the CPU.
        tokenizer: a directory (or Tokenizer) to take the tokenizer from instead of ``model``'s.
        cuda_graphs: replay decode-only steps as CUDA graphs captured at start. Default (None): on
            when the model runs on CUDA, unless ``enforce_eager``; True with another device raises
            ValueError. Capture takes a few seconds and ~0.1 GiB at the 8B shape, taken from the KV
            cache; both are printed once when the LLM is built.
        async_scheduling: in ``step`` (and so ``generate``), schedule and launch the next decode step
            before the current one's tokens are read (``AsyncScheduler``; vLLM's
            ``async_scheduling``): the host's per-step work (reading tokens, detokenizing, outputs,
            scheduling) overlaps the device's next step instead of leaving the device idle. Outputs
            are the same; a request that finishes has one step of device work done for nothing.
            A step ahead with requests whose sampling reads their output so far (a grammar,
            penalties, ``min_tokens`` not yet reached, bad words of several tokens) launches its
            sampler after the previous step's tokens are applied; with requests waiting, the next step
            is not scheduled ahead.
            Default (None): on when the model runs on CUDA, unless ``enforce_eager``.
        enforce_eager: vLLM's name for the slow, simple path: no CUDA graphs and no scheduling ahead
            (unless ``async_scheduling=True`` is given too). ``cuda_graphs=True`` with it raises ValueError.
        async_scheduling_min_seqs: schedule ahead only steps of at least this many requests. At a
            small batch the host work hidden is small (~1 ms at batch 1–2 at the 8B shape) and a
            request that arrives waits for the step scheduled ahead too (``fuseformer serve`` uses 8).
        quantization: None, or "fp8": FP8 inference (vLLM's name), weights in e4m3 with a scale per
            output channel and activations quantized per token as they go, in every decoder layer's
            QKV, output and MLP projections (the norms before them fused with the quantization); the
            embeddings, the final norm, the LM head and attention stay in ``dtype``. A bf16/fp32
            checkpoint is quantized as it loads; an FP8 checkpoint (config.json's
            ``quantization_config``: "fp8" or "compressed-tensors", per-tensor or per-channel scales,
            dynamic activations) loads as it is, with None too (the checkpoint's quantization is used,
            as vLLM does). A built model passed as ``model`` is quantized in place (it must be the
            registry's, which ``model`` is checked to be anyway). Other values raise ValueError.
            On a CPU the FP8 ops run their PyTorch references: correct, not fast. See docs/models.md.
        kv_cache_dtype: "auto" (the model's dtype), or "fp8" / "fp8_e4m3": K and V cached in e4m3 with
            each layer's ``k_scale``/``v_scale`` (the checkpoint's, else 1.0) (``CacheConfig``);
            "fp8_e5m2" raises ValueError.
        prefill_stream: on CUDA, a prefill that ``step_with_arrivals`` launches while a decode step is
            in flight runs on a second stream, beside that step instead of queued behind it (the
            prefill is host-bound, the decode step memory-bound: they share the GPU well). On by
            default in ``fuseformer serve`` on CUDA (H200, 8B shape: 1 req/s p50 time to first token
            0.95-1.00x a lone request's with ``AsyncEngine.overlap_prefill``, runs 31-33).
        **vllm_only: vLLM's arguments in ``_VLLM_ONLY`` (``tensor_parallel_size``,
            ``trust_remote_code``, ``enable_chunked_prefill``, ``swap_space``, ...),
            at the values that are this engine's behaviour (``tensor_parallel_size=1``,
            ``trust_remote_code=False``, ...); another value raises ValueError naming it.
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        device: str | torch.device | None = None,
        seed: int = 0,
        cpu_kv_cache_gib: float = 1.0,
        tokenizer: str | Path | Tokenizer | None = None,
        cuda_graphs: bool | None = None,
        async_scheduling: bool | None = None,
        async_scheduling_min_seqs: int = 1,
        prefill_stream: bool = False,
        enforce_eager: bool = False,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        **vllm_only: Any,
    ) -> None:
        _check_vllm_only(vllm_only)
        wants_fp8(quantization, None, "LLM")  # a ValueError naming the accepted values, before loading
        for name, value in (("cuda_graphs", cuda_graphs), ("async_scheduling", async_scheduling)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"LLM: {name} must be a bool or None (the default), got {value!r}")
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"LLM: enforce_eager must be a bool, got {enforce_eager!r}")
        if enforce_eager and cuda_graphs:
            raise ValueError("LLM: enforce_eager=True and cuda_graphs=True contradict each other; pass one")
        if not isinstance(async_scheduling_min_seqs, int) or async_scheduling_min_seqs < 1:
            raise ValueError(f"LLM: async_scheduling_min_seqs must be an int >= 1, got {async_scheduling_min_seqs!r}")
        if not isinstance(prefill_stream, bool):
            raise ValueError(f"LLM: prefill_stream must be a bool, got {prefill_stream!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"LLM: max_model_len must be an int >= 2 or None, got {max_model_len!r}")
        cache_config = CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_gib=cpu_kv_cache_gib,
            kv_cache_dtype=kv_cache_dtype,
        )
        if device is None and isinstance(model, nn.Module):
            device = next(model.parameters()).device  # a built model runs where it is
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        seqs, tokens = batch_limits(device)
        max_num_seqs = seqs if max_num_seqs is None else max_num_seqs
        max_num_batched_tokens = tokens if max_num_batched_tokens is None else max_num_batched_tokens
        fast = device.type == "cuda" and not enforce_eager
        cuda_graphs = fast if cuda_graphs is None else cuda_graphs
        async_scheduling = fast if async_scheduling is None else async_scheduling
        if cuda_graphs and device.type != "cuda":  # before loading: the mistake costs no load time
            raise ValueError(f"LLM: cuda_graphs=True needs a CUDA device, got device {str(device)!r}")
        torch.manual_seed(seed)
        path = None
        if isinstance(model, nn.Module):
            self.model_config = _check_model(model)
            if quantization == "fp8" and not is_fp8_model(model):
                quantize_model_fp8(model, self.model_config)
            self.model = model.eval()
        else:
            path = Path(model)
            checkpoint_dtype = ModelConfig.from_file(path / "config.json").torch_dtype if path.is_dir() else None
            self.model, self.model_config = load_model(
                path, _resolve_dtype(dtype, checkpoint_dtype), device, quantization=quantization
            )
        if isinstance(tokenizer, Tokenizer):
            self.tokenizer: Tokenizer | None = tokenizer
        elif tokenizer is not None:
            self.tokenizer = Tokenizer(tokenizer)
        elif path is not None and (path / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer(path)
        else:
            self.tokenizer = None
        eos_token_ids = _eos_ids_of(path, self.tokenizer)

        self.core = EngineCore(
            self.model,
            self.model_config,
            cache_config,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            cuda_graphs=cuda_graphs,
            async_scheduling=async_scheduling,
            async_scheduling_min_seqs=async_scheduling_min_seqs,
            prefill_stream=prefill_stream,
        )
        self.max_model_len = self.core.max_model_len
        self.output_processor = OutputProcessor(
            self.tokenizer, eos_token_ids, self.model_config.vocab_size, self.max_model_len
        )
        if device.type == "cuda":  # as the engine's warm-up: no first-request wait
            self.output_processor.prepare_grammars()

    # ---- the core's state, read-only (LLM's attributes before the engine core was split out; to
    # change a setting, set it on ``core``) --------------------------------------------------------

    @property
    def runner(self) -> ModelRunner:
        """``core.runner``: the model runner (its KV cache, its decode graphs)."""
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        """``core.scheduler``: the scheduler (its requests, its KV cache manager)."""
        return self.core.scheduler

    @property
    def step_log(self) -> StepLog:
        """``core.step_log``: where the steps' time went, by kind of step."""
        return self.core.step_log

    @property
    def async_scheduling(self) -> bool:
        """``core.async_scheduling``: decode steps may be scheduled ahead of the previous one's tokens."""
        return self.core.async_scheduling

    @property
    def async_scheduling_min_seqs(self) -> int | None:
        """The fewest running requests whose steps are scheduled ahead (``AsyncScheduler.min_seqs``);
        None without ``async_scheduling``."""
        return getattr(self.core.scheduler, "min_seqs", None)

    @property
    def num_steps_ahead(self) -> int:
        """``core.num_steps_ahead``: steps launched ahead of the previous step's tokens."""
        return self.core.num_steps_ahead

    @property
    def prefill_stream(self) -> bool:
        """``core.prefill_stream``: early prefills (``step_with_arrivals``) run on a second CUDA stream."""
        return self.core.prefill_stream

    # ---- output settings --------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a request unless ``ignore_eos`` (from generation_config.json)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value: list[int]) -> None:
        self.output_processor.eos_token_ids = value

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer (``encode``, ``decode``, ``apply_chat_template``); None when the model has none."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json (do_sample false -> greedy), else vLLM's defaults."""
        return self.output_processor.default_sampling_params()

    # ---- streaming API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a prompt (text, token ids, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``) for
        ``step``; returns its request id (made when None). With ``structured_outputs`` it runs once
        its grammar has compiled (in the background; others run meanwhile); one that does not
        compile finishes with "abort", the error in its ``stop_reason``."""
        group = self.output_processor.make_request(request_id, prompt, sampling_params, arrival_time)
        self._queue(group)
        return group.request_id

    def _queue(self, group: Group) -> None:
        self.core.add_requests(self.output_processor.add(group))

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Stop requests now and free their KV blocks (unknown or finished ids are ignored)."""
        self.core.abort(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def has_waiting_requests(self) -> bool:
        """Requests added (or preempted) and not yet running."""
        return self.core.has_waiting_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns, per prompt whose completions changed, a delta RequestOutput: each
        of its ``outputs`` holds the text and tokens that completion gained in this step.

        With ``async_scheduling`` the next decode step is launched before this one's tokens are read
        (it is this method's next step; its requests' outputs come from the next call)."""
        return self.core.step(self.output_processor)

    def step_with_arrivals(
        self, arrivals: Callable[[float], bool], poll_s: float = 2e-4
    ) -> tuple[list[RequestOutput], bool]:
        """``step``, launching the prefill of requests that ``arrivals`` adds while a CUDA-graph decode
        step runs (``EngineCore.step_with_arrivals``)."""
        return self.core.step_with_arrivals(arrivals, self.output_processor, poll_s)

    def launch_step(self, admit_only: bool = False) -> StepHandle:
        """The first half of ``step`` (``EngineCore.launch_step``)."""
        return self.core.launch_step(admit_only)

    def finish_step(self, handle: StepHandle) -> list[RequestOutput]:
        """The second half of ``step``: wait for the launched step and return its deltas."""
        return self.core.finish_step(handle, self.output_processor)

    # ---- offline API ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt; outputs in the order of ``prompts``.

        Args:
            prompts: one prompt or a list of them: a string, a list of token ids, or vLLM's prompt
                dicts ``{"prompt": text}`` and ``{"prompt_token_ids": ids}`` (other keys, such as
                ``multi_modal_data``, raise ValueError).
            sampling_params: one for all prompts, or one per prompt; None: the model's defaults
                (generation_config.json).
            use_tqdm: show a progress bar.

        It steps the engine until no request is left: requests added with ``add_request`` and not yet
        finished run along, and their outputs are not returned here (do not mix the two APIs).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"LLM.generate: prompts must be a string, a prompt dict, token ids or a list of them, "
                f"got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        processor = self.output_processor
        params = processor.params_list(sampling_params, len(prompts))
        checked = [processor.prompt_ids(p, f"prompts[{i}]", sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        return self._run(checked, params, use_tqdm)

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
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, (dict, list, tuple)) for m in messages):
            raise TypeError(
                "LLM.chat: messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) "
                f"or a list of conversations, got {type(messages).__name__}"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        processor = self.output_processor
        params = processor.params_list(sampling_params, len(conversations))
        checked = []
        for i, (conv, sp) in enumerate(zip(conversations, params)):
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            _, ids = processor.prompt_ids(ids, f"conversation {i}", sp)
            checked.append((text, ids))
        return self._run(checked, params, use_tqdm)

    def _run(
        self, checked: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        with _frozen_heap():  # the whole call: its requests made, run and turned into outputs
            return self._run_frozen(checked, params, use_tqdm)

    def _run_frozen(
        self, checked: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        processor = self.output_processor
        # Every group is built (each request made, so checked) before any is queued: an error in the
        # batch leaves nothing behind to run, unseen, in the next call.
        groups = [processor.make_group(None, text, ids, p) for (text, ids), p in zip(checked, params)]
        for group in groups:  # a constraint that does not compile raises here, before anything runs
            for req in group.requests:
                error = req.grammar.wait() if req.grammar is not None else None
                if error is not None:
                    raise StructuredOutputsError(f"LLM: structured_outputs: {error}", "structured_outputs")
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
        return [processor.final_output(g) for g in groups]


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """The objects alive when a ``generate`` call starts (the libraries, the model, this engine: ~200k on
    a CPU with torch and transformers) frozen out of Python's cyclic collector until it ends, so that a
    full collection triggered by the call's allocations walks only what the call made (one took 92 ms of
    a CPU step, session 29; 240-450 ms in every timed run on an H100 host, runs 124-125). Unfrozen at the
    end, so nothing frozen is kept from collection past the call (the engine is cyclic: a lasting freeze
    would keep a deleted engine's memory). A freeze made before the call is undone with it (unfreezing
    is all or nothing): on the H100 host something froze 375 objects before any call, and leaving the
    heap alone whenever anything was frozen let every full collection walk it all. ``fuseformer serve``,
    which freezes its heap for its whole life, serves through the engine, not through ``generate``."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _check_vllm_only(kwargs: dict[str, Any]) -> None:
    """Raise for an argument that is neither LLM's nor one of vLLM's ``_VLLM_ONLY`` (TypeError, as
    Python's own), or one of those at a value that asks for a feature this engine does not have."""
    for name, value in kwargs.items():
        if name not in _VLLM_ONLY:
            raise TypeError(f"LLM: unexpected keyword argument {name!r} (not an argument of this engine's LLM)")
        accepted, behaviour = _VLLM_ONLY[name]
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted):
            raise ValueError(
                f"LLM: {name}={value!r} is not supported: {behaviour} (accepted: {', '.join(map(repr, accepted))})"
            )
