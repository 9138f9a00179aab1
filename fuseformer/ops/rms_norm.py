"""RMSNorm, optionally fused with the residual add before it.

    h = x + residual            (when residual is given)
    y = h * rsqrt(mean(h^2) + eps) * (offset + weight)

``offset`` is 0 for Llama-style norms and 1 for Gemma's ``x * (1 + w)``. The scale ``offset + w`` is
formed in fp32 and multiplies the fp32 normalized row before the one cast to x's dtype: Gemma's order
(HF GemmaRMSNorm: ``(norm(x.float()) * (1.0 + w.float())).type_as(x)``). HF LlamaRMSNorm rounds the
normalized row to x's dtype before multiplying by w; the kernels keep it in fp32 (one rounding fewer:
identical in fp32, within DESIGN.md §3 in fp16/bf16).

Everything below autograd lives here (STYLE.md §1): the reference ``rms_norm_ref``, the forward's
Triton kernel, the launcher ``rms_norm_fwd`` (no autograd; the engine calls it), the ``torch.library``
registration with fake and autograd, and the public ``rms_norm``. The backward (its kernels, the
launcher ``rms_norm_bwd``, re-exported here, and its custom op) is rms_norm_bwd.py, as attention's is
attention_bwd.py: one file held both at 956 lines, past the 700 a file may have.

Shapes: x (..., N), weight (N,) or None, residual like x. The kernels see x as (M, N) rows with a
row stride and unit column stride. Rows of up to ``_SINGLE_PASS_MAX`` elements are held in
registers in one pass; longer rows are streamed in chunks (sum of squares, then normalize).

Launch configurations come from the autotune cache (runtime/autotune.py: ``rms_norm_fwd`` keyed by the
row length's bucket, the fused residual and the dtype); with nothing tuned, the H200-swept rule
``default_config``; ``candidate_configs`` is what ``fuseformer bench --tune`` (bench/tune.py) times.
Host overhead matters at small row counts
(4096x1024 bf16 moves 16 MB, ~4 us of HBM time): the lookup happens once per launch plan (row length,
flags, dtype, device), kernels go through ``_utils.Launcher`` (direct calls of the compiled kernel
after the first launch), and the eager paths allocate nothing they do not return.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    LaunchConfig,
    Launcher,
    autograd_function,
    check_tensor,
    covers_row,
    dispatch,
    float_dtype_of,
    launch_config,
    new_empty,
    next_pow2,
    row_norm_config_key,
    rows_2d,
)
from fuseformer.ops.rms_norm_bwd import _rms_norm_bwd_op, rms_norm_bwd
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend, forced_backend

_OP = "rms_norm"
# Longest row held in registers in one pass; longer rows take the chunked loop. H200 sweep
# (2026-11-30): fwd 4096x32768 one pass (16 warps) 3.70 TB/s against 2.98 chunked; at 65536 the
# chunked loop (8192-wide chunks, 16 warps) 2.65 against 2.63. (The backward's: rms_norm_bwd.py.)
_SINGLE_PASS_MAX = 32768


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    upcast: bool = True,
    *,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure PyTorch RMSNorm. Computes in fp32 (fp64 stays fp64) when ``upcast``, else in x's dtype;
    the scale is ``offset + weight`` in that dtype.

    Returns y (x's dtype), or (y, x + residual) when ``residual`` is given.
    """
    dtype = x.dtype
    compute = float_dtype_of(x) if upcast else dtype
    h = x.to(compute)
    if residual is not None:
        h = h + residual.to(compute)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(compute) + offset if offset else weight.to(compute))
    y = y.to(dtype)
    return (y, h.to(dtype)) if residual is not None else y


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,
    stride_x, stride_r, stride_y, stride_h,
    M, N, eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, STORE_RSTD: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RELOAD: tl.constexpr = False,
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
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=row_mask)
        y = h * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset  # the scale
            y = y * w[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Pass 1: h = x (+ r), stored when fused, and the sum of squares. RELOAD (Inductor's structure
        # for the fused pair; the default for fused rows of 2049..4096): pass 1 only loads (kept in
        # L2), pass 2 re-reads x and r and stores h with y.
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_last" if RELOAD else "").to(tl.float32)  # fmt: skip
            if HAS_RESIDUAL:
                r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_last" if RELOAD else "")  # fmt: skip
                h += r.to(tl.float32)
                if not RELOAD:
                    tl.store(H + rows[:, None] * stride_h + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(sum_sq / N + eps)
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=row_mask)
        # Pass 2: normalize, re-reading the row (mostly from L2).
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_RESIDUAL and RELOAD:
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first")  # fmt: skip
                r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_first")  # fmt: skip
                h = x.to(tl.float32) + r.to(tl.float32)
                tl.store(H + rows[:, None] * stride_h + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
            elif HAS_RESIDUAL:
                h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = h * rstd[:, None]
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset  # the scale
                y = y * w[None, :]
            tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache; the rule below is the default)
# --------------------------------------------------------------------------------------------
FWD_KERNEL = "rms_norm_fwd"
_FWD_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps", "RELOAD")

config_key = row_norm_config_key  # N<bucket>-add|norm-<dtype>


@functools.cache
def default_config(n: int, has_residual: bool = False) -> dict:
    """The default forward config for a row length ``n`` (H200 sweep, 2026-11-30, docs/perf-notes.md).

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
    if has_residual and block_n == 4096:
        # Fused add + norm (4 streams): Inductor's two-loop structure (RELOAD: pass 1 only loads x and
        # r for the sum of squares, pass 2 re-reads them from L2 and stores h and y), one row and 16
        # warps: 32768x4096 at 99.4% of copy in run 38 against 96.3% for the one-pass (2 rows, 32
        # warps) that was the best of the earlier sweeps.
        return dict(BLOCK_M=1, BLOCK_N=4096, SINGLE_PASS=False, num_warps=16, RELOAD=True)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, num_warps=num_warps, RELOAD=False)


def fwd_config(n: int, has_residual: bool, dtype: torch.dtype, device: torch.device | str | int | None = None) -> dict:
    """The forward's launch config for rows of ``n`` (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps): the
    autotune cache's for this bucket, else the default rule."""
    return autotune.get_config(
        FWD_KERNEL, config_key(n, has_residual, dtype), device=device,
        default=lambda: default_config(n, has_residual), fields=_FWD_FIELDS, check=covers_row(n),
    )  # fmt: skip


def candidate_configs(n: int, has_residual: bool, quick: bool = False) -> list[dict]:
    """The tuning sweep for rows of ``n`` (``fuseformer bench --tune``), the default first (it wins ties)."""
    out = [default_config(n, has_residual)]
    # RELOAD (pass 2 re-reads x and r; fused add + norm only) for the two-pass candidates.
    reloads = (False, True) if has_residual else (False,)
    if n > _SINGLE_PASS_MAX:
        out += [dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, num_warps=w, RELOAD=r)
                for bn in ((8192,) if quick else (2048, 4096, 8192)) for w in (8, 16) for r in reloads]  # fmt: skip
    else:
        bn = next_pow2(n)
        sizes = (8192, 16384) if quick else (2048, 4096, 8192, 16384, 32768)
        out += [dict(BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=True, num_warps=w, RELOAD=False)
                for bm in (1, 2, 4, 8, 16) if bm * bn in sizes
                for w in ((8, 16) if quick else (4, 8, 16, 32))]  # fmt: skip
        if has_residual:
            out += [dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, num_warps=w, RELOAD=True) for w in (8, 16)]
    return [c for i, c in enumerate(out) if c not in out[:i]]


