"""``fuseformer bench attention``: flash_attention side by side with the attention a user would pick instead.

Peers, in the same process and run: ``torch.nn.functional.scaled_dot_product_attention`` under each
``torch.nn.attention.sdpa_kernel`` backend (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION)
and FlexAttention (``torch.compile``d, with a causal block mask). Shapes: bf16, B * S = 16384 tokens,
H 32, S 512..16384, head dim 64/128/256, causal and not (quick: the three goal cases).

TFLOP/s as flash-attn counts them: forward 4 * B * S^2 * H * D (half of it when causal), backward
2.5x the forward, forward + backward 3.5x; also as a percentage of the bf16 GEMM ceiling measured in
the same run. Each figure is a do_bench median; the backward is autograd.grad on a kept graph.

Paged decode attention (``bench_paged_decode``): one query per sequence over a paged KV cache, GQA
32/8, head dim 128, in TB/s of the K/V read (and % of the copy ceiling), against SDPA on the same K/V
laid out contiguously.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fuseformer.ops as F
from fuseformer.bench._timing import bench_ms, gemm_ceiling_tflop_s, tflop_per_s

Record = dict
TOKENS, HEADS = 16384, 32
# (head dim, seqlen, causal) of the goals: fwd causal S4096, fwd full S16384, bwd causal S4096.
GOAL_CASES = [(128, 4096, True), (128, 16384, False)]


def attention_flops(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs as flash-attn counts them (two matmuls of 2 * S^2 * D per head; half if causal)."""
    flops = 4.0 * batch * seqlen * seqlen * heads * head_dim
    return flops / 2 if causal else flops


