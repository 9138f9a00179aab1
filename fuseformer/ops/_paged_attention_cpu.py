"""The CPU path of paged_attention's reference backend (ops/paged_attention.py): what that backend runs
on fp32 CPU tensors unless the reference is forced. The reference's results within DESIGN.md §3, in
fewer ops: a decode step calls it once per layer, and on a CPU each op's dispatch costs as much as its
arithmetic at one token (SmolLM-135M shape, 1 thread, 2026-12-03: 1.45 ms -> 0.37 ms a call). Its own
file only to keep paged_attention.py under the size limit; paged_attention.py re-exports it.
"""

from __future__ import annotations

import torch

from fuseformer.ops._fp8_kv_cache import dequantize, is_fp8

_OP = "paged_attention"


def _paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention_ref's loop over sequences with each one's attention done by torch's SDPA (its
    CPU kernel accumulates in fp32; GQA by ``enable_gqa``, without repeating K/V); a mask only where
    some key is masked. With ``softcap`` > 0 (SDPA cannot cap its scores) the capped scores are
    computed here, per KV group without repeating K/V. e4m3 caches: each sequence's gathered K/V
    dequantized to q's dtype (times ``k_scale`` / ``v_scale``). (T, Hq, D) in q's dtype."""
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    whole = len(cu) == 2 and cu[0] == 0 and cu[1] == t  # one sequence owns every row: return its output
    out = None if whole else torch.zeros(t, hq, d, dtype=q.dtype, device=q.device)
    for b in range(len(cu) - 1):
        q0, q1, ctx = cu[b], cu[b + 1], ctx_lens[b]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len > ctx:
            raise ValueError(f"{_OP}: sequence {b} has {q_len} new queries but a context of only {ctx}")
        blocks = block_tables[b, : (ctx + bs - 1) // bs]
        ids = blocks.tolist()
        run = 0 <= ids[0] and ids[-1] < k_cache.shape[0] and ids == list(range(ids[0], ids[0] + len(ids)))
        if run and k_cache.is_contiguous() and v_cache.is_contiguous():
            # Blocks in a run (the pool hands a lone sequence consecutive blocks): a view, no gather.
            k = k_cache.view(-1, hkv, d)[ids[0] * bs : ids[0] * bs + ctx]  # (ctx, Hkv, D)
            v = v_cache.view(-1, hkv, d)[ids[0] * bs : ids[0] * bs + ctx]
        else:  # index_select: ~3x faster than advanced indexing at a decode's few blocks
            k = k_cache.index_select(0, blocks).view(-1, hkv, d)[:ctx]
            v = v_cache.index_select(0, blocks).view(-1, hkv, d)[:ctx]
        if is_fp8(k):
            k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
        qs = q[q0:q1].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, D)
        # Query i sits at position ctx - q_len + i (bottom-right aligned); the mask is built only when
        # a key is outside some query's range: causal with q_len > 1, or a window shorter than the context.
        windowed = window > 0 and ctx - q_len >= window
        mask, is_causal = None, False
        if causal and q_len == ctx and not windowed:
            is_causal = True  # SDPA's top-left causal mask is the bottom-right one when q_len == ctx
        elif (causal and q_len > 1) or windowed:
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device)
            if causal:
                mask &= k_pos <= q_pos
            if window > 0:
                mask &= k_pos > q_pos - window
        if softcap > 0:
            o = _capped_attention(qs[0], k[0], v[0], scale, softcap, mask, is_causal).transpose(0, 1)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv
            )[0].transpose(0, 1)  # (q_len, Hq, D)
        if whole:
            return o.contiguous()
        out[q0:q1] = o
    return out if out is not None else torch.zeros(t, hq, d, dtype=q.dtype, device=q.device)


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float,
    mask: torch.Tensor | None,
    is_causal: bool,
) -> torch.Tensor:
    """q (Hq, q_len, D), k/v (Hkv, ctx, D) -> (Hq, q_len, D): softmax(softcap * tanh(s / softcap) + mask) v
    with s = scale * q k^T, in fp32 (q's dtype out); q heads grouped per KV head, K/V not repeated."""
    hq, q_len, d = q.shape
    hkv, ctx = k.shape[0], k.shape[1]
    qg = q.float().reshape(hkv, hq // hkv * q_len, d)  # (Hkv, group * q_len, D): head h = kv * group + g
    s = torch.matmul(qg, k.float().transpose(1, 2)).view(hq, q_len, ctx) * scale
    s = softcap * torch.tanh(s / softcap)
    if is_causal:  # q_len == ctx: top-left is bottom-right
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).view(hkv, hq // hkv * q_len, ctx)
    return torch.matmul(p, v.float()).view(hq, q_len, d).to(q.dtype)
