"""``fuseformer bench engine``: the engine on four workloads, as users run it, with transformers as peers.

Random weights at the Llama-3-8B shape (no checkpoint: the HF model is built in memory and its
weights copied into ours, so both run the same numbers), greedy, EOS ignored, random prompts:

- ``batch1``: one request, 128 prompt tokens, 256 output (decode at the weights-bandwidth limit);
- ``fixed``: 256 requests x (256 prompt, 256 output);
- ``mix``: 512 requests, prompt lengths U(32, 1024), output lengths U(16, 512) (ShareGPT-like);
- ``prefix``: 256 requests of one shared 2,048-token prefix and 32 tokens of their own, 128 output.

Ours runs with the defaults (``LLM(model)``: CUDA graphs, async scheduling, warm-up) and with
``enforce_eager=True`` (CUDA only: on the CPU the two are the same engine). Reported per row: output
tok/s (output tokens / wall time of the whole batch), mean time to first token (from submission; all
requests are submitted at once, so it includes queueing, as vLLM's offline benchmark measures it),
mean time per output token after the first, and for ``batch1`` the decode bandwidth: the bytes of
weights a decode step reads (every parameter but the input embedding, which is read one row a token)
/ TPOT, as % of the device-to-device copy bandwidth measured in the same run. Peers: transformers'
continuous-batching ``generate_batch`` and ``generate`` at batch 64 (``fixed``), ``generate`` with
its dynamic cache and with its static cache (which transformers compiles with torch.compile by
itself on CUDA) for ``batch1``. ``quick``: the Llama-3.2-1B shape, every workload a quarter the size.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fuseformer.engine.step_log import totals_since

Record = dict[str, Any]


class TritonCompiles:
    """Records the Triton kernels compiled (JIT, in this process) while in use, one entry a kernel
    specialization: its name and the argument types Triton specialized on (``repr`` of the compile
    hook). A compile inside a timed run is a kernel the engine's warm-up missed. Triton without the
    hook (< 3.4) records nothing (``available`` False)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.available = False

    def __enter__(self) -> TritonCompiles:
        try:
            from triton import knobs
        except ImportError:
            return self
        self.available, self._knobs = True, knobs
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def _hook(self, *, repr: str, signature: Any = None, configs: Any = None, **_: Any) -> None:
        # Triton 3.6's repr names only the first argument: the signature (dtypes) and the specializations
        # (divisibility, equal-to-1) say what differs between two compiles of one kernel.
        detail = "" if signature is None else f" {signature} {configs[0] if configs else ''}"
        self.names.append(f"{repr}{detail}"[:1200])

    def __exit__(self, *exc: object) -> None:
        if self.available:
            self._knobs.runtime.jit_post_compile_hook = self._previous


