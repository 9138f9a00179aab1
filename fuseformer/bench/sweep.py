"""Launch-config sweeps for the tuning notes (docs/perf-notes.md): each config timed in one run."""

from __future__ import annotations

import importlib
import time

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
    """The fused add + rms_norm forward (4 streams: x, r in; y, h out) over BLOCK_M, warps and the
    loads' eviction policy, with the peers of the goal timed in the same run (add then compiled
    norm; torch.compile of both)."""
    out = []
    m, n = 32768, 4096
    x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ceiling = copy_ceiling_tb_s()
    nbytes = 4 * m * n * 2

    def add_norm(x, r, w):
        h = x + r
        return torch.nn.functional.rms_norm(h, (n,), w, 1e-6), h

    compiled_pair = torch.compile(add_norm)
    compiled_norm = torch.compile(lambda h, w: torch.nn.functional.rms_norm(h, (n,), w, 1e-6))
    compiled_pair(x, r, w)
    peers = {
        "add + compiled norm": lambda: compiled_norm(x + r, w),
        "torch.compile(add + norm)": lambda: compiled_pair(x, r, w),
        "fuseformer default": lambda: rn.rms_norm_fwd(x, w, r, 1e-6),
    }
    for name, fn in peers.items():
        fn()
        ms = bench_ms(fn)
        tb = tb_per_s(nbytes, ms)
        out.append(dict(kind="add_rms_norm_peer", impl=name, shape=[m, n], ms=ms, tb_s=tb, pct_copy=100 * tb / ceiling))
    # One pass (the row in registers) against Inductor's structure: chunks of the row, h stored in
    # pass 1 and re-read (from L2) in pass 2, loads of data read for the last time "evict_first".
    configs = [dict(BLOCK_M=bm, BLOCK_N=n, SINGLE_PASS=True, num_warps=wp, EVICT="") for bm, wp in ((2, 32), (4, 8))]
    configs += [
        dict(BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=False, num_warps=wp, EVICT=ev)
        for ev in ("", "evict_first")
        for bn in (512, 1024, 2048)
        for bm in (1, 2, 4)
        for wp in (4, 8, 16)
        if bm * bn <= 4096
    ]
    for cfg in configs:
        try:
            ms = bench_ms(lambda cfg=cfg: rn.rms_norm_fwd(x, w, r, 1e-6, config=cfg))
            tb = tb_per_s(nbytes, ms)
            rec = dict(kind="add_rms_norm_fwd", shape=[m, n], **cfg, ms=ms, tb_s=tb, pct_copy=100 * tb / ceiling)
        except Exception as exc:
            rec = dict(kind="add_rms_norm_fwd", shape=[m, n], **cfg, error=str(exc)[:200])
        out.append(rec)
    return out


def sweep_small_rows() -> list[dict]:
    """rms_norm at 4096x1024 bf16, where eager calls are host-bound: for each call (ours, F.rms_norm,
    Liger; forward without and with grad, backward alone through autograd.grad) the host time per
    call (500 calls, GPU synchronized at the end), the do_bench median, the GPU time alone (CUDA
    graph replay), our direct-launch misses, and the kernels one call runs (torch.profiler)."""
    import time

    import fuseformer.ops as F

    m, n = 4096, 1024
    x0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    calls = {
        "ours launcher": lambda: rn.rms_norm_fwd(x0, w0, None, 1e-6, store_rstd=False),
        "ours fwd no grad": lambda: F.rms_norm(x0, w0),
        "ours fwd": lambda: F.rms_norm(x, w),
        "F.rms_norm fwd": lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6),
    }
    try:
        from liger_kernel.transformers.functional import liger_rms_norm

        calls["liger fwd"] = lambda: liger_rms_norm(x, w, 1e-6)
    except Exception:
        pass
    for name in [k for k in calls if k.endswith(" fwd")]:
        y = calls[name]()
        dy = torch.randn_like(y)
        calls[name.replace(" fwd", " bwd")] = lambda y=y, dy=dy: torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    out = []
    for name, fn in calls.items():
        rec = dict(kind="small_rows", impl=name, shape=[m, n])
        try:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            misses = {k: v.misses for k, v in _launchers().items()}
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            torch.cuda.synchronize()
            rec["host_us"] = (time.perf_counter() - t0) / 500 * 1e6
            rec["launch_misses_per_call"] = sum(v.misses - misses[k] for k, v in _launchers().items()) / 500
            rec["do_bench_us"] = 1e3 * bench_ms(fn)
            if not name.endswith(" bwd"):
                from fuseformer.bench._timing import bench_graph_ms

                rec["graph_us"] = 1e3 * bench_graph_ms(fn)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            rec["kernels"] = [
                dict(name=e.key[:90], calls_per_call=e.count / 20, us=e.device_time_total / e.count)
                for e in prof.key_averages()
                if e.device_time_total > 0
            ]
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(rec)
    return out


