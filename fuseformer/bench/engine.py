"""``fuseformer bench engine``: offline throughput of the engine, with transformers as peers in the same run.

Random weights at the Llama-3-8B shape (no checkpoint: the HF model is built in memory and its
weights copied into ours, so both run the same numbers), 256 requests x (256 prompt, 256 output)
tokens, greedy, EOS ignored. Reported per implementation: output tok/s (output tokens / wall time of
the whole batch), mean time to first token (from submission; all requests are submitted at once, so
it includes queueing, as vLLM's offline benchmark measures it) and mean time per output token after
the first. Ours runs twice on CUDA, eager and with CUDA graphs for decode steps
(``cuda_graphs=True``: graph capture happens when the LLM is built, outside the timed part; the row
adds the capture time, the graphs' memory pool and the share of steps that replayed a graph); on
the CPU the graphs row is left out (CUDA graphs need a CUDA device). Peers: transformers'
continuous-batching ``generate_batch`` and ``generate`` at batch 64. ``quick``: a Llama-3.2-1B shape
and 64 requests.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

Record = dict[str, Any]

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


def _record(impl: str, case: dict, **fields: Any) -> Record:
    return {"bench": "engine", "impl": impl, **case, **fields}


def _run_ours(
    model,
    prompts: list[list[int]],
    output_len: int,
    case: dict,
    device: str,
    impl: str = "fuseformer LLM",
    **llm_kwargs,
) -> Record:
    from fuseformer.engine.llm import LLM
    from fuseformer.engine.sampling_params import SamplingParams

    llm = LLM(model, device=device, max_model_len=len(prompts[0]) + output_len, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    core = llm.core
    extra: Record = {}
    graphs = None
    try:
        llm.generate(prompts[: min(8, len(prompts))], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        graphs = core.runner.decode_graphs
        replays_before = sum(graphs.replays.values()) if graphs is not None else 0
        steps_before, ahead_before = core.runner.num_steps, core.num_steps_ahead
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        seconds = time.perf_counter() - start
        extra["steps"] = core.runner.num_steps - steps_before
        if core.async_scheduling:
            extra["steps_ahead"] = core.num_steps_ahead - ahead_before
        if graphs is not None:
            extra |= dict(
                graph_steps=sum(graphs.replays.values()) - replays_before,
                graph_capture_s=graphs.capture_seconds,
                graph_pool_mib=graphs.pool_bytes / 2**20,
            )
    finally:
        num_blocks = core.runner.num_blocks
        del llm, core, graphs  # the graphs hold the cache and their memory pool
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


def _run_hf_generate(hf, prompts: list[list[int]], output_len: int, case: dict, device: str, batch: int = 64) -> Record:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids[:batch, :8], attention_mask=torch.ones_like(ids[:batch, :8]), max_new_tokens=2, do_sample=False)
        _sync(device)
        start = time.perf_counter()
        num_out = 0
        for i in range(0, len(prompts), batch):
            chunk = ids[i : i + batch]
            out = hf.generate(chunk, attention_mask=torch.ones_like(chunk), **kwargs)
            num_out += out[:, chunk.shape[1] :].numel()
        _sync(device)
    seconds = time.perf_counter() - start
    return _record(
        f"HF generate bs {batch}", case, seconds=seconds, output_tokens=num_out, output_tok_s=num_out / seconds
    )


def run_case(
    shape: dict,
    num_requests: int,
    input_len: int,
    output_len: int,
    *,
    shape_name: str = "custom",
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    peers: bool = True,
    cuda_graphs: bool | None = None,
    **llm_kwargs: Any,
) -> list[Record]:
    """Our engine (eager, then with CUDA graphs, then with graphs and async scheduling), then each peer
    (a run that fails is recorded with its error), on one set of random weights and random prompts.
    ``cuda_graphs``: add the graphs rows; None: on CUDA only."""
    hf, ours = build_models(shape, device, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (num_requests, input_len), generator=gen).tolist()
    case = dict(model=shape_name, requests=num_requests, input_len=input_len, output_len=output_len, dtype=str(dtype))
    records = []
    runs = [("fuseformer LLM", lambda: _run_ours(ours, prompts, output_len, case, device, **llm_kwargs))]
    if cuda_graphs if cuda_graphs is not None else device.startswith("cuda"):
        graphs = "fuseformer LLM + CUDA graphs"
        runs.append(
            (graphs, lambda: _run_ours(ours, prompts, output_len, case, device, graphs, cuda_graphs=True, **llm_kwargs))
        )
        ahead = "fuseformer LLM + graphs + async scheduling"
        kw = dict(cuda_graphs=True, async_scheduling=True) | llm_kwargs
        runs.append((ahead, lambda: _run_ours(ours, prompts, output_len, case, device, ahead, **kw)))
    if peers:
        runs.append(("HF generate_batch", lambda: _run_hf_generate_batch(hf, prompts, output_len, case, device)))
        runs.append(("HF generate bs 64", lambda: _run_hf_generate(hf, prompts, output_len, case, device)))
    for impl, run in runs:
        try:
            records.append(run())
        except Exception as exc:  # a peer (or we) failing is a result to report, not the end of the run
            records.append(_record(impl, case, error=f"{type(exc).__name__}: {exc}"))
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return records


def format_table(records: list[Record]) -> str:
    lines = [f"{'impl':<28} {'output tok/s':>12} {'TTFT ms':>9} {'TPOT ms':>8} {'seconds':>8}"]
    for r in records:
        if "error" in r:
            lines.append(f"{r['impl']:<28} error: {r['error'][:200]}")
            continue
        ttft = f"{r['mean_ttft_ms']:.0f}" if "mean_ttft_ms" in r else "-"
        tpot = f"{r['mean_tpot_ms']:.1f}" if "mean_tpot_ms" in r else "-"
        line = f"{r['impl']:<28} {r['output_tok_s']:>12.0f} {ttft:>9} {tpot:>8} {r['seconds']:>8.1f}"
        if "graph_steps" in r:
            line += (
                f"  ({r['graph_steps']}/{r['steps']} steps on graphs, capture {r['graph_capture_s']:.1f} s, "
                f"pool {r['graph_pool_mib']:.0f} MiB)"
            )
        lines.append(line)
    return "\n".join(lines)


def bench_engine(quick: bool = False) -> list[Record]:
    """The issue's case on a CUDA GPU: 256 requests x (256 in, 256 out) at the Llama-3-8B shape;
    ``quick``: the Llama-3.2-1B shape and 64 requests."""
    name = "llama3.2-1b" if quick else "llama3-8b"
    records = run_case(SHAPES[name], 64 if quick else 256, 256, 256, shape_name=name)
    print(format_table(records))
    return records