# The per-call launch plans: everything a launch needs that depends only on the row length, the
# flags, the dtype and the device, computed once (the host time of a small call is the whole call):
# the autotune lookup happens here, never per call.
@autotune.plan_cache
def _fwd_plan(
    n: int, has_residual: bool, has_weight: bool, store_rstd: bool, dtype: torch.dtype, device: torch.device
) -> tuple[LaunchConfig, int]:
    """(launch config, BLOCK_M) of the forward kernel."""
    cfg = fwd_config(n, has_residual, dtype, device)
    flags = dict(HAS_RESIDUAL=has_residual, HAS_WEIGHT=has_weight, STORE_RSTD=store_rstd)
    return launch_config(**flags, **cfg), cfg["BLOCK_M"]


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs already checked; x and residual as (M, N) with unit col stride)
# --------------------------------------------------------------------------------------------
def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
    config: dict | None = None,
    store_rstd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x, residual (M, N) -> y (M, N) in x's dtype, h = x + residual (M, N) or None, rstd (M,) fp32.

    y scales by ``offset + weight`` (formed in fp32); ``offset`` is ignored without a weight.
    ``store_rstd=False`` (no backward to come) returns rstd None and skips its buffer and stores.
    ``config`` overrides the launch configuration (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps); for
    tuning sweeps.
    """
    m, n = x.shape
    y = new_empty(x, m, n)
    h = new_empty(x, m, n) if residual is not None else None
    rstd = new_empty(x, m, dtype=torch.float32) if store_rstd else None
    if m == 0 or n == 0:
        if n == 0 and rstd is not None:
            rstd.fill_(eps**-0.5 if eps > 0 else float("inf"))
        return y, h, rstd
    sx = x.stride()  # one call for both strides (x.stride(i) costs as much as x.stride())
    sr = residual.stride() if residual is not None else (0, 1)
    assert sx[1] == 1 and sr[1] == 1
    if config is None:
        cfg, block_m = _fwd_plan(n, residual is not None, weight is not None, store_rstd, x.dtype, x.device)
    else:
        flags = dict(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, STORE_RSTD=store_rstd)
        cfg = launch_config(**flags, **config)
        block_m = config["BLOCK_M"]
    # y and h are fresh (m, n) tensors: row stride n. Without rstd, RSTD points at y (never written).
    rstd_arg = rstd if rstd is not None else y
    if residual is None:
        tensors = (x, x, weight if weight is not None else x, y, y, rstd_arg)
        ints = (sx[0], 0, n, 0, m, n)
    else:
        tensors = (x, residual, weight if weight is not None else x, y, h, rstd_arg)
        ints = (sx[0], sr[0], n, n, m, n)
    _fwd_launcher(((m + block_m - 1) // block_m,), cfg, tensors, ints, (float(eps), float(offset)))
    return y, h, rstd


_fwd_launcher = Launcher(_rms_norm_fwd_kernel)


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with fake and autograd), and the same
# pieces as an autograd.Function for eager calls (far less host overhead); see _utils.dispatch.
# --------------------------------------------------------------------------------------------
def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, rstd = rms_norm_fwd(x, weight, residual, eps, offset)
    # A custom op cannot return None: an empty tensor stands for "no h" when there is no residual.
    return y, (h if h is not None else x.new_empty(0)), rstd


_rms_norm_fwd_op = torch.library.custom_op("fuseformer::rms_norm_fwd", mutates_args=())(_fwd_impl)


@_rms_norm_fwd_op.register_fake
def _(x, weight, residual, eps, offset=0.0):
    m, n = x.shape
    h = x.new_empty((m, n)) if residual is not None else x.new_empty(0)
    return x.new_empty((m, n)), h, x.new_empty((m,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, *offset = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.offset = offset[0] if offset else 0.0
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)


def _backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile/export (so traces stay
    opaque, also under aot_function), the plain implementation in the eager autograd.Function
    (which returns y, or (y, h): its backward gets one or two gradients, possibly None)."""

    def _backward(ctx, dy, dh=None, _drstd=None):
        xn, weight, rstd = ctx.saved_tensors
        has_residual = ctx.has_residual
        if dy is None:  # eager only (grads not materialized): y was unused, only h was
            dy = torch.zeros_like(xn)
        dy = dy.contiguous()
        dh = dh.contiguous() if (has_residual and dh is not None) else None
        dx, dw = bwd(dy, xn, weight, rstd, dh, ctx.offset)
        return dx, (dw if weight is not None else None), (dx if has_residual else None), None, None

    return _backward


