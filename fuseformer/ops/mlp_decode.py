"""The gated MLP at decode: both GEMMs through one weight-streaming Triton kernel (inference, T <= 64).

Decode (inference, T <= 64 tokens, fp16/bf16 on CUDA): the MLP reads 3 H I x 2 bytes of weights
(352 MB at H 4096, I 14336) for a few tokens, so it is judged by weight streaming against the copy
bandwidth, and the prefill kernel's grid is the wrong shape for it (448 programs of one per SM at
T 1: 3.4 waves). ``_mlp_decode_kernel`` runs both GEMMs: gate-up with the activation in its
epilogue, then down, each with its own config (``decode_config``: the H200 sweep's fastest, deep
TMA pipelines and wide weight tiles; split-K for the down GEMM only where its outputs are too few to
give every SM a program), so the whole MLP is two or three kernels, none of them cuBLAS. The down
GEMM is a programmatic dependent launch of the gate-up GEMM (sm_90), both take host-built tensor
descriptors, and after a shape's first call both launch through
``DescLauncher`` (the C launcher called directly: Triton's own launch path cost up to ~60 us of host
time a GEMM on a slow host, run 62). Measured on H200s (BENCHMARKS.md, runs 57-67, L2 flushed by
reading): 84.5-90% of the copy bandwidth at T 1-64 by machine, eager (torch.compile 69-83%); 89.5-93%
from CUDA graphs, as the engine's decode runs it.

Here: the kernel ``_mlp_decode_kernel``, its configs (``decode_config`` by rule, the autotune cache's
``mlp_decode_gate_up`` / ``mlp_decode_down`` entries, ``decode_candidates`` for the sweep), the launcher
``mlp_decode_fwd`` and ``decode_supported``, which says when ``fused_mlp`` (mlp.py) takes this path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fuseformer.ops._mlp_common import _aligned, _gate_up_epilogue, _split_k_reduce
from fuseformer.ops._utils import SM90_SMEM_BYTES, empty, next_pow2, num_sms
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import INTERPRET
from fuseformer.runtime.launch import DescLauncher, HostDesc, launch_config


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _mlp_decode_kernel(
    x_desc, w_desc, OUT, WS, W_SCALE,
    M, N, K,
    stride_om,
    GLU: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False, PDL_WAIT: tl.constexpr = False, W_FP8: tl.constexpr = False,
    FP16_MMA: tl.constexpr = False,
):  # fmt: skip
    # Decode (T <= 64): a weight-streaming GEMM, one kernel for both GEMMs of the MLP.
    #   GLU:  W (2N, K) = [gate; up] -> OUT (M, N) = act(x Wg^T) * (x Wu^T)   (N = I, K = H)
    #   else: W (N, K)               -> OUT (M, N) = x W^T                    (N = H, K = I)
    # Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K): each program streams BLOCK_N weight rows
    # (2 BLOCK_N with GLU) over one K range through tensor descriptors built on the host (x_desc
    # [BLOCK_M, BLOCK_K] boxes of x, w_desc [BLOCK_N, BLOCK_K] of W; kernel parameters: no per-program
    # descriptor writes and fences at the start, no scratch memory), num_stages deep. SPLIT_K > 1
    # writes fp32 partials to WS (SPLIT_K, M, 2N or N), summed by _mlp_split_k_epilogue_kernel.
    # A tl.dot padded to 16 rows rather than a multiply + tl.sum over K on CUDA cores: Triton 3.6
    # pipelines descriptor loads only into a dot (offline sm_90 compile of the tl.sum variant: one
    # shared buffer, each load waited for), and the padding costs tensor-core time, not bytes.
    # Programmatic dependent launch (sm_90, CUDA only; see mlp_decode_fwd): PDL_TRIGGER (the gate-up
    # GEMM) lets the next kernel's programs start at once; PDL_WAIT (the down GEMM, launched with
    # launch_pdl) waits for the previous kernel's writes (y) to land before its first load.
    if PDL_TRIGGER:
        gdc_launch_dependents()
    off_n = tl.program_id(0) * BLOCK_N
    off_m = tl.program_id(1) * BLOCK_M
    split = tl.program_id(2)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_begin = split * per_split
    kt_end = tl.minimum(kt_begin + per_split, k_tiles)  # <= kt_begin: a split left without tiles writes 0
    # Out-of-bounds boxes read as zero and cost no bytes (rows >= M, K's tail); a gate box crossing
    # row N reads up rows into columns >= N, which the stores mask off.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PDL_WAIT:
        gdc_wait()
    for kt in tl.range(kt_begin, kt_end):
        k = kt * BLOCK_K
        x = x_desc.load([off_m, k])
        if FP16_MMA:
            x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        acc = tl.dot(x, w_desc.load([off_n, k]).to(x.dtype).T, acc, input_precision=PRECISION)
        if GLU:
            acc_u = tl.dot(x, w_desc.load([N + off_n, k]).to(x.dtype).T, acc_u, input_precision=PRECISION)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    if W_FP8:  # the weight's per-channel scales (W_SCALE (N,) or (2N,) = [gate; up]), before any sum or act
        acc *= tl.load(W_SCALE + rn, mask=rn < N, other=0.0)[None, :]
        if GLU:
            acc_u *= tl.load(W_SCALE + N + rn, mask=rn < N, other=0.0)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)[:, None]
    if SPLIT_K > 1:
        ws = WS + (split * M + rows) * (2 * N if GLU else N)
        tl.store(ws + rn[None, :], acc, mask=mask)
        if GLU:
            tl.store(ws + (N + rn)[None, :], acc_u, mask=mask)
    elif GLU:
        _gate_up_epilogue(acc, acc_u, OUT, OUT, rows, rn, mask, stride_om, 0, N, ACTIVATION, False)
    else:
        tl.store(OUT + rows * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache)
# --------------------------------------------------------------------------------------------
# Decode: both GEMMs of the MLP through _mlp_decode_kernel, each with its own autotune entry.
DECODE_MAX_T = 64
GATE_UP_DECODE = "mlp_decode_gate_up"  # N = I, K = H, GLU
DOWN_DECODE = "mlp_decode_down"  # N = H, K = I
DECODE_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
# Where fused_mlp takes the decode path (tests add "cpu" to run it under the interpreter).
DECODE_DEVICE_TYPES = frozenset({"cuda"})


def decode_key(t: int, n: int, k: int, dtype: torch.dtype, w_fp8: bool = False) -> str:
    """The decode kernels' autotune key: T's power-of-two bucket (1..64), the GEMM's N and K, x's dtype
    (and "-w8" for e4m3 weights)."""
    return f"T{next_pow2(t)}-N{n}-K{k}-{autotune.dtype_name(dtype)}" + ("-w8" if w_fp8 else "")


def decode_generic_key(t: int, dtype: torch.dtype, w_fp8: bool = False) -> str:
    return f"T{next_pow2(t)}-{autotune.dtype_name(dtype)}" + ("-w8" if w_fp8 else "")


def decode_config(t: int, n: int, k: int, glu: bool, sms: int, on_gpu: bool = True, w_fp8: bool = False) -> dict:
    """The decode kernel's config by rule for the H200 (132 SMs, 227 KB of shared memory per block):
    the fastest configs of the ``benchmarks/sweeps.py mlp_decode`` sweep at Llama-3 8B's shapes (run 34,
    2026-11-30; offline sm_90 compiles: no spills in any of these).

    A decode GEMM reads each weight byte once, so it is judged by the bytes each SM keeps in flight
    (loads run num_stages - 1 tiles ahead; num_stages - 2 with wgmma, BLOCK_M 64) more than by filling
    every SM: in run 34 gate-up tiles of 128 gate + 128 up rows (112 programs, one per SM, 20 SMs
    idle) beat 64 + 64 (224 programs, two per SM) by 3-5%, and the down GEMM without split-K beat
    the split-K configs by 3-8% (its fp32 partials and the extra kernel cost more than the balance
    gains). Best of the sweep, whole MLP: 105.8-108.6 us at T 1-64 (77-79% of copy), torch.compile
    107.1-116.8 us.
    - Gate-up: never split (the act would need the epilogue kernel and a (S, T, 2I) fp32 round trip).
    - Down (N = H outputs, K = I): split-K only while (N / BLOCK_N) x 2 splits still fit one program
      per SM (not at H 4096; a model with H 2048 gets 2 splits), summed by the epilogue kernel.
    - e4m3 weights (``w_fp8``, weight-only FP8): ``_fp8_decode_config``, run 120's sweep.
    Off the GPU (the interpreter): small tiles that exercise every mask.
    """
    bm = max(16, next_pow2(t))
    if not on_gpu:
        return dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1)
    # (BLOCK_N, BLOCK_K, num_stages) by BLOCK_M; shared memory per program (bf16) in the comment.
    if glu:
        # run 34 (us, gate-up alone): T 1 70.9, T 8 71.4, T 32 70.8, T 64 72.0. T 64 at 4 stages, not 3
        # (runs 60, 62, 64, sweep mlp_decode_timeline): the gate-up alone 2.6-4.1 us faster; the whole
        # MLP with PDL 97.5 -> 95.3 us eager, 95.0 -> 92.8 from a CUDA graph (run 64).
        bn, bk, stages = {16: (128, 64, 4), 32: (64, 128, 3), 64: (128, 64, 4)}[min(bm, 64)]
    else:
        # run 34 (us, down alone): T 1 44.6, T 8 43.2, T 32 44.5, T 64 44.4
        bn, bk, stages = {16: (32, 256, 6), 32: (16, 256, 5), 64: (32, 128, 6)}[min(bm, 64)]
        if t == 1:
            # 8 stages at T 1 (sweep mlp_decode_timeline): the down alone 1.4-1.7 us faster (runs 60, 66);
            # the whole MLP with PDL, eager, 98.1 -> 95.5 us in run 66 and level in run 60 (its CUDA-graph
            # time the same: 91.6 us); at T 2-16 it was +1.0 / -1.1 us, so T 1 only. It no longer fits
            # beside a gate-up program, so the PDL launch's programs wait for SMs to free.
            stages = 8
    if w_fp8:
        return _fp8_decode_config(t, n, k, glu, sms, bm, bn, bk, stages)
    split = 1
    if not glu:
        blocks, k_tiles = triton.cdiv(n, bn), triton.cdiv(k, bk)
        while blocks * split * 2 <= sms and k_tiles >= 8 * split:
            split *= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages)


def _fp8_decode_config(t: int, n: int, k: int, glu: bool, sms: int, bm: int, bn: int, bk: int, stages: int) -> dict:
    """decode_config for e4m3 weights (weight-only FP8). Run 120 (H100, 2026-12-06, rotated weights,
    CUDA graphs, the MMA then in bf16; us at T 1 / T 16 against the bf16 kernel's rule): non-GLU GEMMs
    want small tiles and split-K to about 2 programs an SM (the widening of each e4m3 tile in registers,
    not the bytes in flight, limits a program): T 1 BLOCK_N 64, BLOCK_K 128, 5 stages, split 4;
    T 2-16 BLOCK_N 32, BLOCK_K 256, 4 stages, split 2. Gate-up: BLOCK_N 64, BLOCK_K 256, 3 stages, no
    split (split 2 at 128 x 128 was level but needs the epilogue kernel and gives up the down GEMM's
    programmatic launch). T 17-64 (wgmma): BLOCK_N 128, BLOCK_K 64, split 8; elsewhere the bf16 rule's
    bytes a stage (twice BLOCK_K, or BLOCK_N where BLOCK_K is 256) within shared memory.
    The MMA (run 121, H100, us, fp16 / bf16 MMA, bf16 kernel): fp16 (e4m3 -> fp16 is one cvt for two
    elements, x rounded once a tile) at T 1 (qkv 14.0 / 15.0, o 10.4 / 11.1, down 24.8 / 26.9; bf16 23.2,
    14.7, 42.2), in gate-up at every T (T 1 46.1 / 52.3, T 16 45.4 / 52.6, T 64 57.3 / 88.2; bf16 ~81) and
    at T 17-64 (qkv 21.3 / 22.8, down 34.6 / 37.2); bf16 for the T 2-16 non-GLU tile, whose x tile is half
    its weight tile (T 16: qkv 17.4 / 15.6, o 14.0 / 12.3, down 35.6 / 28.4)."""
    if glu:
        if bm == 16:
            bn, bk, stages = 64, 256, 3
        else:
            bn, bk = (bn, 2 * bk) if bk < 256 else (2 * bn, bk)
        split = 1
    else:
        bn, bk, stages = (64, 128, 5) if t == 1 else (32, 256, 4) if bm == 16 else (128, 64, 4)
        blocks, k_tiles, split = triton.cdiv(n, bn), triton.cdiv(k, bk), 1
        while blocks * split * 2 < 3 * sms and k_tiles >= 8 * split:
            split *= 2
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages)
    if not glu and bm == 16 and t > 1:
        # Run 121: at BLOCK_N 32 rounding x to fp16 costs more than the cheaper widening of the weights saves.
        cfg["FP16_MMA"] = False
    while cfg["num_stages"] > 2 and decode_smem_bytes(cfg, glu, 2, 1) + 4096 > SM90_SMEM_BYTES:
        cfg["num_stages"] -= 1
    return cfg


def decode_smem_bytes(cfg: dict, glu: bool, element_size: int = 2, w_element_size: int | None = None) -> int:
    """Shared memory of the decode kernel's operand buffers: num_stages - 1 of them (mma.sync,
    BLOCK_M < 64), num_stages with wgmma (BLOCK_M 64); offline sm_90 compiles match it within 100 B.
    ``w_element_size``: the weight's bytes an element where they differ from x's (1: e4m3)."""
    bufs = cfg["num_stages"] if cfg["BLOCK_M"] >= 64 else max(1, cfg["num_stages"] - 1)
    w_bytes = element_size if w_element_size is None else w_element_size
    return bufs * (cfg["BLOCK_M"] * element_size + (2 if glu else 1) * cfg["BLOCK_N"] * w_bytes) * cfg["BLOCK_K"]


# The decode sweep's tiles around the rule, as (BLOCK_N, BLOCK_K, num_stages, SPLIT_K) by (GLU, BLOCK_M):
# programs per SM (shared memory, H200) and x re-read against the weights differ; all compile for
# sm_90 without spills (offline, Triton 3.6). Gate-up: I 14336 / BLOCK_N programs x SPLIT_K;
# down: 4096 / BLOCK_N x SPLIT_K.
_DECODE_SWEEP = {
    (True, 16): [(64, 128, 3, 1), (64, 64, 5, 1), (64, 64, 4, 1), (32, 64, 5, 1), (32, 128, 4, 1), (128, 64, 4, 1),
                 (128, 64, 3, 1), (128, 64, 4, 2), (128, 64, 3, 2)],
    (True, 32): [(64, 64, 4, 1), (64, 128, 3, 1), (32, 64, 5, 1), (128, 64, 3, 1), (128, 64, 4, 1)],
    (True, 64): [(64, 64, 5, 1), (32, 64, 5, 1), (128, 64, 3, 1), (128, 64, 4, 1), (64, 128, 3, 1)],
    (False, 16): [(32, 256, 4, 1), (16, 256, 5, 1), (32, 128, 6, 2), (32, 256, 4, 2), (64, 128, 6, 2),
                  (64, 128, 5, 4), (128, 64, 6, 4), (128, 64, 4, 4), (128, 128, 4, 4)],
    (False, 32): [(32, 256, 4, 1), (32, 128, 6, 1), (32, 128, 6, 2), (16, 256, 5, 1), (64, 128, 5, 4),
                  (128, 64, 6, 4), (128, 128, 4, 4)],
    (False, 64): [(128, 64, 4, 4), (128, 64, 4, 8), (64, 128, 5, 2), (32, 128, 6, 1), (128, 128, 4, 4)],
}  # fmt: skip


def decode_candidates(t: int, n: int, k: int, glu: bool, sms: int = 132, w_fp8: bool = False) -> list[dict]:
    """The decode sweep's configs for one GEMM at T tokens (benchmarks/sweeps.py mlp_decode): the rule's
    first, then ``_DECODE_SWEEP``'s (for e4m3 weights each with twice the BLOCK_K, and as it is); any
    over the shared memory limit is left out."""
    bm = max(16, next_pow2(t))
    out = [decode_config(t, n, k, glu, sms, w_fp8=w_fp8)]
    for bn, bk, stages, split in _DECODE_SWEEP[(glu, min(bm, 64))]:
        tiles = [(bn, bk)] + ([(bn, 2 * bk)] if w_fp8 and bk < 256 else [])
        for bn_, bk_ in tiles:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn_, BLOCK_K=bk_, SPLIT_K=split, num_warps=4, num_stages=stages)
            if cfg not in out:
                out.append(cfg)
    w_bytes = 1 if w_fp8 else 2
    return [c for c in out if decode_smem_bytes(c, glu, 2, w_bytes) + 4096 <= SM90_SMEM_BYTES]


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; x (T, K) and the weights with unit column strides, 16-byte aligned rows)
# --------------------------------------------------------------------------------------------
def _decode_gemm(
    x: torch.Tensor, w: torch.Tensor, glu: bool, activation: str, config: dict, pdl: str = "",
    rows: int | None = None, w_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x (T, K), w (2N, K) = [gate; up] (``glu``) or (N, K) -> act(x Wg^T) * (x Wu^T) or x W^T (T, N),
    x's dtype, through _mlp_decode_kernel (16-byte aligned rows: host-built tensor descriptors).
    ``w_scale`` (2N,) or (N,) fp32: w is e4m3 and its value ``w * w_scale[:, None]`` (weight-only FP8:
    each tile widened to x's dtype in registers, the scales applied to the fp32 sums).

    ``pdl``: "" none, "trigger" (this kernel lets the next one launch early), "wait" (this kernel is
    launched as a programmatic dependent of the previous one and waits for its writes). ``rows``: the
    output's rows, where they differ from x's (y padded, see mlp_decode_fwd): more (the rows past x's
    come out of zero x rows: zeros after the act) or fewer (x's last rows are padding)."""
    t, k = x.shape
    m = t if rows is None else rows
    n = w.shape[0] // 2 if glu else w.shape[0]
    out = empty((m, n), dtype=x.dtype, device=x.device)
    split = config["SPLIT_K"]
    # Split-K partials (SPLIT_K, T, 2N or N) fp32: 1 MB a split at T 64 for the down GEMM (N 4096).
    ws = empty((split, m, 2 * n if glu else n), dtype=torch.float32, device=x.device) if split > 1 else out
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    # decode_supported has checked what a descriptor needs (aligned bases and rows).
    x_arg = HostDesc(x, (t, k), (x.stride(0), 1), (bm, bk))
    w_arg = HostDesc(w, tuple(w.shape), (w.stride(0), 1), (bn, bk))
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    # e4m3 weights with bf16 x multiply in fp16 (x rounded and clamped to fp16's range in the kernel).
    fp16_mma = w_scale is not None and x.dtype == torch.bfloat16
    lc = _decode_launch_config(
        glu, activation, x.dtype == torch.float32, pdl, w_scale is not None, fp16_mma, tuple(config.items())
    )
    args = (x_arg, w_arg, out, ws, w_scale, m, n, k, out.stride(0))
    _decode_launcher.launch(grid, lc, _launch_key(x, w, out, ws, w_scale), args)
    if split > 1:
        _split_k_reduce(ws, out, None, activation, glu)
    return out


