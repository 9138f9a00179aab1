"""The lab: launch-config sweeps and one-off investigations behind docs/perf-notes.md, each timed in one
run on a CUDA GPU. Not part of the installed package (DESIGN.md §1; STYLE.md §15): what a sweep varies
is an argument of the op's launcher (``config=``, ``gluon=``, ``pdl=``, ``dkdv_config=``, ``dq_config=``,
``gluon_dq_config=``, ``chunk_size=``), never a module global set from here. The tuning drivers of
``fuseformer bench --tune`` are fuseformer/bench/tune.py; the candidates they time are the ops' own
``candidate_configs``, which the config sweeps below time too.

    python benchmarks/sweeps.py NAME [NAME ...] [--out DIR]     # records as JSON lines, and DIR/sweep.json
    python benchmarks/sweeps.py --list

Moved out of ``fuseformer/bench/sweep.py`` in session 19 (``fuseformer bench sweep`` and
``FUSEFORMER_SWEEPS`` are gone). Sweeps of experiments that were measured and not shipped were deleted
there; their results are in docs/perf-notes.md and their code in the commits before session 19:
attention_fold, attention_layouts, flce_plan, mlp_decode_timeline (+ _t32), mlp_decode_pdl.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from fuseformer.bench._timing import (
    bench_graph_ms,
    bench_ms,
    bench_stream_ms,
    copy_ceiling_tb_s,
    gpu_kernels,
    peak_gib_above,
    stream_copy_ceiling_tb_s,
    tb_per_s,
)

# The modules, not the function of the same name that fuseformer.ops exports.
rn = importlib.import_module("fuseformer.ops.rms_norm")
rn_bwd = importlib.import_module("fuseformer.ops.rms_norm_bwd")


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
    """The fused add + rms_norm forward (4 streams: x, r in; y, h out): one pass (the row in
    registers) over BLOCK_M and warps, against Inductor's structure (chunks of the row, h stored in
    pass 1 and re-read from L2 in pass 2). Its peers are the add_rms_norm rows of ``bench ops``."""
    out = []
    m, n = 32768, 4096
    x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ceiling = copy_ceiling_tb_s()
    configs = [dict(BLOCK_M=bm, BLOCK_N=n, SINGLE_PASS=True, num_warps=wp) for bm in (1, 2, 4) for wp in (4, 8, 16, 32)]
    configs += [
        dict(BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=False, num_warps=wp)
        for bn in (512, 1024, 2048)
        for bm in (1, 2, 4)
        for wp in (4, 8, 16)
        if bm * bn <= 4096
    ]
    for cfg in configs:
        try:
            ms = bench_ms(lambda cfg=cfg: rn.rms_norm_fwd(x, w, r, 1e-6, config=cfg))
            tb = tb_per_s(4 * m * n * 2, ms)
            rec = dict(kind="add_rms_norm_fwd", shape=[m, n], **cfg, ms=ms, tb_s=tb, pct_copy=100 * tb / ceiling)
        except Exception as exc:
            rec = dict(kind="add_rms_norm_fwd", shape=[m, n], **cfg, error=str(exc)[:200])
        out.append(rec)
    return out


def sweep_add_rms_norm() -> list[dict]:
    """The fused add + rms_norm forward at 32768x4096 bf16 (issue 2's >= 1.3x case): the default
    config against ``RELOAD`` two-loop configs (Inductor's structure for the pair: pass 1 loads x and
    r with evict_last for the sum of squares, pass 2 re-reads them with evict_first and stores h and
    y), with the bench's peers timed in the same run: the add followed by the compiled norm (the
    goal's baseline) and torch.compile of both. Each record has its ratio to the baseline. (Runs
    35-36 also timed persistent grids, 90-91% of copy, and unmasked blocks, no change: both dropped.)"""
    from fuseformer.bench.ops import _rms_norm_eager

    m, n = 32768, 4096
    x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
    nbytes = 4 * m * n * 2
    ceiling = copy_ceiling_tb_s()
    compiled = torch.compile(_rms_norm_eager, dynamic=False)
    both = torch.compile(lambda x, r, w: (_rms_norm_eager(x + r, w), x + r), dynamic=False)
    peers = {"add + torch.compile norm": lambda: compiled(x + r, w), "torch.compile(add + norm)": lambda: both(x, r, w)}
    configs = [dict(rn.fwd_config(n, True, torch.bfloat16))]  # the default, first
    configs += [dict(BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=False, num_warps=wp, RELOAD=True)
                for bm, bn, wp in ((1, 1024, 4), (1, 2048, 8), (1, 2048, 4), (1, 4096, 8), (1, 4096, 16), (2, 1024, 8),
                                   (2, 2048, 8), (4, 1024, 8))]  # fmt: skip
    runs = [(name, fn, None) for name, fn in peers.items()]
    runs += [("fuseformer", lambda cfg=cfg: rn.rms_norm_fwd(x, w, r, 1e-6, config=cfg), cfg) for cfg in configs]
    out = []
    for impl, fn, cfg in runs + runs[:1]:  # the baseline again at the end: drift within the run
        try:
            ms = bench_ms(fn)
            tb = tb_per_s(nbytes, ms)
            rec = dict(kind="add_rms_norm", impl=impl, shape=[m, n], **(cfg or {}), ms=ms, tb_s=tb,
                       pct_copy=100 * tb / ceiling)  # fmt: skip
        except Exception as exc:
            rec = dict(kind="add_rms_norm", impl=impl, shape=[m, n], **(cfg or {}), error=str(exc)[:200])
        out.append(rec)
    base = [rec["ms"] for rec in out if rec["impl"] == "add + torch.compile norm" and "ms" in rec]
    for rec in out:
        if base and "ms" in rec:
            rec["ratio_to_baseline"] = min(base) / rec["ms"]  # the baseline's better timing: the harder bar
    return out


def _host_us(fn, calls: int = 500) -> float:
    """Host µs per call of ``fn`` (after 50 warm-up calls; the GPU synchronized before and after)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _small_rows_backward_breakdown(x: torch.Tensor, w: torch.Tensor, calls: int = 500) -> dict:
    """Where the host time of ``autograd.grad`` through our eager rms_norm goes: a copy of its
    autograd.Function whose backward stamps ``perf_counter`` at its entry, around ``rms_norm_bwd``
    and at its exit, against stamps before and after ``autograd.grad``. Mean µs per call of: the
    engine until our backward starts (on its device thread), our backward before ``rms_norm_bwd``
    (saved tensors, contiguity), ``rms_norm_bwd`` itself, our backward after it, and the engine after
    our backward returns; and ``rms_norm_bwd`` called directly on the main thread, for comparison."""
    from fuseformer.ops._utils import autograd_function

    stamps: list[float] = []
    clock = time.perf_counter

    def timed_bwd(*args):
        stamps.append(clock())
        result = rn.rms_norm_bwd(*args)
        stamps.append(clock())
        return result

    inner = rn._backward_with(timed_bwd)

    def backward(ctx, *grads):
        stamps.append(clock())
        result = inner(ctx, *grads)
        stamps.append(clock())
        return result

    fn = autograd_function("_TimedRMSNorm", rn._forward_eager, None, backward)
    y = fn.apply(x, w, None, 1e-6)
    dy = torch.randn_like(y)
    sums = [0.0] * 5
    for rep in range(50 + calls):
        stamps.clear()
        t0 = clock()
        torch.autograd.grad(y, (x, w), dy, retain_graph=True)
        t_end = clock()
        if rep >= 50:
            points = [t0, *stamps, t_end]  # t0, enter, before bwd, after bwd, exit, end
            for j in range(5):
                sums[j] += points[j + 1] - points[j]
    torch.cuda.synchronize()
    rstd = rn.rms_norm_fwd(x.detach(), w.detach(), None, 1e-6)[2]
    direct = _host_us(lambda: rn.rms_norm_bwd(dy, x.detach(), w.detach(), rstd), calls)
    # The same loop on a Python thread of its own: is any thread but the main one slower (per-thread
    # state, or a core woken for the work), or only autograd's device thread?
    import threading

    on_thread: list[float] = []
    worker = threading.Thread(target=lambda: on_thread.append(
        _host_us(lambda: rn.rms_norm_bwd(dy, x.detach(), w.detach(), rstd), calls)))  # fmt: skip
    worker.start()
    worker.join()
    names = ("engine until our backward", "our backward before rms_norm_bwd", "rms_norm_bwd",
             "our backward after rms_norm_bwd", "engine after our backward")  # fmt: skip
    return dict(kind="small_rows_bwd_breakdown", shape=list(x.shape),
                us={name: 1e6 * v / calls for name, v in zip(names, sums)}, rms_norm_bwd_direct_us=direct,
                rms_norm_bwd_python_thread_us=on_thread[0] if on_thread else None)  # fmt: skip


