"""Which MLP and which linear at each step's token count (issue 28 item 3), on a CUDA GPU.

1. The Llama-3-8B MLP (H 4096, I 14336, bf16) at T tokens: ``fused_mlp`` (decode GEMMs at T <= 64,
   else the gate-up GEMM with act * mul and cuBLAS's down) against nn.Linear + swiglu + nn.Linear
   (cuBLAS, cuBLAS), each replayed from a CUDA graph (``bench_graph_ms``: GPU time, as the engine's
   graphs run it) and eagerly with L2 flushed by reading (``bench_stream_ms``).
2. The other decode linears (qkv 6144 x 4096, o 4096 x 4096, LM head 128256 x 4096) at T <= 64:
   cuBLAS (torch.matmul) against the weight-streaming decode GEMM of ops/mlp_decode.py (no GLU), as %
   of the copy bandwidth.

    python3 benchmarks/engine_mlp_linear.py --out DIR     # writes DIR/engine_mlp_linear.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fuseformer.ops as F
from fuseformer.bench._timing import bench_graph_ms, bench_stream_ms, copy_ceiling_tb_s
from fuseformer.ops._utils import next_pow2
from fuseformer.ops.mlp_decode import DOWN_DECODE, _decode_gemm, decode_plan


def mlp_rows(h: int = 4096, i: int = 14336, tokens=(1, 8, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 8192)):
    dt = torch.bfloat16
    w_gu = torch.randn(2 * i, h, device="cuda", dtype=dt) / h**0.5
    w_d = torch.randn(h, i, device="cuda", dtype=dt) / i**0.5
    rows = []
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=dt)
        fused = lambda: F.fused_mlp(x, w_gu, w_d, "silu")
        unfused = lambda: torch.matmul(F.swiglu(torch.matmul(x, w_gu.T)), w_d.T)
        with torch.inference_mode():
            rec = dict(bench="mlp", T=t, H=h, I=i)
            for name, fn in (("fused", fused), ("unfused", unfused)):
                rec[f"{name}_graph_us"] = 1e3 * bench_graph_ms(fn)
                rec[f"{name}_eager_us"] = 1e3 * bench_stream_ms(fn)
        rec["fused_speedup_graph"] = rec["unfused_graph_us"] / rec["fused_graph_us"]
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    return rows


def linear_rows(tokens=(1, 8, 32, 64)):
    dt = torch.bfloat16
    copy = copy_ceiling_tb_s()
    rows = []
    for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("lm_head", 128256, 4096)):
        w = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
        for t in tokens:
            x = torch.randn(t, k, device="cuda", dtype=dt)
            cfg = decode_plan(DOWN_DECODE, next_pow2(t), n, k, dt, x.device)
            ours = lambda: _decode_gemm(x, w, False, "silu", cfg)
            cublas = lambda: torch.matmul(x, w.T)
            torch.testing.assert_close(ours(), cublas(), rtol=2e-2, atol=2e-2)
            rec = dict(bench="linear", name=name, T=t, N=n, K=k)
            with torch.inference_mode():
                for impl, fn in (("decode_gemm", ours), ("cublas", cublas)):
                    us = 1e3 * bench_stream_ms(fn)
                    rec[f"{impl}_us"] = us
                    rec[f"{impl}_pct_copy"] = 100 * (n * k * 2 / (us * 1e-6) / 1e12) / copy
                    rec[f"{impl}_graph_us"] = 1e3 * bench_graph_ms(fn)
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    return rows


def engine_rows():
    """The batch1 and fixed workloads with the model's MLP fused (the default) and unfused, in one run."""
    from fuseformer.bench.engine import SHAPES, build_models, run_workload
    from fuseformer.models import llama

    hf, ours = build_models(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
    fused_forward = llama.MLP.forward

    def unfused_forward(self, x):
        return self.down_proj(F.swiglu(self.gate_up_proj(x)))

    rows = []
    for label, forward in (("fused", fused_forward), ("unfused", unfused_forward), ("fused again", fused_forward)):
        llama.MLP.forward = forward
        for w in ("batch1", "fixed"):
            for r in run_workload(w, hf, ours, shape_name="llama3-8b", peers=False):
                if r["impl"] == "fuseformer LLM":
                    r["mlp"] = label
                    print(json.dumps(r), flush=True)
                    rows.append(r)
    llama.MLP.forward = fused_forward
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    records = mlp_rows() + linear_rows() + engine_rows()
    Path(args.out, "engine_mlp_linear.json").write_text(json.dumps(records, indent=1))