@functools.cache
def _decode_launch_config(
    glu: bool, activation: str, fp32: bool, pdl: str, w_fp8: bool, fp16_mma: bool, config: tuple
):  # fmt: skip
    """The LaunchConfig of one decode GEMM (``config``: the tile config's items), built once for
    every value of its arguments. ``fp16_mma``: bf16 x with e4m3 weights multiplies in fp16 (e4m3 ->
    fp16 is one cvt for two elements, e4m3 -> bf16 three; x is clamped to fp16's range in the kernel);
    a config may say ``FP16_MMA=False`` (the sweep's comparison)."""
    flags = dict(
        GLU=glu, ACTIVATION=activation, PRECISION="ieee" if fp32 else "tf32",
        PDL_TRIGGER=pdl == "trigger", PDL_WAIT=pdl == "wait", W_FP8=w_fp8, FP16_MMA=fp16_mma,
        **({"launch_pdl": True} if pdl == "wait" else {}),
    )  # fmt: skip
    return launch_config(**(flags | dict(config)))


def _launch_key(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ws: torch.Tensor, w_scale: torch.Tensor | None):
    """What, beside the launch config and the ints (in the key through the shapes and strides below),
    decides Triton's specialization of a decode launch (``DescLauncher``): dtypes, shapes and row
    strides, and each pointer's 16-byte alignment (True: all aligned, the common case)."""
    ptrs = (x.data_ptr(), w.data_ptr(), out.data_ptr(), ws.data_ptr(), 0 if w_scale is None else w_scale.data_ptr())
    aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15 or tuple(p % 16 == 0 for p in ptrs)
    return (x.dtype, x.shape, x.stride(0), w.dtype, w.shape, w.stride(0), out.shape, out.stride(0), ws.dtype,
            w_scale is None, aligned)  # fmt: skip


