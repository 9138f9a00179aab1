"""Launch-config sweeps for the tuning notes (docs/perf-notes.md): each config timed in one run."""

from __future__ import annotations

import importlib

import torch

from fuseformer.bench._timing import bench_ms, copy_ceiling_tb_s, tb_per_s

# The module, not the function of the same name that fuseformer.ops exports.
rn = importlib.import_module("fuseformer.ops.rms_norm")


def sweep_rms_norm() -> list[dict]:
    """rms_norm fwd and bwd over BLOCK_M, num_warps and backward programs per SM."""
    out = []
    for m, n in ((32768, 4096), (4096, 1024), (16384, 8192), (131072, 1024)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        _, _, rstd = rn.rms_norm_fwd(x, w, None, 1e-6)
        es = x.element_size()
        bn = rn.next_pow2(n)
        for block_m in (1, 2, 4, 8):
            for warps in (2, 4, 8, 16):
                if block_m * bn > 32768:
                    continue
                cfg = dict(BLOCK_M=block_m, BLOCK_N=bn, SINGLE_PASS=True, num_warps=warps)
                try:
                    ms = bench_ms(lambda cfg=cfg: rn.rms_norm_fwd(x, w, None, 1e-6, config=cfg))
                    tb = tb_per_s(2 * m * n * es, ms)
                    out.append(dict(kind="rms_norm_fwd", shape=[m, n], **cfg, ms=ms, tb_s=tb))
                except Exception as exc:
                    out.append(dict(kind="rms_norm_fwd", shape=[m, n], **cfg, error=str(exc)[:200]))
        for block_m in (1, 2, 4, 8, 16):
            for warps in (4, 8, 16):
                for per_sm in (1, 2, 4, 8):
                    if block_m * bn > 16384:
                        continue
                    cfg = dict(BLOCK_M=block_m, BLOCK_N=bn, SINGLE_PASS=True, num_warps=warps)
                    try:
                        ms = bench_ms(
                            lambda cfg=cfg, per_sm=per_sm: rn.rms_norm_bwd(
                                dy, x, w, rstd, None, config=cfg, programs_per_sm=per_sm
                            )
                        )
                        tb = tb_per_s(3 * m * n * es, ms)
                        out.append(dict(kind="rms_norm_bwd", shape=[m, n], **cfg, per_sm=per_sm, ms=ms, tb_s=tb))
                    except Exception as exc:
                        out.append(dict(kind="rms_norm_bwd", shape=[m, n], **cfg, per_sm=per_sm, error=str(exc)[:200]))
    ceiling = copy_ceiling_tb_s()
    for r in out:
        if "tb_s" in r:
            r["pct_copy"] = 100 * r["tb_s"] / ceiling
    return out


def sweep_rms_norm_long() -> list[dict]:
    """Rows of 16384..65536: one pass in registers (16/32 warps) against the chunked two-pass loop."""
    out = []
    for m, n in ((8192, 16384), (4096, 32768), (2048, 65536)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        _, _, rstd = rn.rms_norm_fwd(x, w, None, 1e-6)
        es = x.element_size()
        configs = [dict(BLOCK_M=1, BLOCK_N=rn.next_pow2(n), SINGLE_PASS=True, num_warps=wp) for wp in (16, 32)]
        configs += [
            dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, num_warps=wp)
            for bn in (2048, 4096, 8192)
            for wp in (4, 8, 16)
        ]
        for cfg in configs:
            for kind, nbytes, fn in (
                ("rms_norm_fwd", 2 * m * n * es, lambda cfg=cfg: rn.rms_norm_fwd(x, w, None, 1e-6, config=cfg)),
                (
                    "rms_norm_bwd",
                    3 * m * n * es,
                    lambda cfg=cfg: rn.rms_norm_bwd(dy, x, w, rstd, None, config=cfg, programs_per_sm=2),
                ),
            ):
                try:
                    ms = bench_ms(fn)
                    out.append(dict(kind=kind, shape=[m, n], **cfg, per_sm=2, ms=ms, tb_s=tb_per_s(nbytes, ms)))
                except Exception as exc:
                    out.append(dict(kind=kind, shape=[m, n], **cfg, error=str(exc)[:200]))
    ceiling = copy_ceiling_tb_s()
    for r in out:
        if "tb_s" in r:
            r["pct_copy"] = 100 * r["tb_s"] / ceiling
    return out


def sweep_rms_norm_residual() -> list[dict]:
    """The fused add + rms_norm forward (4 streams: x, r in; y, h out) over BLOCK_M and warps."""
    out = []
    m, n = 32768, 4096
    x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ceiling = copy_ceiling_tb_s()
    for block_m in (1, 2, 4, 8):
        for warps in (4, 8, 16, 32):
            cfg = dict(BLOCK_M=block_m, BLOCK_N=n, SINGLE_PASS=True, num_warps=warps)
            try:
                ms = bench_ms(lambda cfg=cfg: rn.rms_norm_fwd(x, w, r, 1e-6, config=cfg))
                tb = tb_per_s(4 * m * n * 2, ms)
                out.append(
                    dict(kind="add_rms_norm_fwd", shape=[m, n], **cfg, ms=ms, tb_s=tb, pct_copy=100 * tb / ceiling)
                )
            except Exception as exc:
                out.append(dict(kind="add_rms_norm_fwd", shape=[m, n], **cfg, error=str(exc)[:200]))
    return out


def sweep_overhead() -> list[dict]:
    """Host overhead per call: the public op (eager autograd path) against the bare launcher, on
    a tiny shape where the kernel itself is ~5 us, timed on the host with the GPU synchronized."""
    import time

    import fuseformer.ops as F

    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = []
    for name, fn in (
        ("launcher", lambda: rn.rms_norm_fwd(x.detach(), w.detach(), None, 1e-6)),
        ("public no grad", lambda: F.rms_norm(x.detach(), w.detach())),
        ("public with grad", lambda: F.rms_norm(x, w)),
        ("custom op with grad", lambda: rn._rms_norm_fwd_op(x, w, None, 1e-6)),
        ("torch F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6)),
    ):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        out.append(dict(kind="host_overhead", impl=name, us_per_call=(time.perf_counter() - t0) / 500 * 1e6))
    return out


def sweep_attention() -> list[dict]:
    from fuseformer.bench.attention import sweep_attention_configs

    return sweep_attention_configs(quick=True)


SWEEPS = {
    "overhead": sweep_overhead,
    "attention": sweep_attention,
    "rms_norm": sweep_rms_norm,
    "rms_norm_long": sweep_rms_norm_long,
    "rms_norm_residual": sweep_rms_norm_residual,
}
