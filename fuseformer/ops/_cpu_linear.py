"""x W^T on a CPU in the form MKL runs fastest at a decode step's few rows (issue 30 item 20).

``F.linear`` with one row of x and a weight of more rows than columns takes MKL's gemv path, which
streamed the weight at 8-10 GB/s on one thread and did not use a second (AMD EPYC, torch 2.13.0+cpu,
MKL 2024.2, fp32). The same product written as ``(W @ x^T)^T`` with x padded to two rows is a GEMM of
two columns: 17-19 GB/s on one thread, and it uses the second. Over 40 weights streamed from memory,
one row, 1 / 2 threads (benchmarks/cpu_linear.py, BENCHMARKS.md 2026-12-06): gate-up 3072x576
26.0 -> 13.8 / 26.3 -> 10.3 ms, qkv 960x576 8.7 -> 5.1 / 9.0 -> 2.9 ms, a 49152x576 LM head (two
copies) 22.2 -> 11.6 / 21.9 -> 5.8 ms. Wide weights (N < K) went either way (Qwen2-0.5B's down
896x4864: 15.4 -> 27.2 ms at one thread), and from 8 rows on the forms are within ~15% both ways. Hence
the rule below; everything else is ``F.linear``.
"""

from __future__ import annotations

import torch

SMALL_ROWS = 4  # up to this many rows of x (tokens) take the GEMM form


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (..., K), weight (N, K), bias (N,) or None -> (..., N).

    fp32 CPU tensors with at most ``SMALL_ROWS`` rows and N >= K (a contiguous weight) run as
    ``(weight @ x^T)^T`` (one row padded to two: MKL's one-column product is its slow gemv); the result
    is the same product in another summation order. Anything else is ``F.linear`` as it is."""
    if not x.is_cpu or x.dtype != torch.float32:  # first: the GPU's eager steps pay only this check
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if not (0 < rows <= SMALL_ROWS and n >= k and weight.dtype == torch.float32 and weight.is_contiguous()):
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(rows, k)
    if rows == 1:
        x2 = torch.cat((x2, x2))  # not expand(): a zero stride sends MKL back to a slow path
    y = (weight @ x2.t()).t()[:rows]
    y = y.contiguous() if bias is None else y.contiguous().add_(bias)
    return y.view(*x.shape[:-1], n)