def sweep_small_rows() -> list[dict]:
    """rms_norm at 4096x1024 bf16, where eager calls are host-bound: for each call (our launcher,
    public op and custom op; F.rms_norm; Liger; forward without and with grad, backward alone through
    autograd.grad) the host time per call, the do_bench median, the GPU time alone (CUDA graph
    replay, forward only), our direct-launch misses, and the kernels one call runs."""
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
    # Zero-work graph nodes (no kernel in their backward): what autograd.grad itself costs through a
    # C++ node (a view's) and through a Python autograd.Function returning stored gradients.
    gx, gw = torch.randn_like(x0), torch.randn_like(w0)

    class _StoredGrads(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x.clone()

        @staticmethod
        def backward(ctx, dy):
            return gx, gw

    calls["no-kernel C++ node (view) fwd"] = lambda: x.view(m, n)
    calls["no-kernel Python node fwd"] = lambda: _StoredGrads.apply(x, w)
    for name in [k for k in calls if k.endswith(" fwd")]:
        y = calls[name]()
        dy = torch.randn_like(y)
        inputs = (x,) if name.startswith("no-kernel C++") else (x, w)  # a view of x: w gets no gradient
        calls[name.replace(" fwd", " bwd")] = lambda y=y, dy=dy, inputs=inputs: torch.autograd.grad(
            y, inputs, dy, retain_graph=True
        )
    # Last: the first call of a torch.library custom op with autograd may set up state the others
    # would then pay for (see the note on the kernel listing below).
    calls["ours custom op with grad"] = lambda: rn._rms_norm_fwd_op(x, w, None, 1e-6)
    launchers = (rn._fwd_launcher, rn_bwd._bwd_launcher, rn_bwd._dw_launcher)
    out = []
    for name, fn in calls.items():
        rec = dict(kind="small_rows", impl=name, shape=[m, n])
        try:
            misses = sum(lc.misses for lc in launchers)
            rec["host_us"] = _host_us(fn)
            rec["launch_misses_per_call"] = (sum(lc.misses for lc in launchers) - misses) / (50 + 500)
            rec["do_bench_us"] = 1e3 * bench_ms(fn)
            if not name.endswith(" bwd"):
                rec["graph_us"] = 1e3 * bench_graph_ms(fn)
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(rec)
    out.append(_small_rows_backward_breakdown(x, w))
    # The kernels by torch.profiler, after every timing. In run 45 (kernel listings interleaved with
    # the timings, the custom op timed third) the Python autograd.Functions' calls (ours, Liger's)
    # came out 2-4x slower than in `bench ops` in a fresh process on the same machine (ours fwd 38.0
    # vs 9.9 us do_bench, Liger 99.6 vs 26.5) while F.rms_norm's matched (11.0 vs 10.9): something
    # run before them (a profiler session or the custom op's first call) taxed them.
    for rec, fn in zip(out, calls.values()):
        if "error" not in rec:
            try:
                rec["kernels"] = gpu_kernels(fn, reps=20)
            except Exception as exc:
                rec["kernels_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def sweep_train_profile() -> list[dict]:
    """Where one forward + backward of the training case (Llama 1B shape, B 4 x S 4096, every layer
    checkpointed) spends its GPU time, ours and HF + Liger's (when installed) in the same run: the
    40 costliest kernels of each (torch.profiler) and the totals."""
    from fuseformer.train.bench import LLAMA_1B, hf_fwd_bwd_step, our_fwd_bwd_step

    out = []
    impls = {"fuseformer": lambda: our_fwd_bwd_step(dict(LLAMA_1B), 4, 4096, "cuda")}
    impls["hf+liger"] = lambda: hf_fwd_bwd_step(dict(LLAMA_1B), 4, 4096, "cuda", liger=True)
    for impl, make in impls.items():
        try:
            step = make()
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
            kernels = gpu_kernels(step)
        except Exception as exc:  # Liger missing, or out of memory: the other profile still counts
            out.append(dict(kind="train_profile", impl=impl, error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        finally:
            step = None
            torch.cuda.empty_cache()
        gpu_ms = sum(k["ms_per_call"] for k in kernels)
        out.append(dict(kind="train_profile", impl=impl, wall_ms=wall_ms, gpu_ms=gpu_ms, tokens=4 * 4096))
        out += [dict(kind="train_kernel", impl=impl, **k, pct=100 * k["ms_per_call"] / gpu_ms) for k in kernels[:40]]
    return out


def sweep_flce() -> list[dict]:
    """fused_linear_cross_entropy fwd+bwd at the goal shape (8192 tokens, H 4096, V 128256) over the
    tokens per chunk: time, peak memory above the inputs, and (default chunk) the GPU time per kernel.
    (Runs 72-74 also timed the column CE kernels' tiles by setting ``_COLS_CONFIG``: 64 x 128 / 4 warps
    shipped; that part is in the commits before session 19.)"""
    ce = importlib.import_module("fuseformer.ops.fused_linear_cross_entropy")
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

        rec = dict(kind="flce", chunk=chunk or ce._chunk_size(n, h, v, 2), schedule="default" if chunk is None
                   else "fixed chunks")  # fmt: skip
        try:
            step()
            rec["peak_gib_above_inputs"] = peak_gib_above(step)
            rec["ms"] = bench_ms(step, rep=200)
            if chunk is None:
                rec["kernels"] = gpu_kernels(step)
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(rec)
        torch.cuda.empty_cache()
    return out


def sweep_flce_gemms() -> list[dict]:
    """The growing chunks' kernels alone at the goal shape (H 4096, V 128256, bf16) over the tokens a
    chunk (c): the logits GEMM (c, V) and its transposed form (V, c), grad_hidden's GEMM from either,
    grad_weight's update (addmm_, K = c) from either, and the CE kernel; each the median ms of do_bench
    and its TFLOP/s (2 c H V FLOPs a GEMM), on random data. The floor of the update: grad_weight's
    ``mul_(1)`` (one read and one write of it)."""
    ce = importlib.import_module("fuseformer.ops.cross_entropy")
    h, v = 4096, 128256
    cmax = 1024
    hidden = torch.randn(cmax, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    target = torch.randint(0, v, (cmax,), device="cuda")
    dw = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    logits_buf = torch.randn(cmax * v, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(cmax, h, device="cuda", dtype=torch.bfloat16)
    loss = torch.empty(cmax, device="cuda", dtype=torch.float32)
    lse = torch.empty(cmax, device="cuda", dtype=torch.float32)
    scale = torch.full((), 1.0 / 8192, device="cuda")
    out = [dict(kind="flce_gemm", op="dw mul_(1) floor", ms=bench_ms(lambda: dw.mul_(1), rep=300))]
    for c in (240, 256, 272, 288, 304, 320, 336, 352, 384, 448, 512, 768, 1024):
        h_c = hidden[:c]
        rows = logits_buf[: c * v].view(c, v)  # (c, V)
        cols = logits_buf[: c * v].view(v, c)  # (V, c)
        fl = 2 * c * h * v
        ops = {
            "logits (c,V)": lambda: torch.matmul(h_c, weight.T, out=rows),
            "logits^T (V,c)": lambda: torch.matmul(weight, h_c.T, out=cols),
            "dh from (c,V)": lambda: torch.matmul(rows, weight, out=dh[:c]),
            "dh from (V,c)": lambda: torch.matmul(cols.T, weight, out=dh[:c]),
            "dw += from (c,V)": lambda: dw.addmm_(rows.T, h_c),
            "dw += from (V,c)": lambda: dw.addmm_(cols, h_c),
        }
        for name, fn in ops.items():
            rec = dict(kind="flce_gemm", op=name, tokens=c)
            try:
                fn()
                rec["ms"] = bench_ms(fn, rep=150)
                rec["tflops"] = fl / rec["ms"] / 1e9
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            out.append(rec)

        def ce_row(rows=rows, c=c):  # in place: from the second call on its input is its own dlogits (not zeros)
            ce._launch(rows, target[:c], loss[:c], lse[:c], rows, scale, -100, 0.0, 0.0,
                       lse_given=False, write_loss=True, write_grad=True)  # fmt: skip

        rec = dict(kind="flce_gemm", op="ce row kernel", tokens=c)
        rec["ms"] = bench_ms(ce_row, rep=150)
        out.append(rec)
        print(json.dumps(out[-7:]), flush=True)
    return out


def _nvml_handle():
    """An NVML handle for the current CUDA device, or None where pynvml is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:
        return None


def _energy_record(fn: Callable[[], object], handle, seconds: float = 3.0) -> dict:
    """Run ``fn`` back to back for about ``seconds`` (after one timed call to size the loop) and read
    NVML's energy counter around the loop: ms and joules a call, the mean power, the enforced power
    limit, and from a thread polling every 10 ms the median power and SM clock and the share of
    samples whose clock was held down by the software power cap (NVML's throttle-reason bit 0x4) or
    by heat (0x8 | 0x20 | 0x40)."""
    import threading

    import pynvml

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(3, int(seconds / max(time.perf_counter() - t0, 1e-4)))
    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            samples.append((pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)))  # fmt: skip
            time.sleep(0.01)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    thread = threading.Thread(target=poll, daemon=True)
    e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    start.record()
    thread.start()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    e1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    stop.set()
    thread.join()
    ms = start.elapsed_time(end) / calls
    joules = (e1 - e0) / 1e3 / calls
    busy = samples[len(samples) // 10 :] or samples  # skip the loop's first tenth (launch ramp)
    return dict(
        calls=calls, loop_ms=ms, joules=joules, mean_w=joules / (ms / 1e3),
        power_limit_w=pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
        median_w=statistics.median(s[0] for s in busy), median_sm_mhz=statistics.median(s[1] for s in busy),
        power_capped=sum(bool(s[2] & 0x4) for s in busy) / len(busy),
        thermal=sum(bool(s[2] & 0x68) for s in busy) / len(busy),
    )  # fmt: skip


def sweep_flce_energy() -> list[dict]:
    """Whether the FLCE's time at the goal shape (8192 tokens, H 4096, V 128256, bf16, fwd + bwd through
    autograd as `bench mlp_ce` times it) follows its energy: for ours, ours with more logits memory
    (fixed 512 / 1024-token chunks), eager, Liger, the three
    GEMMs alone at full size (25.8 TFLOP, no CE: what every schedule must compute), a 1 GiB copy and an
    8192^3 GEMM: do_bench's median, then NVML's energy counter over ~3 s of back-to-back calls
    (:func:`_energy_record`), each after the same heating, the shipped plan first and last. (Run 106
    also timed the growing chunks' scratch x1.5 / x2 / x3 by replacing ``_growing_plan``; a memory-budget
    goal would make that scratch a launcher argument, not a patched module function.)"""
    ce = importlib.import_module("fuseformer.ops.fused_linear_cross_entropy")
    mlp_ce = importlib.import_module("fuseformer.bench.mlp_ce")
    handle = _nvml_handle()
    hidden, weight, target = mlp_ce.ce_inputs()
    (n, h), v = hidden.shape, weight.shape[0]

    def ours(chunk=None):
        return mlp_ce.ce_step(lambda: ce.fused_linear_cross_entropy(hidden, weight, target, chunk_size=chunk),
                              hidden, weight)  # fmt: skip

    logits = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    dw = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    hd, wd = hidden.detach(), weight.detach()

    def gemms():  # logits, grad_hidden, grad_weight at full size: the FLOPs of every schedule
        torch.matmul(hd, wd.T, out=logits)
        torch.matmul(logits, wd, out=dh)
        torch.matmul(logits.T, hd, out=dw)

    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peers = mlp_ce.ce_loss_fns(hidden, weight, target)
    cases: list[tuple[str, Callable[[], object] | Exception, dict]] = [
        ("fuseformer", ours(), {}),
        ("fuseformer fixed 512", ours(512), {}),
        ("fuseformer fixed 1024", ours(1024), {}),
        *(
            (name, fn if isinstance(fn, Exception) else mlp_ce.ce_step(fn, hidden, weight), {})
            for name, fn in peers.items()
            if name != "fuseformer"
        ),  # fmt: skip
        ("gemms alone", gemms, dict(tflop=3 * 2 * n * h * v / 1e12)),
        ("copy 1 GiB", lambda: dst.copy_(src), dict(gb=2 * src.numel() * 2 / 1e9)),
        ("gemm 8192^3", lambda: square @ square, dict(tflop=2 * 8192**3 / 1e12)),
        ("fuseformer", ours(), {}),
    ]
    out: list[dict] = []
    for name, fn, extra in cases:
        rec = dict(kind="flce_energy", impl=name, **extra)
        try:
            if isinstance(fn, Exception):
                raise fn
            fn()
            hidden.grad = weight.grad = None
            if name.startswith(("fuseformer", "eager", "liger")):
                rec["peak_gib_above_inputs"] = peak_gib_above(fn)
                hidden.grad = weight.grad = None
            mlp_ce._heat()
            rec["ms"] = bench_ms(fn, rep=300)
            if handle is not None:
                rec.update(_energy_record(fn, handle))
            if "tflop" in extra:
                rec["tflop_s"] = extra["tflop"] / rec["ms"] * 1e3
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        hidden.grad = weight.grad = None
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


def sweep_attention_configs(quick: bool = False, head_dims: tuple[int, ...] = (128,)) -> list[dict]:
    """Time the Triton forward, dk/dv and dq kernels over the tuning candidates (ops/_attention_common.py's
    ``candidate_configs``: the full grid, or around the current tables when ``quick``) on the goal
    shapes (bf16, H 32): causal S4096 for all three kernels, full S16384 for the forward (and, not
    quick, the backward). An explicit config (the launchers' ``config=``, ``dkdv_config=``, ``dq_config=``)
    runs the Triton kernels, also where the Gluon ones would run.

    Each record: kernel, case, config (as requested; a config that does not fit falls back, see
    ``launch``), ms, TFLOP/s (the forward's count for fwd; the backward's 2.5x for the whole
    backward with that dk/dv or dq config), or an error.
    """
    records = []
    for d in head_dims:
        records += _attention_configs_case(d, 4096, True, quick, backward=True)
        torch.cuda.empty_cache()
        records += _attention_configs_case(d, 16384, False, quick, backward=not quick)
        torch.cuda.empty_cache()
    return records


def _attention_configs_case(d: int, seqlen: int, causal: bool, quick: bool, backward: bool) -> list[dict]:
    from fuseformer.bench import attention as ba

    attn = importlib.import_module("fuseformer.ops.attention")
    attn_bwd = importlib.import_module("fuseformer.ops.attention_bwd")
    attn_cfg = importlib.import_module("fuseformer.ops._attention_common")
    batch = ba.TOKENS // seqlen
    case = dict(batch=batch, seqlen=seqlen, heads=ba.HEADS, head_dim=d, causal=causal)
    flops = ba.attention_flops(batch, seqlen, ba.HEADS, d, causal)
    q, k, v = (t.detach() for t in ba._inputs(batch, seqlen, d))
    scale = d**-0.5
    right = 0 if causal else -1
    args = (q, k, v, None, None, seqlen, seqlen, scale, -1, right)
    out, lse = attn.flash_attention_fwd(*args, gluon=False)
    dout = torch.randn_like(out)
    block_d = max(16, attn.next_pow2(d))

    bwd_args = (dout, q, k, v, out, lse, None, None, None, seqlen, seqlen, scale, -1, right)

    records = []
    for cfg in attn_cfg.candidate_configs("fwd", block_d, causal, quick):
        fwd = lambda cfg=cfg: attn.flash_attention_fwd(*args, config=cfg)  # noqa: E731
        records.append(ba._record(dict(case, kernel="fwd", **cfg), "fuseformer", "fwd", flops, fwd))
    if not backward:
        return records
    for kind, arg in (("bwd_dkdv", "dkdv_config"), ("bwd_dq", "dq_config")):
        for cfg in attn_cfg.candidate_configs(kind, block_d, causal, quick):
            bwd = lambda cfg=cfg, arg=arg: attn_bwd.flash_attention_bwd(*bwd_args, **{arg: cfg})  # noqa: E731
            records.append(ba._record(dict(case, kernel=kind, **cfg), "fuseformer", "bwd", 2.5 * flops, bwd))
    return records


def best_configs(records: list[dict]) -> dict[str, dict]:
    """The fastest record per (kernel, case) of an attention config sweep."""
    best: dict[str, dict] = {}
    for r in records:
        if "ms" not in r:
            continue
        key = f"{r['kernel']} d{r['head_dim']} S{r['seqlen']} {'causal' if r['causal'] else 'full'}"
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return best


def sweep_attention() -> list[dict]:
    """The quick attention config sweep at head dim 128 (the goal shapes)."""
    return sweep_attention_configs(quick=True)


def sweep_attention64() -> list[dict]:
    """The quick attention config sweep at head dim 64 (the Llama-1B training case's)."""
    return sweep_attention_configs(quick=True, head_dims=(64,))


def sweep_attention_gluon() -> list[dict]:
    """The Gluon forward (ops/attention_hopper.py) against the Triton forward and SDPA's cuDNN kernel
    on the goal shapes (hd 128, 16384 tokens, H 32: causal S4096, full S16384), two more and hd 64
    causal S4096 (the training shape), each with its largest difference from the Triton forward's output, at 2, 3 or 4 stages. (Runs 81-82 also
    timed consumers without the in-warpgroup overlap: 9-18% slower at 3 stages, removed.)"""
    from fuseformer.bench import attention as ba
    from fuseformer.ops import attention_hopper as hopper

    attn = importlib.import_module("fuseformer.ops.attention")
    out = []
    for seqlen, causal, d in ((4096, True, 128), (16384, False, 128), (4096, False, 128), (16384, True, 128),
                              (4096, True, 64)):  # fmt: skip
        batch = ba.TOKENS // seqlen
        case = dict(kind="attention_gluon", batch=batch, seqlen=seqlen, heads=ba.HEADS, head_dim=d, causal=causal)
        flops = ba.attention_flops(batch, seqlen, ba.HEADS, d, causal)
        q, k, v = (t.detach() for t in ba._inputs(batch, seqlen, d))
        args = (q, k, v, None, None, seqlen, seqlen, d**-0.5, -1, 0 if causal else -1)
        ref_out, ref_lse = attn.flash_attention_fwd(*args, gluon=False)
        triton_fwd = lambda a=args: attn.flash_attention_fwd(*a, gluon=False)  # noqa: E731
        out.append(ba._record(case, "fuseformer triton", "fwd", flops, triton_fwd))
        for cfg in (dict(STAGES=2), dict(STAGES=3), dict(STAGES=4, CONSUMER_REGS=232, PRODUCER_REGS=40)):
            rec = dict(case, **cfg)
            try:
                o, lse = hopper.forward(q, k, v, d**-0.5, causal, cfg)
                torch.cuda.synchronize()
                rec["max_abs_diff_out"] = float((o.float() - ref_out.float()).abs().max())
                rec["max_abs_diff_lse"] = float((lse - ref_lse).abs().max())
                fn = lambda cfg=cfg: hopper.forward(q, k, v, d**-0.5, causal, cfg)  # noqa: E731
                out.append(ba._record(rec, "fuseformer gluon", "fwd", flops, fn))
            except Exception as exc:
                out.append(dict(rec, impl="fuseformer gluon", error=f"{type(exc).__name__}: {exc}"[:500]))
            print(json.dumps(out[-1]), flush=True)
        cudnn = ba._impls(seqlen, causal)["sdpa_cudnn"]
        out.append(ba._record(case, "sdpa_cudnn", "fwd", flops, lambda q=q, k=k, v=v: cudnn(q, k, v)))
        print(json.dumps(out[-1]), flush=True)
        torch.cuda.empty_cache()
    return out


def sweep_attention_gluon_bwd() -> list[dict]:
    """The backward with the Gluon dK/dV kernel (ops/attention_hopper.py) and the Gluon dq kernel (2, 3, 4
    stages; the Triton one at hd 64), against the all-Triton backward and SDPA's flash and cuDNN backwards
    on the goal shapes (hd 128, 16384 tokens, H 32: causal S4096, full S16384) and hd 64 causal S4096,
    each with its largest dq / dk / dv difference from the Triton backward's, and its kernels by
    profiler (causal S4096)."""
    from fuseformer.bench import attention as ba
    from fuseformer.ops import attention_bwd as bwd

    attn = importlib.import_module("fuseformer.ops.attention")
    out = []
    for seqlen, causal, d in ((4096, True, 128), (16384, False, 128), (4096, True, 64)):
        batch = ba.TOKENS // seqlen
        case = dict(kind="attention_gluon_bwd", batch=batch, seqlen=seqlen, heads=ba.HEADS, head_dim=d, causal=causal)
        flops = 2.5 * ba.attention_flops(batch, seqlen, ba.HEADS, d, causal)
        q, k, v = (t.detach() for t in ba._inputs(batch, seqlen, d))
        right = 0 if causal else -1
        o, lse = attn.flash_attention_fwd(q, k, v, None, None, seqlen, seqlen, d**-0.5, -1, right)
        do = torch.randn_like(o)
        args = (do, q, k, v, o, lse, None, None, None, seqlen, seqlen, d**-0.5, -1, right)
        ref = bwd.flash_attention_bwd(*args, gluon=False)
        rec = ba._record(case, "fuseformer triton", "bwd", flops, lambda: bwd.flash_attention_bwd(*args, gluon=False))
        if seqlen == 4096:
            rec["kernels"] = gpu_kernels(lambda: bwd.flash_attention_bwd(*args, gluon=False))[:6]
        out.append(rec)
        print(json.dumps(out[-1])[:600], flush=True)
        # The Gluon backward (dK/dV at its shipped stages; dq from the Gluon dq kernel at the head dims of
        # DQ_HEAD_DIMS, at 2, 3 and 4 stages, else from the Triton dq kernel).
        for dq_stages in (2, 3, 4):
            dq_config = dict(STAGES=dq_stages)
            rec = dict(case, DQ_STAGES=dq_stages if d in bwd.attention_hopper.DQ_HEAD_DIMS else None)
            try:
                got = bwd.flash_attention_bwd(*args, gluon_dq_config=dq_config)
                torch.cuda.synchronize()
                rec["max_abs_diff"] = {n: float((a.float() - r.float()).abs().max())
                                       for n, a, r in zip(("dq", "dk", "dv"), got, ref)}  # fmt: skip
                fn = lambda dq_config=dq_config: bwd.flash_attention_bwd(*args, gluon_dq_config=dq_config)  # noqa: E731
                rec = ba._record(rec, "fuseformer gluon", "bwd", flops, fn)
                if seqlen == 4096:
                    rec["kernels"] = gpu_kernels(fn)[:6]
            except Exception as exc:
                rec.update(impl="fuseformer gluon", error=f"{type(exc).__name__}: {exc}"[:500])
            out.append(rec)
            print(json.dumps(out[-1])[:600], flush=True)
        impls = ba._impls(seqlen, causal)
        for name in ("sdpa_flash", "sdpa_cudnn"):
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            y = impls[name](qg, kg, vg)
            dy = torch.randn_like(y)
            fn = lambda y=y, dy=dy, qg=qg, kg=kg, vg=vg: torch.autograd.grad(y, (qg, kg, vg), dy, retain_graph=True)  # noqa: E731
            out.append(ba._record(case, name, "bwd", flops, fn))
            print(json.dumps(out[-1])[:600], flush=True)
        torch.cuda.empty_cache()
    return out


def sweep_mlp_gluon() -> list[dict]:
    """Issue 4's prefill gate-up GEMM (T 8192, H 4096, I 14336, bf16) in Gluon (ops/mlp_hopper.py) over
    stages, tile grouping and persistence, each with its largest difference from the Triton kernel's
    output; then both kernels at fewer tokens (where the Gluon one starts to pay). The whole MLP with
    either kernel beside torch.compile's is ``bench mlp_ce`` (runs 86-88)."""
    from fuseformer.ops import mlp_hopper

    mlp = importlib.import_module("fuseformer.ops.mlp")
    out = []
    t, h, i = 8192, 4096, 14336
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    ref = mlp.mlp_gate_up_fwd(x, w, "silu", config=mlp.cached_config(t, h, i, x.dtype, x.device))[0]
    flops = 4 * t * h * i
    for cfg in (dict(STAGES=4, GROUP_M=8), dict(STAGES=4, GROUP_M=8, PERSISTENT=False), dict(STAGES=3, GROUP_M=8),
                dict(STAGES=4, GROUP_M=16), dict(STAGES=4, GROUP_M=4)):  # fmt: skip
        rec = dict(kind="mlp_gluon_gate_up", T=t, H=h, I=i, **cfg)
        try:
            y = mlp_hopper.gate_up(x, w, "silu", cfg)
            torch.cuda.synchronize()
            rec["max_abs_diff_vs_triton"] = float((y.float() - ref.float()).abs().max())
            rec["ms"] = bench_ms(lambda cfg=cfg: mlp_hopper.gate_up(x, w, "silu", cfg))
            rec["tflop_s"] = flops / rec["ms"] / 1e9
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        out.append(rec)
        print(json.dumps(rec), flush=True)
    # Where the Gluon kernel starts to pay (mlp._GLUON_MIN_TOKENS): both kernels at fewer tokens.
    for t in (256, 512, 1024, 2048, 4096):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        rec = dict(kind="mlp_gluon_gate_up_tokens", T=t, H=h, I=i)
        cfg = mlp.cached_config(t, h, i, x.dtype, x.device)  # an explicit config: the Triton kernel
        try:
            ref = mlp.mlp_gate_up_fwd(x, w, "silu", config=cfg)[0]
            rec["triton_ms"] = bench_ms(lambda x=x, cfg=cfg: mlp.mlp_gate_up_fwd(x, w, "silu", config=cfg))
            y = mlp_hopper.gate_up(x, w, "silu")
            torch.cuda.synchronize()
            rec["max_abs_diff_vs_triton"] = float((y.float() - ref.float()).abs().max())
            rec["gluon_ms"] = bench_ms(lambda x=x: mlp_hopper.gate_up(x, w, "silu"))
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


def sweep_mlp_decode(
    h: int = 4096,
    i: int = 14336,
    tokens: tuple[int, ...] = (1, 8, 32, 64),
    *,
    timer: Callable[[Callable[[], object]], float] | None = None,
    ceiling_tb_s: float | None = None,
) -> list[dict]:
    """fused_mlp decode, bf16, H 4096, I 14336, T 1/8/32/64 (~2-3 min of GPU, compiles included).

    Per T: each candidate config of the decode kernel (ops/mlp.py ``decode_candidates``; the rule's
    first, ``rule: True``) for the gate-up GEMM (with act*mul) and the down GEMM alone; then whole
    MLPs: the decode path with the rule's configs (through ``fused_mlp`` and the launcher, both with
    the down GEMM as a programmatic dependent launch, on since run 53; and the launcher with
    ``pdl=False``), the decode path with the fastest gate-up and down candidates, the prefill-style path (our gate-up
    kernel + cuBLAS, fused_mlp before the decode path), cuBLAS's two GEMMs alone, eager (HF
    LlamaMLP) and torch.compile of it. Each record: ms (do_bench median, L2 flushed), the weight
    bytes its part reads (gate-up 2HI x 2, down HI x 2, whole MLP 3HI x 2) as GB/s, and the percent
    of a 1 GiB device copy (read + write) measured in the same run. Everything is compiled (warmed)
    before a T's timings, then the GPU is kept busy ~1 s, so no timing starts from idle clocks.
    A failing config or peer is a record with ``error``, never the end of the sweep.

    ``h``, ``i``, ``tokens``, ``timer`` and ``ceiling_tb_s`` let a CPU test run it at tiny shapes under
    the interpreter (fp16 there: the interpreter's bf16 tl.dot is wrong).
    """
    import fuseformer.ops as F
    from fuseformer.bench.mlp_ce import _eager_mlp, _heat

    mlp = importlib.import_module("fuseformer.ops.mlp")  # the module, not fuseformer.ops.fused_mlp
    mlp_dec = importlib.import_module("fuseformer.ops.mlp_decode")  # the decode kernels
    on_gpu = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float16)
    timer = timer or (lambda fn: bench_ms(fn, warmup=10, rep=50))
    ceiling = ceiling_tb_s or copy_ceiling_tb_s(nbytes=1 << 30)
    out: list[dict] = [dict(kind="mlp_decode_ceiling", copy_tb_s=ceiling, copy_bytes=1 << 30,
                            gpu=torch.cuda.get_device_name() if on_gpu else "cpu")]  # fmt: skip
    w_gate_up = torch.randn(2 * i, h, device=dev).to(dtype) / h**0.5
    w_down = torch.randn(h, i, device=dev).to(dtype) / i**0.5
    w_gate, w_up = (w.contiguous() for w in w_gate_up.chunk(2))
    part_bytes = dict(gate_up=2 * h * i * 2, down=h * i * 2, mlp=3 * h * i * 2)

    compiled = torch.compile(_eager_mlp) if on_gpu else None
    for t in tokens:
        x = torch.randn(t, h, device=dev).to(dtype)
        y = mlp.mlp_gate_up_fwd(x, w_gate_up, "silu")[0]  # the down GEMM's input: act(g) * u, non-zero
        cases: list[tuple[dict, Callable[[], object]]] = []

        def case(part, impl, fn, **extra):
            cases.append((dict(kind="mlp_decode", T=t, H=h, I=i, part=part, impl=impl, **extra), fn))

        for glu, n, k, part, a, w in ((True, i, h, "gate_up", x, w_gate_up), (False, h, i, "down", y, w_down)):
            for j, cfg in enumerate(mlp_dec.decode_candidates(t, n, k, glu)):
                case(part, "decode", lambda a=a, w=w, glu=glu, cfg=cfg: mlp_dec._decode_gemm(a, w, glu, "silu", cfg),
                     config=cfg, rule=j == 0, programs=-(-n // cfg["BLOCK_N"]) * -(-t // cfg["BLOCK_M"]) * cfg["SPLIT_K"],
                     smem=mlp_dec.decode_smem_bytes(cfg, glu))  # fmt: skip
        case("gate_up", "prefill-style kernel", lambda: mlp.mlp_gate_up_fwd(x, w_gate_up, "silu"))
        case("gate_up", "cublas", lambda: x @ w_gate_up.T)
        case("down", "cublas", lambda: y @ w_down.T)
        case("mlp", "decode rule (fused_mlp)", lambda: F.fused_mlp(x, w_gate_up, w_down))
        case("mlp", "decode rule (launcher)", lambda: mlp.mlp_decode_fwd(x, w_gate_up, w_down, "silu"))
        case("mlp", "decode rule, no PDL", lambda: mlp.mlp_decode_fwd(x, w_gate_up, w_down, "silu", pdl=False))
        case("mlp", "prefill-style", lambda: mlp.mlp_gate_up_fwd(x, w_gate_up, "silu")[0] @ w_down.T)
        case("mlp", "eager", lambda: _eager_mlp(x, w_gate, w_up, w_down))
        if compiled is not None:
            case("mlp", "torch.compile", lambda: compiled(x, w_gate, w_up, w_down))
        for rec, fn in cases:  # compile everything first
            try:
                fn()
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        _heat()
        for rec, fn in cases:
            if "error" not in rec:
                _time_record(rec, fn, timer, part_bytes[rec["part"]], ceiling)
        out += [rec for rec, _ in cases]
        # The decode path with the fastest candidate of each GEMM, timed as one MLP.
        best = {}
        for part in ("gate_up", "down"):
            timed = [r for r, _ in cases if r["part"] == part and r["impl"] == "decode" and "ms" in r]
            best[part] = min(timed, key=lambda r: r["ms"])["config"] if timed else None
        rec = dict(kind="mlp_decode", T=t, H=h, I=i, part="mlp", impl="decode best", gate_up_config=best["gate_up"],
                   down_config=best["down"])  # fmt: skip
        try:
            fn = lambda: mlp.mlp_decode_fwd(x, w_gate_up, w_down, "silu", best["gate_up"], best["down"])  # noqa: E731
            fn()
            _time_record(rec, fn, timer, part_bytes["mlp"], ceiling)
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(rec)
    return out


def sweep_paged_decode() -> list[dict]:
    """Paged decode attention (issue 28 item 5: 64 x 4,096 and 256 x 1,024, GQA 32/8, hd 128, bf16) over
    BLOCK_N, num_stages, num_warps and forced key splits (``paged_attention_fwd``'s ``config=`` and
    ``num_splits=``): ms from a CUDA graph and do_bench (L2 flushed), TB/s of the K/V read, % of copy.
    The rule's choice is the record with ``rule: True``. At 64 x 4,096 the rule runs 512 programs (no split)."""
    pa = importlib.import_module("fuseformer.ops.paged_attention")
    copy = copy_ceiling_tb_s()
    out: list[dict] = [dict(kind="paged_decode_ceiling", copy_tb_s=copy, gpu=torch.cuda.get_device_name())]
    shapes = [(32, 2, 4), (32, 3, 4), (32, 4, 4), (64, 2, 4), (64, 3, 4), (64, 4, 4), (64, 3, 8), (128, 2, 4),
              (128, 3, 4), (128, 2, 8), (128, 3, 8)]  # fmt: skip
    configs = [None] + [dict(BLOCK_N=n, num_stages=st, num_warps=w) for n, st, w in shapes]
    for batch, context in ((64, 4096), (256, 1024)):
        out += _paged_decode_case(pa, batch, context, configs, copy)
        torch.cuda.empty_cache()
    # Batch-1 decode (issue 28's batch-1 workload: contexts 128-384, 8 programs, latency- not bandwidth-bound).
    out += _paged_decode_case(pa, 1, 512, configs[:7], copy, splits=(None, 1, 2, 4, 8))
    return out


def _paged_decode_case(
    pa, batch: int, context: int, configs: list, copy: float, splits: tuple = (None, 1, 2, 3, 4)
) -> list[dict]:
    from fuseformer.bench.attention import paged_decode_bytes, paged_decode_inputs

    q, k_cache, v_cache, cu, lens, tables, _, _ = paged_decode_inputs(batch, context)
    nbytes = paged_decode_bytes(batch, context)
    scale = q.shape[-1] ** -0.5
    ref = pa.paged_attention_fwd(q, k_cache, v_cache, cu, lens, tables, scale, True, -1, 1)
    out = []
    for cfg in configs:
        for n in splits:
            if cfg is not None and n is None:
                continue

            def fn(cfg=cfg, n=n):
                return pa.paged_attention_fwd(q, k_cache, v_cache, cu, lens, tables, scale, True, -1, 1,
                                              config=cfg, num_splits=n)  # fmt: skip

            rec = dict(kind="paged_decode", batch=batch, context=context, config=cfg, splits=n,
                       rule=cfg is None and n is None)  # fmt: skip
            try:
                rec["max_diff"] = float((fn().float() - ref.float()).abs().max())
                graph_ms, ms = bench_graph_ms(fn), bench_ms(fn)
                rec.update(graph_ms=graph_ms, graph_tb_s=tb_per_s(nbytes, graph_ms), ms=ms,
                           tb_s=tb_per_s(nbytes, ms), graph_pct_copy=100 * tb_per_s(nbytes, graph_ms) / copy)  # fmt: skip
            except Exception as exc:  # a config that does not fit (shared memory) is a record, not the end
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            out.append(rec)
    return out


def _time_record(rec: dict, fn: Callable[[], object], timer, nbytes: int, ceiling_tb_s: float) -> None:
    """Time ``fn`` into ``rec``: ms, weight GB/s and percent of the copy ceiling (or the error)."""
    try:
        ms = timer(fn)
        gb_s = nbytes / (ms * 1e-3) / 1e9
        rec.update(ms=ms, weight_bytes=nbytes, gb_s=gb_s, pct_copy=100 * gb_s / (1e3 * ceiling_tb_s))
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]


SWEEPS: dict[str, Callable[[], list[dict]]] = {
    "attention": sweep_attention,
    "attention64": sweep_attention64,
    "attention_gluon": sweep_attention_gluon,
    "attention_gluon_bwd": sweep_attention_gluon_bwd,
    "mlp_gluon": sweep_mlp_gluon,
    "rms_norm": sweep_rms_norm,
    "rms_norm_long": sweep_rms_norm_long,
    "rms_norm_residual": sweep_rms_norm_residual,
    "add_rms_norm": sweep_add_rms_norm,
    "small_rows": sweep_small_rows,
    "train_profile": sweep_train_profile,
    "flce": sweep_flce,
    "flce_gemms": sweep_flce_gemms,
    "flce_energy": sweep_flce_energy,
    "mlp_decode": sweep_mlp_decode,
    "paged_decode": sweep_paged_decode,
    # The same sweep timed with L2 flushed by reading (bench_stream_ms), against the copy ceiling
    # timed that way: do_bench's zero-fill flush charges ~60 MB of dirty-line write-back to each call.
    "mlp_decode_clean": lambda: sweep_mlp_decode(
        timer=lambda fn: bench_stream_ms(fn, warmup=10, rep=50), ceiling_tb_s=stream_copy_ceiling_tb_s(nbytes=1 << 30)
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="benchmarks/sweeps.py")
    parser.add_argument("names", nargs="*", help=f"sweeps to run, in order: {', '.join(SWEEPS)}")
    parser.add_argument("--out", default=None, help="also write the records (and the environment) to DIR/sweep.json")
    parser.add_argument("--list", action="store_true", help="list the sweeps and exit")
    args = parser.parse_args(argv)
    if args.list or not args.names:
        for name, fn in SWEEPS.items():
            doc = (fn.__doc__ or "").strip().split("\n")[0]
            print(f"{name:<22} {doc}")
        return 0 if args.list else 2
    unknown = [n for n in args.names if n not in SWEEPS]
    if unknown:
        print(f"benchmarks/sweeps.py: unknown sweeps {unknown} (--list shows them)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "benchmarks/sweeps.py: needs a CUDA GPU (the figures are GPU timings); none is available", file=sys.stderr
        )
        return 2
    records = []
    for name in args.names:
        for r in SWEEPS[name]():
            print(json.dumps(r), flush=True)
            records.append(r)
    if args.out:
        from fuseformer.bench import environment

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump(dict(env=environment(), sweeps=args.names, records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
