"""Flash attention (FlashAttention-2) forward in Triton, the reference, registration and the public op.

    out = softmax(cap(scale * q k^T) + mask) v       lse = logsumexp(cap(scale * q k^T) + mask)

with cap(s) = softcap * tanh(s / softcap) when ``softcap`` > 0 (Gemma 2's logit soft-capping; the
tanh's derivative enters the backward's ds), else cap(s) = s.

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
keyed by padded head dim, causal/full and dtype), whose defaults are the per-head-dim tables in
``_attention_common.py`` (with the layout helpers and ``launch`` that forward and backward share);
the launchers' ``config=`` arguments (tuning, sweeps) go on top; a config that does not fit falls back. The Gluon kernels (``attention_hopper.py``) take no soft-capping: softcap > 0 runs here.
Varlen rows past ``cu_seqlens_q[-1]`` (and their gradients) are not written, as in flash-attn.
"""

from __future__ import annotations

import math

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
from fuseformer.ops.attention_bwd import flash_attention_bwd, flash_attention_bwd_op
from fuseformer.runtime.backend import choose_backend, forced_backend

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


def _ref_batched(q, k, v, causal, scale, window_size, upcast, softcap=0.0):
    """(B, Sq, Hq, D), (B, Sk, Hkv, D) -> out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) fp32 (fp64)."""
    dtype = q.dtype
    compute = float_dtype_of(q) if upcast else dtype
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    group = q.shape[2] // k.shape[2]
    if group > 1:
        kc = kc.repeat_interleave(group, dim=2)
        vc = vc.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * scale  # (B, Hq, Sq, Sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
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
    softcap: float = 0.0,
    upcast: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch attention with explicit masks; same arguments and results as :func:`flash_attention`.

    Computes in fp32 (fp64 stays fp64) when ``upcast``, else in q's dtype (the low-precision baseline
    of the tests). Materializes the (B, Hq, Sq, Sk) scores. Varlen runs one sequence at a time.
    """
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    window = (int(window_size[0]), int(window_size[1]))
    if cu_seqlens_q is None:
        out, lse = _ref_batched(q, k, v, causal, scale, window, upcast, softcap)
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for b in range(len(cq) - 1):
            qb, kb, vb = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
            o, lse_b = _ref_batched(qb[None], kb[None], vb[None], causal, scale, window, upcast, softcap)
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
# Forward kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_loop(
    acc, l_i, m_i, q, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
    qk_scale, softcap, window_left, window_right, start, end,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, KV_DESC: tl.constexpr,
    WS: tl.constexpr, FOLD_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [start, end). acc (BLOCK_M, BLOCK_D) fp32; l_i, m_i (BLOCK_M,)
    running sum and max of the scores in log2 units. MASK: apply the causal/window/length mask.
    WS: warp-specialize the loop (Triton's producer/consumer warp groups; TMA loads only).
    FOLD_SCALE (qk_scale > 0): the scale goes into one FMA with the max subtraction, qk * s - m,
    instead of a multiply of the whole tile and then a subtraction (the row max of the raw scores
    times s is the max of the scaled ones when s > 0). Run 39 (H200): +2.9% at hd 128 full, +3% at hd
    64, level at hd 128 causal; a zero or negative scale takes the multiply.
    SOFTCAP: scores = softcap * tanh(qk * qk_scale), qk_scale then scale / cap and softcap the cap in
    log2 units (cap * log2(e)); FOLD_SCALE is off with it."""
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
        if SOFTCAP:
            qk = tanh(qk * qk_scale) * softcap  # capped scores, log2 units
        elif not FOLD_SCALE:
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
    seqlen_q, seqlen_k, group_size, qk_scale, window_left, window_right, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KV_DESC: tl.constexpr,
    WS: tl.constexpr, FOLD_SCALE: tl.constexpr = True, SOFTCAP: tl.constexpr = False,
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
            qk_scale, softcap, window_left, window_right, lo, full_lo,
            True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, False, FOLD_SCALE, SOFTCAP,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
        qk_scale, softcap, window_left, window_right, full_lo, full_hi,
        False, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, WS, FOLD_SCALE, SOFTCAP,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, K, V, k_ptrs, v_ptrs, stride_ks, stride_vs, kv_row0, kv_col, rows, sq, sk,
        qk_scale, softcap, window_left, window_right, full_hi, hi,
        True, HAS_LEFT, HAS_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, KV_DESC, False, FOLD_SCALE, SOFTCAP,
    )  # fmt: skip

    # Rows that saw no key: l = 0, acc = 0 -> out 0, lse -inf.
    empty_row = l_i == 0.0
    out = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.math.log2(l_i)) * 0.6931471805599453)
    o_ptrs = OUT + o_off + h * stride_oh + rows64[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + l_off + h * stride_lh + rows64, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs checked by the caller; unit stride in the head dim)
