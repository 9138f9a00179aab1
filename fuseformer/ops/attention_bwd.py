"""Flash attention backward (FlashAttention-2) in Triton: kernels, launcher and registration.

With p = exp(scale * q k^T - lse) recomputed tile by tile (never stored):

    delta = rowsum(o * do)                       (preprocess kernel; minus dlse when lse has a gradient)
    dv = p^T do        dp = do v^T        ds = p * (dp - delta)
    dk = scale * ds^T q                   dq = scale * ds k

The dk/dv kernel owns BLOCK_N key rows of one kv head and streams the q tiles that see them, for
every q head of its GQA group in turn, so the group sum of dk/dv stays in registers (no atomics).
dq comes from a second kernel that owns BLOCK_M q rows and streams key tiles (as the forward does):
deterministic, at the cost of recomputing q k^T and do v^T. (fp32 atomics of ds k from the dk/dv kernel,
5 matmuls per tile pair instead of 7, measured slower at hd 64: 2.89 against 2.32 ms for the whole
backward, run 39; removed in session 19 with FUSEFORMER_DETERMINISTIC, which only turned them off.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops import _gluon, attention_hopper
from fuseformer.ops._attention_common import (
    KernelConfig,
    _descriptor,
    _kv_bounds,
    _load_tile,
    _rows_view,
    _seq_strides,
    _unit_last,
    _use_tma,
    launch,
    resolve_config,
    tanh,
)
from fuseformer.ops._utils import empty, next_pow2

# The Gluon dK/dV kernel (ops/attention_hopper.py) for what the Gluon forward takes: run 84, the whole
# backward 362.7 -> 392.8 TFLOP/s (causal S4096), 397.2 -> 450.9 (full S16384). With it, dq from the
# Gluon dq kernel too at the head dims of attention_hopper.DQ_HEAD_DIMS (else the Triton dq kernel; hd 64
# keeps it: run 89): run 85, the causal S4096 backward 390.8 -> 418.0 TFLOP/s (dq 1547 -> 1343 µs), full
# S16384 450.1 -> 476.8. FUSEFORMER_GLUON=0 turns both off with the forward.
_GLUON_BWD = _gluon.ENABLED


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _flash_attention_bwd_preprocess_kernel(
    OUT, DO, DELTA, CU_Q,
    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
    seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """delta[b, h, i] = sum_d o * do in fp32; grid (cdiv(max Sq, BLOCK_M), Hq, B)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if IS_VARLEN:
        q_start = tl.load(CU_Q + b)
        sq = tl.load(CU_Q + b + 1) - q_start
        o_off = q_start.to(tl.int64) * stride_os
        do_off = q_start.to(tl.int64) * stride_dos
        l_off = q_start.to(tl.int64)
    else:
        sq = seqlen_q
        o_off = b.to(tl.int64) * stride_ob
        do_off = b.to(tl.int64) * stride_dob
        l_off = b.to(tl.int64) * stride_lb
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < sq
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    o = tl.load(OUT + o_off + h * stride_oh + rows64[:, None] * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + do_off + h * stride_doh + rows64[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + l_off + h * stride_lh + rows64, delta, mask=row_ok)


@triton.jit
def _load_row_stats(lse_ptrs, delta_ptrs, row_ok, MASK: tl.constexpr):
    """lse in log2 units (rows that saw no key: +inf, so p = 0 there) and delta, for BLOCK_M rows."""
    if MASK:
        lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    else:
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse2, delta


@triton.jit
def _padded_start(q_start, b):
    """Where sequence b's rows start in the padded per-row statistics of varlen: a multiple of 16
    at or after q_start, and at least one sequence's length past the previous start (the starts of
    b and b + 1 differ by at least len(b) since roundup16(cu[b]) + len(b) <= cu[b + 1] + 15)."""
    return ((q_start + 15) // 16) * 16 + 16 * b


@triton.jit
def _pad_stats_kernel(
    LSE, DELTA, LSE2_PAD, DELTA_PAD, CU_Q, stride_lh, stride_ph,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Varlen: lse (Hq, T) in log2 units (+inf for rows that saw no key) and delta into the padded
    (Hq, W) buffers (prefilled with +inf and 0) at _padded_start; grid (cdiv(max Sq, BLOCK_M), Hq, B)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    sq = tl.load(CU_Q + b + 1) - q_start
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < sq
    src = h.to(tl.int64) * stride_lh + q_start.to(tl.int64) + rows
    dst = h.to(tl.int64) * stride_ph + _padded_start(q_start, b).to(tl.int64) + rows
    lse2, delta = _load_row_stats(LSE + src, DELTA + src, ok, True)
    tl.store(LSE2_PAD + dst, lse2, mask=ok)
    tl.store(DELTA_PAD + dst, delta, mask=ok)


@triton.jit
def _dkdv_loop(
    dk, dv, k, v, Q, DO, q_base, do_base, lse_base, delta_base, q_offs, stride_qs, q_row0, q_col,
    cols, sq, sk, qk_scale, softcap, window_left, window_right, start, end,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, QD_DESC: tl.constexpr,
    PAD_STATS: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Accumulate dk, dv (BLOCK_N, BLOCK_D) fp32 over the q tiles [start, end) of one q head.

    PAD_STATS: lse_base/delta_base point into the padded varlen copies (16-aligned sequence starts,
    lse already in log2 units with +inf for rows that saw no key, every row of a tile in bounds and
    written): unmasked, aligned loads.

    q and do share one layout (the launcher makes them contiguous), so one int32 offset tile
    q_offs (BLOCK_M, BLOCK_D) serves both: fewer live registers in a kernel that spills easily.

    SOFTCAP: the scores are c * tanh(qk * qk_scale) (qk_scale = scale / cap, c = softcap = cap * log2(e)),
    and ds picks up the tanh's derivative 1 - tanh^2."""
    offs_m = tl.arange(0, BLOCK_M)
    d_ok = tl.arange(0, BLOCK_D) < HEAD_DIM
    diag = sk - sq
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < sq
        m64 = tl.cast(start_m, tl.int64)
        row_step = m64 * stride_qs
        # Loads inline (not through helpers): each nested jit call costs ms under the interpreter.
        if QD_DESC:  # TMA; rows past this sequence get p = 0 from the mask
            q = Q.load([q_row0 + start_m, q_col])  # (BLOCK_M, BLOCK_D)
            do = DO.load([q_row0 + start_m, q_col])
        elif MASK or HEAD_DIM != BLOCK_D:
            q = tl.load(q_base + row_step + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_base + row_step + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            q = tl.load(q_base + row_step + q_offs)
            do = tl.load(do_base + row_step + q_offs)
        if PAD_STATS:
            lse2 = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        else:
            if MASK:  # rows past the end: lse +inf, so p = 0
                lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
                delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
            else:
                lse = tl.load(lse_base + rows)
                delta = tl.load(delta_base + rows)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # saw no key: p = 0
        # The scale inside the exponent's FMA (qk * s - lse), the mask applied to p (for any sign of s).
        qk_t = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            th_t = tanh(qk_t * qk_scale)
            p_t = tl.math.exp2(th_t * softcap - lse2[None, :])
        else:
            p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if MASK:
            valid = (cols[:, None] < sk) & row_ok[None, :]
            if HAS_RIGHT:
                valid = valid & (cols[:, None] <= rows[None, :] + (diag + window_right))
            if HAS_LEFT:
                valid = valid & (cols[:, None] >= rows[None, :] + (diag - window_left))
            p_t = tl.where(valid, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            ds_t = (p_t * (dp_t - delta[None, :]) * (1.0 - th_t * th_t)).to(q.dtype)
        else:
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
    return dk, dv


@triton.jit
def _flash_attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, group_size, sm_scale, qk_scale, window_left, window_right, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    QD_DESC: tl.constexpr, PAD_STATS: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    # Grid (cdiv(max Sk, BLOCK_N), Hkv, B). Q, DO: pointers, or with QD_DESC TMA descriptors over
    # (rows, Hq * D) views (rows B * Sq, or Tq). PAD_STATS (varlen): LSE and DELTA are the padded
    # copies (_pad_stats_kernel), sequence b's rows starting at the multiple of 16 _padded_start(b).
    pid_n = tl.program_id(0)
    kv_h = tl.program_id(1)
    b = tl.program_id(2)
    if IS_VARLEN:
        q_start = tl.load(CU_Q + b)
        sq = tl.load(CU_Q + b + 1) - q_start
        q_row0 = q_start
        k_start = tl.load(CU_K + b)
        sk = tl.load(CU_K + b + 1) - k_start
        q_off = q_start.to(tl.int64) * stride_qs
        if PAD_STATS:
            l_off = tl.multiple_of(_padded_start(q_start, b).to(tl.int64), 16)
        else:
            l_off = q_start.to(tl.int64)
        k_off = k_start.to(tl.int64) * stride_ks
    else:
        sq = seqlen_q
        sk = seqlen_k
        q_row0 = b * seqlen_q
        q_off = b.to(tl.int64) * stride_qb
        l_off = b.to(tl.int64) * stride_lb
        k_off = b.to(tl.int64) * stride_kb
    n0 = pid_n * BLOCK_N
    if n0 >= sk:
        return
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < sk
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # k, v, dk, dv share one layout, as do q, do, dq (the launcher makes them so).
    kv_offs = k_off + kv_h * stride_kh + cols.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
    k = _load_tile(K + kv_offs, col_ok, d_ok, True, EVEN_D)
    v = _load_tile(V + kv_offs, col_ok, d_ok, True, EVEN_D)
    q_offs = tl.arange(0, BLOCK_M)[:, None] * stride_qs + offs_d[None, :]  # int32 (BLOCK_M, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query rows that see some key of this block: i >= j - diag - right and i <= j - diag + left.
    diag = sk - sq
    lo = 0
    hi = sq
    if HAS_RIGHT:
        lo = (tl.maximum(n0 - diag - window_right, 0) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(hi, tl.maximum(n0 + BLOCK_N - 1 - diag + window_left + 1, 0))
    for g in range(0, group_size):
        h = kv_h * group_size + g
        head_off = q_off + h * stride_qh
        if QD_DESC:
            q_base = 0
            do_base = 0
        else:
            q_base = Q + head_off
            do_base = DO + head_off
        lse_base = LSE + l_off + h * stride_lh
        delta_base = DELTA + l_off + h * stride_lh
        # One masked loop over every visible q tile. An unmasked middle loop for the tiles that see
        # the whole key block (as the forward has) measured slower (run 43: 331-336 against 348-355
        # TFLOP/s at hd 128, 280 against 289 at hd 64; and it spilled at 64x128, hd 128).
        dk, dv = _dkdv_loop(
            dk, dv, k, v, Q, DO, q_base, do_base, lse_base, delta_base, q_offs, stride_qs,
            q_row0, h * HEAD_DIM,
            cols, sq, sk, qk_scale, softcap, window_left, window_right, lo, hi,
            True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_M, QD_DESC, PAD_STATS, SOFTCAP,
        )  # fmt: skip

    mask = col_ok[:, None] & d_ok[None, :]
    tl.store(DK + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_loop(
    dq, q, do, lse2, delta, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
    qk_scale, softcap, window_left, window_right, start, end,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, KV_DESC: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Accumulate dq (BLOCK_M, BLOCK_D) fp32 (without the scale) over the key blocks [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = tl.arange(0, BLOCK_D) < HEAD_DIM
    diag = sk - sq
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < sk
        n64 = tl.cast(start_n, tl.int64)
        if KV_DESC:  # TMA; rows past this sequence are masked (K) or meet p = 0 (V)
            k = K.load([kv_row0 + start_n, kv_col])  # (BLOCK_N, BLOCK_D)
            v = V.load([kv_row0 + start_n, kv_col])
        elif MASK or HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs + n64 * stride_ks, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs + n64 * stride_vs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs + n64 * stride_ks)
            v = tl.load(v_ptrs + n64 * stride_vs)
        qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N); the scale goes into exp2's FMA
        if SOFTCAP:  # as in _dkdv_loop
            th = tanh(qk * qk_scale)
            p = tl.math.exp2(th * softcap - lse2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASK:
            valid = col_ok[None, :]
            if HAS_RIGHT:
                valid = valid & (cols[None, :] <= rows[:, None] + (diag + window_right))
            if HAS_LEFT:
                valid = valid & (cols[None, :] >= rows[:, None] + (diag - window_left))
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        if SOFTCAP:
            ds = (p * (dp - delta[:, None]) * (1.0 - th * th)).to(k.dtype)
        else:
            ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq)
    return dq


@triton.jit
def _flash_attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, group_size, sm_scale, qk_scale, window_left, window_right, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KV_DESC: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    # Grid (cdiv(max Sq, BLOCK_M), Hq, B), heaviest blocks first when causal (as the forward).
    pid_m = tl.program_id(0)
    if HAS_RIGHT:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    if IS_VARLEN:
        q_start = tl.load(CU_Q + b)
        sq = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        sk = tl.load(CU_K + b + 1) - k_start
        kv_row0 = k_start
        q_off = q_start.to(tl.int64) * stride_qs
        do_off = q_start.to(tl.int64) * stride_dos
        dq_off = q_start.to(tl.int64) * stride_dqs
        l_off = q_start.to(tl.int64)
        k_off = k_start.to(tl.int64) * stride_ks
        v_off = k_start.to(tl.int64) * stride_vs
    else:
        sq = seqlen_q
        sk = seqlen_k
        kv_row0 = b * seqlen_k
        q_off = b.to(tl.int64) * stride_qb
        do_off = b.to(tl.int64) * stride_dob
        dq_off = b.to(tl.int64) * stride_dqb
        l_off = b.to(tl.int64) * stride_lb
        k_off = b.to(tl.int64) * stride_kb
        v_off = b.to(tl.int64) * stride_vb
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    kv_h = h // group_size
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < sq
    rows64 = rows.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = _load_tile(
        Q + q_off + h * stride_qh + rows64[:, None] * stride_qs + offs_d[None, :], row_ok, d_ok, True, EVEN_D
    )
    do = _load_tile(
        DO + do_off + h * stride_doh + rows64[:, None] * stride_dos + offs_d[None, :], row_ok, d_ok, True, EVEN_D
    )
    lse2, delta = _load_row_stats(
        LSE + l_off + h * stride_lh + rows64, DELTA + l_off + h * stride_lh + rows64, row_ok, True
    )
    if KV_DESC:
        k_ptrs = 0
        v_ptrs = 0
    else:
        k_ptrs = K + k_off + kv_h * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = V + v_off + kv_h * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _kv_bounds(m0, sq, sk, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_LEFT:
        dq = _dq_loop(
            dq, q, do, lse2, delta, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_h * HEAD_DIM, rows, sq, sk,
            qk_scale, softcap, window_left, window_right, lo, full_lo,
            True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, SOFTCAP,
        )  # fmt: skip
    dq = _dq_loop(
        dq, q, do, lse2, delta, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_h * HEAD_DIM, rows, sq, sk,
        qk_scale, softcap, window_left, window_right, full_lo, full_hi,
        False, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, SOFTCAP,
    )  # fmt: skip
    dq = _dq_loop(
        dq, q, do, lse2, delta, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_h * HEAD_DIM, rows, sq, sk,
        qk_scale, softcap, window_left, window_right, full_hi, hi,
        True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, SOFTCAP,
    )  # fmt: skip
    dq_ptrs = DQ + dq_off + h * stride_dqh + rows64[:, None] * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def flash_attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float = 0.0,
    *,
    gluon: bool = True,
    dkdv_config: dict | None = None,
    dq_config: dict | None = None,
    gluon_dq_config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher. dout, out like q; lse from the forward; dlse (lse's gradient) or None;
    ``softcap`` as the forward's (> 0: the Triton kernels, with the tanh's derivative in ds).

    Returns dq, dk, dv shaped like q, k, v (contiguous). ``gluon=False`` keeps the Triton kernels where
    the Gluon ones would run. ``dkdv_config``, ``dq_config``: KernelConfig fields put on the looked-up
    configs of the Triton dk/dv and dq kernels, which then run (tuning, sweeps, tests);
    ``gluon_dq_config`` goes to the Gluon dq kernel where it runs (sweeps).
    """
    varlen = cu_seqlens_q is not None
    # The dk/dv kernel reads q, do (and writes dq) with one set of strides, and k, v (dk, dv) with
    # another: contiguous copies where needed (one pass of bytes, small next to the backward).
    dout, q, k, v = (t.contiguous() for t in (dout, q, k, v))
    out = _unit_last(out)
    d = q.shape[-1]
    hq, hkv = q.shape[-2], k.shape[-2]
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    if varlen:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k
        lse_strides = (0, lse.stride(0))
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lse_strides = (lse.stride(0), lse.stride(1))
    if batch == 0 or q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = max(16, next_pow2(d))
    cu_q = cu_seqlens_q if varlen else lse
    cu_k = cu_seqlens_k if varlen else lse
    flags = dict(HEAD_DIM=d, BLOCK_D=block_d, IS_VARLEN=varlen)
    window = dict(HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0)
    bounded = window_left >= 0 or window_right >= 0

    delta = empty(lse.shape, dtype=torch.float32, device=q.device)
    pre_block = max(16, min(128, 8192 // block_d))
    _flash_attention_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, pre_block), hq, batch)](
        out, dout, delta, cu_q,
        *_seq_strides(out, varlen), *_seq_strides(dout, varlen), *lse_strides,
        seqlen_q, **flags, BLOCK_M=pre_block, num_warps=4,
    )  # fmt: skip
    if dlse is not None:
        # d lse / d s = p, so lse's gradient enters ds = p * (dp - delta) as delta - dlse.
        delta = delta - dlse.float()

    # The Gluon dK/dV kernel where the Gluon forward applies (dq then from the separate dq kernel).
    # Soft-capping: the Triton kernels only (the Gluon ones have none).
    capped = softcap > 0
    gluon = gluon and not capped and dkdv_config is None and dq_config is None
    gluon = gluon and _GLUON_BWD and attention_hopper.usable(q, k, v, varlen, window_left, window_right, softmax_scale)
    qk_scale = softmax_scale / softcap if capped else softmax_scale * 1.4426950408889634
    common = (seqlen_q, seqlen_k, hq // hkv, softmax_scale, qk_scale, window_left, window_right,
              softcap * 1.4426950408889634 if capped else 0.0)  # fmt: skip
    # TMA descriptors (see attention._use_tma): q, do streamed by the dk/dv kernel; k, v by the dq kernel.
    tma = _use_tma(q)
    q_view, do_view = (_rows_view(q, varlen), _rows_view(dout, varlen)) if tma else (None, None)
    k_view, v_view = (_rows_view(k, varlen), _rows_view(v, varlen)) if tma else (None, None)
    qd_desc = q_view is not None and do_view is not None
    # Varlen: the dk/dv kernel reads lse and delta from padded copies whose sequences start at
    # multiples of 16 (aligned, unmasked loads; run 40: dk/dv 30% slower without at the training
    # shape). W covers every row a BLOCK_M tile can touch past a sequence's padded start.
    pad_stats = varlen
    if pad_stats:
        width = ((q.shape[0] + 16 * batch + 16 + 2 * 128) + 15) // 16 * 16
        lse_pad = torch.full((hq, width), float("inf"), dtype=torch.float32, device=q.device)
        delta_pad = torch.zeros((hq, width), dtype=torch.float32, device=q.device)
        _pad_stats_kernel[(triton.cdiv(seqlen_q, 128), hq, batch)](
            lse, delta, lse_pad, delta_pad, cu_q, lse.stride(0), width, BLOCK_M=128, num_warps=4
        )
        dkdv_stats = (lse_pad, delta_pad, 0, width)
    else:
        dkdv_stats = (lse, delta, *lse_strides)
    kv_desc = k_view is not None and v_view is not None
    dkdv_rest = (
        dkdv_stats[0], dkdv_stats[1], dk, dv, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *dkdv_stats[2:], *common,
    )  # fmt: skip

    def dkdv_args(c: KernelConfig) -> tuple:
        if qd_desc:
            return (_descriptor(q_view, c.BLOCK_M, block_d), k, v, _descriptor(do_view, c.BLOCK_M, block_d), *dkdv_rest)
        return (q, k, v, dout, *dkdv_rest)

    if gluon:
        attention_hopper.backward_dkdv(q, k, v, dout, lse, delta, softmax_scale, window_right == 0, dk=dk, dv=dv)
    else:
        launch(
            _flash_attention_bwd_dkdv_kernel,
            lambda c: (triton.cdiv(seqlen_k, c.BLOCK_N), hkv, batch),
            resolve_config("bwd_dkdv", dkdv_config, block_d, bounded, q.dtype, q.device),
            dkdv_args,
            dict(**flags, **window, QD_DESC=qd_desc, PAD_STATS=pad_stats, SOFTCAP=capped),
            key=(q.dtype, d, varlen, qd_desc, pad_stats, capped, tuple(window.items())),
        )
    if gluon and q.shape[-1] in attention_hopper.DQ_HEAD_DIMS:
        attention_hopper.backward_dq(
            q, k, v, dout, lse, delta, softmax_scale, window_right == 0, config=gluon_dq_config, dq=dq
        )
        return dq, dk, dv
    dq_rest = (
        dout, lse, delta, dq, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(dout, varlen), *_seq_strides(dq, varlen), *lse_strides, *common,
    )  # fmt: skip

    def dq_args(c: KernelConfig) -> tuple:
        if kv_desc:
            return (q, _descriptor(k_view, c.BLOCK_N, block_d), _descriptor(v_view, c.BLOCK_N, block_d), *dq_rest)
        return (q, k, v, *dq_rest)

    launch(
        _flash_attention_bwd_dq_kernel,
        lambda c: (triton.cdiv(seqlen_q, c.BLOCK_M), hq, batch),
        resolve_config("bwd_dq", dq_config, block_d, bounded, q.dtype, q.device),
        dq_args,
        dict(**flags, **window, KV_DESC=kv_desc, SOFTCAP=capped),
        key=(q.dtype, d, varlen, kv_desc, capped, tuple(window.items())),
    )
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# torch.library registration (the forward's autograd calls this op)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fuseformer::flash_attention_bwd", mutates_args=())
def flash_attention_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attention_bwd(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
    )  # fmt: skip


@flash_attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, left, right, softcap=0.0):
    fmt = torch.contiguous_format
    return (
        torch.empty_like(q, memory_format=fmt),
        torch.empty_like(k, memory_format=fmt),
        torch.empty_like(v, memory_format=fmt),
    )
