"""The one timing helper and the two ceilings every benchmark reports against (DESIGN.md §8).

All timings are ``triton.testing.do_bench`` medians (CUDA events, L2 flushed between reps),
on random inputs, never zeros. ``bench_stream_ms`` is the same method with another flush, for the
short weight-streaming kernels of decode (see there).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device (warmup/rep are in ms)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


_STREAM_FLUSH_BYTES = 256_000_000  # as do_bench's flush buffer: over 4x the H200's 60 MB L2


@functools.cache
def _stream_flush_buffer(device: int) -> torch.Tensor:
    return torch.ones(_STREAM_FLUSH_BYTES // 4, dtype=torch.float32, device=f"cuda:{device}")


def bench_stream_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()``, timed as ``do_bench`` times it (CUDA events around each call,
    L2 flushed before each, warm-up and repeat counts from a 5-call estimate) except for the flush:
    it reads 256 MB (an ``amax``) instead of zero-filling it.

    do_bench's ``zero_`` leaves L2 full of dirty lines (~60 MB on an H200), which are written back
    while the timed kernel evicts them: for a kernel that streams 352 MB in ~100 us (the decode MLP's
    weights) that is up to ~15% more DRAM traffic than the kernel's own, charged to the kernel. A
    flush by reading evicts L2 just as well and leaves it clean, as the kernels before an MLP in a
    decode step (attention over the KV cache, a norm) leave it. For large copies (the ceiling) the
    difference is ~1%; ``stream_copy_ceiling_tb_s`` is the ceiling measured this way.
    """
    flush = _stream_flush_buffer(torch.cuda.current_device())
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.amax()
        fn()
    stop.record()
    stop.synchronize()
    estimate_ms = start.elapsed_time(stop) / 5
    n_warmup, n_repeat = max(1, int(warmup / estimate_ms)), max(1, int(rep / estimate_ms))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for i in range(n_repeat):
        flush.amax()
        starts[i].record()
        fn()
        stops[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops))


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
def copy_ceiling_tb_s(device: str = "cuda", nbytes: int = 2 << 30, read_flush: bool = False) -> float:
    """Device-to-device copy bandwidth, bytes read + bytes written, TB/s (measured, cached); timed
    with :func:`bench_stream_ms` (L2 flushed by reading) when ``read_flush``, else :func:`bench_ms`."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = (bench_stream_ms if read_flush else bench_ms)(lambda: dst.copy_(src))
    return tb_per_s(2 * nbytes, ms)


def stream_copy_ceiling_tb_s(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """:func:`copy_ceiling_tb_s` timed with :func:`bench_stream_ms` (L2 flushed by reading)."""
    return copy_ceiling_tb_s(device, nbytes, read_flush=True)


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
