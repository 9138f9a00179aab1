"""RMSNorm's backward: kernels, launcher, launch configuration and its custom op (the forward,
the reference, the autograd registration and the public ``rms_norm`` are in rms_norm.py, which
imports this module: the backward imports nothing of the forward's).

    dx = rstd * (dy*w - xhat * mean(dy*w*xhat)) (+ dh, the gradient reaching the h output)
    dw = sum over rows of dy * xhat                (w here the scale offset + weight)

A persistent grid (a few programs per SM) walks the rows and keeps its partial dw in registers; the
partials ((programs, N) fp32) are summed, in a fixed order, either by the same launch (small problems,
host-bound: the last program of each group of ~sqrt(P) sums its group, the last group's sums dw; see
``_fused_dw_rows``) or by a second small kernel (the rest), into dw in weight's dtype.

Launch configurations come from the autotune cache (runtime/autotune.py: ``rms_norm_bwd`` keyed by
the row length's bucket, dh fused or not and the dtype; ``rms_norm_dw`` by the N bucket); with
nothing tuned, the H200-swept rules below (``default_config``, ``default_dw_config``);
``candidate_configs`` is what ``fuseformer bench --tune`` (bench/tune.py) times.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    LaunchConfig,
    Launcher,
    covers_row,
    empty,
    launch_config,
    new_empty,
    next_pow2,
    num_sms,
    row_norm_config_key,
)
from fuseformer.runtime import autotune

# Longest row the backward holds in registers in one pass (H200 sweep, 2026-11-30: 8192x16384 one pass
# 3.35 TB/s against 1.86 chunked).
_BWD_SINGLE_PASS_MAX = 16384


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
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
    M, N, DW_GROUP, offset,
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
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset  # the scale; d/dw of it is 1
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
                    dy = dy * (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)[None, :]
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
                    wdy = dy * (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)[None, :]
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
BWD_KERNEL, DW_KERNEL = "rms_norm_bwd", "rms_norm_dw"
_BWD_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps", "programs_per_sm")
_DW_FIELDS = ("BLOCK_P", "BLOCK_N", "num_warps")

config_key = row_norm_config_key  # N<bucket>-add|norm-<dtype> ("add": dh fused)


# Backward launch table by row length (BLOCK_M rows per step, warps, persistent programs per SM),
# from the H200 sweep of 2026-11-30: 32768x4096 ran 3.85 TB/s at (2, 8, 2) against 2.74 at the first
# guess (1, 8, 4); 16384x8192 3.76 at (1, 4, 2). Short rows: 131072x1024 ran only 1.16 TB/s at
# (2, 4, 4) (too little in flight per loop step), so they take ~8K elements a step (unmeasured yet).
_BWD_TABLE = {1024: (8, 8, 4), 2048: (4, 8, 2), 4096: (2, 8, 2), 8192: (1, 4, 2), 16384: (1, 16, 2)}


@functools.cache
def default_config(n: int) -> dict:
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


def default_dw_config(n: int) -> dict:
    """The default dw reduction config: about 128+ programs (one per SM), each a column strip of at
    least 8 fp32 (one 32-byte sector a row) summed 4096 elements a step, so that all of a strip's
    partials (P <= 4 programs per SM) are in flight at once for N <= 4096. Unmeasured on the GPU; it
    replaces torch's sum(0) + .to(dtype), two launches."""
    block_n = max(8, min(64, next_pow2((n + 127) // 128)))
    return dict(BLOCK_P=4096 // block_n, BLOCK_N=block_n, num_warps=4)


def bwd_config(n: int, has_dh: bool, dtype: torch.dtype, device: torch.device | str | int | None = None) -> dict:
    """The backward's launch config (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps, programs_per_sm)."""
    return autotune.get_config(
        BWD_KERNEL, config_key(n, has_dh, dtype), device=device,
        default=lambda: default_config(n), fields=_BWD_FIELDS, check=covers_row(n),
    )  # fmt: skip


def dw_config(n: int, device: torch.device | str | int | None = None) -> dict:
    """The dw reduction's launch config (BLOCK_P, BLOCK_N, num_warps); its key is the N bucket."""
    return autotune.get_config(
        DW_KERNEL, f"N{autotune.bucket(n)}", device=device, default=lambda: default_dw_config(n), fields=_DW_FIELDS
    )


def candidate_configs(n: int, quick: bool = False) -> list[dict]:
    """The tuning sweep for rows of ``n`` (with programs per SM), the default first (it wins ties)."""
    out = [default_config(n)]
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


# The per-call launch plans (see rms_norm.py's): the autotune lookup happens here, never per call.
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
# Launcher (no autograd; inputs already checked; x, dy and dh as (M, N) with unit col stride)
# --------------------------------------------------------------------------------------------
def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dh: torch.Tensor | None = None,
    offset: float = 0.0,
    config: dict | None = None,
    programs_per_sm: int | None = None,
    fused_dw: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy, x (the normalized input: h when the residual was fused), dh (M, N) -> dx (M, N), dw (N,).

    ``offset`` is the forward's: dx sees the scale ``offset + weight``; dw does not depend on it.
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
            (sx[0], sdy[0], sdh[0], n, m, n, 0), (0.0,),
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
            (sx[0], sdy[0], sdh[0], n, m, n, group), (float(offset),),
        )  # fmt: skip
        return dx, dw
    programs = min(row_blocks, max_programs)
    partials = empty((programs, n), dtype=torch.float32, device=x.device)
    _bwd_launcher(
        (programs,), cfg, (x, weight, dy, dh if dh is not None else dy, rstd, dx, partials, partials, partials),
        (sx[0], sdy[0], sdh[0], n, m, n, 0), (float(offset),),
    )  # fmt: skip
    dw_cfg, dw_block_n = _dw_plan(n, device_index)
    _dw_launcher(((n + dw_block_n - 1) // dw_block_n,), dw_cfg, (partials, dw), (programs, n))
    return dx, dw


_bwd_launcher = Launcher(_rms_norm_bwd_kernel)
_dw_launcher = Launcher(_rms_norm_dw_kernel)


# --------------------------------------------------------------------------------------------
# Registration: the backward's custom op (rms_norm.py's forward op registers its autograd with it)
# --------------------------------------------------------------------------------------------
def _bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = rms_norm_bwd(dy, x, weight, rstd, dh, offset)
    return dx, (dw if dw is not None else x.new_empty(0))


_rms_norm_bwd_op = torch.library.custom_op("fuseformer::rms_norm_bwd", mutates_args=())(_bwd_impl)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, dh, offset=0.0):
    return torch.empty_like(x), (torch.empty_like(weight) if weight is not None else x.new_empty(0))