def _launchers() -> dict:
    return {"fwd": rn._fwd_launcher, "bwd": rn._bwd_launcher, "dw": rn._dw_launcher}


def sweep_train_profile() -> list[dict]:
    """Where one forward + backward of the training case (Llama 1B shape, B 4 x S 4096, every layer
    checkpointed) spends its GPU time: the 40 costliest kernels (torch.profiler) and the total."""
    from fuseformer.train.bench import LLAMA_1B, our_fwd_bwd_step

    step = our_fwd_bwd_step(dict(LLAMA_1B), 4, 4096, "cuda")
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    out = [dict(kind="train_profile", wall_ms=wall_ms, gpu_ms=total / 1e3, tokens=4 * 4096)]
    out += [
        dict(kind="train_kernel", name=e.key[:120], count=e.count, ms=e.device_time_total / 1e3,
             pct=100 * e.device_time_total / total)
        for e in events[:40]
    ]  # fmt: skip
    return out


def sweep_overhead() -> list[dict]:
    """Host overhead per call: the public op (eager autograd path) against the bare launcher, on
    a tiny shape where the kernel itself is ~5 us, timed on the host with the GPU synchronized."""

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


def sweep_flce() -> list[dict]:
    """fused_linear_cross_entropy fwd+bwd at the goal shape (8192 tokens, H 4096, V 128256) over the
    tokens per chunk: time, peak memory above the inputs, and (default chunk) the GPU time per kernel."""
    ce = importlib.import_module("fuseformer.ops.cross_entropy")
    n, h, v = 8192, 4096, 128256
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    target = torch.randint(0, v, (n,), device="cuda")
    out = []
    for chunk in (None, 256, 512, 1024):

        def step(chunk=chunk):
            return ce.fused_linear_cross_entropy_fwd(
                hidden, weight, target, None, -100, "mean", 0.0, 0.0, True, True, False, chunk_size=chunk
            )

        rec = dict(kind="flce", chunk=chunk or ce._chunk_size(n, h, v, 2))
        try:
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            rec["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            rec["ms"] = bench_ms(step, rep=200)
            if chunk is None:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                rec["kernels"] = [
                    dict(name=e.key[:100], count=e.count, ms=e.device_time_total / 1e3)
                    for e in prof.key_averages()
                    if e.device_time_total > 0
                ]
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(rec)
        torch.cuda.empty_cache()
    return out


def sweep_attention() -> list[dict]:
    from fuseformer.bench.attention import sweep_attention_configs

    return sweep_attention_configs(quick=True)


def sweep_attention64() -> list[dict]:
    """The quick attention sweep at head dim 64 (the Llama-1B training case's)."""
    from fuseformer.bench.attention import sweep_attention_configs

    return sweep_attention_configs(quick=True, head_dims=(64,))


SWEEPS = {
    "overhead": sweep_overhead,
    "attention": sweep_attention,
    "attention64": sweep_attention64,
    "rms_norm": sweep_rms_norm,
    "rms_norm_long": sweep_rms_norm_long,
    "rms_norm_residual": sweep_rms_norm_residual,
    "small_rows": sweep_small_rows,
    "train_profile": sweep_train_profile,
    "flce": sweep_flce,
}
