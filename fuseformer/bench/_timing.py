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