def _inputs(batch, seqlen, head_dim, dtype=torch.bfloat16):
    shape = (batch, seqlen, HEADS, head_dim)
    return [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def _impls(seqlen: int, causal: bool) -> dict[str, Callable]:
    """name -> fn(q, k, v) on (B, S, H, D) inputs returning (B, S, H, D)-compatible output."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ours(q, k, v):
        return F.flash_attention(q, k, v, causal=causal)

    def sdpa(backend):
        def fn(q, k, v):
            # (B, H, S, D) views; only the attention call is timed (transposes are views).
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
                )
            return o

        return fn

    impls = {
        "fuseformer": ours,
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        mask = None
        if causal:
            mask = create_block_mask(
                lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen
            )

        def flex_fn(q, k, v):
            return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask)

        impls["flex"] = flex_fn
    except Exception as exc:  # an older torch without FlexAttention: recorded as an error below
        err = f"{type(exc).__name__}: {exc}"[:300]

        def flex_missing(q, k, v, err=err):
            raise RuntimeError(err)

        impls["flex"] = flex_missing
    return impls


def _record(case: dict, impl: str, pass_: str, flops: float, fn: Callable[[], object]) -> Record:
    rec: Record = dict(case, impl=impl, pass_=pass_)
    try:
        fn()  # compile / warm up outside the timing
        ms = bench_ms(fn)
        tf = tflop_per_s(flops, ms)
        rec.update(ms=ms, tflop_s=tf, pct_gemm=100 * tf / gemm_ceiling_tflop_s())
    except Exception as exc:  # one failing peer must not kill the run
        rec.update(error=f"{type(exc).__name__}: {exc}"[:300])
    return rec


def _bench_case(head_dim: int, seqlen: int, causal: bool) -> list[Record]:
    batch = TOKENS // seqlen
    case = dict(op="attention", batch=batch, seqlen=seqlen, heads=HEADS, head_dim=head_dim, causal=causal)
    case["dtype"] = "bfloat16"
    flops = attention_flops(batch, seqlen, HEADS, head_dim, causal)
    q, k, v = _inputs(batch, seqlen, head_dim)
    records = []
    for name, fn in _impls(seqlen, causal).items():
        records.append(_record(case, name, "fwd", flops, lambda fn=fn: fn(q, k, v)))
        try:
            out = fn(q, k, v)
            dout = torch.randn_like(out)
            bwd = lambda out=out, dout=dout: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            records.append(_record(case, name, "bwd", 2.5 * flops, bwd))
            del out
        except Exception as exc:
            records.append(dict(case, impl=name, pass_="bwd", error=f"{type(exc).__name__}: {exc}"[:300]))

        def fwd_bwd(fn=fn):
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        records.append(_record(case, name, "fwd_bwd", 3.5 * flops, fwd_bwd))
    return records


# Paged decode attention (issue 28 item 5): (sequences, context) with GQA 32/8, head dim 128, blocks of 16.
PAGED_DECODE_CASES = [(64, 4096), (256, 1024)]
PAGED_HEADS, PAGED_KV_HEADS, PAGED_HEAD_DIM, PAGED_BLOCK = 32, 8, 128, 16


def paged_decode_inputs(batch: int, context: int, device: str = "cuda", dtype=torch.bfloat16, seed: int = 0):
    """A decode step's paged attention inputs: q (B, Hq, D); a cache of B * ceil(context / block) blocks
    (+1 free) handed out in a random order, as a busy engine's pool does; the same K/V contiguous as
    (B, Hkv, context, D) for the peers. Returns (q, k_cache, v_cache, cu_seqlens_q, context_lens,
    block_tables, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // PAGED_BLOCK)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, PAGED_BLOCK, PAGED_KV_HEADS, PAGED_HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    tables = (1 + torch.randperm(num_blocks - 1, generator=gen)).view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch, PAGED_HEADS, PAGED_HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    tables = tables.to(device)

    def contiguous(cache):  # (B, Hkv, context, D)
        return cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    return q, k_cache, v_cache, cu, lens, tables, contiguous(k_cache), contiguous(v_cache)


def paged_decode_bytes(batch: int, context: int, element_size: int = 2) -> int:
    """Bytes a decode step's attention must move: each sequence's K and V once, q read, out written."""
    kv = 2 * batch * context * PAGED_KV_HEADS * PAGED_HEAD_DIM * element_size
    return kv + 2 * batch * PAGED_HEADS * PAGED_HEAD_DIM * element_size


def _paged_decode_impls(inputs) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> fn() returning (B, Hq, D): ours on the paged cache; SDPA's backends on the same K/V laid
    out contiguously (what a non-paged engine reads: the same bytes, no block table)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k_cache, v_cache, cu, lens, tables, k, v = inputs

    def ours():
        return F.paged_attention(q, k_cache, v_cache, cu, lens, tables, causal=True, max_seqlen_q=1)

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)
            return out.squeeze(2)

        return fn

    return {
        "fuseformer paged": ours,
        "sdpa_flash contiguous": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn contiguous": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient contiguous": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }


def bench_paged_decode(cases=PAGED_DECODE_CASES) -> list[Record]:
    """One record per (case, impl): do_bench ms (L2 flushed; the K/V are ~1 GB, far past L2) and the
    CUDA-graph ms (no host overhead, as the engine replays it), TB/s of ``paged_decode_bytes`` and % of
    the copy ceiling measured here; ``max_err`` against SDPA's math backend in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fuseformer.bench._timing import bench_graph_ms, copy_ceiling_tb_s, tb_per_s

    copy = copy_ceiling_tb_s()
    records = []
    for batch, context in cases:
        case = dict(op="paged_decode_attention", batch=batch, context=context, heads=PAGED_HEADS,
                    kv_heads=PAGED_KV_HEADS, head_dim=PAGED_HEAD_DIM, block_size=PAGED_BLOCK, dtype="bfloat16")  # fmt: skip
        inputs = paged_decode_inputs(batch, context)
        nbytes = paged_decode_bytes(batch, context)
        q, k, v = inputs[0], inputs[6], inputs[7]
        with sdpa_kernel(SDPBackend.MATH):
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float().unsqueeze(2), k.float(), v.float(), enable_gqa=True
            ).squeeze(2)
        for impl, fn in _paged_decode_impls(inputs).items():
            rec: Record = dict(case, impl=impl, bytes=nbytes, copy_tb_s=copy)
            try:
                rec["max_err"] = float((fn().float() - ref).abs().max())
                ms, graph_ms = bench_ms(fn), bench_graph_ms(fn)
                rec.update(ms=ms, tb_s=tb_per_s(nbytes, ms), graph_ms=graph_ms, graph_tb_s=tb_per_s(nbytes, graph_ms))
                rec.update(pct_copy=100 * rec["tb_s"] / copy, graph_pct_copy=100 * rec["graph_tb_s"] / copy)
            except Exception as exc:  # one failing peer must not kill the run
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            records.append(rec)
        del inputs, q, k, v, ref
        torch.cuda.empty_cache()
    return records


def bench_attention(quick: bool = False) -> list[Record]:
    """One record per (case, impl, pass): ms, TFLOP/s and % of the bf16 GEMM ceiling, or an error; then
    the paged decode cases (``bench_paged_decode``: ms, TB/s, % of copy)."""
    if quick:
        cases = GOAL_CASES
    else:
        cases = [(d, s, c) for d in (64, 128, 256) for s in (512, 1024, 2048, 4096, 8192, 16384) for c in (True, False)]
    records = []
    for d, s, c in cases:
        records += _bench_case(d, s, c)
        torch.cuda.empty_cache()
    return records + bench_paged_decode()