def _forward_eager(
    ctx,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The eager Function's forward: y, or (y, h). It saves what the custom op's ``_setup_context``
    saves; rstd stays inside (saved for the backward, not an output: no gradient is ever built for
    it). With the residual, unused output gradients stay None: autograd would otherwise fill a zero
    gradient for an unused h (an allocation and a fill kernel in the backward). Without it y is the
    one output: its gradient is None only where every consumer's was, and the backward then makes
    the zeros autograd would have made."""
    y, h, rstd = rms_norm_fwd(x, weight, residual, eps, offset)
    ctx.offset = offset
    if residual is None:
        ctx.has_residual = False
        ctx.save_for_backward(x, weight, rstd)
        return y
    ctx.has_residual = True
    ctx.save_for_backward(h, weight, rstd)
    ctx.set_materialize_grads(False)
    return y, h


def _fwd_no_grad(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float, offset: float = 0.0
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Eager call with nothing to differentiate: y or (y, h), and no rstd allocated or stored."""
    y, h, _ = rms_norm_fwd(x, weight, residual, eps, offset, store_rstd=False)
    return y if h is None else (y, h)


_rms_norm_fwd_op.register_autograd(_backward_with(_rms_norm_bwd_op), setup_context=_setup_context)
# Eager: rms_norm_fwd itself inside the forward (h is None without a residual: no placeholder tensor).
# Host time of the eager forward with grad, 4096x1024 bf16 (CPU, 2026-12-01, launches stubbed at the C
# launch call; median of 8 processes' best of 30 rounds): 35.9 -> 30.5 us (with the residual 42.0 ->
# 38.0; a do-nothing Function.apply of two tensors and one new_empty 11.7), from rstd by new_empty
# (~1.5 us), the one-frame forward above and fast_apply's loop (~1 us each), weight's checks in one call
# and 2-D rows without rows_2d (~0.5 us each). Most of the rest: the launch (~7 us, spec_key ~3), dispatch
# (~3.5) and choose_backend (~3.5).
_RMSNormFunction = autograd_function("_RMSNormFunction", _forward_eager, None, _backward_with(rms_norm_bwd))


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    *,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, with the residual add before it fused when ``residual`` is given.

    Args:
        x: (..., N) fp16, bf16 or fp32 (fp64 runs on the reference).
        weight: (N,) any float dtype, or None for no scale.
        eps: added to mean(x^2) before the rsqrt.
        residual: like x (same shape and dtype), added to x first.
        offset: added to the weight: the scale is ``offset + weight``, formed in fp32 and applied to
            the fp32 normalized row before the cast to x's dtype (Gemma: offset 1, ``x * (1 + w)``,
            which is exactly HF GemmaRMSNorm's order). Needs a weight unless 0.

    Returns:
        y (..., N) in x's dtype; or (y, x + residual) when ``residual`` is given, the second being
        the new residual stream (as flash-attn's and Liger's fused add-norm return it).
    """
    check_tensor(_OP, "x", x, dtypes=FLOAT_DTYPES)
    ndim = x.dim()
    if ndim == 0:
        raise ValueError(f"{_OP}: x must have at least 1 dim, got a scalar")
    shape, device = x.shape, x.device
    n = shape[-1]
    if weight is not None:
        check_tensor(_OP, "weight", weight, dtypes=FLOAT_DTYPES, device=device, shape=(n,), what="the last dim of x")
    if residual is not None:
        check_tensor(_OP, "residual", residual, dtypes=(x.dtype,), device=device, shape=shape, what="the shape of x")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{_OP}: eps must be a non-negative float, got {eps!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"{_OP}: offset must be a finite float, got {offset!r}")
    if offset and weight is None:
        raise ValueError(f"{_OP}: offset {offset!r} needs a weight (the scale is offset + weight)")
    supported = x.dtype in KERNEL_DTYPES and (weight is None or weight.dtype in KERNEL_DTYPES)
    backend = choose_backend(_OP, device, supported, "float64 runs on the reference")
    if backend == "reference":
        if x.is_cpu and x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
            if forced_backend() is None:
                # The CPU path: the reference's fp32 arithmetic in the same order (bitwise equal), without
                # its casts and with in-place steps (SmolLM-135M decode row of 576 with the residual, 1
                # thread, 2026-12-03: 18 -> 11 us a call). torch's F.rms_norm timed the same alone but
                # ~5x slower inside the decode step (cProfile, 44 us a call).
                h = x + residual if residual is not None else x
                y = h * torch.mean(h * h, -1, keepdim=True).add_(eps).rsqrt_()
                if weight is not None:
                    scale = weight + offset if offset else weight
                    y = y.mul_(scale) if not _needs_grad(y, weight) else y * scale
                return (y, h) if residual is not None else y
        return rms_norm_ref(x, weight, eps, residual, offset=offset)

    # What rows_2d returns, without its call for 2-D rows (~0.5 us of the eager forward, CPU 2026-12-01).
    x2 = x if ndim == 2 and x.stride(1) == 1 else rows_2d(x)
    r2 = rows_2d(residual) if residual is not None else None
    w = weight.contiguous() if weight is not None else None
    # Eager: y, or (y, h). Under torch.compile, the custom op's (y, h or a 0-size stand-in, rstd).
    out = dispatch(_rms_norm_fwd_op, _RMSNormFunction, _fwd_no_grad, x2, w, r2, float(eps), float(offset))
    y, h = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    if ndim != 2:  # 2-D inputs come back in their own shape: no view needed
        y = y.view(*shape)  # sizes as ints: ~2 us faster than passing the torch.Size
        if residual is not None:
            h = h.view(*shape)
    return (y, h) if residual is not None else y
