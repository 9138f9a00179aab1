"""Training throughput of the issue's case: Llama 1B shape, B 4 x S 4096, activation checkpointing.

``bench_train(quick)`` measures, in one process (random weights, random tokens):

- forward + backward, bf16 weights (no optimizer), every layer checkpointed (ours also with the
  last 1-3 layers left out, ``all-but:k``):
    fuseformer (our model: fused RMSNorm/rotary/SwiGLU, varlen flash attention, fused linear CE),
    HF eager (transformers' LlamaForCausalLM, SDPA attention, full logits),
    HF + Liger (``apply_liger_kernel_to_llama``: fused RMSNorm/rope/SwiGLU and linear CE), if installed;
  tokens/s, peak memory (``max_memory_allocated``: weights + grads + activations), MFU.
- the full step of our Trainer (fp32 master weights, bf16 autocast, fused AdamW, clipping, schedule).

MFU counts model FLOPs only (no recompute): 6 * N_matmul per token (N_matmul: every Linear incl. the
LM head, not the embedding lookup) + 6 * L * H * S per token for causal attention (QK^T and PV,
forward 2 * 2 * S/2 * H per layer, backward twice that), over the H200's dense bf16 peak of 989 TFLOP/s
(also shown against the bf16 GEMM ceiling measured in the same run).

Run on the H200:  python -c "from fuseformer.train.bench import main; main()"   (--quick for a smoke run)
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from fuseformer.models.config import ModelConfig

H200_BF16_DENSE_TFLOPS = 989.4
GOAL = {"tokens_per_s": 65_000, "peak_gib": 6.8}
PEERS = {"hf+liger": (55_000, 6.8), "hf eager": (41_400, 27.9)}  # tok/s, GiB, measured 2026-11-30

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def _model_flops_per_token(cfg: dict, seq: int) -> float:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    n_matmul = L * per_layer + v * h
    return 6 * n_matmul + 6 * L * h * seq


def _time_ms(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Median ms of fn() (one call is hundreds of ms here, so a few reps suffice)."""
    if device == "cuda":
        from fuseformer.bench._timing import bench_ms

        return bench_ms(fn, warmup=500, rep=reps * 400)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _measure(impl: str, case: str, fn: Callable[[], Any], cfg: dict, batch: int, seq: int, device: str, reps: int):
    rec: dict[str, Any] = dict(case=case, impl=impl, batch=batch, seq=seq, layers=cfg["num_hidden_layers"])
    try:
        fn()  # warm up: autotune, allocate grads, compile kernels
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ms = _time_ms(fn, device, reps)
        tokens = batch * seq
        tflops = _model_flops_per_token(cfg, seq) * tokens / (ms * 1e-3) / 1e12
        rec.update(
            ms=ms,
            tokens_per_s=tokens / (ms * 1e-3),
            model_tflop_s=tflops,
            mfu_pct=100 * tflops / H200_BF16_DENSE_TFLOPS,
        )
        if device == "cuda":
            from fuseformer.bench._timing import gemm_ceiling_tflop_s

            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            rec["pct_gemm_ceiling"] = 100 * tflops / gemm_ceiling_tflop_s()
    except Exception as exc:  # one failing peer must not kill the run
        rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return rec


# --------------------------------------------------------------------------------------------
# fuseformer
# --------------------------------------------------------------------------------------------
def _our_model(cfg: dict, device: str, dtype: torch.dtype):
    from fuseformer.models.loader import empty_model

    lm = empty_model(ModelConfig(architecture="LlamaForCausalLM", **cfg), dtype, device)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return lm.train()


def _our_fwd_bwd(
    cfg: dict, batch: int, seq: int, device: str, reps: int, skip_last: int = 0, fp8: bool = False
) -> dict:
    impl = ("fuseformer" if not skip_last else f"fuseformer all-but:{skip_last}") + (" fp8" if fp8 else "")
    try:
        step = our_fwd_bwd_step(cfg, batch, seq, device, skip_last, fp8)
    except Exception as exc:  # fp8 without torchao or on an older GPU: a record, not a dead run
        return dict(case="fwd+bwd", impl=impl, error=f"{type(exc).__name__}: {exc}"[:300])
    rec = _measure(impl, "fwd+bwd", step, cfg, batch, seq, device, reps)
    rec["checkpointing"] = "all" if not skip_last else f"all but the last {skip_last} layers"
    return rec


def our_fwd_bwd_step(
    cfg: dict, batch: int, seq: int, device: str, skip_last: int = 0, fp8: bool = False
) -> Callable[[], None]:
    """One forward + backward of our model (bf16 weights, every layer checkpointed but the last
    ``skip_last``; with ``fp8`` the layers' linears as the trainer's fp8=True makes them), as a function."""
    from fuseformer.train.fp8 import apply_fp8_training
    from fuseformer.train.trainer import CausalLMLoss, apply_activation_checkpointing

    lm = _our_model(cfg, device, torch.bfloat16)
    if fp8:
        apply_fp8_training(lm)
    apply_activation_checkpointing(lm, 1, skip_last)
    module = CausalLMLoss(lm)
    t = batch * seq
    ids = torch.randint(0, cfg["vocab_size"], (t,), device=device)
    targets = torch.randint(0, cfg["vocab_size"], (t,), device=device)
    positions = torch.arange(seq, device=device).repeat(batch)
    cu = torch.arange(0, t + 1, seq, dtype=torch.int32, device=device)  # B sequences of S

    def step():
        lm.zero_grad(set_to_none=True)
        loss = module(ids, positions, cu, seq, targets) / t
        loss.backward()

    return step