# --------------------------------------------------------------------------------------------
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
    softcap: float = 0.0,
    *,
    gluon: bool = True,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher: q (B, Sq, Hq, D) / (Tq, Hq, D), k, v (B, Sk, Hkv, D) / (Tk, Hkv, D), fp16 or bf16.

    window_right = 0 is causal; -1 unbounded. Varlen when ``cu_seqlens_q`` is given (then
    ``max_seqlen_q/k`` must bound every sequence). ``softcap`` > 0 caps the scaled scores at
    softcap * tanh(s / softcap) (the Triton kernel takes it; the Gluon one does not). Returns out like
    q (contiguous) and lse fp32 (B, Hq, Sq) or (Hq, Tq). ``gluon=False`` keeps the Triton kernel where
    the Gluon one would run (sweeps and tests compare the two). ``config``: KernelConfig fields put on
    the looked-up config of the Triton kernel, which then runs (tuning, sweeps, tests).
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
    capped = softcap > 0
    gluon = gluon and not capped and config is None  # the Gluon kernel has no soft-capping
    if (
        gluon
        and _GLUON_FWD
        and attention_hopper.forward_usable(q, k, v, varlen, window_left, window_right, softmax_scale)
    ):
        return attention_hopper.forward(q, k, v, softmax_scale, causal=window_right == 0, out=out, lse=lse)
    block_d = max(16, next_pow2(d))
    cfg = resolve_config("fwd", config, block_d, window_left >= 0 or window_right >= 0, q.dtype, q.device)
    cu_q = cu_seqlens_q if varlen else lse  # unused pointer when not varlen
    cu_k = cu_seqlens_k if varlen else lse
    k_view = _rows_view(k, varlen) if _use_tma(k) else None
    v_view = _rows_view(v, varlen) if k_view is not None else None
    kv_desc = v_view is not None
    rest = (
        out, lse, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen), *_seq_strides(out, varlen),
        *lse_strides,
        seqlen_q, seqlen_k, hq // hkv,
        # Soft-capping: tanh of q k^T * scale / cap, times the cap in log2 units; else the scale in log2 units.
        softmax_scale / softcap if capped else softmax_scale * 1.4426950408889634, window_left, window_right,
        softcap * 1.4426950408889634 if capped else 0.0,
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
        FOLD_SCALE=softmax_scale > 0 and not capped,
        SOFTCAP=capped,
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
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
        softcap,
    )  # fmt: skip


@_flash_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
      softcap=0.0):  # fmt: skip
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, left, right, softcap)


def _backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile/export, the plain launcher in the
    eager autograd.Function (as every op does; see _utils.dispatch)."""

    def _backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None

    return _backward


_flash_attention_fwd_op.register_autograd(_backward_with(flash_attention_bwd_op), setup_context=_setup_context)
_FlashAttentionFunction = autograd_function(
    "_FlashAttentionFunction", flash_attention_fwd, _setup_context, _backward_with(flash_attention_bwd)
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


def _sdpa_serves(q, k, varlen, return_lse, softcap, left, right) -> bool:
    """Whether the CPU path (torch's SDPA) computes this call exactly as the reference would: a CPU
    tensor below fp64, the reference not forced, no packed sequences, lse, soft-cap or window, non-empty
    sequences, and a causal mask only where Sq == Sk."""
    if not q.is_cpu or q.dtype == torch.float64 or forced_backend() is not None:
        return False
    if varlen or return_lse or softcap or left != -1 or q.shape[1] == 0 or k.shape[1] == 0:
        return False
    return right == -1 or (right == 0 and q.shape[1] == k.shape[1])


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
    softcap: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention, FlashAttention-2 style, with flash-attn's arguments and layouts.

    Args:
        q: (B, Sq, Hq, D), or packed (Tq, Hq, D) with ``cu_seqlens_q``. fp16 or bf16 run in the
            kernel; fp32 and fp64 run on the reference (on a CPU, torch's SDPA wherever it computes
            the same: ``_sdpa_serves``).
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
        softcap: > 0 caps the scaled scores as Gemma 2 does, s = softcap * tanh(s / softcap), before
            the mask and softmax (flash-attn's ``softcap``); 0 leaves them as they are. Forward and
            backward (the gradients through the tanh) both run in the kernels.

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
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        raise ValueError(f"{_OP}: softcap must be a float >= 0 (0: no capping), got {softcap!r}")
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
        if _sdpa_serves(q, k, varlen, return_lse, softcap, left, right):
            # The CPU path: ATen's fused attention instead of the reference's materialized scores and masks
            # (BERT-base layers on a CPU, 2026-12-07: the reference made optimize's attention kind slower than
            # eager). SDPA's causal mask is aligned top-left: taken only where Sq == Sk (the two agree).
            if hq != hkv:  # K/V heads repeated for their groups (SDPA's enable_gqa needs torch >= 2.5)
                k, v = k.repeat_interleave(hq // hkv, dim=2), v.repeat_interleave(hq // hkv, dim=2)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=right == 0, scale=scale
            )
            return out.transpose(1, 2)
        return flash_attention_ref(
            q, k, v, False, scale, (left, right), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse,
            softcap,
        )  # fmt: skip
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
        float(softcap),
    )
    return (out, lse) if return_lse else out