class GcPauses:
    """Records Python's cyclic garbage collections while in use: count and seconds by generation. A full
    (generation 2) collection walks every tracked object of the process (~0.1 s at 200k objects on
    a CPU) from inside whatever step allocated last."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.full: list[dict] = []  # each full collection: ms, the objects frozen then, the thread
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        seconds = time.perf_counter() - self._start
        self.counts[info["generation"]] += 1
        self.seconds[info["generation"]] += seconds
        if info["generation"] == 2:
            name = threading.current_thread().name
            self.full.append(dict(ms=round(1e3 * seconds, 1), frozen=gc.get_freeze_count(), thread=name))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def record(self) -> Record:
        return dict(counts=self.counts, ms=[round(1e3 * s, 1) for s in self.seconds], full=self.full)


WORKLOADS = ("batch1", "fixed", "mix", "prefix")

# Llama-3-8B and Llama-3.2-1B (config.json values; rope scaling left out: random weights do not care).
SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}
_COMMON = dict(rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000)


def build_models(shape: dict, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(HF LlamaForCausalLM with its random init, ours, built through the registry, holding the same weights)."""
    import transformers

    from fuseformer.models.config import ModelConfig
    from fuseformer.models.loader import checkpoint_targets, empty_model

    hf_config = transformers.LlamaConfig(**shape, **_COMMON, eos_token_id=128001)
    hf_config.architectures = ["LlamaForCausalLM"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialize in dtype: an fp32 8B model would take 32 GB first
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(previous)
    hf_dict = hf_config.to_dict()
    hf_dict["dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    config = ModelConfig.from_hf(hf_dict)
    ours = empty_model(config, dtype, device)
    params = dict(ours.named_parameters())
    targets = checkpoint_targets(
        ours, config
    )  # checkpoint name -> (our parameter, first row, rows): packs q/k/v, gate/up
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            if name not in targets:
                continue
            param_name, start, n = targets[name]
            dest = params[param_name].data
            (dest if n < 0 else dest[start : start + n]).copy_(tensor)
    return hf, ours.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(llm: Any, prompts: list, params: Any, device: str) -> tuple[list, float, Record, list]:
    """``llm.generate`` as a benchmark times it: (outputs, seconds, record, the run's StepRecords). The
    record holds the run's steps by kind (where the time went), its five longest launches (a kernel
    compiled inside the run shows there), the Triton kernels compiled inside it (the warm-up missed
    them), Python's collections by generation and, on CUDA, the caching allocator's device allocations
    and retries inside the run (a retry frees every cached block, syncing: a first-run stall candidate)."""
    log = llm.core.step_log
    kinds_before, count_before = log.totals(), log.count
    _sync(device)
    alloc_before = _alloc_counts(device)
    with TritonCompiles() as compiles, GcPauses() as pauses:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        seconds = time.perf_counter() - start
    alloc = {k: v - alloc_before[k] for k, v in _alloc_counts(device).items()}
    records = log.since(count_before)
    slowest = sorted(records, key=lambda r: r.launch_ms)[-5:]
    record = dict(
        step_kinds=totals_since(log.totals(), kinds_before),
        slowest_launches=[
            dict(kind=r.kind, tokens=r.tokens, seqs=r.seqs, launch_ms=round(r.launch_ms, 2)) for r in slowest
        ],
        triton_compiles=compiles.names,
        gc=pauses.record(),
        cuda_allocator=alloc,
    )
    return outs, seconds, record, records


def _alloc_counts(device: str) -> dict[str, int]:
    """The CUDA caching allocator's cudaMalloc calls and out-of-memory retries so far ({} off CUDA)."""
    if not str(device).startswith("cuda"):
        return {}
    stats = torch.cuda.memory_stats()
    return {"device_allocs": stats.get("num_device_alloc", 0), "alloc_retries": stats.get("num_alloc_retries", 0)}


def _record(impl: str, case: dict, **fields: Any) -> Record:
    return {"bench": "engine", "impl": impl, **case, **fields}


def workload(name: str, vocab_size: int, scale: float = 1.0, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids, output lengths) of workload ``name``; ``scale`` shrinks every count
    and length (at least 1), for quick runs and tests."""
    rng = random.Random(seed)

    def n(x: int) -> int:
        return max(1, round(x * scale))

    def tokens(k: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(k)]

    if name == "batch1":
        return [tokens(n(128))], [n(256)]
    if name == "fixed":
        return [tokens(n(256)) for _ in range(n(256))], [n(256)] * n(256)
    if name == "mix":
        count = n(512)
        return [tokens(rng.randint(n(32), n(1024))) for _ in range(count)], [
            rng.randint(n(16), n(512)) for _ in range(count)
        ]
    if name == "prefix":
        shared = tokens(n(2048))
        return [shared + tokens(n(32)) for _ in range(n(256))], [n(128)] * n(256)
    raise ValueError(f"bench engine: workload must be one of {WORKLOADS}, got {name!r}")


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding (a lookup
    reads one row a token), unless the LM head shares it."""
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)  # ours and HF's
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    head = getattr(model, "lm_head", None)
    tied = head is not None and embed is not None and head.weight is embed
    return total - (0 if embed is None or tied else embed.numel() * embed.element_size())


def _run_ours(
    model,
    prompts: list[list[int]],
    output_lens: list[int],
    case: dict,
    device: str,
    impl: str = "fuseformer LLM",
    after_build: Callable[[Any], None] | None = None,
    **llm_kwargs,
) -> Record:
    """One run of ours; ``after_build(llm)`` may change the engine before the timed run (A/B variants)."""
    from fuseformer.engine.llm import LLM
    from fuseformer.engine.sampling_params import SamplingParams

    max_len = max(len(p) + o for p, o in zip(prompts, output_lens))
    start = time.perf_counter()
    llm = LLM(model, device=device, max_model_len=max_len, **llm_kwargs)
    build_s = time.perf_counter() - start
    if after_build is not None:
        after_build(llm)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in output_lens]
    core = llm.core
    extra: Record = {"startup_s": build_s, "warm_up_s": core.warm_up_seconds}
    graphs, pieces = core.runner.decode_graphs, core.runner.piecewise_graphs
    try:
        replays_before = sum(graphs.replays.values()) if graphs is not None else 0
        pieces_before = sum(pieces.replays.values()) if pieces is not None else 0
        steps_before, ahead_before = core.runner.num_steps, core.num_steps_ahead
        outs, seconds, measured, _ = timed_generate(llm, prompts, params, device)
        extra |= measured
        extra["steps"] = core.runner.num_steps - steps_before
        if len(prompts) == 1:  # the first request after start against a later one (issue 28: within 1.5x)
            vocab = model.config.vocab_size
            later = [[(t + 1) % vocab for t in prompts[0]]]  # other tokens: no prefix-cache hit
            again = llm.generate(later, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            extra["later_ttft_ms"] = 1e3 * again[0].metrics.time_to_first_token
        if core.async_scheduling:
            extra["steps_ahead"] = core.num_steps_ahead - ahead_before
        if graphs is not None:
            extra |= dict(
                graph_steps=sum(graphs.replays.values()) - replays_before,
                graph_capture_s=graphs.capture_seconds,
                graph_pool_mib=graphs.pool_bytes / 2**20,
            )
        if pieces is not None:
            extra |= dict(
                piece_steps=sum(pieces.replays.values()) - pieces_before,
                piece_capture_s=pieces.capture_seconds,
                piece_pool_mib=pieces.pool_bytes / 2**20,
            )
        extra["prefix_hit_rate"] = core.scheduler.kv.prefix_cache_hit_rate
    finally:
        num_blocks = core.runner.num_blocks
        del llm, core, graphs, pieces  # the graphs hold the cache and their memory pool
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    completions = [o.outputs[0] for o in outs]
    num_out = sum(len(c.token_ids) for c in completions)
    ttft = [o.metrics.time_to_first_token for o in outs]
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if len(o.outputs[0].token_ids) > 1
    ]
    if "later_ttft_ms" in extra:
        extra["first_ttft_ratio"] = 1e3 * ttft[0] / extra["later_ttft_ms"]
    return _record(
        impl,
        case,
        seconds=seconds,
        output_tokens=num_out,
        output_tok_s=num_out / seconds,
        mean_ttft_ms=1e3 * sum(ttft) / len(ttft),
        mean_tpot_ms=1e3 * sum(tpot) / max(len(tpot), 1),
        kv_blocks=num_blocks,
        **extra,
    )


