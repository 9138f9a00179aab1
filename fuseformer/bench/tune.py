"""``fuseformer bench --tune``: the tuning drivers, one per tuned kernel, in one place.

Each op exports what tuning needs (STYLE.md §16: one config mechanism): its autotune kernel name and
key (``config_key``), its default rule (``default_config``) and its candidates (``candidate_configs``),
and its launcher takes an explicit ``config=``. A driver here picks the shapes, builds inputs on the
GPU, and hands the candidates to ``runtime.autotune.tune`` with the one timing helper
(``bench._timing.bench_ms``), which stores the fastest in the disk cache; the ops then look it up as
any stored config (``autotune.get_config``). Nothing in ``fuseformer.ops`` or ``fuseformer.runtime``
imports this module.

``tune_all(quick)`` runs every driver and returns one record per (kernel, key): the config chosen and
the op's time with it, or the error. ``python -m fuseformer.runtime.autotune ship`` turns the cache
files a run wrote into the shipped tables.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable

import torch

from fuseformer.bench._timing import bench_ms, tb_per_s, tflop_per_s
from fuseformer.ops import _attention_common as attn_cfg
from fuseformer.ops import mlp
from fuseformer.ops._utils import next_pow2
from fuseformer.ops.attention import flash_attention_fwd
from fuseformer.ops.attention_bwd import flash_attention_bwd
from fuseformer.runtime import autotune

# The ops modules are looked up by name: ``fuseformer.ops.rms_norm`` the attribute is the function.
_rms = importlib.import_module("fuseformer.ops.rms_norm")
_rms_bwd = importlib.import_module("fuseformer.ops.rms_norm_bwd")

DTYPE = torch.bfloat16  # every driver tunes bf16, the dtype the goal shapes run in

# rms_norm: row lengths, each timed at M x N = 2^27 elements (256 MiB of bf16, far past the 60 MB L2).
RMS_NORM_ROWS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
RMS_NORM_QUICK_ROWS = (1024, 4096, 8192)
_RMS_NORM_ELEMENTS = 1 << 27
# fused_mlp's gate-up GEMM: (H, I) of Llama-3 8B, 1B, 70B; token counts (the T buckets).
MLP_SHAPES = ((4096, 14336), (2048, 8192), (8192, 28672))
MLP_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MLP_QUICK_TOKENS = (16, 64, 8192)
# flash_attention: B * S and H of the goal shapes; (head dim, seqlen, causal): causal at S 4096, full
# at S 16384, as the goals time them.
ATTENTION_TOKENS, ATTENTION_HEADS = 16384, 32
ATTENTION_CASES = tuple((d, s, c) for d in (64, 128, 256) for s, c in ((4096, True), (16384, False)))


def _tune(kernel: str, candidates: list[dict], bench: Callable[[dict], Callable[[], object]], key: str) -> dict:
    """The fastest candidate for ``key``, measured now (``force``: a stored one is re-measured) and stored."""
    return autotune.tune(kernel, candidates, bench, key, timer=bench_ms, force=True)


def _error(kernel: str, key: str, exc: Exception) -> dict:
    return dict(kernel=kernel, key=key, error=f"{type(exc).__name__}: {exc}"[:300])


# --------------------------------------------------------------------------------------------
# rms_norm (ops/rms_norm.py, ops/rms_norm_bwd.py)
# --------------------------------------------------------------------------------------------
def _rms_norm_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = max(1, _RMS_NORM_ELEMENTS // n)
    return torch.randn(m, n, device="cuda", dtype=DTYPE), torch.randn(n, device="cuda", dtype=DTYPE)


def _bandwidth_record(kernel: str, key: str, tune: Callable[[], dict], run: Callable[[], object], nbytes: int) -> dict:
    """Tune one key, then time the op with what it now resolves."""
    try:
        best = tune()
        ms = bench_ms(run)
        return dict(kernel=kernel, key=key, config=best, ms=ms, tb_s=tb_per_s(nbytes, ms))
    except Exception as exc:
        return _error(kernel, key, exc)


def tune_rms_norm_fwd(quick: bool = False) -> list[dict]:
    """The forward, plain and with the residual add, over row lengths."""
    records = []
    for n in RMS_NORM_QUICK_ROWS if quick else RMS_NORM_ROWS:
        x, w = _rms_norm_inputs(n)
        for fused in (False, True):
            r = torch.randn_like(x) if fused else None
            key = _rms.config_key(n, fused, DTYPE)

            def bench(cfg, x=x, w=w, r=r):
                return lambda: _rms.rms_norm_fwd(x, w, r, 1e-6, config=cfg, store_rstd=False)

            tune = functools.partial(_tune, _rms.FWD_KERNEL, _rms.candidate_configs(n, fused, quick), bench, key)
            run = functools.partial(_rms.rms_norm_fwd, x, w, r, 1e-6, store_rstd=False)
            nbytes = (4 if fused else 2) * x.numel() * x.element_size()
            records.append(_bandwidth_record(_rms.FWD_KERNEL, key, tune, run, nbytes))
    return records


def tune_rms_norm_bwd(quick: bool = False) -> list[dict]:
    """The backward, without and (in the full run) with dh, over row lengths."""
    records = []
    for n in RMS_NORM_QUICK_ROWS if quick else RMS_NORM_ROWS:
        x, w = _rms_norm_inputs(n)
        dy = torch.randn_like(x)
        _, _, rstd = _rms.rms_norm_fwd(x, w, None, 1e-6)
        for fused in (False,) if quick else (False, True):
            dh = torch.randn_like(x) if fused else None
            key = _rms_bwd.config_key(n, fused, DTYPE)

            def bench(cfg, x=x, w=w, dy=dy, rstd=rstd, dh=dh):
                cfg = dict(cfg)
                per_sm = cfg.pop("programs_per_sm")
                return lambda: _rms_bwd.rms_norm_bwd(dy, x, w, rstd, dh, config=cfg, programs_per_sm=per_sm)

            candidates = _rms_bwd.candidate_configs(n, quick)
            tune = functools.partial(_tune, _rms_bwd.BWD_KERNEL, candidates, bench, key)
            run = functools.partial(_rms_bwd.rms_norm_bwd, dy, x, w, rstd, dh)
            nbytes = (4 if fused else 3) * x.numel() * x.element_size()
            records.append(_bandwidth_record(_rms_bwd.BWD_KERNEL, key, tune, run, nbytes))
    return records


# --------------------------------------------------------------------------------------------
# fused_mlp's gate-up GEMM (ops/mlp.py)
# --------------------------------------------------------------------------------------------
def tune_mlp_gate_up(quick: bool = False) -> list[dict]:
    """The Triton gate-up kernel over T buckets and model shapes."""
    records = []
    for h, i in MLP_SHAPES[:1] if quick else MLP_SHAPES:
        w = torch.randn(2 * i, h, device="cuda", dtype=DTYPE) / h**0.5
        for t in MLP_QUICK_TOKENS if quick else MLP_TOKENS:
            x = torch.randn(t, h, device="cuda", dtype=DTYPE)
            key = mlp.config_key(t, h, i, DTYPE)
            try:
                best = _tune(
                    mlp.KERNEL, mlp.candidate_configs(t, DTYPE),
                    lambda cfg, x=x, w=w: lambda: mlp.mlp_gate_up_fwd(x, w, "silu", config=cfg), key,
                )  # fmt: skip
                ms = bench_ms(lambda x=x, w=w, best=best: mlp.mlp_gate_up_fwd(x, w, "silu", config=best))
                records.append(dict(kernel=mlp.KERNEL, key=key, config=best, ms=ms,
                                    tflop_s=tflop_per_s(2 * t * h * 2 * i, ms),
                                    weight_gb_s=2 * i * h * 2 / (ms * 1e-3) / 1e9))  # fmt: skip
            except Exception as exc:
                records.append(_error(mlp.KERNEL, key, exc))
    return records


# --------------------------------------------------------------------------------------------
# flash_attention (ops/attention.py, ops/attention_bwd.py; configs in ops/_attention_common.py)
# --------------------------------------------------------------------------------------------
def _attention_inputs(head_dim: int, seqlen: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, S, H, D) for one case."""
    shape = (ATTENTION_TOKENS // seqlen, seqlen, ATTENTION_HEADS, head_dim)
    return tuple(torch.randn(shape, device="cuda", dtype=DTYPE) for _ in range(3))


def tune_attention_fwd(quick: bool = False) -> list[dict]:
    """The Triton forward kernel (``gluon=False``: where the Gluon one would run, this one is tuned)
    over head dims, causal and full; quick: head dim 128."""
    kernel = attn_cfg.KERNELS["fwd"]
    records = []
    for d, seqlen, causal in [c for c in ATTENTION_CASES if c[0] == 128] if quick else ATTENTION_CASES:
        q, k, v = _attention_inputs(d, seqlen)
        args = (q, k, v, None, None, seqlen, seqlen, d**-0.5, -1, 0 if causal else -1)
        block_d = max(16, next_pow2(d))
        key = attn_cfg.config_key(block_d, causal, DTYPE)
        try:
            best = _tune(
                kernel, attn_cfg.candidate_configs("fwd", block_d, causal, quick),
                lambda cfg, args=args: lambda: flash_attention_fwd(*args, config=cfg), key,
            )  # fmt: skip
            ms = bench_ms(lambda args=args: flash_attention_fwd(*args, gluon=False))
            flops = 4.0 * ATTENTION_TOKENS * seqlen * ATTENTION_HEADS * d / (2 if causal else 1)
            records.append(dict(kernel=kernel, key=key, config=best, ms=ms, tflop_s=tflop_per_s(flops, ms)))
        except Exception as exc:
            records.append(_error(kernel, key, exc))
    return records


def tune_attention_bwd(quick: bool = False) -> list[dict]:
    """The Triton dk/dv kernel, then the dq kernel (with the dk/dv config just stored), each timed as
    the whole Triton backward; quick: head dim 128, causal only."""
    records = []
    cases = [c for c in ATTENTION_CASES if c[0] == 128 and c[2]] if quick else ATTENTION_CASES
    for d, seqlen, causal in cases:
        q, k, v = _attention_inputs(d, seqlen)
        scale, right = d**-0.5, 0 if causal else -1
        out, lse = flash_attention_fwd(q, k, v, None, None, seqlen, seqlen, scale, -1, right)
        dout = torch.randn_like(out)
        args = (dout, q, k, v, out, lse, None, None, None, seqlen, seqlen, scale, -1, right)
        block_d = max(16, next_pow2(d))
        key = attn_cfg.config_key(block_d, causal, DTYPE)
        flops = 2.5 * 4.0 * ATTENTION_TOKENS * ATTENTION_HEADS * seqlen * d / (2 if causal else 1)
        for kind, arg in (("bwd_dkdv", "dkdv_config"), ("bwd_dq", "dq_config")):
            kernel = attn_cfg.KERNELS[kind]

            def bench(cfg, arg=arg, args=args):
                return lambda: flash_attention_bwd(*args, **{arg: cfg})

            try:
                best = _tune(kernel, attn_cfg.candidate_configs(kind, block_d, causal, quick), bench, key)
                ms = bench_ms(lambda args=args: flash_attention_bwd(*args, gluon=False))
                records.append(dict(kernel=kernel, key=key, config=best, ms=ms, tflop_s=tflop_per_s(flops, ms)))
            except Exception as exc:
                records.append(_error(kernel, key, exc))
    return records


# --------------------------------------------------------------------------------------------
# All of them
# --------------------------------------------------------------------------------------------
# Driver name -> driver(quick) -> records. "attention_bwd" tunes both of the backward's kernels.
TUNERS: dict[str, Callable[[bool], list[dict]]] = {
    "attention_bwd": tune_attention_bwd,
    "attention_fwd": tune_attention_fwd,
    "mlp_gate_up": tune_mlp_gate_up,
    "rms_norm_bwd": tune_rms_norm_bwd,
    "rms_norm_fwd": tune_rms_norm_fwd,
}


def tune_all(quick: bool = False, kernels: Iterable[str] | None = None) -> list[dict]:
    """Run every driver (or those named in ``kernels``) on this GPU, filling the disk cache.

    Returns one record per (kernel, key): the config chosen and the op's time with it, or the error
    (one failing driver does not stop the others).
    """
    wanted = set(TUNERS) if kernels is None else set(kernels)
    unknown = wanted - set(TUNERS)
    if unknown:
        raise ValueError(f"tune_all: kernels has unknown names {sorted(unknown)}; known: {sorted(TUNERS)}")
    if not torch.cuda.is_available():
        raise RuntimeError("tune_all needs a CUDA GPU (it times kernels); none is available")
    records: list[dict] = []
    for name, driver in TUNERS.items():
        if name not in wanted:
            continue
        try:
            records += driver(quick)
        except Exception as exc:
            records.append(dict(kernel=name, error=f"{type(exc).__name__}: {exc}"[:300]))
    return records
