"""Attention over a paged KV cache (inference only; no autograd). The write of new K/V into the cache is
its own op, ops/reshape_and_cache.py.

KV cache layout per layer (DESIGN.md §4): k_cache, v_cache (num_blocks, block_size, Hkv, D). A
sequence's context lives in the blocks its row of ``block_tables`` (B, max_blocks) int32 names, in
order: token position p sits in block ``block_tables[b, p // block_size]`` at offset
``p % block_size``.

``paged_attention`` serves a step that mixes prefill chunks (with a cached prefix) and single-token
decodes: sequence b has q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b] new queries at positions
context_lens[b] - q_len .. context_lens[b] - 1, attending to its whole context (the cached prefix
and the new tokens, already written by ``reshape_and_cache``), causal masks aligned bottom-right.
``window`` > 0 limits each query at position i to the keys j with i - window < j <= i (Hugging
Face's ``sliding_window``; flash-attn's window_size=(window - 1, 0)).

Everything below autograd lives here (STYLE.md §1): the reference ``paged_attention_ref`` (and the
CPU path of the reference backend), the Triton kernels, the launcher ``paged_attention_fwd`` (the engine
calls it), the ``torch.library`` registration and the public function.

The attention kernel packs GQA groups: one program per (sequence, q tile, KV head), whose BLOCK_M
rows are (query, q head of the group) pairs (row r: query m_tile * ROWS + r // HEADS, q head
kv_head * GROUP + r % HEADS, ROWS = BLOCK_M // HEADS), so each K/V tile is read once per KV head
instead of once per q head (4x less K/V traffic for Llama-3-8B's 32/8 heads). Groups that do not
divide BLOCK_M leave masked rows; a group wider than BLOCK_M is split over several tiles (head
chunks). The program loops over its keys BLOCK_N at a time (pages looked up per key, so any
block_size works; one table entry per tile when BLOCK_N divides block_size), with online softmax
in fp32, masks only on the blocks at the edges of the causal/window range. Decodes in a step with
a long prefill get the prefill's q-tile count and their extra tiles exit at once.

Split-K ("flash-decoding"): when a step's queries fit one tile per (sequence, KV head) and those
programs are too few to fill the GPU (few sequences, long contexts), each one's keys are split
into runs; the programs write fp32 partial outputs with their log-sum-exp, and a small second
kernel merges them.

FP8 KV cache (ops/_fp8_kv_cache.py): e4m3 caches hold K / k_scale and V / v_scale. The kernel loads
the e4m3 tiles (half the bytes of bf16) and converts them to q's dtype, exactly (e4m3 values are
exact in fp16 and bf16), for the two dots; the scales are not applied per element but folded: k_scale
into the score scale (s = (q . k_stored) * k_scale * softmax_scale, in fp32) and v_scale into the
output (o = v_scale * sum_j p_j v_stored_j, once per row at the end). Fewer multiplies than
dequantizing each tile, and more accurate: the dequantized K/V are never rounded to q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuseformer.ops._attention_common import tanh
from fuseformer.ops._fp8_kv_cache import FP8_KV_DTYPE, UNSUPPORTED_WHY, check_cache_scales, dequantize, is_fp8
from fuseformer.ops._paged_attention_cpu import _paged_attention_cpu
from fuseformer.ops._utils import FLOAT_DTYPES, KERNEL_DTYPES, check_shape, check_tensor, empty, next_pow2, sm_count
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend, forced_backend

_OP = "paged_attention"
_MAX_HEAD_DIM = 256
_INT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    window: int = -1,
    softcap: float = 0.0,
    upcast: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure PyTorch: gather each sequence's blocks (e4m3 caches dequantized: times ``k_scale`` /
    ``v_scale``, None 1.0), cap the scores (``softcap`` > 0), mask bottom-right aligned, softmax,
    weight V.

    Computes in fp32 (fp64 stays fp64) when ``upcast``, else in q's dtype. Returns (T, Hq, D) in
    q's dtype. A loop over sequences with host syncs: the oracle and the CPU path, not a fast path.
    """
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    compute = (torch.float64 if q.dtype == torch.float64 else torch.float32) if upcast else q.dtype
    if not is_fp8(k_cache):
        k_scale = v_scale = None
    out = torch.zeros(t, hq, d, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    for b in range(len(cu) - 1):
        q0, q1, ctx = cu[b], cu[b + 1], ctx_lens[b]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len > ctx:
            raise ValueError(f"{_OP}: sequence {b} has {q_len} new queries but a context of only {ctx}")
        blocks = block_tables[b, : (ctx + bs - 1) // bs].long()
        k = dequantize(k_cache[blocks].reshape(-1, hkv, d)[:ctx], k_scale, compute)  # (ctx, Hkv, D)
        v = dequantize(v_cache[blocks].reshape(-1, hkv, d)[:ctx], v_scale, compute)
        k = k.repeat_interleave(hq // hkv, dim=1)  # (ctx, Hq, D)
        v = v.repeat_interleave(hq // hkv, dim=1)
        qs = q[q0:q1].to(compute)  # (q_len, Hq, D)
        s = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= k_pos <= q_pos
        if window > 0:
            allowed &= k_pos > q_pos - window
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _paged_attention_loop(
    acc, l_i, m_i, q, q_pos, k_base, v_base, table, stride_kb, stride_ks, stride_vb, stride_vs,
    qk_scale, softcap, window, start, end, hi,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax over the keys [start, end) (start a multiple of BLOCK_N). acc (BLOCK_M, BLOCK_D)
    fp32; l_i, m_i (BLOCK_M,) running sum and max in log2 units; q_pos (BLOCK_M,) absolute positions.
    MASK: mask keys >= hi and the causal/window bounds (blocks at the edges of the tile's range).
    SOFTCAP: scores softcap * tanh(q k^T * qk_scale), with qk_scale = scale / cap and softcap = cap * log2(e).
    e4m3 caches: the tiles converted to q's dtype (exact); their scales are the caller's (qk_scale, acc)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < hi
        if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one table entry
            page = tl.load(table + start_n // PAGE_SIZE).to(tl.int64)
            k_rows = page * stride_kb + (start_n % PAGE_SIZE + offs_n0).to(tl.int64) * stride_ks
            v_rows = page * stride_vb + (start_n % PAGE_SIZE + offs_n0).to(tl.int64) * stride_vs
        else:
            if MASK:
                page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            else:
                page = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
            k_rows = page * stride_kb + slot * stride_ks
            v_rows = page * stride_vb + slot * stride_vs
        k_ptrs = k_base + k_rows[:, None] + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
        v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if k.dtype.is_fp8():
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if SOFTCAP:
            s = tanh(s) * softcap
        if MASK:
            valid = n_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                valid = valid & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Integers that change from step to step (the block table's width, the query tiles, the key splits, the
# window) are not specialized on (Triton would compile a kernel for each of ==1, % 16 == 0 and neither):
# an engine's eager steps meet every mix of them, each new one a compile inside a user's request
# (H100, 2026-12-07: 1.8 s in a prefill step after prefix hits). They only index and divide.
@triton.jit(do_not_specialize=["stride_bt", "window", "q_tiles", "num_splits"])
def _paged_attention_fwd_kernel(
    Q, K_CACHE, V_CACHE, OUT, LSE, CU_Q, CTX_LENS, BLOCK_TABLES, K_SCALE, V_SCALE,
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    qk_scale, window, q_tiles, num_splits, softcap,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP: tl.constexpr, HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    # Grid (B * q_tiles, Hkv * CHUNKS * num_splits). A tile's BLOCK_M rows are (query, q head)
    # pairs of one KV group: row r is query m_tile * ROWS + r // HEADS of the sequence with q head
    # kv_head * GROUP + chunk * HEADS + r % HEADS, so each K/V tile is loaded once for the group.
    # SPLIT: this program covers 1/num_splits of the keys and writes fp32 partials (OUT) and their
    # log2-sum-exp (LSE), indexed by split; _paged_attention_merge_kernel combines them.
    # K_SCALE, V_SCALE: fp32 scalars of e4m3 caches (None: 1.0, not loaded), folded into the score
    # scale and the output (the merge is linear: each split's partial carries v_scale).
    ROWS: tl.constexpr = BLOCK_M // HEADS  # queries per tile
    CHUNKS: tl.constexpr = (GROUP + HEADS - 1) // HEADS  # tiles per group (> 1 only when GROUP > BLOCK_M)
    pid = tl.program_id(0)
    seq = pid // q_tiles
    pid_m = pid % q_tiles
    pid_h = tl.program_id(1)
    split = 0
    if SPLIT:
        split = pid_h % num_splits
        pid_h = pid_h // num_splits
        OUT += split.to(tl.int64) * stride_os
        LSE += split.to(tl.int64) * stride_ls
    kv_head = (pid_h // CHUNKS).to(tl.int64)
    chunk = pid_h % CHUNKS
    q_start = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_start
    n_tiles = tl.cdiv(q_len, ROWS)
    # Tiles past this sequence's queries (e.g. decodes in a step with a long prefill) leave at once.
    if pid_m >= n_tiles:
        return
    m_tile = pid_m
    if CAUSAL:  # each sequence's heaviest (last) tile starts first
        m_tile = n_tiles - 1 - pid_m
    ctx = tl.load(CTX_LENS + seq)

    r = tl.arange(0, BLOCK_M)
    qi = m_tile * ROWS + r // HEADS  # (BLOCK_M,) query index within the sequence's new tokens
    hg = chunk * HEADS + r % HEADS  # (BLOCK_M,) q head within the group
    row_ok = qi < q_len
    if BLOCK_M % HEADS != 0:
        row_ok = row_ok & (r < ROWS * HEADS)
    if GROUP % HEADS != 0:
        row_ok = row_ok & (hg < GROUP)
    q_pos = ctx - q_len + qi  # (BLOCK_M,) absolute positions of the rows' queries
    tok = q_start.to(tl.int64) + qi.to(tl.int64)
    head = kv_head * GROUP + hg.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Keys of this tile: [lo, hi). Every row sees [full_lo, full_hi) whole (no mask); the blocks
    # before and after it are partly visible. Block edges are multiples of BLOCK_N (lo is one).
    p_first = ctx - q_len + m_tile * ROWS
    p_last = ctx - q_len + tl.minimum((m_tile + 1) * ROWS, q_len) - 1
    lo = 0
    full_lo = 0
    if CAUSAL:
        hi = p_last + 1
        full_hi = ((p_first + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = ctx
        full_hi = (ctx // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = (tl.maximum(p_first - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(p_last - window + 1, 0), BLOCK_N) * BLOCK_N
    no_full = full_hi <= full_lo
    full_lo = tl.where(no_full, lo, full_lo)
    full_hi = tl.where(no_full, lo, full_hi)
    s_lo = lo
    s_hi = hi
    if SPLIT:  # this program's share: a run of whole blocks
        per_split = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        s_lo = lo + split * per_split
        s_hi = tl.minimum(s_lo + per_split, hi)

    # Finite start for the running max: a row whose keys are all masked in a tile keeps p = 0
    # instead of exp(-inf - -inf) = NaN.
    if K_SCALE is not None:
        qk_scale = qk_scale * tl.load(K_SCALE)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    k_base = K_CACHE + kv_head * stride_kh
    v_base = V_CACHE + kv_head * stride_vh
    acc, l_i, m_i = _paged_attention_loop(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table, stride_kb, stride_ks, stride_vb, stride_vs,
        qk_scale, softcap, window, s_lo, tl.minimum(s_hi, full_lo), hi,
        True, CAUSAL, HAS_WINDOW, DOT_PRECISION, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP,
    )  # fmt: skip
    acc, l_i, m_i = _paged_attention_loop(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table, stride_kb, stride_ks, stride_vb, stride_vs,
        qk_scale, softcap, window, tl.maximum(s_lo, full_lo), tl.minimum(s_hi, full_hi), hi,
        False, CAUSAL, HAS_WINDOW, DOT_PRECISION, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP,
    )  # fmt: skip
    acc, l_i, m_i = _paged_attention_loop(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table, stride_kb, stride_ks, stride_vb, stride_vs,
        qk_scale, softcap, window, tl.maximum(s_lo, full_hi), s_hi, hi,
        True, CAUSAL, HAS_WINDOW, DOT_PRECISION, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SOFTCAP,
    )  # fmt: skip

    if V_SCALE is not None:
        acc = acc * tl.load(V_SCALE)
    o_ptrs = OUT + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # A row that saw no key in this split: out 0 and lse -inf, no weight in the merge.
        empty_row = l_i == 0.0
        out = acc / tl.where(empty_row, 1.0, l_i)[:, None]
        lse = tl.where(empty_row, float("-inf"), m_i + tl.math.log2(l_i))  # log2 units
        tl.store(o_ptrs, out, mask=o_mask)
        tl.store(LSE + tok * stride_lt + head, lse, mask=row_ok)
    else:
        tl.store(o_ptrs, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_merge_kernel(
    O_PART, LSE, OUT, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # One program per (token, q head): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LSE + offs_s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    w = tl.math.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        O_PART + offs_s[:, None].to(tl.int64) * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D) fp32
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(OUT + t * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs already checked; unit stride in the head dim)
# --------------------------------------------------------------------------------------------
# Launch configuration. Rows of a tile are (query, q head of the group) pairs, so the tile height
# follows max_seqlen_q * GROUP up to a cap: a Llama-3-8B decode step (GROUP 4) takes BLOCK_M 16 (4
# rows used; mma needs 16), its prefill BLOCK_M 128 (32 queries x 4 heads). Chosen so that ptxas
# (Triton 3.6, sm_90, offline compile) reports no register spills; untimed on the H200:
#   bf16 hd 128 decode 16x64, 4 warps, 3 stages: 168 regs, 38 KiB smem (K/V prefetched one tile ahead
#     by cp.async, the page numbers two); prefill 128x64, 8 warps, 3 stages: 184 regs, 96 KiB.
#     (128x128 reaches 255 regs and 160 KiB.)
#   bf16 hd 64 prefill 128x64, 8 warps: 117 regs. bf16 hd 256: decode 16x32, 8 warps: 128 regs
#     (4 warps: 8 B of spill); prefill 64x32, 8 warps: 184 regs, 96 KiB.
#   fp32 ("ieee" products run on FMA, not tensor cores, and take far more registers): BLOCK_N 32,
#     8 warps, 1 stage; BLOCK_M 32 at hd <= 64 (62 regs), else 16 (hd 128: 79 regs, hd 256: 122).
#     At hd 128, BLOCK_M 32 spills 64 B; the old 64x32, 4 warps, 2 stages spilled 17 KB.
#   e4m3 caches take q's dtype's defaults (their own key, so a tuned fp8 config never serves bf16
#     caches); untimed on the H200, where half the K/V bytes may favour larger BLOCK_N.
# A sweep passes its fields as paged_attention_fwd's ``config=`` (put on the chosen ones).
KERNEL = "paged_attention"
_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def config_key(decode: bool, rows: int, block_d: int, element_size: int, kv_element_size: int | None = None) -> str:
    """The autotune key: decode or prefill step, tile rows (max_seqlen_q * GROUP's bucket, up to 128:
    the default depends on nothing finer), padded head dim, q's element size, and the caches' element
    size where it differs from q's (``-KV1``: an e4m3 cache)."""
    kv = f"-KV{kv_element_size}" if kv_element_size not in (None, element_size) else ""
    return f"{'decode' if decode else 'prefill'}-R{min(rows, 128)}-D{block_d}-E{element_size}{kv}"


def default_config(rows: int, block_d: int, element_size: int) -> dict:
    """The default BLOCK_M, BLOCK_N, num_warps, num_stages (see the comment above ``KERNEL``)."""
    if element_size == 4:
        block_m = min(rows, 32 if block_d <= 64 else 16)
        return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=8, num_stages=1)
    if block_d <= 128:
        block_m = min(rows, 128)
        return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=8 if block_m >= 128 else 4, num_stages=3)
    return dict(BLOCK_M=min(rows, 64), BLOCK_N=32, num_warps=8, num_stages=2)


@autotune.plan_cache
def _cached_config(
    decode: bool, rows: int, block_d: int, element_size: int, kv_element_size: int, device: torch.device | None
) -> dict:
    """The autotune cache's config for this bucket, else the default; looked up once per bucket and device."""
    return autotune.get_config(
        KERNEL, config_key(decode, rows, block_d, element_size, kv_element_size), device=device,
        default=lambda: default_config(rows, block_d, element_size), fields=_FIELDS,
    )  # fmt: skip


def _attn_config(
    max_seqlen_q: int,
    group: int,
    head_dim: int,
    element_size: int,
    device: torch.device | None = None,
    config: dict | None = None,
    kv_element_size: int | None = None,
) -> dict:
    """BLOCK_M, BLOCK_N, HEADS (q heads per tile), num_warps, num_stages for one step: the cached
    (or default) config of its bucket, then the fields of an explicit ``config``, then HEADS from BLOCK_M.
    ``kv_element_size``: the caches' (default q's ``element_size``; 1 for e4m3)."""
    block_d = max(16, next_pow2(head_dim))
    rows = _config_rows(max_seqlen_q, group)
    decode = max_seqlen_q == 1
    kv_size = element_size if kv_element_size is None else kv_element_size
    cfg = dict(_cached_config(decode, rows, block_d, element_size, kv_size, device))
    cfg.update(config or {})
    cfg["HEADS"] = min(group, cfg["BLOCK_M"])
    return cfg


def _config_rows(max_seqlen_q: int, group: int) -> int:
    """The config bucket of a step: its tile's (query, q head) rows, 16 to 128."""
    return min(128, max(16, next_pow2(max_seqlen_q * group)))


def config_query_lengths(group: int) -> list[int]:
    """One query length (a sequence's new tokens in a step) per launch-config bucket of ``_attn_config``
    for GQA ``group`` (q heads per KV head): 1 (the decode bucket), then the shortest longer one that
    reaches each of 16, 32, 64, 128 rows. An engine's warm-up runs a step of each, so that no request
    waits for a bucket's compile."""
    lengths = [1]
    for rows in (16, 32, 64, 128):
        n = max(2, rows // group)
        if _config_rows(n, group) == rows:
            lengths.append(n)
    return lengths


# Split-K ("flash-decoding"): when all of a step's queries fit one tile per (sequence, KV group) and
# those programs cannot fill the GPU (fewer than _SPLIT_FILL x SMs), each one's keys are split into
# runs of at least _SPLIT_MIN_KEYS; a second kernel merges the fp32 partials by their log-sum-exp.
_SPLIT_FILL = 2
_SPLIT_MIN_KEYS = 512
_MAX_SPLITS = 64


def _num_splits(programs: int, max_keys: int, sms: int) -> int:
    """Key splits for ``programs`` (sequence, KV group) programs over at most ``max_keys`` keys each."""
    target = _SPLIT_FILL * sms
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_keys // _SPLIT_MIN_KEYS, _MAX_SPLITS))


def paged_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window: int,
    max_seqlen_q: int,
    softcap: float = 0.0,
    config: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) -> out (T, Hq, D); see the module docstring for the other arguments. ``config``:
    fields (BLOCK_M, BLOCK_N, num_warps, num_stages) put on the looked-up config (sweeps, tests).
    ``k_scale``, ``v_scale``: one-element fp32 tensors of e4m3 caches (None: 1.0); unused otherwise.
    ``num_splits``: the split-K runs of each program's keys (sweeps, tests); None: the rule
    (``_num_splits``). More than 1 needs every query of a sequence in one tile."""
    t, hq, d = q.shape
    out = empty((t, hq, d), dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if t == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    cfg = _attn_config(max_seqlen_q, group, d, q.element_size(), q.device, config, k_cache.element_size())
    if not is_fp8(k_cache):
        k_scale = v_scale = None  # None: the kernel's K_SCALE / V_SCALE are constexpr, nothing loaded
    q_tiles = triton.cdiv(max_seqlen_q, cfg["BLOCK_M"] // cfg["HEADS"])
    head_programs = hkv * triton.cdiv(group, cfg["HEADS"])
    splits = 1
    if num_splits is not None:
        if num_splits < 1 or (num_splits > 1 and q_tiles != 1):
            raise ValueError(
                f"paged_attention_fwd: num_splits {num_splits} needs to be >= 1, and 1 where a sequence's "
                f"queries take {q_tiles} tiles"
            )
        splits = num_splits
    elif q_tiles == 1:
        # Keys per sequence are at most the block table's width in tokens (known without a sync).
        max_keys = block_tables.shape[1] * page_size
        if window > 0:
            max_keys = min(max_keys, window + max_seqlen_q)
        splits = _num_splits(batch * head_programs, max_keys, sm_count(q))
    capped = softcap > 0
    consts = dict(
        CAUSAL=causal, HAS_WINDOW=window > 0, SPLIT=splits > 1, SOFTCAP=capped,
        # fp32 inputs: true fp32 products (tf32 would fail the §3 criterion against fp32 PyTorch).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), **cfg,
    )  # fmt: skip
    if splits == 1:
        o, lse = out, out  # LSE unused
        o_strides = (0, out.stride(0), out.stride(1), 0, 0)
    else:
        o = empty((splits, t, hq, d), dtype=torch.float32, device=q.device)
        lse = empty((splits, t, hq), dtype=torch.float32, device=q.device)
        o_strides = (o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1))
    _paged_attention_fwd_kernel[(batch * q_tiles, head_programs * splits)](
        q, k_cache, v_cache, o, lse, cu_seqlens_q, context_lens, block_tables, k_scale, v_scale,
        q.stride(0), q.stride(1), *o_strides,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        # Soft-capping: tanh of the scores * scale / cap, times the cap in log2 units.
        softmax_scale / softcap if capped else softmax_scale * 1.4426950408889634, window, q_tiles, splits,
        softcap * 1.4426950408889634 if capped else 0.0,
        **consts,
    )  # fmt: skip
    if splits > 1:
        _paged_attention_merge_kernel[(t, hq)](
            o, lse, out, splits,
            o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            # BLOCK_S the most splits, whatever this step's: one compiled merge for every step (a
            # power of two of the splits compiled up to 6 variants, each inside the first step that met it).
            HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_S=_MAX_SPLITS, num_warps=4,
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile; CUDA-graph capturable (no host syncs)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fuseformer::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window: int,
    max_seqlen_q: int,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_attention_fwd(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, softmax_scale, causal, window, max_seqlen_q,
        softcap, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, softmax_scale, causal, window, max_seqlen_q,
      softcap=0.0, k_scale=None, v_scale=None):  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def _check_caches(op: str, k_cache: object, v_cache: object, device: torch.device, dtype: torch.dtype) -> None:
    """Both caches 4-d on q's device, in q's dtype or both e4m3, of one shape."""
    check_tensor(op, "k_cache", k_cache, dtypes=(dtype, FP8_KV_DTYPE), ndim=4, device=device, device_of="q")
    check_tensor(op, "v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4, device=device, device_of="q")
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), "the shape of k_cache")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    window: int = -1,
    max_seqlen_q: int | None = None,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new queries over its whole context in the paged KV cache.

    Args:
        q: (T, Hq, D) fp16, bf16 or fp32 (fp64 runs on the reference), the step's new queries of all
            sequences packed; unit stride in D (other strides are made contiguous).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), both q's dtype or both float8_e4m3fn (an
            FP8 KV cache, read as stored * scale); Hq a multiple of Hkv (GQA). The new tokens' K/V
            must already be written (``reshape_and_cache``, with the same scales).
        cu_seqlens_q: (B+1,) int32, prefix sums of the new-query counts.
        context_lens: (B,) int32, tokens of context per sequence (cached + new), each >= its q_len.
        block_tables: (B, max_blocks) int32, the blocks of each sequence's context in order.
        softmax_scale: default 1/sqrt(D).
        causal: mask bottom-right aligned (query i of q_len sits at position context_len - q_len + i).
        window: > 0 keeps only the keys j with i - window < j <= i (HF ``sliding_window``); -1 for all.
        max_seqlen_q: the largest q_len, an int known on the host (the engine has it); computed from
            cu_seqlens_q with a device sync when None.
        softcap: > 0 caps the scaled scores, s = softcap * tanh(s / softcap), before the mask and
            softmax (Gemma 2's ``attn_logit_softcapping``); 0 leaves them as they are.
        k_scale, v_scale: the layer's K and V scales for e4m3 caches: one-element fp32 tensors (shape
            () or (1,)) on q's device, read by the kernel (CUDA graphs capture them by address); None
            means 1.0. Unused (and unchecked) for caches in q's dtype.

    Returns:
        (T, Hq, D) in q's dtype. Not differentiable (inference only).
    """
    check_tensor(_OP, "q", q, dtypes=FLOAT_DTYPES, ndim=3)
    _check_caches(_OP, k_cache, v_cache, q.device, q.dtype)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"{_OP}: k_cache has head dim {k_cache.shape[3]} but q has {d}")
    if d > _MAX_HEAD_DIM or d < 1:
        raise ValueError(f"{_OP}: head_dim {d} is outside the supported 1..{_MAX_HEAD_DIM}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{_OP}: q has {hq} heads, not a multiple of k_cache's {hkv} kv heads")
    check_tensor(_OP, "cu_seqlens_q", cu_seqlens_q, dtypes=_INT_DTYPES, ndim=1, device=q.device, device_of="q")
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError(f"{_OP}: cu_seqlens_q must have B+1 >= 1 entries, got shape {tuple(cu_seqlens_q.shape)}")
    check_tensor(_OP, "context_lens", context_lens, dtypes=_INT_DTYPES, ndim=1, device=q.device, device_of="q")
    check_shape(_OP, "context_lens", context_lens, (batch,), "one per sequence of cu_seqlens_q")
    check_tensor(_OP, "block_tables", block_tables, dtypes=_INT_DTYPES, ndim=2, device=q.device, device_of="q")
    if block_tables.shape[0] != batch:
        raise ValueError(f"{_OP}: block_tables has {block_tables.shape[0]} rows; expected {batch} (one per sequence)")
    if not isinstance(window, int) or (window <= 0 and window != -1):
        raise ValueError(f"{_OP}: window must be -1 or a positive int, got {window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        raise ValueError(f"{_OP}: softcap must be a float >= 0 (0: no capping), got {softcap!r}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    # e4m3 before sm_89: Triton has no fp8e4nv there, so the reference reads those caches (slow, with
    # host syncs: the engine refuses fp8 caches on such GPUs, model_runner.py).
    k_scale, v_scale, supported = check_cache_scales(_OP, k_cache, v_cache, q.dtype, k_scale, v_scale, q.device, "q")
    backend = choose_backend(_OP, q.device, supported, UNSUPPORTED_WHY)
    if backend == "reference":
        # In bf16/fp16 SDPA's CPU kernel rounds its probabilities to that dtype, as eager attention (§3's
        # baseline) does; the reference keeps fp32. Within §3 (test_paged_attention_cpu_path_matches_reference).
        cpu = q.is_cpu and q.dtype in KERNEL_DTYPES and forced_backend() is None
        run_ref = _paged_attention_cpu if cpu else paged_attention_ref
        args = (q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, causal, window, softcap)
        return run_ref(*args, k_scale=k_scale, v_scale=v_scale)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch > 0 else 0
    q = q if q.stride(2) == 1 else q.contiguous()
    # The custom op only under torch.compile: eager (the engine's per-layer decode path) calls the launcher.
    run = _paged_attention_op if torch.compiler.is_compiling() else paged_attention_fwd
    return run(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q.contiguous(),
        context_lens.contiguous(),
        block_tables if block_tables.stride(1) == 1 else block_tables.contiguous(),
        scale,
        bool(causal),
        int(window),
        int(max_seqlen_q),
        float(softcap),
        k_scale=k_scale,
        v_scale=v_scale,
    )
