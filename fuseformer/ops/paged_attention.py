"""Attention over a paged KV cache, and the write of new K/V into it (inference only; no autograd).

KV cache layout per layer (DESIGN.md §4): k_cache, v_cache (num_blocks, block_size, Hkv, D). A
sequence's context lives in the blocks its row of ``block_tables`` (B, max_blocks) int32 names, in
order: token position p sits in block ``block_tables[b, p // block_size]`` at offset
``p % block_size``. ``slot_mapping`` (T,) int64 gives each new token's flat slot
``block * block_size + offset`` (-1: do not write).

``paged_attention`` serves a step that mixes prefill chunks (with a cached prefix) and single-token
decodes: sequence b has q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b] new queries at positions
context_lens[b] - q_len .. context_lens[b] - 1, attending to its whole context (the cached prefix
and the new tokens, already written by ``reshape_and_cache``), causal masks aligned bottom-right.
``window`` > 0 limits each query at position i to the keys j with i - window < j <= i (Hugging
Face's ``sliding_window``; flash-attn's window_size=(window - 1, 0)).

Everything below autograd lives here (STYLE.md §1): the references ``reshape_and_cache_ref`` and
``paged_attention_ref``, the Triton kernels, the launchers ``reshape_and_cache_fwd`` and
``paged_attention_fwd`` (the engine calls these), the ``torch.library`` registration and the public
functions.

The attention kernel is the straightforward one: one program per (sequence, q tile, q head), a loop
over the sequence's keys BLOCK_N at a time (pages looked up per key, so any block_size works),
online softmax in fp32. Split-K for long decodes and GQA packing are a later (tuning) issue.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import FLOAT_DTYPES, KERNEL_DTYPES, check_shape, check_tensor, empty, next_pow2
from fuseformer.runtime.backend import choose_backend

_OP_CACHE = "reshape_and_cache"
_OP = "paged_attention"
_MAX_HEAD_DIM = 256
_INT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------
def reshape_and_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v (T, Hkv, D) into the caches at ``slot_mapping`` (T,); slots < 0 are skipped."""
    nb, bs = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


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
    upcast: bool = True,
) -> torch.Tensor:
    """Pure PyTorch: gather each sequence's blocks, mask bottom-right aligned, softmax, weight V.

    Computes in fp32 (fp64 stays fp64) when ``upcast``, else in q's dtype. Returns (T, Hq, D) in
    q's dtype. A loop over sequences with host syncs: the oracle and the CPU path, not a fast path.
    """
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    compute = (torch.float64 if q.dtype == torch.float64 else torch.float32) if upcast else q.dtype
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
        k = k_cache[blocks].reshape(-1, hkv, d)[:ctx].to(compute)  # (ctx, Hkv, D)
        v = v_cache[blocks].reshape(-1, hkv, d)[:ctx].to(compute)
        k = k.repeat_interleave(hq // hkv, dim=1)  # (ctx, Hq, D)
        v = v.repeat_interleave(hq // hkv, dim=1)
        qs = q[q0:q1].to(compute)  # (q_len, Hq, D)
        s = torch.einsum("qhd,khd->hqk", qs, k) * scale
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
def _reshape_and_cache_kernel(
    K, V, K_CACHE, V_CACHE, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per (token, kv head): copy one D-vector of K and of V.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
        kc = K_CACHE + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
        vc = V_CACHE + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
        tl.store(kc, k.to(K_CACHE.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(V_CACHE.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_fwd_kernel(
    Q, K_CACHE, V_CACHE, OUT, CU_Q, CTX_LENS, BLOCK_TABLES,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    qk_scale, window, block_size, group,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(CU_Q + seq).to(tl.int64)
    q_len = (tl.load(CU_Q + seq + 1) - tl.load(CU_Q + seq)).to(tl.int32)
    if m_tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(CTX_LENS + seq).to(tl.int32)
    kv_head = (head // group).to(tl.int64)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx - q_len + offs_m  # (BLOCK_M,) absolute positions of this tile's queries
    rows = q_start + offs_m.to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Keys this tile can see: [kv_start, kv_end).
    if CAUSAL:
        kv_end = tl.minimum(ctx, ctx - q_len + (m_tile + 1) * BLOCK_M)
    else:
        kv_end = ctx
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(ctx - q_len + m_tile * BLOCK_M - window + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N

    # Finite start for the running max: a row whose keys are all masked in a tile keeps p = 0
    # instead of exp(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        page = tl.load(table + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
        slot = (offs_n % block_size).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K_CACHE + (page * stride_kb + slot * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            V_CACHE + (page * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        valid = n_mask[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            valid = valid & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        OUT + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs already checked; unit stride in the head dim)
# --------------------------------------------------------------------------------------------
def reshape_and_cache_fwd(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v (T, Hkv, D) -> k_cache, v_cache (num_blocks, block_size, Hkv, D) at slot_mapping (T,)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _reshape_and_cache_kernel[(t, hkv)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1],
        HEAD_DIM=d, BLOCK_D=next_pow2(d), num_warps=1 if d <= 128 else 2,
    )  # fmt: skip


def _attn_config(max_seqlen_q: int, head_dim: int, element_size: int) -> dict:
    # Untuned defaults (tuning is a later issue): BLOCK_M 16 for decode-heavy steps, 64 for prefill.
    # Wide tiles (fp32, or head dim > 128) take smaller blocks and one stage to stay within shared
    # memory (fp32 D=256: K and V tiles 32x256x4 B = 32 KiB each).
    block_m = 16 if max_seqlen_q <= 16 else 64
    block_n, num_stages = 64, 2
    if head_dim > 128 or element_size == 4:
        block_n = 32
    if head_dim > 128 and element_size == 4:
        block_m, num_stages = min(block_m, 32), 1
    num_warps = 8 if block_m == 64 and head_dim > 128 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


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
) -> torch.Tensor:
    """q (T, Hq, D) -> out (T, Hq, D); see the module docstring for the other arguments."""
    t, hq, d = q.shape
    out = empty((t, hq, d), dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if t == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    cfg = _attn_config(max_seqlen_q, d, q.element_size())
    grid = (batch, triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), hq)
    _paged_attention_fwd_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        softmax_scale * 1.4426950408889634, window, k_cache.shape[1], hq // k_cache.shape[2],
        CAUSAL=causal, HAS_WINDOW=window > 0,
        # fp32 inputs: true fp32 products (tf32 would fail the §3 criterion against fp32 PyTorch).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), **cfg,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile; CUDA-graph capturable (no host syncs)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fuseformer::reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def _reshape_and_cache_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    reshape_and_cache_fwd(k, v, k_cache, v_cache, slot_mapping)


@_reshape_and_cache_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None


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
) -> torch.Tensor:
    return paged_attention_fwd(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, softmax_scale, causal, window, max_seqlen_q
    )


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, softmax_scale, causal, window, max_seqlen_q):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------
def _check_caches(op: str, k_cache: object, v_cache: object, device: torch.device, dtype: torch.dtype) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, c, dtypes=(dtype,), ndim=4, device=device, device_of="q")
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), "the shape of k_cache")


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new keys and values into their slots of the paged KV cache, in place.

    Args:
        k, v: (T, Hkv, D) fp16, bf16, fp32 (fp64 runs on the reference); any strides with a unit
            stride in D (e.g. slices of a packed qkv projection go in without a copy).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), k's dtype. Written in place.
        slot_mapping: (T,) int64 (or int32): flat slot ``block * block_size + offset`` of each token;
            -1 skips the token (e.g. padding).
    """
    check_tensor(_OP_CACHE, "k", k, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(_OP_CACHE, "v", v, dtypes=(k.dtype,), ndim=3, device=k.device, device_of="k")
    check_shape(_OP_CACHE, "v", v, tuple(k.shape), "the shape of k")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(_OP_CACHE, name, c, dtypes=(k.dtype,), ndim=4, device=k.device, device_of="k")
    check_shape(_OP_CACHE, "v_cache", v_cache, tuple(k_cache.shape), "the shape of k_cache")
    check_shape(
        _OP_CACHE,
        "k_cache",
        k_cache,
        (k_cache.shape[0], k_cache.shape[1], *k.shape[1:]),
        "(blocks, block_size, Hkv, D) of k",
    )
    check_tensor(_OP_CACHE, "slot_mapping", slot_mapping, dtypes=_INT_DTYPES, ndim=1, device=k.device, device_of="k")
    check_shape(_OP_CACHE, "slot_mapping", slot_mapping, (k.shape[0],), "one slot per token of k")
    supported = k.dtype in KERNEL_DTYPES and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    backend = choose_backend(_OP_CACHE, k.device, supported, "float64 or a cache with non-unit stride in D")
    if backend == "reference":
        reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    # The custom op only under torch.compile: eager (the engine's per-layer decode path) calls the
    # launcher itself and skips the dispatcher's host time.
    run = _reshape_and_cache_op if torch.compiler.is_compiling() else reshape_and_cache_fwd
    run(k, v, k_cache, v_cache, slot_mapping.contiguous())


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
) -> torch.Tensor:
    """Attention of each sequence's new queries over its whole context in the paged KV cache.

    Args:
        q: (T, Hq, D) fp16, bf16 or fp32 (fp64 runs on the reference), the step's new queries of all
            sequences packed; unit stride in D (other strides are made contiguous).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), q's dtype; Hq a multiple of Hkv (GQA).
            The new tokens' K/V must already be written (``reshape_and_cache``).
        cu_seqlens_q: (B+1,) int32, prefix sums of the new-query counts.
        context_lens: (B,) int32, tokens of context per sequence (cached + new), each >= its q_len.
        block_tables: (B, max_blocks) int32, the blocks of each sequence's context in order.
        softmax_scale: default 1/sqrt(D).
        causal: mask bottom-right aligned (query i of q_len sits at position context_len - q_len + i).
        window: > 0 keeps only the keys j with i - window < j <= i (HF ``sliding_window``); -1 for all.
        max_seqlen_q: the largest q_len, an int known on the host (the engine has it); computed from
            cu_seqlens_q with a device sync when None.

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
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    supported = q.dtype in KERNEL_DTYPES and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    backend = choose_backend(_OP, q.device, supported, "float64 or a cache with non-unit stride in D")
    if backend == "reference":
        return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, causal, window)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch > 0 else 0
    q = q if q.stride(2) == 1 else q.contiguous()
    run = _paged_attention_op if torch.compiler.is_compiling() else paged_attention_fwd  # see reshape_and_cache
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
    )
