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
its partial dw in registers; the partials ((programs, N) fp32) are summed, in a fixed order, either by
the same launch (small problems, host-bound: the last program of each group of ~sqrt(P) sums its
group, the last group's sums dw; see ``_fused_dw_rows``) or by a second small kernel (the rest), into
dw in weight's dtype.

Launch configurations come from the autotune cache (runtime/autotune.py: ``rms_norm_fwd``,
``rms_norm_bwd``, ``rms_norm_dw``, keyed by the row length's bucket, the fused residual/dh and the
dtype); with nothing tuned, the H200-swept rules below. Host overhead matters at small row counts
(4096x1024 bf16 moves 16 MB, ~4 us of HBM time): the lookup happens once per launch plan (row length,
flags, dtype, device), kernels go through ``_utils.Launcher`` (direct calls of the compiled kernel
after the first launch), and the eager paths allocate nothing they do not return.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

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
    empty,
    float_dtype_of,
    launch_config,
    new_empty,
    next_pow2,
    num_sms,
    row_norm_config_key,
    rows_2d,
)
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend, forced_backend

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
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
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
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                y = y * w[None, :]
            tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sum_rows(
    SRC, first, step, count, DST, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """DST[:N] = the sum of the fp32 rows SRC[first + i * step, :N] for i < count, in a fixed order
    (deterministic), stored in DST's dtype. Loads bypass L1 (.cg): the rows were written by other
    programs during this launch."""
    for cstart in range(0, N, BLOCK_N):
        cols = cstart + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for start in range(0, count, BLOCK_P):
            i = start + tl.arange(0, BLOCK_P)
            rows = (first + i * step).to(tl.int64)
            mask = (i < count)[:, None] & col_mask[None, :]
            acc += tl.load(SRC + rows[:, None] * N + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(DST + cols, tl.sum(acc, axis=0).to(DST.dtype.element_ty), mask=col_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    X, W, DY, DH, RSTD, DX, DW_PARTIAL, DW, COUNTERS,
    stride_x, stride_dy, stride_dh, stride_dx,
    M, N, DW_GROUP,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DW: tl.constexpr = False, DW_ROWS: tl.constexpr = 1,
):  # fmt: skip
    # Persistent: program p handles row blocks p, p + P, p + 2P, ...; its dw partial goes to
    # DW_PARTIAL[p, :] (fp32). Without FUSED_DW the launcher sums the partials with
    # _rms_norm_dw_kernel; with it this launch does (the tail after the row loops below).
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
    if FUSED_DW:
        # dw in this launch, deterministically, without waiting on other programs (the interpreter
        # runs programs one after another; a spin-wait would hang there): a two-level "last one
        # reduces". Programs form groups of DW_GROUP (~sqrt(P)); each takes a ticket from its group's
        # counter once its partial row is stored, and the program drawing the group's last ticket
        # sums the group's rows (in row order) into the group's first row. Those group reducers take
        # tickets from COUNTERS[0], and the last one sums the group rows (in group order) into dw. The
        # serial tail is then ~2 sqrt(P) rows instead of P (33 of 264 at 4096x1024). Whoever draws the
        # last ticket resets that counter: the kernel leaves COUNTERS at zero for the next launch.
        # Ordering: the barrier puts every thread's partial stores before the one thread's acq_rel
        # ticket (release: the stores are visible at GPU scope before the ticket is; acquire: the
        # last program's loads see every release before its ticket), as in CUDA's
        # threadFenceReduction sample and cooperative groups' grid sync.
        tl.debug_barrier()
        num_groups = (num_programs + DW_GROUP - 1) // DW_GROUP
        group = pid // DW_GROUP
        first = group * DW_GROUP
        size = tl.minimum(DW_GROUP, num_programs - first)
        ticket = tl.atomic_add(COUNTERS + 1 + group, 1, sem="acq_rel")
        if ticket == size - 1:
            tl.store(COUNTERS + 1 + group, 0)
            if num_groups == 1:
                _sum_rows(DW_PARTIAL, first, 1, size, DW, N, DW_ROWS, BLOCK_N)
            else:
                _sum_rows(DW_PARTIAL, first, 1, size, DW_PARTIAL + first.to(tl.int64) * N, N, DW_ROWS, BLOCK_N)
                tl.debug_barrier()
                ticket = tl.atomic_add(COUNTERS, 1, sem="acq_rel")
                if ticket == num_groups - 1:
                    tl.store(COUNTERS, 0)
                    _sum_rows(DW_PARTIAL, 0, DW_GROUP, num_groups, DW, N, DW_ROWS, BLOCK_N)


@triton.jit
def _rms_norm_dw_kernel(
    DW_PARTIAL, DW,
    P, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # dw[cols] = sum over the P partial rows (fp32), stored in DW's dtype: one launch where
    # torch's sum(0) then .to(dtype) took two (and ~2x the host time).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & col_mask[None, :]
        acc += tl.load(DW_PARTIAL + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache; the rules below are the defaults)
# --------------------------------------------------------------------------------------------
FWD_KERNEL, BWD_KERNEL, DW_KERNEL = "rms_norm_fwd", "rms_norm_bwd", "rms_norm_dw"
_FWD_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps", "RELOAD")
_BWD_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps", "programs_per_sm")
_DW_FIELDS = ("BLOCK_P", "BLOCK_N", "num_warps")


config_key = row_norm_config_key  # N<bucket>-add|norm-<dtype>


@functools.cache
def _fwd_config(n: int, has_residual: bool = False) -> dict:
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


# Backward launch table by row length (BLOCK_M rows per step, warps, persistent programs per SM),
# from the H200 sweep of 2026-11-30: 32768x4096 ran 3.85 TB/s at (2, 8, 2) against 2.74 at the first
# guess (1, 8, 4); 16384x8192 3.76 at (1, 4, 2). Short rows: 131072x1024 ran only 1.16 TB/s at
# (2, 4, 4) (too little in flight per loop step), so they take ~8K elements a step (unmeasured yet).
_BWD_TABLE = {1024: (8, 8, 4), 2048: (4, 8, 2), 4096: (2, 8, 2), 8192: (1, 4, 2), 16384: (1, 16, 2)}


@functools.cache
def _bwd_config(n: int) -> dict:
    """The default backward config (with its persistent ``programs_per_sm``) for a row length ``n``."""
    if n <= _BWD_SINGLE_PASS_MAX:
        block_n = next_pow2(n)
        block_m, num_warps, per_sm = _BWD_TABLE.get(max(1024, block_n), (1, 8, 2))
        if block_n < 1024:
            block_m = min(16, block_m * (1024 // block_n))
        single = True
    else:
        block_n, block_m, num_warps, per_sm, single = 8192, 1, 16, 2, False  # 4096x32768: 1.56 TB/s
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, num_warps=num_warps, programs_per_sm=per_sm)


def _dw_config(n: int) -> dict:
    """The default dw reduction config: about 128+ programs (one per SM), each a column strip of at
    least 8 fp32 (one 32-byte sector a row) summed 4096 elements a step, so that all of a strip's
    partials (P <= 4 programs per SM) are in flight at once for N <= 4096. Unmeasured on the GPU; it
    replaces torch's sum(0) + .to(dtype), two launches."""
    block_n = max(8, min(64, next_pow2((n + 127) // 128)))
    return dict(BLOCK_P=4096 // block_n, BLOCK_N=block_n, num_warps=4)


def fwd_config(n: int, has_residual: bool, dtype: torch.dtype, device: torch.device | str | int | None = None) -> dict:
    """The forward's launch config for rows of ``n`` (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps): the
    autotune cache's for this bucket, else the default rule."""
    return autotune.get_config(
        FWD_KERNEL, config_key(n, has_residual, dtype), device=device,
        default=lambda: _fwd_config(n, has_residual), fields=_FWD_FIELDS, check=covers_row(n),
    )  # fmt: skip


def bwd_config(n: int, has_dh: bool, dtype: torch.dtype, device: torch.device | str | int | None = None) -> dict:
    """The backward's launch config (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps, programs_per_sm)."""
    return autotune.get_config(
        BWD_KERNEL, config_key(n, has_dh, dtype), device=device,
        default=lambda: _bwd_config(n), fields=_BWD_FIELDS, check=covers_row(n),
    )  # fmt: skip


def dw_config(n: int, device: torch.device | str | int | None = None) -> dict:
    """The dw reduction's launch config (BLOCK_P, BLOCK_N, num_warps); its key is the N bucket."""
    return autotune.get_config(
        DW_KERNEL, f"N{autotune.bucket(n)}", device=device, default=lambda: _dw_config(n), fields=_DW_FIELDS
    )


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


@autotune.plan_cache
def _bwd_plan(
    n: int, has_dh: bool, has_weight: bool, dtype: torch.dtype, device_index: int
) -> tuple[LaunchConfig, LaunchConfig | None, int, int, int]:
    """(launch config, its single-launch form (None without weight), BLOCK_M, most persistent
    programs, most programs of the single-launch form: 0 where its rule never applies (no weight,
    or chunked rows)) of the backward kernel."""
    cfg = dict(bwd_config(n, has_dh, dtype, device_index))
    per_sm = cfg.pop("programs_per_sm")
    sms = num_sms(device_index)
    fused_programs = sms * min(per_sm, _FUSED_DW_PER_SM) if has_weight and cfg["SINGLE_PASS"] else 0
    return _bwd_launch_configs(has_dh, has_weight, cfg) + (cfg["BLOCK_M"], sms * per_sm, fused_programs)


def _bwd_launch_configs(has_dh: bool, has_weight: bool, cfg: dict) -> tuple[LaunchConfig, LaunchConfig | None]:
    """The two-launch and the single-launch (FUSED_DW) forms of a backward config. The single-launch
    tail sums DW_ROWS partial rows a step: 16384 elements (H200, 2026-11-30, 4096 rows: 16 rows at
    N 1024 14.8 us against 17.9 at 8 rows; 8 at N 2048 20.9 against 21.7 at 4 and 25.8 at 16; 4 at
    N 4096 37.3 against 38.6 at 2 and 49.9 at 8)."""
    flags = dict(HAS_DH=has_dh, HAS_WEIGHT=has_weight)
    cfg = dict(cfg)
    dw_rows = cfg.pop("DW_ROWS", max(1, 16384 // cfg["BLOCK_N"]))
    fused = launch_config(**flags, **cfg, FUSED_DW=True, DW_ROWS=dw_rows) if has_weight else None
    return launch_config(**flags, **cfg), fused


# The single-launch backward (dw summed in the backward kernel's tail, _rms_norm_bwd_kernel FUSED_DW)
# saves the dw kernel's launch, its plan and the partials' allocation (they live in a per-stream
# workspace): host time, which is what a small eager call is made of. H200, 2026-11-30, 4096x1024 bf16
# (min of 7 rounds): rms_norm_bwd alone 31.7 -> 21.7 us of host time, the eager backward through
# autograd.grad 101.6 -> 88.4 (F.rms_norm 77.0), with the residual 117.0 -> 105.4; do_bench 113.5 ->
# 103.0 (F.rms_norm 83.3). Its cost is a serial tail on the GPU: after the last program's rows, two
# ticketed steps each sum ~sqrt(P) fp32 rows of N in one program. GPU time per call: 4096x1024 12.5 ->
# 14.9 us (two kernels -> one), 16384x1024 41.3 -> 44.2, 4096x2048 17.0 -> 20.6; 4096x4096 31.5 ->
# 37.3 (not taken: the host saving, ~10 us, would be half gone). Taken when (see _fused_dw_rows):
# - the one-pass kernel runs (N <= _BWD_SINGLE_PASS_MAX; longer rows make the tail long),
# - M*N <= _FUSED_DW_MAX_ELEMENTS (the kernel moves <= 100 MB in bf16, <= ~45 us of GPU time, under
#   the ~90-170 us of host time of an eager backward),
# - the tail reads at most _FUSED_DW_MAX_TAIL fp32 (512 KB; 4096x2048: 33 rows of 2048),
# - no CUDA graph is being captured on the current stream (its scratch is per stream, see _workspace).
# It runs at most _FUSED_DW_PER_SM programs per SM (fewer rows in the tail).
_FUSED_DW_MAX_ELEMENTS = 1 << 24
_FUSED_DW_MAX_TAIL = 1 << 17
_FUSED_DW_PER_SM = 2  # at most 2 programs per SM: 4096x1024 14.8 us in one launch against 16.8 at 4
_MAX_COUNTERS = 1024  # ticket counters per workspace: 1 + groups (<= sqrt(P) + 1)


def _fused_dw_group(programs: int) -> int:
    """Programs per group of the single-launch dw reduction: ceil(sqrt(P)), which balances the two
    serial steps (a group's DW_GROUP rows, then the ceil(P / DW_GROUP) group rows)."""
    return math.isqrt(programs - 1) + 1


def _fused_dw_rows(m: int, n: int, programs: int) -> int:
    """The group size of the single-launch backward at this size, or 0 for the two-launch form."""
    if m * n > _FUSED_DW_MAX_ELEMENTS:
        return 0
    group = _fused_dw_group(programs)
    groups = (programs + group - 1) // group
    return group if (group + groups) * n <= _FUSED_DW_MAX_TAIL and groups < _MAX_COUNTERS else 0


# Scratch of the single-launch backward, per (device index, stream): the ticket counters (int32, zero
# between launches: every launch leaves them so) and the dw partial rows (fp32, grown to the largest
# P x N seen: 1 MB at 4096x1024, ~3.2 MB at most under the rule). Launches on one stream run one after
# another, so they share one; launches on two streams get two, and may overlap. A buffer replaced by
# a larger one goes back to the caching allocator, whose reuse on this stream is ordered after the
# launches still reading it. None while the current stream captures a CUDA graph (the two-launch
# form runs then): a captured launch would bake this buffer into a graph that may be replayed
# alongside eager launches or other graphs using it.
_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_cuda_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_cuda_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def _workspace(x: torch.Tensor, device_index: int, floats: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(counters, partials) of at least ``floats`` fp32 for the current stream on ``x``'s device
    (index ``device_index``), or None (capturing)."""
    if device_index >= 0:
        if _cuda_capturing():
            return None
        key = (device_index, _cuda_stream(device_index))
    else:  # the interpreter (CPU tensors): programs run one after another
        key = (-1, 0)
    ws = _workspaces.get(key)
    if ws is None or ws[1].numel() < floats:
        device = x.device
        counters = ws[0] if ws is not None else torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
        ws = _workspaces[key] = (counters, empty((floats,), dtype=torch.float32, device=device))
    return ws


@autotune.plan_cache
def _dw_plan(n: int, device_index: int = -1) -> tuple[LaunchConfig, int]:
    """(launch config, BLOCK_N) of the dw reduction."""
    cfg = dw_config(n, device_index)
    return launch_config(**cfg), cfg["BLOCK_N"]


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs already checked; x and residual as (M, N) with unit col stride)
# --------------------------------------------------------------------------------------------
def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    config: dict | None = None,
    store_rstd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x, residual (M, N) -> y (M, N) in x's dtype, h = x + residual (M, N) or None, rstd (M,) fp32.

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
    _fwd_launcher(((m + block_m - 1) // block_m,), cfg, tensors, ints, (float(eps),))
    return y, h, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dh: torch.Tensor | None = None,
    config: dict | None = None,
    programs_per_sm: int | None = None,
    fused_dw: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy, x (the normalized input: h when the residual was fused), dh (M, N) -> dx (M, N), dw (N,).

    ``dh`` is the gradient reaching the h output of the fused residual form; it is added into dx.
    dw comes in weight's dtype, None without weight. ``config``/``programs_per_sm`` override the
    launch configuration (for tuning sweeps). ``fused_dw`` forces dw into the backward's own launch
    (True; not while a CUDA graph is captured) or into a second reduction launch (False); None
    takes the rule at ``_fused_dw_rows``. Either way dw is deterministic (a fixed summation order).
    """
    # Host time, 4096x1024 bf16 (CPU, 2026-11-30, launches stubbed at the C launch call; median of 8
    # processes' best of 60 rounds): this function 13.6 -> 11.5 us, the eager backward through
    # autograd.grad 74.7 -> 67.7 us (with the residual 82.2 -> 74.1), from outputs by new_empty,
    # spec_key's int-key and aligned-pointer shortcuts, the graph node calling the backward directly
    # (_utils.autograd_function), and (~0.3 us, since undone for simplicity) the dw group from the plan.
    m, n = x.shape
    dx = new_empty(x, m, n)
    if m == 0 or n == 0:
        if dh is not None:
            dx.copy_(dh)
        dw = torch.zeros_like(weight) if weight is not None else None
        return dx, dw
    sx, sdy = x.stride(), dy.stride()
    sdh = dh.stride() if dh is not None else (0, 1)
    assert sx[1] == 1 and sdy[1] == 1 and sdh[1] == 1
    device_index = x.get_device()
    cfg, fused_cfg, block_m, max_programs, fused_max = _bwd_plan(
        n, dh is not None, weight is not None, x.dtype, device_index
    )
    if config is not None or programs_per_sm is not None:
        # Sweeps: what is given replaces the config the op would use (the cached or default one),
        # programs per SM included for both forms.
        resolved = dict(bwd_config(n, dh is not None, x.dtype, device_index))
        per_sm = resolved.pop("programs_per_sm")
        config = config or resolved
        cfg, fused_cfg = _bwd_launch_configs(dh is not None, weight is not None, config)
        block_m = config["BLOCK_M"]
        max_programs = num_sms(device_index) * (programs_per_sm or per_sm)
        fused_max = max_programs if weight is not None and config["SINGLE_PASS"] else 0
    row_blocks = (m + block_m - 1) // block_m
    if weight is None:  # no dw: one launch; the partials' pointer is never used
        _bwd_launcher(
            (min(row_blocks, max_programs),), cfg, (x, x, dy, dh if dh is not None else dy, rstd, dx, rstd, rstd, rstd),
            (sx[0], sdy[0], sdh[0], n, m, n, 0),
        )  # fmt: skip
        return dx, None
    dw = new_empty(weight, n)
    group = 0
    if fused_dw is None and fused_max:
        programs = min(row_blocks, fused_max)
        group = _fused_dw_rows(m, n, programs)
    elif fused_dw:
        programs = min(row_blocks, fused_max or max_programs)
        group = _fused_dw_group(programs)
    workspace = _workspace(x, device_index, programs * n) if group else None
    if workspace is not None:
        counters, partials = workspace
        _bwd_launcher(
            (programs,), fused_cfg, (x, weight, dy, dh if dh is not None else dy, rstd, dx, partials, dw, counters),
            (sx[0], sdy[0], sdh[0], n, m, n, group),
        )  # fmt: skip
        return dx, dw
    programs = min(row_blocks, max_programs)
    partials = empty((programs, n), dtype=torch.float32, device=x.device)
    _bwd_launcher(
        (programs,), cfg, (x, weight, dy, dh if dh is not None else dy, rstd, dx, partials, partials, partials),
        (sx[0], sdy[0], sdh[0], n, m, n, 0),
    )  # fmt: skip
    dw_cfg, dw_block_n = _dw_plan(n, device_index)
    _dw_launcher(((n + dw_block_n - 1) // dw_block_n,), dw_cfg, (partials, dw), (programs, n))
    return dx, dw


_fwd_launcher = Launcher(_rms_norm_fwd_kernel)
_bwd_launcher = Launcher(_rms_norm_bwd_kernel)
_dw_launcher = Launcher(_rms_norm_dw_kernel)


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
    opaque, also under aot_function), the plain implementation in the eager autograd.Function
    (which returns y, or (y, h): its backward gets one or two gradients, possibly None)."""

    def _backward(ctx, dy, dh=None, _drstd=None):
        xn, weight, rstd = ctx.saved_tensors
        has_residual = ctx.has_residual
        if dy is None:  # eager only (grads not materialized): y was unused, only h was
            dy = torch.zeros_like(xn)
        dy = dy.contiguous()
        dh = dh.contiguous() if (has_residual and dh is not None) else None
        dx, dw = bwd(dy, xn, weight, rstd, dh)
        return dx, (dw if weight is not None else None), (dx if has_residual else None), None

    return _backward


def _forward_eager(
    ctx, x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The eager Function's forward: y, or (y, h). It saves what the custom op's ``_setup_context``
    saves; rstd stays inside (saved for the backward, not an output: no gradient is ever built for
    it). With the residual, unused output gradients stay None: autograd would otherwise fill a zero
    gradient for an unused h (an allocation and a fill kernel in the backward). Without it y is the
    one output: its gradient is None only where every consumer's was, and the backward then makes
    the zeros autograd would have made."""
    y, h, rstd = rms_norm_fwd(x, weight, residual, eps)
    if residual is None:
        ctx.has_residual = False
        ctx.save_for_backward(x, weight, rstd)
        return y
    ctx.has_residual = True
    ctx.save_for_backward(h, weight, rstd)
    ctx.set_materialize_grads(False)
    return y, h


def _fwd_no_grad(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Eager call with nothing to differentiate: y or (y, h), and no rstd allocated or stored."""
    y, h, _ = rms_norm_fwd(x, weight, residual, eps, store_rstd=False)
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
                    y = y.mul_(weight) if not _needs_grad(y, weight) else y * weight
                return (y, h) if residual is not None else y
        return rms_norm_ref(x, weight, eps, residual)

    # What rows_2d returns, without its call for 2-D rows (~0.5 us of the eager forward, CPU 2026-12-01).
    x2 = x if ndim == 2 and x.stride(1) == 1 else rows_2d(x)
    r2 = rows_2d(residual) if residual is not None else None
    w = weight.contiguous() if weight is not None else None
    # Eager: y, or (y, h). Under torch.compile, the custom op's (y, h or a 0-size stand-in, rstd).
    out = dispatch(_rms_norm_fwd_op, _RMSNormFunction, _fwd_no_grad, x2, w, r2, float(eps))
    y, h = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    if ndim != 2:  # 2-D inputs come back in their own shape: no view needed
        y = y.view(*shape)  # sizes as ints: ~2 us faster than passing the torch.Size
        if residual is not None:
            h = h.view(*shape)
    return (y, h) if residual is not None else y


# --------------------------------------------------------------------------------------------
# Tuning (``fuseformer bench --tune`` through autotune.tune_all), in the spirit of benchmarks/sweeps.py
# --------------------------------------------------------------------------------------------
TUNE_ROWS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
_TUNE_ELEMENTS = 1 << 27  # M x N of each tuning shape: 256 MiB of bf16, far past the 60 MB L2


def fwd_candidates(n: int, has_residual: bool, quick: bool = False) -> list[dict]:
    """The forward sweep for rows of ``n``, the default first (it wins ties)."""
    out = [_fwd_config(n, has_residual)]
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


def bwd_candidates(n: int, quick: bool = False) -> list[dict]:
    """The backward sweep for rows of ``n`` (with programs per SM), the default first."""
    out = [_bwd_config(n)]
    if n > _BWD_SINGLE_PASS_MAX:
        out += [dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, num_warps=w, programs_per_sm=p)
                for bn in ((8192,) if quick else (4096, 8192)) for w in (8, 16) for p in (1, 2)]  # fmt: skip
    else:
        bn = next_pow2(n)
        sizes = (4096, 8192) if quick else (2048, 4096, 8192, 16384)
        out += [dict(BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=True, num_warps=w, programs_per_sm=p)
                for bm in (1, 2, 4, 8, 16) if bm * bn in sizes
                for w in ((4, 8) if quick else (4, 8, 16)) for p in ((2, 4) if quick else (1, 2, 4, 8))]  # fmt: skip
    return [c for i, c in enumerate(out) if c not in out[:i]]


def _tune_inputs(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    m = max(1, _TUNE_ELEMENTS // n)
    return torch.randn(m, n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)


def _tune_record(kernel: str, key: str, tune: Callable[[], dict], run: Callable[[], object], nbytes: int) -> dict:
    """Tune one key and time the op with what it now resolves: a record of ``tune_all``."""
    from fuseformer.bench._timing import bench_ms, tb_per_s

    try:
        best = tune()
        ms = bench_ms(run)
        return dict(kernel=kernel, key=key, config=best, ms=ms, tb_s=tb_per_s(nbytes, ms))
    except Exception as exc:
        return dict(kernel=kernel, key=key, error=f"{type(exc).__name__}: {exc}"[:300])


def tune_rms_norm_fwd(quick: bool = False) -> list[dict]:
    """Tune the forward (plain and with the residual add) over row lengths on this GPU (bf16)."""
    records = []
    dtype = torch.bfloat16
    for n in (1024, 4096, 8192) if quick else TUNE_ROWS:
        x, w = _tune_inputs(n, dtype)
        for fused in (False, True):
            r = torch.randn_like(x) if fused else None
            key = config_key(n, fused, dtype)

            def bench(cfg, x=x, w=w, r=r):
                return lambda: rms_norm_fwd(x, w, r, 1e-6, config=cfg, store_rstd=False)

            tune = functools.partial(autotune.tune, FWD_KERNEL, fwd_candidates(n, fused, quick), bench, key, force=True)
            run = functools.partial(rms_norm_fwd, x, w, r, 1e-6, store_rstd=False)
            records.append(_tune_record(FWD_KERNEL, key, tune, run, (4 if fused else 2) * x.numel() * x.element_size()))
    return records


def tune_rms_norm_bwd(quick: bool = False) -> list[dict]:
    """Tune the backward (without and, in the full run, with dh) over row lengths on this GPU (bf16)."""
    records = []
    dtype = torch.bfloat16
    for n in (1024, 4096, 8192) if quick else TUNE_ROWS:
        x, w = _tune_inputs(n, dtype)
        dy = torch.randn_like(x)
        _, _, rstd = rms_norm_fwd(x, w, None, 1e-6)
        for fused in (False,) if quick else (False, True):
            dh = torch.randn_like(x) if fused else None
            key = config_key(n, fused, dtype)

            def bench(cfg, x=x, w=w, dy=dy, rstd=rstd, dh=dh):
                cfg = dict(cfg)
                per_sm = cfg.pop("programs_per_sm")
                return lambda: rms_norm_bwd(dy, x, w, rstd, dh, config=cfg, programs_per_sm=per_sm)

            tune = functools.partial(autotune.tune, BWD_KERNEL, bwd_candidates(n, quick), bench, key, force=True)
            run = functools.partial(rms_norm_bwd, dy, x, w, rstd, dh)
            records.append(_tune_record(BWD_KERNEL, key, tune, run, (4 if fused else 3) * x.numel() * x.element_size()))
    return records


autotune.register_tuner(FWD_KERNEL, tune_rms_norm_fwd)
autotune.register_tuner(BWD_KERNEL, tune_rms_norm_bwd)
