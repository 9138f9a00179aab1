"""Flash attention (FlashAttention-2) forward in Triton, the reference, registration and the public op.

    out = softmax(scale * q k^T + mask) v            lse = logsumexp(scale * q k^T + mask)

Layouts follow flash-attn: batched q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D); packed varlen q (Tq, Hq, D),
k/v (Tk, Hkv, D) with ``cu_seqlens_q/k`` (B + 1,) int32 offsets. GQA/MQA: q head h reads kv head
h // (Hq // Hkv). lse is (B, Hq, Sq) fp32, or (Hq, Tq) for varlen.

Masking, per sequence, as flash-attn 2.1+ does it (bottom-right aligned when Sq != Sk): query row i
sees key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``, with left/right = -1 unbounded and
causal meaning right = 0. Rows that see no key (causal with Sq > Sk, windows, empty sequences) give
out = 0 and lse = -inf (the logsumexp of nothing, what torch.logsumexp gives; flash-attn's CUDA
kernel writes +inf there). Their gradients are zero.

The forward kernel (FlashAttention-2): one program per (BLOCK_M query rows, q head, batch); K/V tiles
streamed through an online softmax in fp32 using exp2 with the scale folded into log2(e); the score
matrix never reaches HBM. Key blocks are split in three runs: blocks every row of the tile fully
sees go through the loop without masks; blocks on the causal diagonal, the window edges or the
sequence end go through the masked loop; blocks no row sees are never visited.

The backward (``attention_bwd.py``): delta = rowsum(o * do); dk/dv by a kernel looping over q tiles
per k tile (and over the q heads of its GQA group, so the group sum stays in registers); dq by a
separate kernel over k tiles (deterministic).

Head dims up to 256 run in the kernel, padded to the next power of two with masks. fp16 and bf16
run in the kernel; fp32/fp64 run on the reference. Streamed tiles come through TMA descriptors
on sm_90+ when the layout allows one (``_use_tma``), else through pointer loads. Block sizes come
from the autotune cache (``kernel_config``; ``attention_fwd``, ``attention_bwd_dkdv``, ``attention_bwd_dq``
keyed by padded head dim, causal/full and dtype), whose defaults are the per-head-dim tables below,
overridable with ``CONFIG_OVERRIDES`` (the tuner's ``tuning_config``); a config that does not fit
falls back.
Varlen rows past ``cu_seqlens_q[-1]`` (and their gradients) are not written, as in flash-attn.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from fuseformer.ops import _gluon, attention_hopper
from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    autograd_function,
    check_tensor,
    dispatch,
    empty,
    float_dtype_of,
    next_pow2,
    read_offsets,
)
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import INTERPRET, choose_backend

_OP = "flash_attention"
MAX_HEAD_DIM = 256
_ATTN_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def attention_mask(
    seqlen_q: int, seqlen_k: int, causal: bool, window_size: tuple[int, int], device: torch.device | str
) -> torch.Tensor:
    """(Sq, Sk) bool, True where query row i sees key j (bottom-right aligned, flash-attn's rule)."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    diag = seqlen_k - seqlen_q
    valid = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        valid &= cols <= rows + diag + right
    if left >= 0:
        valid &= cols >= rows + diag - left
    return valid


def _ref_batched(q, k, v, causal, scale, window_size, upcast):
    """(B, Sq, Hq, D), (B, Sk, Hkv, D) -> out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) fp32 (fp64)."""
    dtype = q.dtype
    compute = float_dtype_of(q) if upcast else dtype
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    group = q.shape[2] // k.shape[2]
    if group > 1:
        kc = kc.repeat_interleave(group, dim=2)
        vc = vc.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * scale  # (B, Hq, Sq, Sk)
    valid = attention_mask(q.shape[1], k.shape[1], causal, window_size, q.device)
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key: softmax gives NaN there; the masked_fill turns them into zeros (and its
    # backward zeroes their gradient).
    p = torch.softmax(scores, dim=-1).masked_fill(~valid, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(vc.dtype), vc)
    return out.to(dtype), lse.to(float_dtype_of(q))


def flash_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    upcast: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch attention with explicit masks; same arguments and results as :func:`flash_attention`.

    Computes in fp32 (fp64 stays fp64) when ``upcast``, else in q's dtype (the low-precision baseline
    of the tests). Materializes the (B, Hq, Sq, Sk) scores. Varlen runs one sequence at a time.
    """
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    window = (int(window_size[0]), int(window_size[1]))
    if cu_seqlens_q is None:
        out, lse = _ref_batched(q, k, v, causal, scale, window, upcast)
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for b in range(len(cq) - 1):
            qb, kb, vb = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
            o, lse_b = _ref_batched(qb[None], kb[None], vb[None], causal, scale, window, upcast)
            outs.append(o[0])
            lses.append(lse_b[0])  # (Hq, s)
        out = torch.cat(outs, 0) if outs else q.new_empty((0, *q.shape[1:]))
        lse = torch.cat(lses, 1) if lses else q.new_empty((q.shape[1], 0), dtype=float_dtype_of(q))
        tail = q.shape[0] - out.shape[0]  # rows after cu_seqlens_q[-1] belong to no sequence
        if tail:
            out = torch.cat([out, out.new_zeros((tail, *q.shape[1:]))], 0)
            lse = torch.cat([lse, lse.new_full((q.shape[1], tail), float("-inf"))], 1)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# Kernel helpers (shared with attention_bwd.py)
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; masked rows and padded head-dim columns read 0 (never a gap)."""
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _kv_bounds(
    m0, sq, sk, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):  # fmt: skip
    """Key blocks for the query rows [m0, m0 + BLOCK_M): lo <= full_lo <= full_hi <= hi.

    [full_lo, full_hi) every row sees entirely (no mask); [lo, full_lo) and [full_hi, hi) are
    partly visible (masked); keys outside [lo, hi) no row sees (skipped).
    """
    diag = sk - sq
    m_last = m0 + BLOCK_M - 1
    lo = 0
    hi = sk
    full_lo = 0
    full_hi = (sk // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = (tl.maximum(m0 + diag - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(m_last + diag - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(m_last + diag + window_right + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + diag + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    no_full = full_hi <= full_lo
    full_lo = tl.where(no_full, lo, full_lo)
    full_hi = tl.where(no_full, lo, full_hi)
    return lo, full_lo, full_hi, hi


# --------------------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_loop(
    acc, l_i, m_i, q, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
    qk_scale, window_left, window_right, start, end,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, KV_DESC: tl.constexpr,
    WS: tl.constexpr, FOLD_SCALE: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [start, end). acc (BLOCK_M, BLOCK_D) fp32; l_i, m_i (BLOCK_M,)
    running sum and max of the scores in log2 units. MASK: apply the causal/window/length mask.
    WS: warp-specialize the loop (Triton's producer/consumer warp groups; TMA loads only).
    FOLD_SCALE (qk_scale > 0): the scale goes into one FMA with the max subtraction, qk * s - m,
    instead of a multiply of the whole tile and then a subtraction (the row max of the raw scores
    times s is the max of the scaled ones when s > 0). Run 39 (H200): +2.9% at hd 128 full, +3% at hd
    64, level at hd 128 causal; a zero or negative scale takes the multiply."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = tl.arange(0, BLOCK_D) < HEAD_DIM
    diag = sk - sq
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        cols = start_n + offs_n
        col_ok = cols < sk
        n64 = tl.cast(start_n, tl.int64)
        # Loads inline (not through _load_tile): each nested jit call costs ms under the interpreter.
        if KV_DESC:  # TMA: rows past this sequence are masked below (K) or meet p = 0 (V)
            k = K.load([kv_row0 + start_n, kv_col])  # (BLOCK_N, BLOCK_D)
        elif MASK or HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs + n64 * stride_ks, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs + n64 * stride_ks)
        qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N)
        if not FOLD_SCALE:
            qk = qk * qk_scale  # log2 units
        if MASK:
            valid = col_ok[None, :]
            if HAS_RIGHT:
                valid = valid & (cols[None, :] <= rows[:, None] + (diag + window_right))
            if HAS_LEFT:
                valid = valid & (cols[None, :] >= rows[:, None] + (diag - window_left))
            qk = tl.where(valid, qk, float("-inf"))
        if FOLD_SCALE:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASK:
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        if FOLD_SCALE:
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        else:
            p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_DESC:
            v = V.load([kv_row0 + start_n, kv_col])
        elif MASK or HEAD_DIM != BLOCK_D:
            v = tl.load(v_ptrs + n64 * stride_vs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs + n64 * stride_vs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_attention_fwd_kernel(
    Q, K, V, OUT, LSE, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, group_size, qk_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KV_DESC: tl.constexpr,
    WS: tl.constexpr, FOLD_SCALE: tl.constexpr = True,
):  # fmt: skip
    # K, V: pointers, or with KV_DESC TMA descriptors over (rows, Hkv * D) views (rows B * Sk, or Tk).
    # Grid (cdiv(max Sq, BLOCK_M), Hq, B). With a right bound (causal) the heaviest query blocks
    # (the last ones) start first, so the short ones fill the tail of the wave.
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
        k_off = k_start.to(tl.int64) * stride_ks
        v_off = k_start.to(tl.int64) * stride_vs
        o_off = q_start.to(tl.int64) * stride_os
        l_off = q_start.to(tl.int64)
    else:
        sq = seqlen_q
        sk = seqlen_k
        kv_row0 = b * seqlen_k
        q_off = b.to(tl.int64) * stride_qb
        k_off = b.to(tl.int64) * stride_kb
        v_off = b.to(tl.int64) * stride_vb
        o_off = b.to(tl.int64) * stride_ob
        l_off = b.to(tl.int64) * stride_lb
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    kv_h = h // group_size

    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < sq
    rows64 = rows.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    q_ptrs = Q + q_off + h * stride_qh + rows64[:, None] * stride_qs + offs_d[None, :]
    q = _load_tile(q_ptrs, row_ok, d_ok, True, EVEN_D)  # (BLOCK_M, BLOCK_D)
    if KV_DESC:
        k_ptrs = 0
        v_ptrs = 0
    else:
        k_ptrs = K + k_off + kv_h * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = V + v_off + kv_h * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :]
    kv_col = kv_h * HEAD_DIM

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _kv_bounds(m0, sq, sk, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_LEFT:  # partly visible blocks at the window's left edge
        acc, l_i, m_i = _fwd_loop(
            acc, l_i, m_i, q, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
            qk_scale, window_left, window_right, lo, full_lo,
            True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, False, FOLD_SCALE,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
        qk_scale, window_left, window_right, full_lo, full_hi,
        False, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, WS, FOLD_SCALE,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
        qk_scale, window_left, window_right, full_hi, hi,
        True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, False, FOLD_SCALE,
    )  # fmt: skip

    # Rows that saw no key: l = 0, acc = 0 -> out 0, lse -inf.
    empty_row = l_i == 0.0
    out = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.math.log2(l_i)) * 0.6931471805599453)
    o_ptrs = OUT + o_off + h * stride_oh + rows64[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + l_off + h * stride_lh + rows64, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Launch configuration: a table per padded head dim, overridable for sweeps
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Block sizes and launch options of one attention kernel."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    # Forward only: warp-specialize the unmasked key loop (tl.range(..., warp_specialize=True)).
    warp_specialize: int = 0


# Starting points for the H100/H200 (sm_90), keyed by the padded head dim (BLOCK_D); not yet timed
# on the H200 (benchmarks/sweeps.py has the ``attention`` sweep for that). Chosen so that ptxas
# (Triton 3.6, sm_90a, bf16, offline compile) reports no register spills:
# fwd with TMA K/V: hd 64 128x128/3 stages 171 regs; hd 128 128x128/2 stages 206 regs, 161 KiB smem
# (3 stages: 225 KiB, just fits); hd 256 128x64/2 stages 232 regs. Pointer loads (no TMA) need more:
# hd 128 128x128 reaches 255 regs with a few bytes of spill, 128x64/3 stages 182 regs.
# H200 sweep (2026-11-30, bf16, B*S 16384, H 32, hd 128; docs/perf-notes.md): causal S4096 best at
# 128x128/8 warps/3 stages (451 TFLOP/s; 2 stages ~400), full S16384 at 128x64/4 warps/2 stages (510;
# 128x128/8/2: 440). Warp specialization (tl.range(..., warp_specialize=True)) did not help (440, 495).
# hd 64: causal 64x128/4/2 401 (128x128/8/3: 312), full 128x128/4/3 425 (375).
_FWD_TABLE = {
    16: KernelConfig(128, 64, 4, 3),
    32: KernelConfig(128, 64, 4, 3),
    64: KernelConfig(64, 128, 4, 2),
    128: KernelConfig(128, 128, 8, 3),
    256: KernelConfig(128, 64, 8, 2),
}
# Without a causal/window bound (every key block unmasked), where the sweep chose differently.
_FWD_FULL_TABLE = {64: KernelConfig(128, 128, 4, 3), 128: KernelConfig(128, 64, 4, 2)}
# dk/dv: BLOCK_N key rows accumulate dk, dv (2 x BLOCK_N x BLOCK_D fp32) while BLOCK_M q rows stream.
# ptxas: hd 64 64x128: 234 regs; hd 128 32x128: 254 regs (64x128 spills 108 B); hd 256 32x64: 40 B spill.
# H200 sweep, causal S4096 hd 128: 64x64/4 warps 330 TFLOP/s over the whole backward (32x128/8: 274);
# hd 64: 32x64/4 280 (64x128/8: 240).
_BWD_DKDV_TABLE = {
    16: KernelConfig(64, 128, 8, 2),
    32: KernelConfig(64, 128, 8, 2),
    64: KernelConfig(32, 64, 4, 2),
    128: KernelConfig(64, 64, 4, 2),
    256: KernelConfig(32, 64, 8, 2),
}
# dq: BLOCK_M q rows accumulate dq while BLOCK_N key rows stream. ptxas: hd 128 198-230 regs.
# H200 sweep, causal S4096 hd 128: 64x64/4 warps 293 (with the old dk/dv config; 128x64/8: 273);
# hd 64: 64x64/4 252 (128x64/8: 241).
_BWD_DQ_TABLE = {
    16: KernelConfig(128, 64, 8, 2),
    32: KernelConfig(128, 64, 8, 2),
    64: KernelConfig(64, 64, 4, 2),
    128: KernelConfig(64, 64, 4, 2),
    256: KernelConfig(64, 64, 8, 2),
}
# Under the interpreter: small, unequal blocks so that CPU-sized tests cross several of them.
_INTERPRET_CONFIGS = {
    "fwd": KernelConfig(32, 16, 4, 1),
    "bwd_dkdv": KernelConfig(16, 32, 4, 1),
    "bwd_dq": KernelConfig(32, 16, 4, 1),
}
_TABLES = {"fwd": _FWD_TABLE, "bwd_dkdv": _BWD_DKDV_TABLE, "bwd_dq": _BWD_DQ_TABLE}

# The tuner's config (``tuning_config``) replaces the cached one's fields for every head dim while set.
CONFIG_OVERRIDES: dict[str, dict[str, int]] = {"fwd": {}, "bwd_dkdv": {}, "bwd_dq": {}}


# The autotune cache's kernel names (runtime/autotune.py); a stored config has every KernelConfig field.
KERNELS = {"fwd": "attention_fwd", "bwd_dkdv": "attention_bwd_dkdv", "bwd_dq": "attention_bwd_dq"}
_FIELDS = KernelConfig.__slots__


def config_key(block_d: int, bounded: bool, dtype: torch.dtype) -> str:
    """The autotune key: padded head dim, ``causal`` (a causal or window bound: masked diagonal
    blocks) or ``full``, dtype."""
    return f"D{block_d}-{'causal' if bounded else 'full'}-{autotune.dtype_name(dtype)}"


def _default_config(kind: str, block_d: int, bounded: bool) -> KernelConfig:
    """The tables above (the interpreter's small configs under TRITON_INTERPRET=1)."""
    if INTERPRET:
        return _INTERPRET_CONFIGS[kind]
    if kind == "fwd" and not bounded and block_d in _FWD_FULL_TABLE:
        return _FWD_FULL_TABLE[block_d]
    return _TABLES[kind][block_d]


@autotune.plan_cache
def cached_config(
    kind: str, block_d: int, bounded: bool, dtype: torch.dtype, device: torch.device | str | None = None
) -> KernelConfig:
    """The config of ``kind`` before overrides: the autotune cache's for (block_d, bounded, dtype) on
    ``device``, else the default; looked up once per such tuple."""
    stored = autotune.get_config(KERNELS[kind], config_key(block_d, bounded, dtype), device=device, fields=_FIELDS)
    return KernelConfig(**stored) if stored is not None else _default_config(kind, block_d, bounded)


def kernel_config(
    kind: str,
    block_d: int,
    bounded: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> KernelConfig:
    """The config of kernel ``kind`` ("fwd", "bwd_dkdv", "bwd_dq") for padded head dim ``block_d``;
    ``bounded``: a causal or window bound (masked diagonal blocks) rather than full attention.

    The cached lookup (:func:`cached_config`), then ``CONFIG_OVERRIDES`` on top (the tuner's
    :func:`tuning_config`), read on every call."""
    cfg = cached_config(kind, block_d, bounded, dtype, device)
    fields = CONFIG_OVERRIDES.get(kind)
    return replace(cfg, **fields) if fields else cfg


def _fallbacks(cfg: KernelConfig):
    """cfg, then fewer stages, then smaller blocks: what to try when a config runs out of shared memory."""
    seen = []
    for stages in range(cfg.num_stages, 0, -1):
        seen.append(replace(cfg, num_stages=stages))
    if cfg.BLOCK_N > 32:
        seen.append(replace(cfg, BLOCK_N=cfg.BLOCK_N // 2, num_stages=min(cfg.num_stages, 2)))
    if cfg.BLOCK_M > 32:
        seen.append(replace(cfg, BLOCK_M=cfg.BLOCK_M // 2, BLOCK_N=max(32, cfg.BLOCK_N // 2), num_stages=1))
    return seen


# (kernel name, requested config, constexpr key) -> the config that fit, so a failed config is tried once.
_FITTED: dict[tuple, KernelConfig] = {}


def launch(kernel, grid_fn, cfg: KernelConfig, args, consts: dict, key: tuple) -> KernelConfig:
    """Launch ``kernel`` with ``cfg``; if it does not fit (OutOfResources), with the next fallback.

    ``args``: the positional arguments, or a function of the config returning them (descriptors
    carry the block shape)."""
    full_key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), cfg, key)
    candidates = [_FITTED[full_key]] if full_key in _FITTED else _fallbacks(cfg)
    error = None
    for c in candidates:
        try:
            kernel[grid_fn(c)](
                *(args(c) if callable(args) else args),
                **consts,
                BLOCK_M=c.BLOCK_M,
                BLOCK_N=c.BLOCK_N,
                num_warps=c.num_warps,
                num_stages=c.num_stages,
            )
        except OutOfResources as exc:
            error = exc
            continue
        _FITTED[full_key] = c
        return c
    raise error


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs checked by the caller; unit stride in the head dim)
# --------------------------------------------------------------------------------------------
def _seq_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, S, H, D) or packed (T, H, D) tensor."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# The forward streams K and V through TMA descriptors (sm_90+, and the interpreter) when their
# layout allows: one async bulk copy per tile instead of per-thread address math and loads.
def _use_tma(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return torch.cuda.get_device_capability(t.device)[0] >= 9
    return INTERPRET


def _rows_view(t: torch.Tensor, varlen: bool) -> torch.Tensor | None:
    """(B, S, H, D) or (T, H, D) as a (rows, H * D) matrix view (row b * S + s, or t), when the layout
    allows one and a TMA descriptor (16-byte aligned base and row stride); else None."""
    h, d = t.shape[-2], t.shape[-1]
    if t.numel() == 0 or t.stride(-1) != 1 or (h > 1 and t.stride(-2) != d):
        return None
    if d & (d - 1):
        # A padded head dim (59 -> 64) would make each tile's box run into the next head's columns;
        # on the H200 the dk/dv kernel hit an illegal instruction there (hd 59, run 4): pointer loads.
        return None
    if varlen:
        rows, row_stride = t.shape[0], t.stride(0)
    elif t.shape[1] == 1:
        rows, row_stride = t.shape[0], t.stride(0)
    elif t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1):
        rows, row_stride = t.shape[0] * t.shape[1], t.stride(1)
    else:
        return None
    if (row_stride * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return t.as_strided((rows, h * d), (row_stride, 1))


def _descriptor(view: torch.Tensor, block_rows: int, block_d: int) -> TensorDescriptor:
    return TensorDescriptor(view, list(view.shape), [view.stride(0), 1], [block_rows, block_d])


# The Gluon forward (ops/attention_hopper.py) for the cases it takes (sm_90, hd 64 or 128, batched,
# equal lengths a multiple of 128, causal or full): 1.2-1.23x this module's kernel on the goal shapes and
# ahead of cuDNN (run 82). FUSEFORMER_GLUON=0 turns it off.
_GLUON_FWD = _gluon.ENABLED


def flash_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    *,
    gluon: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher: q (B, Sq, Hq, D) / (Tq, Hq, D), k, v (B, Sk, Hkv, D) / (Tk, Hkv, D), fp16 or bf16.

    window_right = 0 is causal; -1 unbounded. Varlen when ``cu_seqlens_q`` is given (then
    ``max_seqlen_q/k`` must bound every sequence). Returns out like q (contiguous) and lse fp32
    (B, Hq, Sq) or (Hq, Tq). ``gluon=False`` keeps the Triton kernel where the Gluon one would run
    (sweeps and tests compare the two).
    """
    varlen = cu_seqlens_q is not None
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    d = q.shape[-1]
    hq, hkv = q.shape[-2], k.shape[-2]
    out = empty(q.shape, dtype=q.dtype, device=q.device)
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        lse = empty((hq, q.shape[0]), dtype=torch.float32, device=q.device)
        lse_strides = (0, lse.stride(0))
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lse = empty((batch, hq, seqlen_q), dtype=torch.float32, device=q.device)
        lse_strides = (lse.stride(0), lse.stride(1))
    # Varlen rows after cu_seqlens_q[-1] belong to no sequence; no program writes them (as flash-attn).
    if q.numel() == 0 or batch == 0 or seqlen_q == 0:
        return out, lse
    if gluon and _GLUON_FWD and attention_hopper.usable(q, k, v, varlen, window_left, window_right, softmax_scale):
        return attention_hopper.forward(q, k, v, softmax_scale, causal=window_right == 0, out=out, lse=lse)
    block_d = max(16, next_pow2(d))
    cfg = kernel_config("fwd", block_d, window_left >= 0 or window_right >= 0, q.dtype, q.device)
    cu_q = cu_seqlens_q if varlen else lse  # unused pointer when not varlen
    cu_k = cu_seqlens_k if varlen else lse
    k_view = _rows_view(k, varlen) if _use_tma(k) else None
    v_view = _rows_view(v, varlen) if k_view is not None else None
    kv_desc = v_view is not None
    rest = (
        out, lse, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen), *_seq_strides(out, varlen),
        *lse_strides,
        seqlen_q, seqlen_k, hq // hkv, softmax_scale * 1.4426950408889634, window_left, window_right,
    )  # fmt: skip

    def args(c: KernelConfig) -> tuple:
        if kv_desc:
            return (q, _descriptor(k_view, c.BLOCK_N, block_d), _descriptor(v_view, c.BLOCK_N, block_d), *rest)
        return (q, k, v, *rest)

    consts = dict(
        HEAD_DIM=d,
        BLOCK_D=block_d,
        IS_VARLEN=varlen,
        HAS_LEFT=window_left >= 0,
        HAS_RIGHT=window_right >= 0,
        KV_DESC=kv_desc,
        WS=bool(cfg.warp_specialize) and kv_desc,  # warp specialization needs TMA loads (fallbacks keep it)
        FOLD_SCALE=softmax_scale > 0,
    )
    launch(
        _flash_attention_fwd_kernel,
        lambda c: (triton.cdiv(seqlen_q, c.BLOCK_M), hq, batch),
        cfg,
        args,
        consts,
        key=(q.dtype, tuple(sorted(consts.items()))),
    )
    return out, lse


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fuseformer::flash_attention_fwd", mutates_args=())
def _flash_attention_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right
    )


@_flash_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right):
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, left, right)


def _backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile/export, the plain launcher in the
    eager autograd.Function (as every op does; see _utils.dispatch)."""

    def _backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None

    return _backward


# attention_bwd imports this module's helpers, so the backward functions are looked up at call time.
_flash_attention_fwd_op.register_autograd(
    _backward_with(lambda *a: attention_bwd.flash_attention_bwd_op(*a)), setup_context=_setup_context
)
_FlashAttentionFunction = autograd_function(
    "_FlashAttentionFunction",
    flash_attention_fwd,
    _setup_context,
    _backward_with(lambda *a: attention_bwd.flash_attention_bwd(*a)),
)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def _check_cu_seqlens(name: str, cu: object, device: torch.device) -> torch.Tensor:
    check_tensor(_OP, name, cu, dtypes=(torch.int32,), ndim=1, device=device, device_of="q")
    if cu.numel() < 1:
        raise ValueError(f"{_OP}: {name} must hold at least one offset (0), got an empty tensor")
    return cu


def _check_lengths(name: str, cu: torch.Tensor, total: int, max_seqlen: int | None, max_name: str) -> int:
    """Offsets start at 0, never decrease, end within the packed length; returns the longest sequence.

    Reads ``cu`` on the host (one sync, once per unchanged tensor); skipped under torch.compile.
    """
    last, longest = read_offsets(_OP, name, cu)
    if last > total:
        raise ValueError(f"{_OP}: {name} ends at {last} but the packed tensor has {total} rows")
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"{_OP}: {max_name}={max_seqlen} is below the longest sequence in {name} ({longest})")
    return longest


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention, FlashAttention-2 style, with flash-attn's arguments and layouts.

    Args:
        q: (B, Sq, Hq, D), or packed (Tq, Hq, D) with ``cu_seqlens_q``. fp16 or bf16 run in the
            kernel; fp32 and fp64 run on the reference.
        k, v: (B, Sk, Hkv, D) or packed (Tk, Hkv, D), q's dtype; Hq a multiple of Hkv (GQA/MQA).
            D <= 256, the same for q, k and v.
        causal: mask keys after the query, aligned bottom-right when Sq != Sk (query i sees keys
            j <= i + Sk - Sq), as flash-attn 2.1+.
        softmax_scale: multiplies q k^T; default 1 / sqrt(D).
        window_size: (left, right); query i sees keys in [i + Sk - Sq - left, i + Sk - Sq + right],
            -1 unbounded. causal=True sets right to 0.
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 offsets of each sequence in the packed q and k/v.
        max_seqlen_q, max_seqlen_k: the longest sequence in each; read from the offsets if None
            (a host sync; pass them under torch.compile and CUDA graphs).
        return_lse: also return the log-sum-exp of the scaled scores.

    Returns:
        out like q; and with ``return_lse`` lse fp32 (B, Hq, Sq), or (Hq, Tq) for varlen. Rows that
        see no key give out 0 and lse -inf. The gradient of lse is supported too.
    """
    check_tensor(_OP, "q", q, dtypes=FLOAT_DTYPES, ndim=(3, 4))
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"{_OP}: varlen needs both cu_seqlens_q and cu_seqlens_k; {missing} is None")
    ndim = 3 if varlen else 4
    what = "packed (T, H, D) with cu_seqlens" if varlen else "(B, S, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(_OP, name, t, dtypes=FLOAT_DTYPES, device=q.device, device_of="q")
        if t.dim() != ndim:
            raise ValueError(f"{_OP}: {name} must be {what}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{_OP}: {name} has dtype {t.dtype} but q has {q.dtype}; q, k, v must share one dtype")
    d = q.shape[-1]
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] != d:
            raise ValueError(f"{_OP}: {name} has head_dim {t.shape[-1]} but q has {d}; they must match")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{_OP}: head_dim {d} is outside the supported 1..{MAX_HEAD_DIM}")
    if v.shape != k.shape:
        raise ValueError(f"{_OP}: v has shape {tuple(v.shape)}; expected k's shape {tuple(k.shape)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{_OP}: q has {hq} heads, not a multiple of k's {hkv} heads (GQA needs Hq % Hkv == 0)")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"{_OP}: k has batch {k.shape[0]} but q has {q.shape[0]}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or any(not isinstance(w, int) or w < -1 for w in window_size)
    ):
        raise ValueError(f"{_OP}: window_size must be (left, right) ints >= -1, got {window_size!r}")
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"{_OP}: softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if varlen:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"{_OP}: cu_seqlens_q has {cu_seqlens_q.numel()} offsets but cu_seqlens_k has {cu_seqlens_k.numel()}"
            )
        if not torch.compiler.is_compiling():
            longest_q = _check_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
            longest_k = _check_lengths("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
            max_seqlen_q = longest_q if max_seqlen_q is None else max_seqlen_q
            max_seqlen_k = longest_k if max_seqlen_k is None else max_seqlen_k
        elif max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError(f"{_OP}: under torch.compile pass max_seqlen_q and max_seqlen_k with cu_seqlens")

    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    supported = q.dtype in _ATTN_KERNEL_DTYPES
    backend = choose_backend(_OP, q.device, supported, "fp32/fp64 attention runs on the reference")
    if backend == "reference":
        return flash_attention_ref(
            q, k, v, False, scale, (left, right), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse
        )
    out, lse = dispatch(
        _flash_attention_fwd_op,
        _FlashAttentionFunction,
        flash_attention_fwd,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q) if varlen else q.shape[1],
        int(max_seqlen_k) if varlen else k.shape[1],
        scale,
        left,
        right,
    )
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# Tuning (``fuseformer bench --tune`` through autotune.tune_all), in the spirit of
# benchmarks/sweeps.py's attention sweep times the same candidates; the backward's tuner is in
# attention_bwd.py
# --------------------------------------------------------------------------------------------
TUNE_TOKENS, TUNE_HEADS = 16384, 32  # B * S and H of the goal shapes (bf16)
# (head dim, seqlen, causal): causal at S 4096, full at S 16384, as the goals time them.
TUNE_CASES = tuple((d, s, c) for d in (64, 128, 256) for s, c in ((4096, True), (16384, False)))


@contextlib.contextmanager
def tuning_config(kind: str, cfg: dict):
    """Run ``kind`` with exactly ``cfg`` inside the block (through CONFIG_OVERRIDES, every field)."""
    previous = CONFIG_OVERRIDES.get(kind, {})
    CONFIG_OVERRIDES[kind] = dict(cfg)
    try:
        yield
    finally:
        CONFIG_OVERRIDES[kind] = previous


# Quick tuning: (BLOCK_M, BLOCK_N, num_warps, num_stages) around the H200 sweeps' winners (tables above).
_QUICK_CANDIDATES = {
    "fwd": ((64, 128, 4, 2), (128, 64, 4, 2), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2)),
    "bwd_dkdv": ((32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2)),
    "bwd_dq": ((64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2)),
}
# The full sweep: (BLOCK_M values, BLOCK_N values, num_stages values), warps 4 and 8.
_SWEEP = {
    "fwd": ((64, 128), (32, 64, 128), (2, 3, 4)),
    "bwd_dkdv": ((16, 32, 64), (64, 128), (1, 2, 3)),
    "bwd_dq": ((64, 128), (32, 64, 128), (1, 2, 3)),
}


def candidate_configs(kind: str, block_d: int, bounded: bool, quick: bool = False) -> list[dict]:
    """The sweep of one kernel, its current default first (it wins ties). A config that does not fit
    shared memory runs its fallback (``launch``) and is timed as such."""
    if quick:
        grid = _QUICK_CANDIDATES[kind]
    else:
        bms, bns, stages = _SWEEP[kind]
        grid = [(m, n, w, st) for m in bms for n in bns for w in (4, 8) for st in stages]
    out = [asdict(_default_config(kind, block_d, bounded))]
    out += [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st, warp_specialize=0) for m, n, w, st in grid]
    if kind == "fwd" and not quick:  # warp-specialized key loop (TMA producer warps)
        out += [dict(BLOCK_M=128, BLOCK_N=n, num_warps=w, num_stages=st, warp_specialize=1)
                for n in (64, 128) for w in (4, 8) for st in (2, 3)]  # fmt: skip
    return [c for i, c in enumerate(out) if c not in out[:i]]


def tune_inputs(head_dim: int, seqlen: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, S, H, D) on the GPU for one tuning case."""
    shape = (TUNE_TOKENS // seqlen, seqlen, TUNE_HEADS, head_dim)
    return tuple(torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))


def tune_attention_fwd(quick: bool = False) -> list[dict]:
    """Tune the forward over head dims, causal and full, on this GPU (bf16); one record a key."""
    from fuseformer.bench._timing import bench_ms

    records = []
    dtype = torch.bfloat16
    for d, seqlen, causal in [c for c in TUNE_CASES if c[0] == 128] if quick else TUNE_CASES:
        q, k, v = tune_inputs(d, seqlen, dtype)
        args = (q, k, v, None, None, seqlen, seqlen, d**-0.5, -1, 0 if causal else -1)
        block_d = max(16, next_pow2(d))
        key = config_key(block_d, causal, dtype)

        def bench(cfg, args=args):
            def run():
                with tuning_config("fwd", cfg):
                    flash_attention_fwd(*args, gluon=False)  # the Triton kernel's config is tuned

            return run

        try:
            best = autotune.tune(
                KERNELS["fwd"], candidate_configs("fwd", block_d, causal, quick), bench, key, force=True
            )
            ms = bench_ms(lambda args=args: flash_attention_fwd(*args, gluon=False))
            flops = 4.0 * TUNE_TOKENS * seqlen * TUNE_HEADS * d / (2 if causal else 1)
            records.append(dict(kernel=KERNELS["fwd"], key=key, config=best, ms=ms, tflop_s=flops / (ms * 1e-3) / 1e12))
        except Exception as exc:
            records.append(dict(kernel=KERNELS["fwd"], key=key, error=f"{type(exc).__name__}: {exc}"[:300]))
    return records


autotune.register_tuner(KERNELS["fwd"], tune_attention_fwd)


from fuseformer.ops import attention_bwd  # noqa: E402  (backward kernels; it imports the helpers above)