def _run_hf_generate_batch(hf, prompts: list[list[int]], output_len: int, case: dict, device: str) -> Record:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate_batch(inputs=prompts[:8], generation_config=config, progress_bar=False)  # warm up
        _sync(device)
        start = time.perf_counter()
        results = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        _sync(device)
    seconds = time.perf_counter() - start
    num_out = sum(len(r.generated_tokens) for r in results.values())
    return _record("HF generate_batch", case, seconds=seconds, output_tokens=num_out, output_tok_s=num_out / seconds)


def _run_hf_generate(
    hf, prompts: list[list[int]], output_len: int, case: dict, device: str, batch: int = 64, static: bool = False
) -> Record:
    """``generate`` over batches of ``batch`` prompts; ``static``: its static cache (which transformers
    compiles with torch.compile by itself on CUDA: the two warm-up calls take the compilation)."""
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        warm = ids[:batch]
        # The static cache compiles per cache length: its warm-ups generate the timed length (twice:
        # the first call compiles, the second checks nothing recompiles); 4 tokens warm the dynamic one.
        warm_kwargs = kwargs if static else kwargs | dict(max_new_tokens=4, min_new_tokens=4)
        for _ in range(2 if static else 1):
            hf.generate(warm, attention_mask=torch.ones_like(warm), **warm_kwargs)
        _sync(device)
        start = time.perf_counter()
        num_out = 0
        for i in range(0, len(prompts), batch):
            chunk = ids[i : i + batch]
            out = hf.generate(chunk, attention_mask=torch.ones_like(chunk), **kwargs)
            num_out += out[:, chunk.shape[1] :].numel()
        _sync(device)
    seconds = time.perf_counter() - start
    impl = f"HF generate bs {batch}" + (" static cache (compiled)" if static else "")
    return _record(
        impl,
        case,
        seconds=seconds,
        output_tokens=num_out,
        output_tok_s=num_out / seconds,
        mean_tpot_ms=1e3 * seconds / max(1, num_out // len(prompts)) if len(prompts) <= batch else None,
    )


def run_workload(
    name: str,
    hf,
    ours,
    *,
    shape_name: str = "custom",
    device: str = "cuda",
    scale: float = 1.0,
    peers: bool = True,
    eager: bool = True,
    variants: dict[str, dict[str, Any]] | None = None,
    **llm_kwargs: Any,
) -> list[Record]:
    """Workload ``name`` (``workload``) on ours with the defaults, with ``enforce_eager=True`` on CUDA
    (unless ``eager`` is False), as each of ``variants`` (impl name -> ``_run_ours`` keywords, e.g. an
    ``after_build``), then its peers (a run that fails is recorded with its error)."""
    vocab = ours.config.vocab_size
    prompts, output_lens = workload(name, vocab, scale)
    case = dict(
        model=shape_name, workload=name, requests=len(prompts), dtype=str(next(ours.parameters()).dtype),
        input_tokens=sum(map(len, prompts)), max_output_len=max(output_lens),
    )  # fmt: skip
    runs = [("fuseformer LLM", lambda: _run_ours(ours, prompts, output_lens, case, device, **llm_kwargs))]
    if eager and device.startswith("cuda"):
        impl = "fuseformer LLM enforce_eager"
        runs.append((impl, lambda: _run_ours(ours, prompts, output_lens, case, device, impl, enforce_eager=True)))
    for impl, kw in (variants or {}).items():
        runs.append((impl, lambda impl=impl, kw=kw: _run_ours(ours, prompts, output_lens, case, device, impl, **kw)))
    if peers and name == "fixed":
        runs.append(("HF generate_batch", lambda: _run_hf_generate_batch(hf, prompts, output_lens[0], case, device)))
        runs.append(("HF generate bs 64", lambda: _run_hf_generate(hf, prompts, output_lens[0], case, device)))
    if peers and name == "batch1":
        runs.append(("HF generate bs 1", lambda: _run_hf_generate(hf, prompts, output_lens[0], case, device, 1)))
        if device.startswith("cuda"):
            static = "HF generate bs 1 static cache (compiled)"
            runs.append((static, lambda: _run_hf_generate(hf, prompts, output_lens[0], case, device, 1, static=True)))
    records = []
    for impl, run in runs:
        try:
            records.append(run())
        except Exception as exc:  # a peer (or we) failing is a result to report, not the end of the run
            records.append(_record(impl, case, error=f"{type(exc).__name__}: {exc}"))
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if name == "batch1":
        nbytes = decode_bytes(ours)
        copy = None
        if device.startswith("cuda"):
            from fuseformer.bench._timing import copy_ceiling_tb_s

            copy = copy_ceiling_tb_s(device)
        for r in records:
            if r.get("mean_tpot_ms"):
                r["decode_tb_s"] = nbytes / (r["mean_tpot_ms"] * 1e-3) / 1e12
                if copy:
                    r["decode_pct_copy"] = 100 * r["decode_tb_s"] / copy
    return records


def format_table(records: list[Record]) -> str:
    lines = [f"{'workload':<8} {'impl':<42} {'output tok/s':>12} {'TTFT ms':>9} {'TPOT ms':>8} {'seconds':>8}"]
    for r in records:
        head = f"{r.get('workload', '-'):<8} {r['impl']:<42}"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:200]}")
            continue
        ttft = f"{r['mean_ttft_ms']:.0f}" if r.get("mean_ttft_ms") is not None else "-"
        tpot = f"{r['mean_tpot_ms']:.2f}" if r.get("mean_tpot_ms") is not None else "-"
        line = f"{head} {r['output_tok_s']:>12.0f} {ttft:>9} {tpot:>8} {r['seconds']:>8.1f}"
        if "decode_pct_copy" in r:
            line += f"  decode {r['decode_tb_s']:.2f} TB/s = {r['decode_pct_copy']:.0f}% of copy"
        if "graph_steps" in r:
            line += (
                f"  ({r['graph_steps']}/{r['steps']} steps on graphs, capture {r['graph_capture_s']:.1f} s, "
                f"warm-up {r['warm_up_s']:.1f} s, pool {r['graph_pool_mib']:.0f} MiB)"
            )
        if "piece_steps" in r:
            line += f"  ({r['piece_steps']} steps on graph pieces, capture {r['piece_capture_s']:.1f} s)"
        lines.append(line)
    return "\n".join(lines)


def bench_engine(quick: bool = False, workloads: tuple[str, ...] = WORKLOADS) -> list[Record]:
    """The four workloads at the Llama-3-8B shape in bf16 on a CUDA GPU; ``quick``: the Llama-3.2-1B
    shape, each workload at a quarter of its size."""
    name = "llama3.2-1b" if quick else "llama3-8b"
    hf, ours = build_models(SHAPES[name], "cuda", torch.bfloat16)
    records = []
    for w in workloads:
        records += run_workload(w, hf, ours, shape_name=name, scale=0.25 if quick else 1.0)
        print(format_table(records[-4:]), flush=True)
    return records