# Direct launches of the decode kernel with host-built descriptors (after the first, compiling one).
_decode_launcher = DescLauncher(_mlp_decode_kernel)


@autotune.plan_cache
def decode_plan(
    kernel: str, tb: int, n: int, k: int, dtype: torch.dtype, device: torch.device, w_fp8: bool = False
) -> dict:
    """The launch config of one decode GEMM (cached per T bucket, shape, dtype, weight kind and device)."""
    glu, on_gpu = kernel == GATE_UP_DECODE, device.type == "cuda"
    return autotune.get_config(
        kernel, decode_key(tb, n, k, dtype, w_fp8), device=device, generic_key=decode_generic_key(tb, dtype, w_fp8),
        default=lambda: _wide_dtype(decode_config(tb, n, k, glu, num_sms(device.index or 0), on_gpu, w_fp8), dtype),
        fields=DECODE_CONFIG_KEYS,
    )  # fmt: skip


def _wide_dtype(cfg: dict, dtype: torch.dtype) -> dict:
    """The rule's tiles are sized for 2-byte elements: fp32 (reachable through ``mlp_decode_fwd``, not
    ``fused_mlp``) takes half the BLOCK_K, so its operand buffers stay within shared memory (run 62,
    H200: the bf16 tiles in fp32 asked for 241,720 of 232,448 bytes)."""
    if torch.empty((), dtype=dtype).element_size() > 2 and cfg["BLOCK_K"] > 16:
        cfg = dict(cfg, BLOCK_K=cfg["BLOCK_K"] // 2)
    return cfg


def decode_supported(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether ``fused_mlp`` takes the decode kernels for x (T, H): 1 <= T <= DECODE_MAX_T, fp16 or
    bf16 on CUDA, H and I > 0, and rows the tensor descriptors can read (16-byte aligned bases and
    row strides, y (T, I) included); anything else takes the prefill-style path."""
    t, h = x.shape
    i = w_down.shape[1]
    return (
        0 < t <= DECODE_MAX_T and h > 0 and i > 0 and x.device.type in DECODE_DEVICE_TYPES
        and x.dtype in (torch.float16, torch.bfloat16) and (i * x.element_size()) % 16 == 0
        and _aligned(x) and _aligned(w_gate_up) and _aligned(w_down)
    )  # fmt: skip


def mlp_decode_fwd(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
    gate_up_config: dict | None = None,
    down_config: dict | None = None,
    pdl: bool = True,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H), T <= 64 -> out (T, H) and y (T, I): the gate-up GEMM with the activation, then the
    down GEMM, both through _mlp_decode_kernel (plus the split-K epilogue where a config splits).
    No pre-activation (inference only). The configs override the cached ones (sweeps, tests);
    ``pdl=False`` launches the down GEMM plainly where it would be a programmatic dependent launch
    (the sweeps' and tests' baseline; the result is the same bits). ``scales``: (gate-up (2I,), down
    (H,)) fp32 per-channel scales of e4m3 weights (``fp8_weight_mlp``)."""
    t, h = x.shape
    i = w_down.shape[1]
    tb = next_pow2(t)
    if gate_up_config is None:
        gate_up_config = decode_plan(GATE_UP_DECODE, tb, i, h, x.dtype, x.device)
    if down_config is None:
        down_config = decode_plan(DOWN_DECODE, tb, h, i, x.dtype, x.device)
    # The down GEMM as a programmatic dependent launch of the gate-up GEMM (sm_90+): its programs
    # start while the gate-up's last ones run and wait for y in-kernel, so the gap between the two
    # (launch, program start) leaves the weight stream. Only where gate-up is one kernel (no split-K
    # epilogue between them) and the device is sm_90+. Run 53 (H200, 2026-12-01, L2 flushed by
    # reading), whole MLP at the rule's configs, us without / with PDL (the plain launch timed twice,
    # first and last): T 1 102.5, 100.5 / 97.7; T 8 101.3, 96.4 / 93.8; T 32 108.5, 100.1 / 99.6; T 64
    # 104.4, 100.0 / 98.3. Host-built descriptors (run 57, whole MLP with PDL, us device-built / host-
    # built: T 1 99.3 / 97.7, T 8 96.0 / 94.4, T 32 97.9 / 94.9, T 64 99.3 / 98.9) also leave the two
    # overlapping kernels no descriptor scratch to share (the hangs of runs 48-50).
    pdl = pdl and gate_up_config["SPLIT_K"] == 1 and _pdl_capable(x.device)
    # y padded to the down GEMM's row block of 16 (T < 16): the gate-up GEMM writes all 16 rows (those
    # past T are zeros: x's missing rows read as zeros, and act(0) * 0 = 0) and the down GEMM reads y
    # without out-of-bounds rows. Runs 60-66: the down GEMM alone ran 35.4 us at T 1, 32.9 at T 2, 30.8
    # at T 8 (one row block of 16 each time): fewer valid rows in its x boxes, slower. Run 70 (H200,
    # 2026-12-01): the down alone on a padded y 33.6 -> 29.8 us at T 1, 32.7 -> 28.8 at T 2, level at
    # T 8; the whole MLP with PDL from CUDA graphs 91.9 -> 90.6-90.9 us at T 1, 92.4 -> 89.0-89.3 at T 2.
    bm = down_config["BLOCK_M"]
    pad = t < bm == 16 and gate_up_config["BLOCK_M"] == bm and gate_up_config["SPLIT_K"] == 1
    y_rows, out_rows = (bm, t) if pad else (None, None)
    gu_scale, down_scale = (None, None) if scales is None else scales
    y = _decode_gemm(x, w_gate_up, True, activation, gate_up_config, "trigger" if pdl else "", y_rows, gu_scale)
    out = _decode_gemm(y, w_down, False, activation, down_config, "wait" if pdl else "", out_rows, down_scale)
    return out, (y[:t] if pad else y)


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and not INTERPRET and torch.cuda.get_device_capability(device)[0] >= 9
