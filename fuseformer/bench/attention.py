"""``fuseformer bench attention``: flash_attention side by side with the attention a user would pick instead.

Peers, in the same process and run: ``torch.nn.functional.scaled_dot_product_attention`` under each
``torch.nn.attention.sdpa_kernel`` backend (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION)
and FlexAttention (``torch.compile``d, with a causal block mask). Shapes: bf16, B * S = 16384 tokens,
H 32, S 512..16384, head dim 64/128/256, causal and not (quick: the three goal cases).

TFLOP/s as flash-attn counts them: forward 4 * B * S^2 * H * D (half of it when causal), backward
2.5x the forward, forward + backward 3.5x; also as a percentage of the bf16 GEMM ceiling measured in
the same run. Each figure is a do_bench median; the backward is autograd.grad on a kept graph.
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


def bench_attention(quick: bool = False) -> list[Record]:
    """One record per (case, impl, pass): ms, TFLOP/s and % of the bf16 GEMM ceiling, or an error."""
    if quick:
        cases = GOAL_CASES
    else:
        cases = [(d, s, c) for d in (64, 128, 256) for s in (512, 1024, 2048, 4096, 8192, 16384) for c in (True, False)]
    records = []
    for d, s, c in cases:
        records += _bench_case(d, s, c)
        torch.cuda.empty_cache()
    return records
