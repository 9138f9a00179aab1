"""linear_act (issue 26: the plain GELU MLPs' up projection) against eager cuBLAS + GELU and torch.compile,
on a CUDA GPU, bf16, do_bench medians; then the tuning candidates at the largest T. JSON to OUT/linear_act.json.

    python3 benchmarks/linear_act.py [--out DIR] [--tokens 1,16,64,256,1024,4096,16384] [--sweep-tokens 16384]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

import torch
import torch.nn.functional as tf

import fuseformer.ops as F
from fuseformer.bench._timing import bench_ms

LA = importlib.import_module("fuseformer.ops.linear_act")
# (name, K, N, activation, Conv1D layout)
SHAPES = (("bert-base", 768, 3072, "gelu", False), ("bert-large", 1024, 4096, "gelu", False),
          ("gpt2", 768, 3072, "gelu_tanh", True))  # fmt: skip


def _eager(x, w, b, activation):
    z = tf.linear(x, w, b)
    return tf.gelu(z, approximate="tanh") if activation == "gelu_tanh" else tf.gelu(z)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--tokens", default="1,16,64,256,1024,4096,16384")
    p.add_argument("--sweep-tokens", type=int, default=16384)
    p.add_argument("--quick-sweep", action="store_true", help="BLOCK_K 64, 3-4 stages only")
    args = p.parse_args()
    rows = []
    compiled = torch.compile(_eager, dynamic=False)
    for name, k, n, act, kn in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        if kn:
            w = w.T.contiguous().T  # Conv1D's (K, N) storage, seen as (N, K)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                ref = _eager(x.float(), w.float(), b.float(), act)
                err = (F.linear_act(x, w, b, act).float() - ref).abs().max().item()
                base = (_eager(x, w, b, act).float() - ref).abs().max().item()
                rec = dict(shape=name, T=t, K=k, N=n, activation=act, max_err=err, eager_max_err=base,
                           ours_us=1e3 * bench_ms(lambda: F.linear_act(x, w, b, act)),
                           eager_us=1e3 * bench_ms(lambda: _eager(x, w, b, act)),
                           gemm_only_us=1e3 * bench_ms(lambda: tf.linear(x, w, b)))  # fmt: skip
                if act == "gelu_tanh":  # cuBLASLt's GELU epilogue (the tanh form) through torch
                    rec["cublaslt_gelu_us"] = 1e3 * bench_ms(lambda: torch._addmm_activation(b, x, w.T, use_gelu=True))
                if t == 16384:  # one compile a shape (dynamic=False)
                    rec["compile_us"] = 1e3 * bench_ms(lambda: compiled(x, w, b, act))
            rec["speedup_vs_eager"] = rec["eager_us"] / rec["ours_us"]
            rec["tflops"] = 2 * t * k * n / (rec["ours_us"] * 1e-6) / 1e12
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    # The tuning candidates at BERT-base's shape, T = --sweep-tokens.
    t, k, n = args.sweep_tokens, 768, 3072
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    sweep = []
    cands = LA.candidate_configs(t, torch.bfloat16)
    if args.quick_sweep:
        cands = [c for c in cands if c["BLOCK_K"] == 64 and c["num_stages"] in (3, 4)]
    for cfg in cands:
        try:
            us = 1e3 * bench_ms(lambda cfg=cfg: LA.linear_act_fwd(x, w, b, "gelu", False, cfg), rep=40)
        except Exception as exc:  # a config that does not compile or fit: recorded, not fatal
            sweep.append(dict(config=cfg, error=f"{type(exc).__name__}: {str(exc)[:100]}"))
            continue
        sweep.append(dict(config=cfg, us=us))
    ok = sorted((r for r in sweep if "us" in r), key=lambda r: r["us"])
    print("# sweep T", t, "best 3:", json.dumps(ok[:3]), flush=True)
    info = dict(date=time.strftime("%Y-%m-%d %H:%M"), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    os.makedirs(args.out, exist_ok=True)
    json.dump(dict(info, rows=rows, sweep=sweep), open(os.path.join(args.out, "linear_act.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
