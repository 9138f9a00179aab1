"""LayerNorm, optionally fused with the residual add before it.

    h = x + residual            (when residual is given)
    y = (h - mean(h)) * rsqrt(var(h) + eps) * weight + bias      (var biased, as torch computes it)

Everything below autograd lives here (STYLE.md §1): the reference ``layer_norm_ref``, the Triton
kernels, the launchers ``layer_norm_fwd``/``layer_norm_bwd`` (no autograd; the engine calls them),
the ``torch.library`` registration with fake and autograd, and the public ``layer_norm``.

Shapes: x (..., N), weight (N,) or None, bias (N,) or None, residual like x. The kernels see x as
(M, N) rows with a row stride and unit column stride. Rows of up to ``_SINGLE_PASS_MAX`` elements
are held in registers in one pass (mean, then the centred sum of squares, both from registers).
Longer rows are streamed in chunks: pass 1 merges per-chunk (mean, M2) pairs with Chan's parallel
update, so the variance never comes from sum(h^2) - N*mean^2 (which cancels catastrophically when
|mean| >> std); pass 2 normalizes. With a residual, h is rounded to x's dtype (as stored and as the
unfused ``F.layer_norm(x + residual)`` would see it) before its statistics are taken, so that the
backward, which re-reads the stored h, sees the same h as the forward.

Backward, with xhat = (h - mean) * rstd and g = dy * w:
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   (+ dh, the gradient reaching the h output)
    dw = sum over rows of dy * xhat,  db = sum over rows of dy.
A persistent grid (a few programs per SM) walks the rows and keeps its partial dw and db in
registers; the partials ((programs, N) fp32 each) are summed at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    Launcher,
    autograd_function,
    check_shape,
    check_tensor,
    covers_row,
    dispatch,
    empty,
    float_dtype_of,
    launch_config,
    next_pow2,
    row_norm_config_key,
    rows_2d,
    sm_count,
)
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend, forced_backend

_OP = "layer_norm"
# Longest row held in registers in one pass; longer rows take the chunked loop. Same limits as
# rms_norm: the forward holds one fp32 row (+ w, b), the backward two (x, dy) plus dw, db.
_SINGLE_PASS_MAX = 16384
_BWD_SINGLE_PASS_MAX = 8192


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    upcast: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure PyTorch LayerNorm. Computes in fp32 (fp64 stays fp64) when ``upcast``, else in x's dtype.

    Written out (two-pass mean and biased variance) rather than calling F.layer_norm, so that with
    ``upcast=False`` it is the plain low-precision computation the §3 criterion compares against.
    Returns y (x's dtype), or (y, x + residual) when ``residual`` is given.
    """
    dtype = x.dtype
    compute = float_dtype_of(x) if upcast else dtype
    h = x.to(compute)
    if residual is not None:
        h = h + residual.to(compute)
    xc = h - h.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    y = y.to(dtype)
    return (y, h.to(dtype)) if residual is not None else y


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _layer_norm_fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    stride_x, stride_r, stride_y, stride_h,
    M, N, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SINGLE_PASS: tl.constexpr,
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
            # Normalize h as stored (rounded to x's dtype): the backward re-reads the stored h, and
            # mean/rstd from the unrounded sum would not match it (with N = 1, h - mean would be a
            # rounding error times rstd = eps^-1/2, instead of 0).
            h = (h + r.to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
            h = h.to(tl.float32)
        mean = tl.sum(h, axis=1) / N
        xc = tl.where(mask, h - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(MEAN + rows, mean, mask=row_mask)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = xc * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if HAS_BIAS:
            b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y + b[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Pass 1: h = x (+ r), stored when fused, and the row's (mean, M2), merged chunk by chunk
        # (Chan et al.): with n_a elements so far and n_b in this chunk,
        #   mean += delta * n_b / n,   M2 += M2_b + delta^2 * n_a * n_b / n,   delta = mean_b - mean.
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        count = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
                # Normalize h as stored (rounded to x's dtype), as in the single pass.
                h = (h + r.to(tl.float32)).to(H.dtype.element_ty)
                tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
                h = h.to(tl.float32)
            n_b = tl.sum(col_mask.to(tl.float32), axis=0)  # elements in this chunk (>= 1)
            mean_b = tl.sum(h, axis=1) / n_b
            xc = tl.where(mask, h - mean_b[:, None], 0.0)
            m2_b = tl.sum(xc * xc, axis=1)
            n_ab = count + n_b
            delta = mean_b - mean
            mean += delta * (n_b / n_ab)
            m2 += m2_b + delta * delta * (count * n_b / n_ab)
            count = n_ab
        rstd = tl.rsqrt(m2 / N + eps)
        tl.store(MEAN + rows, mean, mask=row_mask)
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
            y = (h - mean[:, None]) * rstd[:, None]
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                y = y * w[None, :]
            if HAS_BIAS:
                b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
                y = y + b[None, :]
            tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    X, W, DY, DH, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    stride_x, stride_dy, stride_dh, stride_dx,
    M, N,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Persistent: program p handles row blocks p, p + P, p + 2P, ...; its dw and db partials go to
    # DW_PARTIAL[p, :] and DB_PARTIAL[p, :] (fp32), summed over p by the launcher.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(pid * BLOCK_M, M, num_programs * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            if HAS_WEIGHT:
                g = dy * w[None, :]
                dw_acc += tl.sum(dy * xhat, axis=0)
            else:
                g = dy
            if HAS_BIAS:
                db_acc += tl.sum(dy, axis=0)
            c1 = tl.sum(xhat * g, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
            dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            if HAS_DH:
                dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_acc, mask=col_mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid.to(tl.int64) * N + cols, db_acc, mask=col_mask)
    else:
        # Long rows: chunked. Pass A gets c1 = mean(g*xhat) and c2 = mean(g); pass B writes dx and
        # adds into this program's own dw/db partial rows (read-modify-write; no other program
        # touches them).
        dw_row = DW_PARTIAL + pid.to(tl.int64) * N
        db_row = DB_PARTIAL + pid.to(tl.int64) * N
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            if HAS_WEIGHT:
                tl.store(dw_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
            if HAS_BIAS:
                tl.store(db_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
        for start in range(pid * BLOCK_M, M, num_programs * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows = rows.to(tl.int64)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            acc1 = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M], dtype=tl.float32)
            for cstart in range(0, N, BLOCK_N):
                cols = cstart + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                g = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    g = g * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                acc1 += tl.sum(xhat * g, axis=1)
                acc2 += tl.sum(g, axis=1)
            c1 = acc1 / N
            c2 = acc2 / N
            for cstart in range(0, N, BLOCK_N):
                cols = cstart + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                if HAS_WEIGHT:
                    g = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                    dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                else:
                    g = dy
                if HAS_BIAS:
                    db = tl.load(db_row + cols, mask=col_mask, other=0.0)
                    tl.store(db_row + cols, db + tl.sum(dy, axis=0), mask=col_mask)
                dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
                if HAS_DH:
                    dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache; the rules below are the defaults)
# --------------------------------------------------------------------------------------------
FWD_KERNEL, BWD_KERNEL = "layer_norm_fwd", "layer_norm_bwd"
_FWD_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps")
_BWD_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps", "programs_per_sm")


config_key = row_norm_config_key  # N<bucket>-add|norm-<dtype>


def _fwd_config(n: int) -> dict:
    """Block sizes and warps for a row length ``n``.

    Rows up to _SINGLE_PASS_MAX go in one pass; short rows are packed BLOCK_M to a program so a
    program still moves >= 8 KiB (BLOCK_M * BLOCK_N >= 4096 elements).
    """
    if n <= _SINGLE_PASS_MAX:
        block_n = next_pow2(n)
        block_m = max(1, min(16, 4096 // block_n))
        single = True
    else:
        block_n, block_m, single = 4096, 1, False
    elems = block_m * block_n
    num_warps = 4 if elems <= 2048 else 8 if elems <= 8192 else 16
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, num_warps=num_warps)


# Persistent backward: programs per SM (more hides latency; each adds two N-float partials to sum).
_BWD_PROGRAMS_PER_SM = 4


def _bwd_config(n: int) -> dict:
    if n <= _BWD_SINGLE_PASS_MAX:
        block_n = next_pow2(n)
        block_m = max(1, min(16, 2048 // block_n))
        single = True
    else:
        block_n, block_m, single = 2048, 1, False
    elems = block_m * block_n
    num_warps = 4 if elems <= 1024 else 8 if elems <= 4096 else 16
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, num_warps=num_warps, programs_per_sm=_BWD_PROGRAMS_PER_SM
    )


@autotune.plan_cache
def fwd_config(n: int, has_residual: bool, dtype: torch.dtype, device: torch.device | str | None = None) -> dict:
    """The forward's launch config (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps), looked up once per
    (n, flags, dtype, device): the autotune cache's for this bucket, else the default rule."""
    return autotune.get_config(
        FWD_KERNEL, config_key(n, has_residual, dtype), device=device,
        default=lambda: _fwd_config(n), fields=_FWD_FIELDS, check=covers_row(n),
    )  # fmt: skip


@autotune.plan_cache
def bwd_config(n: int, has_dh: bool, dtype: torch.dtype, device: torch.device | str | None = None) -> dict:
    """The backward's launch config (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps, programs_per_sm)."""
    return autotune.get_config(
        BWD_KERNEL, config_key(n, has_dh, dtype), device=device,
        default=lambda: _bwd_config(n), fields=_BWD_FIELDS, check=covers_row(n),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs already checked; x and residual as (M, N) with unit col stride)
# --------------------------------------------------------------------------------------------
def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """x, residual (M, N); weight, bias (N,) contiguous or None.

    Returns y (M, N) in x's dtype, h = x + residual (M, N) or None, mean (M,) fp32, rstd (M,) fp32.
    """
    m, n = x.shape
    y = empty((m, n), dtype=x.dtype, device=x.device)
    h = empty((m, n), dtype=x.dtype, device=x.device) if residual is not None else None
    mean = empty((m,), dtype=torch.float32, device=x.device)
    rstd = empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        if n == 0:  # var of nothing taken as 0; nothing reads these, but keep them finite-defined
            mean.zero_()
            rstd.fill_(eps**-0.5 if eps > 0 else float("inf"))
        return y, h, mean, rstd
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    assert (weight is None or weight.is_contiguous()) and (bias is None or bias.is_contiguous())
    cfg = fwd_config(n, residual is not None, x.dtype, x.device)
    flags = dict(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    _fwd_launcher(
        (triton.cdiv(m, cfg["BLOCK_M"]),), launch_config(**flags, **cfg),
        (x, residual if residual is not None else x, weight if weight is not None else x,
         bias if bias is not None else x, y, h if h is not None else y, mean, rstd),
        (x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
         h.stride(0) if h is not None else 0, m, n),
        (float(eps),),
    )  # fmt: skip
    return y, h, mean, rstd


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dy, x (the normalized input: h when the residual was fused), dh (M, N) -> dx (M, N), dw, db (N,).

    ``dh`` is the gradient reaching the h output of the fused residual form; it is added into dx.
    ``bias`` is only used for its presence and dtype. dw comes in weight's dtype (None without
    weight), db in bias's dtype (None without bias).
    """
    m, n = x.shape
    dx = empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        if dh is not None:
            dx.copy_(dh)
        dw = torch.zeros_like(weight) if weight is not None else None
        db = torch.zeros_like(bias) if bias is not None else None
        return dx, dw, db
    assert x.stride(1) == 1 and dy.stride(1) == 1 and (dh is None or dh.stride(1) == 1)
    assert weight is None or weight.is_contiguous()
    cfg = dict(bwd_config(n, dh is not None, x.dtype, x.device))
    programs = max(1, min(triton.cdiv(m, cfg["BLOCK_M"]), sm_count(x) * cfg.pop("programs_per_sm")))
    dw_partial = empty((programs, n), dtype=torch.float32, device=x.device) if weight is not None else rstd
    db_partial = empty((programs, n), dtype=torch.float32, device=x.device) if bias is not None else rstd
    flags = dict(HAS_DH=dh is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    _bwd_launcher(
        (programs,), launch_config(**flags, **cfg),
        (x, weight if weight is not None else x, dy, dh if dh is not None else dy, mean, rstd, dx,
         dw_partial, db_partial),
        (x.stride(0), dy.stride(0), dh.stride(0) if dh is not None else 0, dx.stride(0), m, n),
    )  # fmt: skip
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    db = db_partial.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db


# The one launch path (runtime/launch.py): kernel[grid] for a specialization's first launch, then, on
# the Triton it was written for, the compiled kernel's C launcher.
_fwd_launcher = Launcher(_layer_norm_fwd_kernel)
_bwd_launcher = Launcher(_layer_norm_bwd_kernel)


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with fake and autograd), and the same
# pieces as an autograd.Function for eager calls (far less host overhead); see _utils.dispatch.
# --------------------------------------------------------------------------------------------
def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, mean, rstd = layer_norm_fwd(x, weight, bias, residual, eps)
    # A custom op cannot return None: an empty tensor stands for "no h" when there is no residual.
    return y, (h if h is not None else x.new_empty(0)), mean, rstd


def _bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = layer_norm_bwd(dy, x, weight, bias, mean, rstd, dh)
    return dx, (dw if dw is not None else x.new_empty(0)), (db if db is not None else x.new_empty(0))


_layer_norm_fwd_op = torch.library.custom_op("fuseformer::layer_norm_fwd", mutates_args=())(_fwd_impl)
_layer_norm_bwd_op = torch.library.custom_op("fuseformer::layer_norm_bwd", mutates_args=())(_bwd_impl)


@_layer_norm_fwd_op.register_fake
def _(x, weight, bias, residual, eps):
    m, n = x.shape
    h = x.new_empty((m, n)) if residual is not None else x.new_empty(0)
    stat = x.new_empty((m,), dtype=torch.float32)
    return x.new_empty((m, n)), h, stat, torch.empty_like(stat)


@_layer_norm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd, dh):
    dw = torch.empty_like(weight) if weight is not None else x.new_empty(0)
    db = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    return torch.empty_like(x), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps = inputs
    _, h, mean, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if residual is not None else x, weight, bias, mean, rstd)


def _backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile/export (so traces stay
    opaque, also under aot_function), the plain implementation in the eager autograd.Function."""

    def _backward(ctx, dy, dh, _dmean, _drstd):
        xn, weight, bias, mean, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        dh = dh.contiguous() if (ctx.has_residual and dh is not None) else None
        dx, dw, db = bwd(dy, xn, weight, bias, mean, rstd, dh)
        return (
            dx,
            dw if weight is not None else None,
            db if bias is not None else None,
            dx if ctx.has_residual else None,
            None,
        )

    return _backward


_layer_norm_fwd_op.register_autograd(_backward_with(_layer_norm_bwd_op), setup_context=_setup_context)
_LayerNormFunction = autograd_function("_LayerNormFunction", _fwd_impl, _setup_context, _backward_with(_bwd_impl))


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim (what ``torch.nn.functional.layer_norm(x, (N,), weight, bias,
    eps)`` computes), with the residual add before it fused when ``residual`` is given.

    Args:
        x: (..., N) fp16, bf16 or fp32 (fp64 runs on the reference).
        weight: (N,) any float dtype, or None for no scale.
        bias: (N,) any float dtype, or None for no shift.
        eps: added to the (biased) variance before the rsqrt.
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
    if bias is not None:
        check_tensor(_OP, "bias", bias, dtypes=FLOAT_DTYPES, device=x.device)
        check_shape(_OP, "bias", bias, (n,), "the last dim of x")
    if residual is not None:
        check_tensor(_OP, "residual", residual, dtypes=(x.dtype,), device=x.device)
        check_shape(_OP, "residual", residual, tuple(x.shape), "the shape of x")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{_OP}: eps must be a non-negative float, got {eps!r}")
    supported = all(t is None or t.dtype in KERNEL_DTYPES for t in (x, weight, bias))
    backend = choose_backend(_OP, x.device, supported, "float64 runs on the reference")
    if backend == "reference":
        fp32 = all(t is None or t.dtype == torch.float32 for t in (x, weight, bias))
        if x.is_cpu and fp32 and forced_backend() is None:
            # The CPU path: ATen's fused layer_norm (the same biased-variance math in fp32) instead of the
            # reference's written-out passes and casts (BERT-base, 1 x 8 tokens, 1 thread, 2026-12-07: the
            # reference made optimize's norm kind 5% slower than eager).
            h = x + residual if residual is not None else x
            y = torch.nn.functional.layer_norm(h, (n,), weight, bias, eps)
            return (y, h) if residual is not None else y
        return layer_norm_ref(x, weight, bias, eps, residual)

    shape = x.shape
    x2 = rows_2d(x)
    r2 = rows_2d(residual) if residual is not None else None
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    y, h, _, _ = dispatch(_layer_norm_fwd_op, _LayerNormFunction, _fwd_impl, x2, w, b, r2, float(eps))
    y = y.view(shape)
    return (y, h.view(shape)) if residual is not None else y
