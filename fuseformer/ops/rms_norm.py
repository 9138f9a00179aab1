"""RMSNorm, optionally fused with the residual add before it.

    h = x + residual            (when residual is given)
    y = h * rsqrt(mean(h^2) + eps) * weight

Everything below autograd lives here (STYLE.md §1): the reference ``rms_norm_ref``, the Triton
kernels, the launchers ``rms_norm_fwd``/``rms_norm_bwd`` (no autograd; the engine calls them),
the ``torch.library`` registration with fake and autograd, and the public ``rms_norm``.

Shapes: x (..., N), weight (N,) or None, residual like x. The kernels see x as (M, N) rows with a
row stride and unit column stride. Rows of up to ``_SINGLE_PASS_MAX`` elements are held in
registers in one pass; longer rows are streamed in chunks (sum of squares, then normalize).

Backward: dx = rstd * (dy*w - xhat * mean(dy*w*xhat)) (+ dh, the gradient reaching the h output),
dw = sum over rows of dy * xhat. A persistent grid (a few programs per SM) walks the rows and keeps
its partial dw in registers; the partials ((programs, N) fp32) are summed at the end.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    autograd_function,
    check_shape,
    check_tensor,
    dispatch,
    empty,
    float_dtype_of,
    next_pow2,
    rows_2d,
    sm_count,
)
from fuseformer.runtime.backend import choose_backend

_OP = "rms_norm"
# Longest row held in registers in one pass; longer rows take the chunked loop. H200 sweep
# (2026-11-30): fwd 4096x32768 one pass (16 warps) 3.70 TB/s against 2.98 chunked; at 65536 the
# chunked loop (8192-wide chunks, 16 warps) 2.65 against 2.63. bwd 8192x16384 one pass 3.35 against
# 1.86 chunked.
_SINGLE_PASS_MAX = 32768
_BWD_SINGLE_PASS_MAX = 16384


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    upcast: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure PyTorch RMSNorm. Computes in fp32 (fp64 stays fp64) when ``upcast``, else in x's dtype.

    Returns y (x's dtype), or (y, x + residual) when ``residual`` is given.
    """
    dtype = x.dtype
    compute = float_dtype_of(x) if upcast else dtype
    h = x.to(compute)
    if residual is not None:
        h = h + residual.to(compute)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    y = y.to(dtype)
    return (y, h.to(dtype)) if residual is not None else y


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,
    stride_x, stride_r, stride_y, stride_h,
    M, N, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # row * stride can pass 2^31
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
            h += r.to(tl.float32)
            tl.store(H + rows[:, None] * stride_h + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = h * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * w[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Pass 1: h = x (+ r), stored when fused, and the sum of squares.
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
                h += r.to(tl.float32)
                tl.store(H + rows[:, None] * stride_h + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(sum_sq / N + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        # Pass 2: normalize, re-reading the row (mostly from L2).
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_RESIDUAL:
                h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = h * rstd[:, None]
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                y = y * w[None, :]
            tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    X, W, DY, DH, RSTD, DX, DW_PARTIAL,
    stride_x, stride_dy, stride_dh, stride_dx,
    M, N,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Persistent: program p handles row blocks p, p + P, p + 2P, ...; its dw partial goes to
    # DW_PARTIAL[p, :] (fp32), summed over p by the launcher.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(pid * BLOCK_M, M, num_programs * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                wdy = dy * w[None, :]
                dw_acc += tl.sum(dy * xhat, axis=0)
            else:
                wdy = dy
            c = tl.sum(xhat * wdy, axis=1) / N
            dx = (wdy - xhat * c[:, None]) * rstd[:, None]
            if HAS_DH:
                dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_acc, mask=col_mask)
    else:
        # Long rows: chunked. Pass A gets c = mean(dy*w*xhat); pass B writes dx and adds into this
        # program's own dw partial row (read-modify-write; no other program touches it).
        dw_row = DW_PARTIAL + pid.to(tl.int64) * N
        if HAS_WEIGHT:
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                tl.store(dw_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
        for start in range(pid * BLOCK_M, M, num_programs * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows = rows.to(tl.int64)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for cstart in range(0, N, BLOCK_N):
                cols = cstart + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    dy = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                acc += tl.sum(x * rstd[:, None] * dy, axis=1)
            c = acc / N
            for cstart in range(0, N, BLOCK_N):
                cols = cstart + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                xhat = x * rstd[:, None]
                if HAS_WEIGHT:
                    wdy = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                    dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                else:
                    wdy = dy
                dx = (wdy - xhat * c[:, None]) * rstd[:, None]
                if HAS_DH:
                    dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@functools.cache
def _fwd_config(n: int) -> dict:
    """Block sizes and warps for a row length ``n`` (H200 sweep, 2026-11-30, docs/perf-notes.md).

    Short rows are packed BLOCK_M to a program: 32768x4096 bf16 ran 4.03 TB/s with 4 rows and 8
    warps against 3.4 with 1 row; 16384x8192 4.02 with 2 rows and 8 warps.
    """
    if n <= _SINGLE_PASS_MAX:
        block_n = next_pow2(n)
        block_m = max(1, min(16, (8192 if block_n <= 2048 else 16384) // block_n))
        single = True
    else:
        block_n, block_m, single = 8192, 1, False
    elems = block_m * block_n
    num_warps = 16 if (block_n >= 16384 or not single) else 4 if elems <= 8192 else 8
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, num_warps=num_warps)


# Backward launch table by row length (BLOCK_M rows per step, warps, persistent programs per SM),
# from the H200 sweep of 2026-11-30: 32768x4096 ran 3.85 TB/s at (2, 8, 2) against 2.74 at the first
# guess (1, 8, 4); 16384x8192 3.76 at (1, 4, 2). Short rows: 131072x1024 ran only 1.16 TB/s at
# (2, 4, 4) (too little in flight per loop step), so they take ~8K elements a step (unmeasured yet).
_BWD_TABLE = {1024: (8, 8, 4), 2048: (4, 8, 2), 4096: (2, 8, 2), 8192: (1, 4, 2), 16384: (1, 16, 2)}


@functools.cache
def _bwd_config(n: int) -> tuple[dict, int]:
    """(kernel config, programs per SM) for a row length ``n``."""
    if n <= _BWD_SINGLE_PASS_MAX:
        block_n = next_pow2(n)
        block_m, num_warps, per_sm = _BWD_TABLE.get(max(1024, block_n), (1, 8, 2))
        if block_n < 1024:
            block_m = min(16, block_m * (1024 // block_n))
        single = True
    else:
        block_n, block_m, num_warps, per_sm, single = 8192, 1, 16, 2, False  # 4096x32768: 1.56 TB/s
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, num_warps=num_warps), per_sm


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs already checked; x and residual as (M, N) with unit col stride)
# --------------------------------------------------------------------------------------------
def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x, residual (M, N) -> y (M, N) in x's dtype, h = x + residual (M, N) or None, rstd (M,) fp32.

    ``config`` overrides the launch configuration (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps); for
    tuning sweeps.
    """
    m, n = x.shape
    y = empty((m, n), dtype=x.dtype, device=x.device)
    h = empty((m, n), dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        if n == 0:
            rstd.fill_(eps**-0.5 if eps > 0 else float("inf"))
        return y, h, rstd
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    cfg = config or _fwd_config(n)  # cached; never mutated
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _rms_norm_fwd_kernel[grid](
        x, residual if residual is not None else x, weight if weight is not None else x, y,
        h if h is not None else y, rstd,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        h.stride(0) if h is not None else 0,
        m, n, eps,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, **cfg,
    )  # fmt: skip
    return y, h, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dh: torch.Tensor | None = None,
    config: dict | None = None,
    programs_per_sm: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy, x (the normalized input: h when the residual was fused), dh (M, N) -> dx (M, N), dw (N,).

    ``dh`` is the gradient reaching the h output of the fused residual form; it is added into dx.
    dw comes in weight's dtype, None without weight. ``config``/``programs_per_sm`` override the
    launch configuration (for tuning sweeps).
    """
    m, n = x.shape
    dx = empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        if dh is not None:
            dx.copy_(dh)
        dw = torch.zeros_like(weight) if weight is not None else None
        return dx, dw
    assert x.stride(1) == 1 and dy.stride(1) == 1 and (dh is None or dh.stride(1) == 1)
    default_cfg, default_per_sm = _bwd_config(n)
    cfg = config or default_cfg
    per_sm = programs_per_sm or default_per_sm
    programs = max(1, min(triton.cdiv(m, cfg["BLOCK_M"]), sm_count(x) * per_sm))
    dw_partial = empty((programs, n), dtype=torch.float32, device=x.device) if weight is not None else rstd
    _rms_norm_bwd_kernel[(programs,)](
        x, weight if weight is not None else x, dy, dh if dh is not None else dy, rstd, dx, dw_partial,
        x.stride(0), dy.stride(0), dh.stride(0) if dh is not None else 0, dx.stride(0),
        m, n,
        HAS_DH=dh is not None, HAS_WEIGHT=weight is not None, **cfg,
    )  # fmt: skip
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    return dx, dw


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with fake and autograd), and the same
# pieces as an autograd.Function for eager calls (far less host overhead); see _utils.dispatch.
# --------------------------------------------------------------------------------------------
def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, rstd = rms_norm_fwd(x, weight, residual, eps)
    # A custom op cannot return None: an empty tensor stands for "no h" when there is no residual.
    return y, (h if h is not None else x.new_empty(0)), rstd


def _bwd_impl(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, dh: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = rms_norm_bwd(dy, x, weight, rstd, dh)
    return dx, (dw if dw is not None else x.new_empty(0))


_rms_norm_fwd_op = torch.library.custom_op("fuseformer::rms_norm_fwd", mutates_args=())(_fwd_impl)
_rms_norm_bwd_op = torch.library.custom_op("fuseformer::rms_norm_bwd", mutates_args=())(_bwd_impl)


@_rms_norm_fwd_op.register_fake
def _(x, weight, residual, eps):
    m, n = x.shape
    h = x.new_empty((m, n)) if residual is not None else x.new_empty(0)
    return x.new_empty((m, n)), h, x.new_empty((m,), dtype=torch.float32)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, dh):
    return torch.empty_like(x), (torch.empty_like(weight) if weight is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)


def _backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile/export (so traces stay
    opaque, also under aot_function), the plain implementation in the eager autograd.Function."""

    def _backward(ctx, dy, dh, _drstd):
        xn, weight, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        dh = dh.contiguous() if (ctx.has_residual and dh is not None) else None
        dx, dw = bwd(dy, xn, weight, rstd, dh)
        return dx, (dw if weight is not None else None), (dx if ctx.has_residual else None), None

    return _backward


_rms_norm_fwd_op.register_autograd(_backward_with(_rms_norm_bwd_op), setup_context=_setup_context)
_RMSNormFunction = autograd_function("_RMSNormFunction", _fwd_impl, _setup_context, _backward_with(_bwd_impl))


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, with the residual add before it fused when ``residual`` is given.

    Args:
        x: (..., N) fp16, bf16 or fp32 (fp64 runs on the reference).
        weight: (N,) any float dtype, or None for no scale.
        eps: added to mean(x^2) before the rsqrt.
        residual: like x (same shape and dtype), added to x first.

    Returns:
        y (..., N) in x's dtype; or (y, x + residual) when ``residual`` is given, the second being
        the new residual stream (as flash-attn's and Liger's fused add-norm return it).
    """
    check_tensor(_OP, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x must have at least 1 dim, got a scalar")
    n = x.shape[-1]
    if weight is not None:
        check_tensor(_OP, "weight", weight, dtypes=FLOAT_DTYPES, device=x.device)
        check_shape(_OP, "weight", weight, (n,), "the last dim of x")
    if residual is not None:
        check_tensor(_OP, "residual", residual, dtypes=(x.dtype,), device=x.device)
        check_shape(_OP, "residual", residual, tuple(x.shape), "the shape of x")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{_OP}: eps must be a non-negative float, got {eps!r}")
    supported = x.dtype in KERNEL_DTYPES and (weight is None or weight.dtype in KERNEL_DTYPES)
    backend = choose_backend(_OP, x.device, supported, "float64 runs on the reference")
    if backend == "reference":
        return rms_norm_ref(x, weight, eps, residual)

    shape = x.shape
    x2 = rows_2d(x)
    r2 = rows_2d(residual) if residual is not None else None
    w = weight.contiguous() if weight is not None else None
    y, h, _ = dispatch(_rms_norm_fwd_op, _RMSNormFunction, _fwd_impl, x2, w, r2, float(eps))
    y = y.view(shape)
    return (y, h.view(shape)) if residual is not None else y
