"""FP8 GEMMs per shape and token count (issue 31): which backend and tiles, and what the FP8 layers cost
against bf16, at the Llama-3-8B shapes, on a CUDA GPU. JSON to $OUT/fp8_gemm.json.

1. ``fp8_gemm`` (per-token a_scale; grouped for the down projection, as Fp8GatedMLP feeds it) at
   M in TOKENS for qkv (6144 x 4096), o (4096 x 4096), down (4096 x 14336): ``torch._scaled_mm`` and
   the Triton kernel at each of its candidate configs, against bf16 cuBLAS (``torch.matmul``).
2. ``fp8_gemm_glu`` (gate-up 28672 x 4096 with act * mul and the group quantization) at each candidate,
   against bf16 cuBLAS gate-up + ``swiglu``.
3. The layers as the model runs them: Fp8GatedMLP (from a quantized activation) against ``fused_mlp``
   (bf16); Fp8Linear o_proj (quantizing its bf16 input) against nn.Linear.

Times are medians of CUDA-graph replays (``bench_graph_ms``) for M >= 256, and of eager calls with L2
flushed by reading (``bench_stream_ms``) below, where weights would otherwise stay in L2 between calls.

    OUT=/tmp/out python3 benchmarks/fp8_gemm.py [--tokens 1,16,64,256,1024,4096] [--max-candidates 12]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

import torch

import fuseformer.ops as F
from fuseformer.bench._timing import bench_graph_ms, bench_stream_ms, copy_ceiling_tb_s
from fuseformer.layers.fp8 import Fp8Activation, Fp8GatedMLP, Fp8Linear
from fuseformer.layers.mlp import GatedMLP

G = importlib.import_module("fuseformer.ops.fp8_gemm")  # the module (fuseformer.ops.fp8_gemm is the function)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
H, INTER = 4096, 14336  # hidden, intermediate


def _time(fn, m: int) -> float:
    """Microseconds of one call (see the module docstring)."""
    return 1e3 * (bench_graph_ms(fn) if m >= 256 else bench_stream_ms(fn))


def _best(candidates, run, m: int) -> tuple[dict | None, float]:
    best, best_us = None, float("inf")
    for cfg in candidates:
        try:
            run(cfg)
            us = _time(lambda cfg=cfg: run(cfg), m)
        except Exception as exc:  # a config that does not compile or fit: skipped, counted
            print(f"  skipped {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if us < best_us:
            best, best_us = cfg, us
    return best, best_us


def gemm_rows(tokens, max_candidates: int, copy: float) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") / k**0.5
        w_bf16 = w.bfloat16()
        w_q, w_s = F.quantize_weight_fp8(w)
        grouped = name == "down"
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, a_s = F.quantize_fp8(x, 128 if grouped else None)
            rec = dict(bench="fp8_gemm", name=name, M=m, N=n, K=k, grouped=grouped)
            rec["bf16_cublas_us"] = _time(lambda: torch.matmul(x, w_bf16.T), m)
            rec["default_us"] = _time(lambda: F.fp8_gemm(a, a_s, w_q, w_s), m)
            rec["default"] = G.cached_config(m, n, k, grouped, torch.bfloat16, x.device)
            if G.scaled_mm_applies(n, k, grouped, torch.bfloat16):
                rec["scaled_mm_us"] = _time(lambda: G.fp8_gemm_fwd(a, a_s, w_q, w_s, None, torch.bfloat16,
                                                                    dict(backend="scaled_mm")), m)  # fmt: skip
            cands = [c for c in G.candidate_configs(m, n, k, grouped, torch.bfloat16) if c["backend"] == "triton"]
            cfg, us = _best(cands[:max_candidates],
                            lambda c: G.fp8_gemm_fwd(a, a_s, w_q, w_s, None, torch.bfloat16, c), m)  # fmt: skip
            rec["triton_best"], rec["triton_best_us"] = cfg, us
            fastest = min(us, rec.get("scaled_mm_us", float("inf")))
            rec["fp8_speedup"] = rec["bf16_cublas_us"] / fastest
            if m <= 64:  # weight streaming: the fp8 bytes over the fastest time
                rec["fp8_pct_copy"] = 100 * (n * k) / (fastest * 1e-6) / 1e12 / copy
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    return rows


def glu_rows(tokens, max_candidates: int, copy: float) -> list[dict]:
    w = torch.randn(2 * INTER, H, device="cuda") / H**0.5
    w_bf16 = w.bfloat16()
    w_q, w_s = F.quantize_weight_fp8(w)
    rows = []
    for m in tokens:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
        a, a_s = F.quantize_fp8(x)
        rec = dict(bench="fp8_gemm_glu", M=m, INTER=INTER, K=H)
        rec["bf16_cublas_swiglu_us"] = _time(lambda: F.swiglu(*torch.matmul(x, w_bf16.T).chunk(2, dim=-1)), m)
        rec["default_us"] = _time(lambda: F.fp8_gemm_glu(a, a_s, w_q, w_s), m)
        cfg, us = _best(G.glu_candidate_configs(m)[:max_candidates],
                        lambda c: G.fp8_gemm_glu_fwd(a, a_s, w_q, w_s, "silu", c), m)  # fmt: skip
        rec["triton_best"], rec["triton_best_us"] = cfg, us
        rec["fp8_speedup"] = rec["bf16_cublas_swiglu_us"] / us
        if m <= 64:
            rec["fp8_pct_copy"] = 100 * (2 * INTER * H) / (us * 1e-6) / 1e12 / copy
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    return rows


def layer_rows(tokens) -> list[dict]:
    mlp = GatedMLP(H, INTER, dtype=torch.bfloat16, device="cuda")
    fp8_mlp = Fp8GatedMLP.from_mlp(mlp)
    o = torch.nn.Linear(H, H, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8_o = Fp8Linear.from_linear(o)
    gu = (fp8_mlp.gate_up_proj.weight, fp8_mlp.gate_up_proj.weight_scale)
    dn = (fp8_mlp.down_proj.weight, fp8_mlp.down_proj.weight_scale)
    rows = []
    with torch.inference_mode():
        for m in tokens:
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
            act = Fp8Activation(*F.quantize_fp8(x))
            rec = dict(bench="layers", M=m)
            rec["mlp_bf16_us"] = _time(lambda: mlp(x), m)
            rec["mlp_fp8_us"] = _time(lambda: fp8_mlp(act), m)
            rec["mlp_fp8_fused_glu_us"] = _time(
                lambda: F.fp8_gemm(*F.fp8_gemm_glu(*act, *gu), *dn, out_dtype=torch.bfloat16), m
            )
            rec["mlp_fp8_unfused_us"] = _time(lambda: fp8_mlp._unfused(*act), m)
            rec["o_bf16_us"] = _time(lambda: o(x), m)
            rec["o_fp8_us"] = _time(lambda: fp8_o(x), m)
            rec["quantize_us"] = _time(lambda: F.quantize_fp8(x), m)
            rec["mlp_speedup"] = rec["mlp_bf16_us"] / rec["mlp_fp8_us"]
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    return rows


def _rotating_us(make_call, copies: int) -> float:
    """Microseconds of one call of ``make_call(i)`` (over weight copy i), from a CUDA graph that calls
    each of ``copies`` copies once: GPU time with no host launch in it, and weights read from HBM (the
    copies together pass L2)."""
    calls = [make_call(i) for i in range(copies)]
    return 1e3 * bench_graph_ms(lambda: [c() for c in calls]) / copies


def _copies(nbytes: int) -> int:
    return max(2, -(-160_000_000 // nbytes))  # >= 160 MB of weights a replay: 3x the H100's L2


def decode_rows(tokens, copy: float, rule_only: bool = False, names: tuple[str, ...] = ()) -> list[dict]:
    """M <= 64 as the engine's graphs run it: each backend and candidate over rotated weight copies;
    % of copy bandwidth for the e4m3 weight bytes (bf16 rows: their bf16 bytes). ``rule_only``: the
    weight-only rule's tile in fp16 and bf16 MMA against bf16 and against W8A8 through ``_scaled_mm``
    (the quantization of x included), no sweep of the Triton W8A8 tiles. ``names``: only these shapes
    (qkv, o, down, gate_up; all when empty)."""
    from fuseformer.ops.mlp_decode import DOWN_DECODE, GATE_UP_DECODE, _decode_gemm, decode_candidates, decode_plan

    rows = []
    shapes = {**SHAPES, "gate_up": (2 * INTER, H)}
    for name, (n, k) in shapes.items():
        if names and name not in names:
            continue
        c = _copies(n * k)
        w = [torch.randn(n, k, device="cuda") / k**0.5 for _ in range(c)]
        w16 = [t.bfloat16() for t in w]
        wq = [F.quantize_weight_fp8(t) for t in w]
        del w
        glu, grouped = name == "gate_up", name == "down"
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, a_s = F.quantize_fp8(x, 128 if grouped else None)
            rec = dict(bench="decode", name=name, M=m, N=n, K=k, copies=c)
            kern = GATE_UP_DECODE if glu else DOWN_DECODE
            cfg16 = decode_plan(kern, max(1, 1 << (m - 1).bit_length()), n // 2 if glu else n, k, x.dtype, x.device)
            rec["bf16_decode_us"] = _rotating_us(lambda i: lambda: _decode_gemm(x, w16[i], glu, "silu", cfg16), c)
            rec["bf16_cublas_us"] = _rotating_us(lambda i: lambda: torch.matmul(x, w16[i].T), c)
            # Weight-only FP8 through the bf16 decode kernel (e4m3 tiles widened in registers, x in bf16).
            nn_ = n // 2 if glu else n
            w8 = []
            cands8 = decode_candidates(m, nn_, k, glu, w_fp8=True)[: 1 if rule_only else None]
            # The rule's and the sweep's first five tiles again with the MMA in bf16 (the default is fp16:
            # e4m3 -> fp16 is one cvt for two elements, e4m3 -> bf16 goes through fp16 and fp32).
            cands8 += [dict(c, FP16_MMA=False) for c in cands8[:5]]
            for cfg in cands8:
                try:
                    _decode_gemm(x, wq[0][0], glu, "silu", cfg, w_scale=wq[0][1])
                    us = _rotating_us(lambda i, cfg=cfg: lambda: _decode_gemm(x, wq[i][0], glu, "silu", cfg,
                                                                              w_scale=wq[i][1]), c)  # fmt: skip
                    w8.append((us, cfg))
                except Exception as exc:
                    print(f"  w8 skipped {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            if w8:
                rec["w8_rule_us"] = w8[0][0]
                if rule_only and len(w8) > 1:
                    rec["w8_rule_bf16_mma_us"] = w8[1][0]
                w8.sort(key=lambda r: r[0])
                rec["w8_best_us"], rec["w8_best"] = w8[0]
                rec["w8_top3"] = [(round(us, 1), cfg) for us, cfg in w8[:3]]
                rec["w8_best_pct_copy"] = 100 * n * k / (w8[0][0] * 1e-6) / 1e12 / copy
            rec["bf16_decode_pct_copy"] = 100 * 2 * n * k / (rec["bf16_decode_us"] * 1e-6) / 1e12 / copy
            if not glu and G.scaled_mm_applies(n, k, False, torch.bfloat16):
                # W8A8 as the prefill path runs it: x quantized per token, then cuBLASLt's rowwise _scaled_mm.
                sm = dict(backend="scaled_mm")
                rec["w8a8_scaled_mm_us"] = _rotating_us(
                    lambda i: lambda: G.fp8_gemm_fwd(*F.quantize_fp8(x), *wq[i], None, torch.bfloat16, sm), c
                )
            if rule_only:
                print(json.dumps(rec), flush=True)
                rows.append(rec)
                continue
            if glu:
                cands = G.glu_candidate_configs(m)
                run = lambda cfg, i: lambda: G.fp8_gemm_glu_fwd(a, a_s, *wq[i], "silu", cfg)  # noqa: E731
            else:
                cands = G.candidate_configs(m, n, k, grouped, torch.bfloat16)
                run = lambda cfg, i: lambda: G.fp8_gemm_fwd(a, a_s, *wq[i], None, torch.bfloat16, cfg)  # noqa: E731
            results = []
            for cfg in cands:
                try:
                    run(cfg, 0)()
                    results.append((_rotating_us(lambda i, cfg=cfg: run(cfg, i), c), cfg))
                except Exception as exc:
                    print(f"  skipped {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            results.sort(key=lambda r: r[0])
            rec["fp8_default_us"] = next((us for us, cfg in results if cfg == cands[0]), None)
            rec["fp8_best_us"], rec["fp8_best"] = results[0]
            rec["fp8_top3"] = [(round(us, 1), cfg) for us, cfg in results[:3]]
            rec["fp8_best_pct_copy"] = 100 * n * k / (rec["fp8_best_us"] * 1e-6) / 1e12 / copy
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,16,64,256,1024,4096")
    p.add_argument("--max-candidates", type=int, default=12)
    p.add_argument("--parts", default="layers,decode,gemm,glu")
    p.add_argument("--decode-rule-only", action="store_true", help="decode: the rule's tile, fp16 vs bf16 MMA")
    p.add_argument("--decode-shapes", default="", help="decode: only these of qkv,o,down,gate_up")
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    copy = copy_ceiling_tb_s("cuda")
    out = os.path.join(os.environ.get("OUT", "."), "fp8_gemm.json")
    rows: list[dict] = []
    decode_tokens = [t for t in tokens if t <= 64]
    for part, fn in (("layers", lambda: layer_rows(tokens)), ("decode", lambda: decode_rows(decode_tokens, copy, args.decode_rule_only,
                                                            tuple(filter(None, args.decode_shapes.split(","))))),
                     ("gemm", lambda: gemm_rows(tokens, args.max_candidates, copy)),
                     ("glu", lambda: glu_rows(tokens, args.max_candidates, copy))):  # fmt: skip
        if part in args.parts.split(","):
            start = time.perf_counter()
            rows += fn()
            print(f"# {part}: {time.perf_counter() - start:.0f} s", flush=True)
            info = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
            json.dump(dict(info, copy_tb_s=copy, rows=rows), open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