def _our_full_step(cfg: dict, batch: int, seq: int, device: str, reps: int, fp8: bool = False) -> dict:
    """Trainer.train_step: fp32 master weights, bf16 autocast, AC on every layer, fused AdamW (and
    float8 linears with ``fp8``)."""
    import numpy as np

    from fuseformer.train import TokenCorpus, TrainConfig, Trainer

    config = ModelConfig(architecture="LlamaForCausalLM", **cfg)
    n = batch * seq * (reps + 4) + 1
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg["vocab_size"], n, dtype=np.int64).astype(np.uint32)
    corpus = TokenCorpus(tokens, np.arange(0, n + seq, seq, dtype=np.int64).clip(max=n))
    train_config = TrainConfig(
        model=config,
        seq_len=seq,
        micro_batch_size=batch,
        max_steps=10**6,
        warmup_steps=10,
        precision="bf16",
        activation_checkpointing="all",
        out_dir="/tmp/fuseformer-bench-train",
        resume=False,
        progress=False,
        log_every=0,
        device=device,
        fp8=fp8,
    )
    impl = "fuseformer trainer" + (" fp8" if fp8 else "")
    try:
        trainer = Trainer(train_config, train_corpus=corpus)
    except Exception as exc:
        return dict(case="full step", impl=impl, error=f"{type(exc).__name__}: {exc}"[:300])
    rec = _measure(impl, "full step", trainer.train_step, cfg, batch, seq, device, reps)
    rec["note"] = "fp32 master weights + AdamW state, bf16 autocast" + (", float8 linears (torchao)" if fp8 else "")
    return rec


# --------------------------------------------------------------------------------------------
# Hugging Face transformers, with and without Liger
# --------------------------------------------------------------------------------------------
def hf_fwd_bwd_step(cfg: dict, batch: int, seq: int, device: str, liger: bool) -> Callable[[], None]:
    """One forward + backward of transformers' Llama (SDPA attention, bf16, gradient checkpointing),
    with Liger's kernels patched in when ``liger`` (process-wide: run after any plain HF case)."""
    import transformers

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    hf_cfg = transformers.LlamaConfig(**cfg, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def _hf_fwd_bwd(cfg: dict, batch: int, seq: int, device: str, reps: int, liger: bool) -> dict:
    impl = "hf+liger" if liger else "hf eager"
    try:
        step = hf_fwd_bwd_step(cfg, batch, seq, device, liger)
    except Exception as exc:
        return dict(case="fwd+bwd", impl=impl, error=f"{type(exc).__name__}: {exc}"[:300])
    rec = _measure(impl, "fwd+bwd", step, cfg, batch, seq, device, reps)
    rec["attention"] = "sdpa"
    return rec


def bench_train(quick: bool, device: str = "cuda", shape: dict | None = None) -> list[dict]:
    """Records for the Llama-1B training case (see the module docstring).

    quick: 4 layers and S 1024 (a smoke run); ``shape`` overrides the model dims (CPU smoke tests).
    """
    cfg = dict(LLAMA_1B) | (dict(num_hidden_layers=4) if quick else {}) | (shape or {})
    batch, seq = (4, 1024) if quick else (4, 4096)
    if shape is not None:
        batch, seq = shape.pop("batch", 2), shape.pop("seq", 64)
        cfg = {k: v for k, v in cfg.items() if k not in ("batch", "seq")}
    reps = 3 if quick else 10
    records = []
    for fn in (
        lambda: _hf_fwd_bwd(cfg, batch, seq, device, reps, liger=False),
        lambda: _hf_fwd_bwd(cfg, batch, seq, device, reps, liger=True),
        lambda: _our_fwd_bwd(cfg, batch, seq, device, reps),
        # The last layers left un-checkpointed (trainer: activation_checkpointing="all-but:k"): their
        # activations are the backward's first, freed before the gradients have grown.
        *(lambda k=k: _our_fwd_bwd(cfg, batch, seq, device, reps, k) for k in ((1, 2, 3) if not quick else ())),
        lambda: _our_full_step(cfg, batch, seq, device, reps),
        # Issue 31: the layers' linears in float8 (torchao, rowwise scales); MFU stays over the bf16 peak.
        lambda: _our_fwd_bwd(cfg, batch, seq, device, reps, fp8=True),
        lambda: _our_full_step(cfg, batch, seq, device, reps, fp8=True),
    ):
        _free()
        records.append(fn())
    _free()
    for rec in records:
        if rec["impl"] in PEERS and not quick:
            rec["peer_figure_2026_11_30"] = dict(zip(("tokens_per_s", "peak_gib"), PEERS[rec["impl"]]))
        if rec["impl"].startswith("fuseformer") and rec["case"] == "fwd+bwd" and not quick:
            rec["goal"] = GOAL
    return records


def format_table(records: list[dict]) -> str:
    head = f"{'case':<10} {'impl':<20} {'tok/s':>10} {'ms':>9} {'peak GiB':>9} {'MFU %':>7}"
    lines = [head, "-" * len(head)]
    for r in records:
        if "error" in r:
            lines.append(f"{r['case']:<10} {r['impl']:<20} error: {r['error']}")
            continue
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        tok_s, ms, mfu = r["tokens_per_s"], r["ms"], r["mfu_pct"]
        lines.append(f"{r['case']:<10} {r['impl']:<20} {tok_s:>10,.0f} {ms:>9.1f} {peak:>9} {mfu:>7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Llama-1B-shape training throughput vs HF eager and HF+Liger")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default="bench-train.json")
    args = p.parse_args(argv)
    records = bench_train(args.quick)
    print(format_table(records))
    with open(args.json, "w") as f:
        json.dump(records, f, indent=2)
    print(f"records written to {args.json}")


if __name__ == "__main__":
    main()
