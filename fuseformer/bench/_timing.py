"""The one timing helper and the two ceilings every benchmark reports against (DESIGN.md §8).

All timings are ``triton.testing.do_bench`` medians (CUDA events, L2 flushed between reps),
on random inputs, never zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device (warmup/rep are in ms)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph_ms(fn: Callable[[], object], *, rep: int = 50) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph: GPU time alone, no host
    overhead (L2 is not flushed between replays, so inputs that fit in L2 read faster)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def tb_per_s(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def tflop_per_s(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@functools.cache
def copy_ceiling_tb_s(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + bytes written, TB/s (measured, cached)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return tb_per_s(2 * nbytes, ms)


@functools.cache
def gemm_ceiling_tflop_s(device: str = "cuda", n: int = 8192) -> float:
    """A large bf16 GEMM through cuBLAS (torch.matmul) on random data, TFLOP/s (measured, cached)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return tflop_per_s(2 * n**3, ms)


def peak_gib_above(fn: Callable[[], object]) -> float:
    """GiB allocated at ``fn()``'s peak beyond what was allocated before it (run once, synchronized).
    Call ``fn`` once beforehand so that one-time allocations (cuBLAS workspaces) are not counted."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def gpu_kernels(fn: Callable[[], object], reps: int = 1) -> list[dict]:
    """The CUDA kernels of ``reps`` calls of ``fn`` (torch.profiler), costliest first: name, launches
    per call, GPU µs per launch and GPU ms per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return [
        dict(
            name=e.key[:120], per_call=e.count / reps, us=e.device_time_total / e.count,
            ms_per_call=e.device_time_total / reps / 1e3,
        )
        for e in events
    ]  # fmt: skip
