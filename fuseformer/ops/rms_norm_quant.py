"""RMSNorm (optionally fused with the residual add before it) and per-token FP8 quantization, one kernel.

    h     = x + residual                                   (when residual is given; returned in x's dtype)
    y     = (h * rsqrt(mean(h^2) + eps) * (offset + weight)) rounded to x's dtype      = rms_norm's y
    scale = max(amax(|y| over the row) * (1/448), MIN_SCALE)                          (M, 1) fp32
    q     = clamp(y / scale, -448, 448) as float8_e4m3fn                              = quantize_fp8(y)

The value quantized is the one ``rms_norm`` returns: the norm in fp32 exactly as rms_norm.py's kernel
computes it (same order: h in fp32, rstd, times the fp32 ``offset + weight``), rounded to x's dtype in
registers, then the quantization step of quant_fp8.py. So the kernel's (q, scale) are
``quantize_fp8(rms_norm(x, ...))``, and the bf16 normalized row, which the next GEMM reads only as FP8,
is never written: per token the kernel reads x (and residual), writes h (with the residual), q (1 byte an
element) and one scale. The reference is ``rms_norm_ref`` followed by ``quantize_fp8_ref``.

Everything below autograd lives here (STYLE.md §1; inference only, no autograd): the reference
``rms_norm_quant_fp8_ref``, the kernel ``_rms_norm_quant_fp8_kernel``, the launcher
``rms_norm_quant_fp8_fwd``, the ``torch.library`` registration with its fake, and the public
``rms_norm_quant_fp8``. Rows of up to 32768 are held in registers in one pass; longer rows take three
passes (sum of squares, amax, quantize), the later two re-reading the row mostly from L2.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    LaunchConfig,
    Launcher,
    check_tensor,
    covers_row,
    launch_config,
    new_empty,
    next_pow2,
    row_norm_config_key,
    rows_2d,
)
from fuseformer.ops.quant_fp8 import FP8_DTYPE, MIN_SCALE, _fp8_scale, _max_nan, _row_amax, _to_fp8, call_op
from fuseformer.ops.quant_fp8 import quantize_fp8_ref as _quantize_ref
from fuseformer.ops.rms_norm import _SINGLE_PASS_MAX, rms_norm_ref
from fuseformer.ops.rms_norm import default_config as _rms_norm_default_config
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend

_OP = "rms_norm_quant_fp8"


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def rms_norm_quant_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm_ref`` (fp32 math, y in x's dtype) followed by per-token ``quantize_fp8_ref``.

    Returns (q, scale), or (q, scale, x + residual) when ``residual`` is given.
    """
    out = rms_norm_ref(x, weight, eps, residual, offset=offset)
    y, h = out if residual is not None else (out, None)
    q, scale = _quantize_ref(y)
    return (q, scale, h) if residual is not None else (q, scale)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _norm_row(h, rstd, W, cols, col_mask, offset, Y_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """rms_norm's y of an fp32 tile h: h * rstd * (offset + w), rounded to Y_DTYPE, back in fp32."""
    y = h * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset  # the scale
        y = y * w[None, :]
    return y.to(Y_DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_quant_fp8_kernel(
    X, R, W, H, Q, S,
    stride_x, stride_r, stride_h, stride_q,
    M, N, eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # X, R, H (M, N) in x's dtype; Q (M, N) e4m3; S (M,) fp32 (the (M, 1) scale).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)[:, None]  # row * stride can pass 2^31
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        h = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(R + rows * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(H + rows * stride_h + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        y = _norm_row(h, rstd, W, cols, col_mask, offset, X.dtype.element_ty, HAS_WEIGHT)  # 0 where masked
        scale = _fp8_scale(_row_amax(y))
        tl.store(Q + rows * stride_q + cols[None, :], _to_fp8(y, scale), mask=mask)
    else:
        # Pass 1: h = x (+ r), stored when fused, and the sum of squares.
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            h = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(R + rows * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(H + rows * stride_h + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(sum_sq / N + eps)
        # Pass 2: the amax of y; pass 3: q. Both recompute y from the row (the fp32 h again: x + r).
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            h = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(R + rows * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = _max_nan(amax, _row_amax(_norm_row(h, rstd, W, cols, col_mask, offset, X.dtype.element_ty,
                                                      HAS_WEIGHT)))  # fmt: skip
        scale = _fp8_scale(amax)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            h = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(R + rows * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = _norm_row(h, rstd, W, cols, col_mask, offset, X.dtype.element_ty, HAS_WEIGHT)
            tl.store(Q + rows * stride_q + cols[None, :], _to_fp8(y, scale), mask=mask)
    tl.store(S + rows, scale[:, None], mask=row_mask[:, None])


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache; the rule below is the default)
# --------------------------------------------------------------------------------------------
KERNEL = "rms_norm_quant_fp8"
_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps")

config_key = row_norm_config_key  # N<bucket>-add|norm-<dtype>


def default_config(n: int) -> dict:
    """The default config for rows of ``n``: rms_norm's one-pass rule (its H200 sweep: the same reads;
    the quantization adds registers, not traffic), and 8192-column chunks, 16 warps, for longer rows.
    Not yet swept on the H200 for this kernel."""
    cfg = _rms_norm_default_config(n, False)
    if not cfg["SINGLE_PASS"]:
        return dict(BLOCK_M=1, BLOCK_N=8192, SINGLE_PASS=False, num_warps=16)
    return {k: cfg[k] for k in _FIELDS}


def candidate_configs(n: int) -> list[dict]:
    """The tuning sweep for rows of ``n`` (the default first: it wins ties)."""
    out = [default_config(n)]
    if n > _SINGLE_PASS_MAX:
        out += [dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, num_warps=w) for bn in (4096, 8192) for w in (8, 16)]
    else:
        bn = next_pow2(n)
        out += [dict(BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=True, num_warps=w)
                for bm in (1, 2, 4, 8, 16) if 1024 <= bm * bn <= 32768 for w in (4, 8, 16)]  # fmt: skip
    return [c for i, c in enumerate(out) if c not in out[:i]]


@autotune.plan_cache
def _plan(
    n: int, has_residual: bool, has_weight: bool, dtype: torch.dtype, device: torch.device
) -> tuple[LaunchConfig, int]:
    """(launch config, BLOCK_M), looked up once per (row length, flags, dtype, device)."""
    cfg = autotune.get_config(
        KERNEL, config_key(n, has_residual, dtype), device=device, default=lambda: default_config(n),
        fields=_FIELDS, check=covers_row(n),
    )  # fmt: skip
    return launch_config(HAS_RESIDUAL=has_residual, HAS_WEIGHT=has_weight, **cfg), cfg["BLOCK_M"]


# --------------------------------------------------------------------------------------------
# Launcher (no autograd; inputs checked; x and residual (M, N) with unit column strides)
# --------------------------------------------------------------------------------------------
def rms_norm_quant_fp8_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x, residual (M, N) -> q (M, N) e4m3, scale (M, 1) fp32, h = x + residual (M, N) or None.

    ``config`` overrides the launch configuration (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps); for sweeps.
    """
    m, n = x.shape
    q = new_empty(x, m, n, dtype=FP8_DTYPE)
    scale = new_empty(x, m, 1, dtype=torch.float32)
    h = new_empty(x, m, n) if residual is not None else None
    if m == 0 or n == 0:
        if n == 0:
            scale.fill_(MIN_SCALE)  # an empty row: amax 0
        return q, scale, h
    sx = x.stride()
    sr = residual.stride() if residual is not None else (0, 1)
    assert sx[1] == 1 and sr[1] == 1
    if config is None:
        cfg, block_m = _plan(n, residual is not None, weight is not None, x.dtype, x.device)
    else:
        cfg = launch_config(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, **config)
        block_m = config["BLOCK_M"]
    # Absent tensors point at x (never read: their flags are off).
    tensors = (x, residual if residual is not None else x, weight if weight is not None else x,
               h if h is not None else x, q, scale)  # fmt: skip
    ints = (sx[0], sr[0], n if h is not None else 0, n, m, n)
    _launcher((triton.cdiv(m, block_m),), cfg, tensors, ints, (float(eps), float(offset)))
    return q, scale, h


_launcher = Launcher(_rms_norm_quant_fp8_kernel)


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with its fake); eager calls run the launcher
# --------------------------------------------------------------------------------------------
def _impl(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, scale, h = rms_norm_quant_fp8_fwd(x, weight, residual, eps, offset)
    # A custom op cannot return None: an empty tensor stands for "no h" without a residual.
    return q, scale, (h if h is not None else x.new_empty(0))


def _eager(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return rms_norm_quant_fp8_fwd(x, weight, residual, eps, offset)


_rms_norm_quant_fp8_op = torch.library.custom_op("fuseformer::rms_norm_quant_fp8", mutates_args=())(_impl)


@_rms_norm_quant_fp8_op.register_fake
def _(x, weight, residual, eps, offset):
    m, n = x.shape
    h = x.new_empty((m, n)) if residual is not None else x.new_empty(0)
    return x.new_empty((m, n), dtype=FP8_DTYPE), x.new_empty((m, 1), dtype=torch.float32), h


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_fp8(rms_norm(x, weight, eps, residual, offset=offset))`` in one kernel: the normalized
    row is quantized per token in registers and never written in x's dtype.

    Args:
        x: (..., N) fp16, bf16 or fp32 (fp64 runs on the reference).
        weight: (N,) any float dtype, or None for no scale.
        eps: added to mean(h^2) before the rsqrt.
        residual: like x (same shape and dtype), added to x first (the fused add + norm).
        offset: the scale is ``offset + weight``, formed in fp32 (Gemma: 1). Needs a weight unless 0.

    Returns:
        (q, scale): q (..., N) float8_e4m3fn, scale (..., 1) fp32 per token (q * scale ~= rms_norm's y);
        or (q, scale, x + residual) when ``residual`` is given, the new residual stream in x's dtype.
    """
    check_tensor(_OP, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x must have at least 1 dim, got a scalar")
    shape, device = x.shape, x.device
    n = shape[-1]
    if weight is not None:
        check_tensor(_OP, "weight", weight, dtypes=FLOAT_DTYPES, device=device, shape=(n,), what="the last dim of x")
    if residual is not None:
        check_tensor(_OP, "residual", residual, dtypes=(x.dtype,), device=device, shape=shape, what="the shape of x")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{_OP}: eps must be a non-negative float, got {eps!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"{_OP}: offset must be a finite float, got {offset!r}")
    if offset and weight is None:
        raise ValueError(f"{_OP}: offset {offset!r} needs a weight (the scale is offset + weight)")
    supported = x.dtype in KERNEL_DTYPES and (weight is None or weight.dtype in KERNEL_DTYPES)
    backend = choose_backend(_OP, device, supported, "float64 runs on the reference")
    if backend == "reference" or (x.numel() == 0 and x.dim() != 2):  # (rows_2d cannot view 0 columns)
        return rms_norm_quant_fp8_ref(x, weight, eps, residual, offset)
    x2 = rows_2d(x)
    r2 = rows_2d(residual) if residual is not None else None
    w = weight.contiguous() if weight is not None else None
    q, scale, h = call_op(_rms_norm_quant_fp8_op, _eager, x2, w, r2, float(eps), float(offset))
    if x.dim() != 2:
        q, scale = q.view(*shape), scale.view(*shape[:-1], 1)
        if residual is not None:
            h = h.view(*shape)
    return (q, scale, h) if residual is not None else (q, scale)
