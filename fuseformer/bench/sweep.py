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
    for m, n in ((32768, 4096), (4096, 1024), (16384, 8192)):
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
        for block_m in (1, 2, 4):
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


SWEEPS = {"rms_norm": sweep_rms_norm}
