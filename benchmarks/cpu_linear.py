"""The few-row CPU GEMM forms behind ``fuseformer.ops._cpu_linear`` (issue 30 item 20).

For each weight shape (N, K) of SmolLM-135M and Qwen2-0.5B, ``--copies`` distinct fp32 weights (so
that they stream from memory, as a decode step's layers do, rather than sit in cache) are multiplied
by x of M rows in three forms: ``F.linear(x, W)`` (torch's default), ``x @ W^T`` from a transposed
contiguous copy, and ``(W @ x^T)^T`` with one row padded to two (cpu_linear's form). Prints ms per
pass over all copies (the best of ``--reps``) and the GB/s of weight streamed.

    python benchmarks/cpu_linear.py [--threads 1 2] [--rows 1 2 4 8 32] [--copies 40] [--out cpu_linear.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = [  # (N, K): out_features, in_features
    (960, 576),  # SmolLM qkv
    (576, 576),  # SmolLM o
    (3072, 576),  # SmolLM gate-up
    (576, 1536),  # SmolLM down
    (49152, 576),  # SmolLM LM head (tied)
    (9728, 896),  # Qwen2 gate-up
    (896, 4864),  # Qwen2 down
]


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--copies", type=int, default=40, help="distinct weights per shape (>= the cache's worth)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    args = ap.parse_args()
    records = []
    for n, k in SHAPES:
        copies = max(2, min(args.copies, (256 << 20) // (n * k * 4)))  # at most ~256 MB a shape
        ws = [torch.randn(n, k) for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for threads in args.threads:
            torch.set_num_threads(threads)
            for m in args.rows:
                x = torch.randn(m, k)
                x2 = torch.cat((x, x)) if m == 1 else x
                forms = {
                    "linear": lambda: [torch.nn.functional.linear(x, w) for w in ws],
                    "x_wt_copy": lambda: [x @ wt for wt in wts],
                    "w_xt": lambda: [(w @ x2.t()).t()[:m].contiguous() for w in ws],
                }
                ms = {name: _best_ms(fn, args.reps) for name, fn in forms.items()}
                gbs = {name: round(copies * n * k * 4 / t / 1e6, 1) for name, t in ms.items()}
                rec = dict(n=n, k=k, rows=m, threads=threads, copies=copies, ms={a: round(b, 3) for a, b in ms.items()})
                rec["gb_s"] = gbs
                print(json.dumps(rec), flush=True)
                records.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
