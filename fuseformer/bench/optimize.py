"""``fuseformer bench optimize``: Hugging Face models as users run them, before and after
``fuseformer.optimize``, side by side with HF eager (SDPA), HF + torch.compile and HF + Liger, in one
process (random bf16 weights; issue 26's four cases):

- prefill: ``LlamaForCausalLM`` at the Llama-3-8B shape, forward B 1 x S 4096 (no grad);
- train: Llama-3.2-1B shape, forward + backward B 4 x S 4096 with gradient checkpointing, tokens/s
  and peak memory (HF + Liger last: its patch is process-wide);
- generate: Llama-3-8B shape, ``generate`` batch 1, 128 in / 128 out, greedy, with the static cache
  (transformers compiles the decode step) and with the dynamic cache;
- encoder: BERT-base shape, forward B 32 x S 512 (no grad).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)  # fmt: skip
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=True,
)  # fmt: skip
BERT_BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
GOALS = {"prefill": 1.3, "train": 1.03, "generate": 1.2, "encoder": 1.3}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _build(cls_name: str, cfg: dict, device: str, dtype: torch.dtype = torch.bfloat16):
    import transformers

    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "BertModel": transformers.BertConfig}[cls_name]
    config = config_cls(**cfg, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return getattr(transformers, cls_name)(config)
    finally:
        torch.set_default_dtype(previous)


def _time(fn: Callable[[], Any], device: str, rep_ms: int) -> float:
    if device == "cuda":
        from fuseformer.bench._timing import bench_ms

        return bench_ms(fn, warmup=max(100, rep_ms // 4), rep=rep_ms)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _record(case: str, impl: str, fn: Callable[[], Any], device: str, rep_ms: int, **fields) -> dict:
    rec: dict[str, Any] = dict(bench="optimize", case=case, impl=impl, **fields)
    try:
        fn()  # warm up: compile, autotune
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        rec["ms"] = _time(fn, device, rep_ms)
        if device == "cuda":
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            rec["peak_gib_above_weights"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    except Exception as exc:  # one failing peer must not end the run
        rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return rec


def _optimize(model, training: bool) -> dict:
    import fuseformer

    t = time.perf_counter()
    report = fuseformer.optimize(model, training=training)
    return dict(optimize_s=time.perf_counter() - t, counts=report.counts(), reverted=len(report.reverted))


def bench_prefill(device: str, cfg: dict, seq: int, rep_ms: int) -> list[dict]:
    model = _build("LlamaForCausalLM", cfg, device).eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, seq), device=device)

    def fwd(m):
        with torch.no_grad():
            return m(input_ids=ids).logits

    flops = 2 * sum(p.numel() for p in model.parameters()) * seq  # matmul FLOPs, ~ 2 N per token
    common = dict(batch=1, seq=seq, model_flops=flops)
    out = [_record("prefill", "hf eager (sdpa)", lambda: fwd(model), device, rep_ms, **common)]
    compiled = torch.compile(model)
    out.append(_record("prefill", "hf + torch.compile", lambda: fwd(compiled), device, rep_ms, **common))
    compiled = None  # noqa: F841  (free its graphs before ours are timed)
    torch._dynamo.reset()
    info = _optimize(model, training=False)
    out.append(_record("prefill", "hf + fuseformer.optimize", lambda: fwd(model), device, rep_ms, **common, **info))
    return out


def bench_train(device: str, cfg: dict, batch: int, seq: int, rep_ms: int, liger: bool = True) -> list[dict]:
    from fuseformer.train.bench import hf_fwd_bwd_step

    common = dict(batch=batch, seq=seq)
    out = [
        _record("train", "hf eager (sdpa)", hf_fwd_bwd_step(cfg, batch, seq, device, False), device, rep_ms, **common)
    ]
    _free()
    model = _build("LlamaForCausalLM", cfg, device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    info = _optimize(model, training=True)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    out.append(_record("train", "hf + fuseformer.optimize", step, device, rep_ms, **common, **info))
    model = None  # its weights and gradients must not count in Liger's peak
    _free()
    if liger:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            out.append(dict(bench="optimize", case="train", impl="hf + liger", error="liger-kernel not installed"))
        else:
            liger_step = hf_fwd_bwd_step(cfg, batch, seq, device, True)
            out.append(_record("train", "hf + liger", liger_step, device, rep_ms, **common))
    for r in out:
        if "ms" in r:
            r["tokens_per_s"] = batch * seq / (r["ms"] * 1e-3)
    return out


def bench_generate(device: str, cfg: dict, prompt: int, new: int, rep_ms: int) -> list[dict]:
    model = _build("LlamaForCausalLM", cfg, device).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, cfg["vocab_size"], (1, prompt), device=device)
    common = dict(batch=1, prompt=prompt, new_tokens=new)

    def gen(cache: str | None):
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        if cache:
            kw["cache_implementation"] = cache
        return lambda: model.generate(ids, **kw)

    out = []
    for label, cache in (("static cache", "static"), ("dynamic cache", None)):
        out.append(_record("generate", f"hf {label}", gen(cache), device, rep_ms, **common))
    torch._dynamo.reset()
    info = _optimize(model, training=False)
    for label, cache in (("static cache", "static"), ("dynamic cache", None)):
        out.append(
            _record("generate", f"hf + fuseformer.optimize, {label}", gen(cache), device, rep_ms, **common, **info)
        )
    for r in out:
        if "ms" in r:
            r["tokens_per_s"] = new / (r["ms"] * 1e-3)
    return out


def bench_encoder(device: str, cfg: dict, batch: int, seq: int, rep_ms: int) -> list[dict]:
    model = _build("BertModel", cfg, device).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    mask = torch.ones_like(ids)

    def fwd(m):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask).last_hidden_state

    common = dict(batch=batch, seq=seq)
    out = [_record("encoder", "hf eager (sdpa)", lambda: fwd(model), device, rep_ms, **common)]
    compiled = torch.compile(model)
    out.append(_record("encoder", "hf + torch.compile", lambda: fwd(compiled), device, rep_ms, **common))
    compiled = None  # noqa: F841  (free its graphs before ours are timed)
    torch._dynamo.reset()
    info = _optimize(model, training=False)
    out.append(_record("encoder", "hf + fuseformer.optimize", lambda: fwd(model), device, rep_ms, **common, **info))
    return out


def speedups(records: list[dict]) -> list[dict]:
    """Each record's speedup over its case's first record (HF eager; HF static cache for generate)."""
    first: dict[str, float] = {}
    for r in records:
        if "ms" not in r:
            continue
        first.setdefault(r["case"], r["ms"])
        r["speedup_vs_first"] = first[r["case"]] / r["ms"]
        r["goal_vs_first"] = GOALS.get(r["case"])
    return records


def bench_optimize(quick: bool = False, device: str = "cuda", cases: tuple[str, ...] | None = None) -> list[dict]:
    """The four cases (``quick``: 4 layers and shorter sequences, a smoke run)."""
    cases = cases or ("prefill", "encoder", "generate", "train")
    small = dict(num_hidden_layers=4) if quick else {}
    rep = 300 if quick else 1500
    records: list[dict] = []
    for case in cases:
        if case == "prefill":
            records += bench_prefill(device, LLAMA_8B | small, 1024 if quick else 4096, rep)
        elif case == "encoder":
            records += bench_encoder(device, BERT_BASE | small, 32, 128 if quick else 512, rep)
        elif case == "generate":
            records += bench_generate(device, LLAMA_8B | small, 128, 16 if quick else 128, rep * 2)
        elif case == "train":
            records += bench_train(device, LLAMA_1B | small, 4, 1024 if quick else 4096, rep * 2)
        else:
            raise ValueError(f"bench optimize: unknown case {case!r} (prefill, encoder, generate, train)")
        _free()
    return speedups(records)


def format_table(records: list[dict]) -> str:
    head = f"{'case':<9} {'impl':<44} {'ms':>9} {'tok/s':>10} {'x first':>8} {'peak GiB':>9}"
    lines = [head, "-" * len(head)]
    for r in records:
        if "error" in r:
            lines.append(f"{r['case']:<9} {r['impl']:<44} error: {r['error']}")
            continue
        tok = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        lines.append(
            f"{r['case']:<9} {r['impl']:<44} {r['ms']:>9.2f} {tok:>10} {r['speedup_vs_first']:>8.3f} {peak:>9}"
        )
    return "\n".join(lines)
