"""``fuseformer bench attention``: flash_attention side by side with the attention a user would pick instead.

Peers, in the same process and run: ``torch.nn.functional.scaled_dot_product_attention`` under each
``torch.nn.attention.sdpa_kernel`` backend (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION)
and FlexAttention (``torch.compile``d, with a causal block mask). Shapes: bf16, B * S = 16384 tokens,
H 32, S 512..16384, head dim 64/128/256, causal and not (quick: the three goal cases).

TFLOP/s as flash-attn counts them: forward 4 * B * S^2 * H * D (half of it when causal), backward
2.5x the forward, forward + backward 3.5x; also as a percentage of the bf16 GEMM ceiling measured in
the same run. Each figure is a do_bench median; the backward is autograd.grad on a kept graph.

``sweep_attention_configs`` times the kernels over block sizes, warps and stages (and the dq mode)
on the goal shapes, for choosing the tables in ops/attention.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

import fuseformer.ops as F
from fuseformer.bench._timing import bench_ms, gemm_ceiling_tflop_s, tflop_per_s
from fuseformer.ops._utils import next_pow2

Record = dict
TOKENS, HEADS = 16384, 32
# (head dim, seqlen, causal) of the goals: fwd causal S4096, fwd full S16384, bwd causal S4096.
GOAL_CASES = [(128, 4096, True), (128, 16384, False)]

# The modules, not the functions of the same names that fuseformer.ops exports.
_attn = importlib.import_module("fuseformer.ops.attention")
_attn_bwd = importlib.import_module("fuseformer.ops.attention_bwd")


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


# --------------------------------------------------------------------------------------------
# Config sweep (for the tables in ops/attention.py)
# --------------------------------------------------------------------------------------------
def sweep_attention_configs(quick: bool = False, head_dims: tuple[int, ...] = (128,)) -> list[Record]:
    """Time the forward, dk/dv and dq kernels over the candidates of ops/attention.py's tuner
    (``candidate_configs``: the full grid, or around the current tables when ``quick``) on the goal
    shapes (bf16, H 32): causal S4096 for all three kernels, full S16384 for the forward (and, not
    quick, the backward).

    Each record: kernel, case, config (as requested; a config that does not fit falls back, see
    ``launch``), ms, TFLOP/s (the forward's count for fwd; the backward's 2.5x for the whole
    backward with that dk/dv or dq config), or an error.
    """
    records = []
    for d in head_dims:
        records += _sweep_case(d, 4096, True, quick, backward=True)
        torch.cuda.empty_cache()
        records += _sweep_case(d, 16384, False, quick, backward=not quick)
        torch.cuda.empty_cache()
    return records


def _sweep_case(d: int, seqlen: int, causal: bool, quick: bool, backward: bool) -> list[Record]:
    batch = TOKENS // seqlen
    case = dict(batch=batch, seqlen=seqlen, heads=HEADS, head_dim=d, causal=causal)
    flops = attention_flops(batch, seqlen, HEADS, d, causal)
    q, k, v = (t.detach() for t in _inputs(batch, seqlen, d))
    scale = d**-0.5
    right = 0 if causal else -1
    args = (q, k, v, None, None, seqlen, seqlen, scale, -1, right)
    out, lse = _attn.flash_attention_fwd(*args)
    dout = torch.randn_like(out)
    block_d = max(16, next_pow2(d))

    def fwd():
        _attn.flash_attention_fwd(*args)

    def bwd(dq_mode):
        _attn_bwd.flash_attention_bwd(
            dout, q, k, v, out, lse, None, None, None, seqlen, seqlen, scale, -1, right, dq_mode=dq_mode
        )

    records = []
    for cfg in _attn.candidate_configs("fwd", block_d, causal, quick):
        with _attn.tuning_config("fwd", cfg):
            records.append(_record(dict(case, kernel="fwd", **cfg), "fuseformer", "fwd", flops, fwd))
    if not backward:
        return records
    for mode in ("separate", "atomic"):
        for cfg in _attn.candidate_configs("bwd_dkdv", block_d, causal, quick):
            with _attn.tuning_config("bwd_dkdv", cfg):
                rec = dict(case, kernel=f"bwd_dkdv[{mode}]", **cfg)
                records.append(_record(rec, "fuseformer", "bwd", 2.5 * flops, lambda mode=mode: bwd(mode)))
    for cfg in _attn.candidate_configs("bwd_dq", block_d, causal, quick):
        with _attn.tuning_config("bwd_dq", cfg):
            rec = dict(case, kernel="bwd_dq", **cfg)
            records.append(_record(rec, "fuseformer", "bwd", 2.5 * flops, lambda: bwd("separate")))
    return records


def best_configs(records: list[Record]) -> dict[str, Record]:
    """The fastest record per (kernel, case) of a sweep."""
    best: dict[str, Record] = {}
    for r in records:
        if "ms" not in r:
            continue
        key = f"{r['kernel']} d{r['head_dim']} S{r['seqlen']} {'causal' if r['causal'] else 'full'}"
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return best
