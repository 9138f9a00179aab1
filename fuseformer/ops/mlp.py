"""The gated MLP of Llama/Qwen/Mistral with its gate-up GEMM and activation fused.

    g, u = x @ w_gate_up[:I].T, x @ w_gate_up[I:].T       (T, I) each, never written (see below)
    y    = act(g) * u                                     (T, I)
    out  = y @ w_down.T                                   (T, H)

Everything below autograd lives here (STYLE.md §1): the reference ``fused_mlp_ref``, the Triton
GEMM ``_mlp_gate_up_kernel``, the launchers ``fused_mlp_fwd``/``fused_mlp_bwd`` (no autograd; the
engine calls them), the ``torch.library`` registration and the public ``fused_mlp``.

The kernel: each program owns an output tile [BLOCK_M, BLOCK_N] of y. It loads an x tile once per
K step and multiplies it with the matching gate rows and up rows of w_gate_up (two fp32
accumulators: the work of one 128x256 GEMM tile at the default 128x128), then applies the
activation in registers and writes y alone. The (T, 2I) pre-activation goes to HBM only when a
backward will need it (``save_pre``), written from the same epilogue: it costs 2 bytes x 2I per
token (0.47 GB at T 8192, I 14336, ~0.1 ms of a ~5.5 ms forward) where recomputing it in the
backward would cost a second gate-up GEMM (~2.3 ms), so training saves it.

Loads go through device-side tensor descriptors (TMA on sm_90) when the config asks for them and
the strides are 16-byte aligned, or through plain pointers (any stride; the interpreter runs both).
Offline sm_90 compiles (Triton 3.6, bf16): the default prefill config (128x128x64, 8 warps, 3
stages, descriptors) uses wgmma + TMA, 147 KB of shared memory, 163 registers and no spills for
inference; saving the pre-activation adds 20 spill stores in the epilogue (once per tile). The
pointer path is not software-pipelined by Triton here (one stage of shared memory), so it is the
fallback, not the fast path.
The config (BLOCK_M/N/K, GROUP_M, split-K, warps, stages, descriptors) comes from the
autotune cache (runtime/autotune.py), by GPU and T bucket, with shipped H200/H100 defaults.

The down projection (decode aside, below) and every backward GEMM are cuBLAS (torch.matmul): a
plain GEMM, where our Triton GEMM has no epilogue to fuse and cuBLAS is the faster one (715 vs 610
TFLOP/s on 8192^3).
Backward: dy = dout @ w_down; dw_down = dout.T @ y; (dg, du) = glu_bwd(dy, g, u) written into the
halves of one (T, 2I) buffer dgu; dx = dgu @ w_gate_up; dw_gate_up = dgu.T @ x.

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
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime import _allocation

from fuseformer.ops import _gluon, mlp_hopper
from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    SM90_SMEM_BYTES,
    DescLauncher,
    HostDesc,
    autocast_inputs,
    autograd_function,
    check_tensor,
    dispatch,
    empty,
    float_dtype_of,
    launch_config,
    next_pow2,
    num_sms,
    rows_2d,
)
from fuseformer.ops.activations import ACTIVATIONS, _act_fwd, _act_ref, glu_bwd
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import INTERPRET, choose_backend

_OP = "fused_mlp"
KERNEL = "mlp_gate_up"


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def fused_mlp_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    upcast: bool = True,
) -> torch.Tensor:
    """(act(x Wg^T) * (x Wu^T)) Wd^T in pure PyTorch: fp32 (fp64 stays fp64) when ``upcast``, else in
    x's dtype with every intermediate rounded to it (what eager PyTorch does). Returns x's dtype."""
    dtype = x.dtype
    compute = float_dtype_of(x) if upcast else dtype
    gu = x.to(compute) @ w_gate_up.to(compute).T
    gate, up = gu.chunk(2, dim=-1)
    y = _act_ref(gate, activation) * up
    return (y @ w_down.to(compute).T).to(dtype)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _mlp_gate_up_kernel(
    X, W, Y, PRE, WS,
    M, N, K,
    stride_xm, stride_wn, stride_ym, stride_pm,
    ACTIVATION: tl.constexpr, SAVE_PRE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_DESC: tl.constexpr,
):  # fmt: skip
    # X (M, K), W (2N, K) = [gate rows; up rows], Y (M, N), PRE (M, 2N). M = tokens, N = I, K = H.
    # Grouped order: GROUP_M row blocks share each column block's weights while they sit in L2.
    # SPLIT_K > 1 (decode): program_id(1) takes one K range and writes its fp32 partial [g | u] to
    # WS (SPLIT_K, M, 2N); _mlp_split_k_epilogue_kernel sums them and applies the activation.
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    kt_begin = 0
    kt_end = k_tiles
    if SPLIT_K > 1:
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        kt_begin = tl.program_id(1) * per_split
        kt_end = tl.minimum(kt_begin + per_split, k_tiles)
    if USE_DESC:
        # Out-of-bounds boxes read as zero; a gate box crossing row N reads up rows into columns
        # >= N, which the store masks off.
        x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(W, shape=[2 * N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
        for kt in tl.range(kt_begin, kt_end):
            k = kt * BLOCK_K
            x = x_desc.load([off_m, k])
            wg = w_desc.load([off_n, k])
            wu = w_desc.load([N + off_n, k])
            acc_g = tl.dot(x, wg.T, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu.T, acc_u, input_precision=PRECISION)
    else:
        x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]  # row * stride can pass 2^31
        wg_ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        wu_ptrs = W + (N + rn).to(tl.int64)[:, None] * stride_wn + rk[None, :]
        m_mask = (rm < M)[:, None]
        n_mask = (rn < N)[:, None]
        for kt in tl.range(kt_begin, kt_end):
            k = kt * BLOCK_K
            k_mask = (rk < K - k)[None, :]
            x = tl.load(x_ptrs + k, mask=m_mask & k_mask, other=0.0)
            wg = tl.load(wg_ptrs + k, mask=n_mask & k_mask, other=0.0)
            wu = tl.load(wu_ptrs + k, mask=n_mask & k_mask, other=0.0)
            acc_g = tl.dot(x, wg.T, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu.T, acc_u, input_precision=PRECISION)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)[:, None]
    if SPLIT_K > 1:
        ws = WS + (tl.program_id(1) * M + rows) * (2 * N)
        tl.store(ws + rn[None, :], acc_g, mask=mask)
        tl.store(ws + (N + rn)[None, :], acc_u, mask=mask)
    else:
        _gate_up_epilogue(acc_g, acc_u, Y, PRE, rows, rn, mask, stride_ym, stride_pm, N, ACTIVATION, SAVE_PRE)


@triton.jit
def _grouped(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of ``tile`` in grouped order: GROUP_M row blocks share each column
    block's weights while they sit in L2."""
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % group) % group_m, (tile % group) // group_m


@triton.jit
def _gate_up_epilogue(acc_g, acc_u, Y, PRE, rows, rn, mask, stride_ym, stride_pm, N, ACTIVATION: tl.constexpr,
                      SAVE_PRE: tl.constexpr):  # fmt: skip
    """y = act(g) * u from fp32 g, u tiles; [g | u] rounded to PRE when saving for the backward."""
    if SAVE_PRE:
        # The backward reads the pre-activation rounded to the input dtype, as eager PyTorch's does.
        g = acc_g.to(PRE.dtype.element_ty)
        u = acc_u.to(PRE.dtype.element_ty)
        tl.store(PRE + rows * stride_pm + rn[None, :], g, mask=mask)
        tl.store(PRE + rows * stride_pm + (N + rn)[None, :], u, mask=mask)
    y = _act_fwd(acc_g, ACTIVATION) * acc_u
    tl.store(Y + rows * stride_ym + rn[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _mlp_split_k_epilogue_kernel(
    WS, Y, PRE,
    M, N,
    stride_ym, stride_pm,
    ACTIVATION: tl.constexpr, SAVE_PRE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GLU: tl.constexpr = True,
):  # fmt: skip
    # Sums the SPLIT_K fp32 partials of WS in split order (deterministic): (SPLIT_K, M, 2N) [g | u]
    # then the activation (GLU), or (SPLIT_K, M, N) rounded to Y as they are (the down GEMM).
    col_blocks = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    rm = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)[:, None]
    width = 2 * N if GLU else N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ws = WS + (s * M + rows) * width
        acc_g += tl.load(ws + rn[None, :], mask=mask, other=0.0)
        if GLU:
            acc_u += tl.load(ws + (N + rn)[None, :], mask=mask, other=0.0)
    if GLU:
        _gate_up_epilogue(acc_g, acc_u, Y, PRE, rows, rn, mask, stride_ym, stride_pm, N, ACTIVATION, SAVE_PRE)
    else:
        tl.store(Y + rows * stride_ym + rn[None, :], acc_g.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _mlp_decode_kernel(
    x_desc, w_desc, OUT, WS,
    M, N, K,
    stride_om,
    GLU: tl.constexpr, ACTIVATION: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False, PDL_WAIT: tl.constexpr = False,
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
        acc = tl.dot(x, w_desc.load([off_n, k]).T, acc, input_precision=PRECISION)
        if GLU:
            acc_u = tl.dot(x, w_desc.load([N + off_n, k]).T, acc_u, input_precision=PRECISION)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
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
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages", "USE_DESC")


def config_key(t: int, h: int, i: int, dtype: torch.dtype) -> str:
    """The autotune key: T bucketed to a power of two (16 at least), H and I as they are (fixed
    per model), and the dtype."""
    return f"T{max(16, next_pow2(t))}-H{h}-I{i}-{autotune.dtype_name(dtype)}"


def generic_key(t: int, dtype: torch.dtype) -> str:
    """The shipped tables' key for any model shape: the T bucket and the dtype."""
    return f"T{max(16, next_pow2(t))}-{autotune.dtype_name(dtype)}"


def default_config(t: int, h: int, i: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """A config by rule, for shapes with no cached or shipped entry.

    Prefill: 128x128 tiles of y (two accumulators: a 128x256 GEMM tile's work, 128 KB of registers
    at 8 warps), BLOCK_K 64, 3 stages (48 KB of shared memory a stage). Decode (T <= 64): BLOCK_M as
    small as tl.dot allows and narrow column blocks, so that >= 2 programs per SM stream the weights.
    Off the GPU (the interpreter): small tiles that exercise every mask.
    """
    if not on_gpu:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, SPLIT_K=1, num_warps=4, num_stages=1,
                    USE_DESC=False)  # fmt: skip
    if dtype == torch.float32:
        # fp32 dots are FMA loops (ieee precision, no tensor cores) with far more live registers:
        # offline sm_90 compiles spilled at 64x64x32 (237 spill stores) and 16x32x128; these do not.
        if t <= 16:
            return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=3,
                        USE_DESC=True)  # fmt: skip
        if t <= 64:
            return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=3,
                        USE_DESC=True)  # fmt: skip
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3,
                    USE_DESC=True)  # fmt: skip
    if t <= 64:
        bm = max(16, next_pow2(t))
        # BLOCK_K 256 only at BLOCK_M 16: 4 stages of (64 + 2 x 32) x 256 bf16 would be 256 KB.
        return dict(BLOCK_M=bm, BLOCK_N=32 if i >= 8192 else 16, BLOCK_K=256 if bm == 16 else 128, GROUP_M=1,
                    SPLIT_K=1, num_warps=4, num_stages=4, USE_DESC=True)  # fmt: skip
    # 3 stages (144 KB) rather than 4 (192 KB + the epilogue's layout conversions, near the 227 KB limit).
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3, USE_DESC=True)


# Decode: both GEMMs of the MLP through _mlp_decode_kernel, each with its own autotune entry.
DECODE_MAX_T = 64
GATE_UP_DECODE = "mlp_decode_gate_up"  # N = I, K = H, GLU
DOWN_DECODE = "mlp_decode_down"  # N = H, K = I
DECODE_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
# Where fused_mlp takes the decode path (tests add "cpu" to run it under the interpreter).
DECODE_DEVICE_TYPES = frozenset({"cuda"})


def decode_key(t: int, n: int, k: int, dtype: torch.dtype) -> str:
    """The decode kernels' autotune key: T's power-of-two bucket (1..64), the GEMM's N and K, dtype."""
    return f"T{next_pow2(t)}-N{n}-K{k}-{autotune.dtype_name(dtype)}"


def decode_generic_key(t: int, dtype: torch.dtype) -> str:
    return f"T{next_pow2(t)}-{autotune.dtype_name(dtype)}"


def decode_config(t: int, n: int, k: int, glu: bool, sms: int, on_gpu: bool = True) -> dict:
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
    split = 1
    if not glu:
        blocks, k_tiles = triton.cdiv(n, bn), triton.cdiv(k, bk)
        while blocks * split * 2 <= sms and k_tiles >= 8 * split:
            split *= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages)


def decode_smem_bytes(cfg: dict, glu: bool, element_size: int = 2) -> int:
    """Shared memory of the decode kernel's operand buffers: num_stages - 1 of them (mma.sync,
    BLOCK_M < 64), num_stages with wgmma (BLOCK_M 64); offline sm_90 compiles match it within 100 B."""
    bufs = cfg["num_stages"] if cfg["BLOCK_M"] >= 64 else max(1, cfg["num_stages"] - 1)
    return bufs * (cfg["BLOCK_M"] + (2 if glu else 1) * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * element_size


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


def decode_candidates(t: int, n: int, k: int, glu: bool, sms: int = 132) -> list[dict]:
    """The decode sweep's configs for one GEMM at T tokens (benchmarks/sweeps.py mlp_decode): the rule's
    first, then ``_DECODE_SWEEP``'s; any over the shared memory limit is left out."""
    bm = max(16, next_pow2(t))
    out = [decode_config(t, n, k, glu, sms)]
    for bn, bk, stages, split in _DECODE_SWEEP[(glu, min(bm, 64))]:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages)
        if cfg not in out:
            out.append(cfg)
    return [c for c in out if decode_smem_bytes(c, glu) + 4096 <= _SMEM_LIMIT]


def _known_form(cfg: dict) -> bool:
    """Whether a stored gate-up config asks for a form this kernel has: caches written before session
    19 also hold ``WARP_SPECIALIZE`` and ``PERSISTENT`` (the warp-specialized K loop and the persistent
    tile loop, which no shipped config used; removed): False is dropped, True is ignored with a
    warning (``autotune.get_config``'s check) and the rule's config runs."""
    return not (cfg.get("WARP_SPECIALIZE") or cfg.get("PERSISTENT"))


def _aligned(t: torch.Tensor) -> bool:
    """What a tensor descriptor needs: a 16-byte aligned base and row stride."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0


def _ensure_allocator() -> None:
    """Device-side descriptors need scratch memory from a Triton allocator: set ours where none is
    (Triton's allocator is a context variable: per thread, and another library may have set its own,
    which is fine for launches in stream order)."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


# Scratch for device-side tensor descriptors (the gate-up kernel's USE_DESC): a fresh buffer a launch
# from the caching allocator, which may hand the next launch the same block (stream order makes that
# safe; the decode kernels, whose launches overlap under PDL, take host-built descriptors instead).
def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; x (T, H) and the weights with unit column strides)
# --------------------------------------------------------------------------------------------
# The Gluon gate-up kernel (ops/mlp_hopper.py) where it applies (sm_90, no saved pre-activation) and
# the tokens fill its 128-row tiles: run 86 (H200, T 8192, H 4096, I 14336) timed it at 2.845 ms
# against the Triton kernel's 3.053 and cuBLAS's plain gate-up GEMM's 2.826 (0.993x). Below
# _GLUON_MIN_TOKENS the Triton kernels (split-K for decode) keep the call: run 88 (H 4096, I 14336, ms,
# Triton / Gluon) T 256 0.122 / 0.168, T 512 0.211 / 0.184, T 1024 0.367 / 0.338, T 4096 1.606 / 1.494.
# FUSEFORMER_GLUON=0 turns it off.
_GLUON_GATE_UP = _gluon.ENABLED
_GLUON_MIN_TOKENS = 512


def cached_config(t: int, h: int, i: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The Triton gate-up kernel's launch config at T tokens (the autotune cache's, else the shipped
    table's, else :func:`default_config`); a config a sweep passes as ``config=`` replaces it."""
    cfg = autotune.get_config(
        KERNEL, config_key(t, h, i, dtype), device=device, generic_key=generic_key(t, dtype),
        default=lambda: default_config(t, h, i, dtype, torch.device(device).type == "cuda"), check=_known_form,
    )  # fmt: skip
    return {k: v for k, v in cfg.items() if k in CONFIG_KEYS}


def mlp_gate_up_fwd(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    activation: str,
    save_pre: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (T, H), w_gate_up (2I, H) -> y = act(x Wg^T) * (x Wu^T) (T, I), and the pre-activation
    [g | u] (T, 2I) when ``save_pre`` (else None). ``config`` overrides the cached launch config."""
    t, h = x.shape
    i = w_gate_up.shape[0] // 2
    if (
        _GLUON_GATE_UP
        and config is None
        and t >= _GLUON_MIN_TOKENS
        and mlp_hopper.usable(x, w_gate_up, activation, save_pre)
    ):
        return mlp_hopper.gate_up(x, w_gate_up, activation), None
    y = empty((t, i), dtype=x.dtype, device=x.device)
    pre = empty((t, 2 * i), dtype=x.dtype, device=x.device) if save_pre else None
    if t == 0 or i == 0:
        return y, pre
    if h == 0:
        y.zero_()  # act(0) * 0
        if pre is not None:
            pre.zero_()
        return y, pre
    assert x.stride(1) == 1 and w_gate_up.stride(1) == 1
    cfg = dict(config or cached_config(t, h, i, x.dtype, x.device))
    if cfg.get("USE_DESC") and not (_aligned(x) and _aligned(w_gate_up)):
        cfg["USE_DESC"] = False
        if cfg["BLOCK_M"] >= 64:
            # Unaligned rows take plain loads, unpipelined and unvectorized: 128x128x64 tiles spill
            # there (227 spill stores, offline sm_90 compile), 128x64x32 at 8 warps does not.
            cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 64), BLOCK_K=min(cfg["BLOCK_K"], 32))
    if cfg.get("USE_DESC") and x.is_cuda:
        _ensure_allocator()
    split = cfg.setdefault("SPLIT_K", 1)
    # Split-K partials (SPLIT_K, T, 2I) fp32: 0.46 MB a split at T 1, I 14336, next to 235 MB of weights.
    ws = empty((split, t, 2 * i), dtype=torch.float32, device=x.device) if split > 1 else y
    tiles = triton.cdiv(t, cfg["BLOCK_M"]) * triton.cdiv(i, cfg["BLOCK_N"])
    _mlp_gate_up_kernel[(tiles, split)](
        x, w_gate_up, y, pre if pre is not None else y, ws,
        t, i, h,
        x.stride(0), w_gate_up.stride(0), y.stride(0), pre.stride(0) if pre is not None else 0,
        ACTIVATION=activation, SAVE_PRE=save_pre,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **cfg,
    )  # fmt: skip
    if split > 1:
        _split_k_reduce(ws, y, pre, activation, glu=True)
    return y, pre


def _split_k_reduce(ws: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None, activation: str, glu: bool) -> None:
    """Sum the fp32 split-K partials ws (S, T, 2N [g | u] with ``glu``, else N) in split order into
    out (T, N): act(g) * u (and [g | u] into ``pre`` when given), or the plain sum."""
    split, t, _ = ws.shape
    n = out.shape[1]
    bm, bn = min(16, next_pow2(t)), 256
    _mlp_split_k_epilogue_kernel[(triton.cdiv(t, bm) * triton.cdiv(n, bn),)](
        ws, out, pre if pre is not None else out,
        t, n,
        out.stride(0), pre.stride(0) if pre is not None else 0,
        ACTIVATION=activation, SAVE_PRE=pre is not None, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, GLU=glu,
        num_warps=4,
    )  # fmt: skip


def _decode_gemm(
    x: torch.Tensor, w: torch.Tensor, glu: bool, activation: str, config: dict, pdl: str = "",
    rows: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x (T, K), w (2N, K) = [gate; up] (``glu``) or (N, K) -> act(x Wg^T) * (x Wu^T) or x W^T (T, N),
    x's dtype, through _mlp_decode_kernel (16-byte aligned rows: host-built tensor descriptors).

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
    lc = _decode_launch_config(glu, activation, x.dtype == torch.float32, pdl, tuple(config.items()))
    _decode_launcher.launch(grid, lc, _launch_key(x, w, out, ws), (x_arg, w_arg, out, ws, m, n, k, out.stride(0)))
    if split > 1:
        _split_k_reduce(ws, out, None, activation, glu)
    return out


@functools.cache
def _decode_launch_config(glu: bool, activation: str, fp32: bool, pdl: str, config: tuple):
    """The LaunchConfig of one decode GEMM (``config``: the tile config's items), built once for
    every value of its arguments."""
    return launch_config(
        GLU=glu, ACTIVATION=activation, PRECISION="ieee" if fp32 else "tf32",
        PDL_TRIGGER=pdl == "trigger", PDL_WAIT=pdl == "wait",
        **({"launch_pdl": True} if pdl == "wait" else {}),
        **dict(config),
    )  # fmt: skip


def _launch_key(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ws: torch.Tensor):
    """What, beside the launch config and the ints (in the key through the shapes and strides below),
    decides Triton's specialization of a decode launch (``DescLauncher``): dtypes, shapes and row
    strides, and each pointer's 16-byte alignment (True: all four aligned, the common case)."""
    px, pw, po, pws = x.data_ptr(), w.data_ptr(), out.data_ptr(), ws.data_ptr()
    aligned = not (px | pw | po | pws) & 15 or (px % 16 == 0, pw % 16 == 0, po % 16 == 0, pws % 16 == 0)
    return (x.dtype, x.shape, x.stride(0), w.shape, w.stride(0), out.shape, out.stride(0), ws.dtype, aligned)


# Direct launches of the decode kernel with host-built descriptors (after the first, compiling one).
_decode_launcher = DescLauncher(_mlp_decode_kernel)


@autotune.plan_cache
def _decode_plan(kernel: str, tb: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The launch config of one decode GEMM (cached per T bucket, shape, dtype and device)."""
    return autotune.get_config(
        kernel, decode_key(tb, n, k, dtype), device=device, generic_key=decode_generic_key(tb, dtype),
        default=lambda: _wide_dtype(decode_config(tb, n, k, kernel == GATE_UP_DECODE, num_sms(device.index or 0),
                                                  device.type == "cuda"), dtype),
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H), T <= 64 -> out (T, H) and y (T, I): the gate-up GEMM with the activation, then the
    down GEMM, both through _mlp_decode_kernel (plus the split-K epilogue where a config splits).
    No pre-activation (inference only). The configs override the cached ones (sweeps, tests);
    ``pdl=False`` launches the down GEMM plainly where it would be a programmatic dependent launch
    (the sweeps' and tests' baseline; the result is the same bits)."""
    t, h = x.shape
    i = w_down.shape[1]
    tb = next_pow2(t)
    if gate_up_config is None:
        gate_up_config = _decode_plan(GATE_UP_DECODE, tb, i, h, x.dtype, x.device)
    if down_config is None:
        down_config = _decode_plan(DOWN_DECODE, tb, h, i, x.dtype, x.device)
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
    y = _decode_gemm(x, w_gate_up, True, activation, gate_up_config, "trigger" if pdl else "", y_rows)
    out = _decode_gemm(y, w_down, False, activation, down_config, "wait" if pdl else "", out_rows)
    return out, (y[:t] if pad else y)


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and not INTERPRET and torch.cuda.get_device_capability(device)[0] >= 9


def fused_mlp_fwd(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
    save_pre: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x (T, H) -> out (T, H), pre (T, 2I) or None, y (T, I): the fused gate-up GEMM, then cuBLAS; or,
    for inference at T <= 64 (``decode_supported``, no ``config``), the two decode GEMMs."""
    if not save_pre and config is None and decode_supported(x, w_gate_up, w_down):
        out, y = mlp_decode_fwd(x, w_gate_up, w_down, activation)
        return out, None, y
    y, pre = mlp_gate_up_fwd(x, w_gate_up, activation, save_pre, config)
    return torch.matmul(y, w_down.T), pre, y


def fused_mlp_bwd(
    dout: torch.Tensor,
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    pre: torch.Tensor,
    y: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout (T, H) -> dx (T, H), dw_gate_up (2I, H), dw_down (H, I), from the saved pre and y."""
    i = w_down.shape[1]
    dy = torch.matmul(dout, w_down)  # (T, I)
    dw_down = torch.matmul(dout.T, y)  # (H, I)
    dgu = empty(tuple(pre.shape), dtype=pre.dtype, device=pre.device)  # (T, 2I)
    glu_bwd(dy, pre[:, :i], pre[:, i:], activation, dgate=dgu[:, :i], dup=dgu[:, i:])
    return torch.matmul(dgu, w_gate_up), torch.matmul(dgu.T, x), dw_down


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with fake and autograd), and the same
# pieces as an autograd.Function for eager calls; see _utils.dispatch.
# --------------------------------------------------------------------------------------------
def _fwd_impl(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, pre, y = fused_mlp_fwd(x, w_gate_up, w_down, activation, save_pre)
    # A custom op cannot return None: empty tensors stand for "not saved".
    if not save_pre:
        return out, x.new_empty(0), x.new_empty(0)
    return out, pre, y


def _bwd_impl(
    dout: torch.Tensor,
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    pre: torch.Tensor,
    y: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_mlp_bwd(dout, x, w_gate_up, w_down, pre, y, activation)


_fwd_op = torch.library.custom_op("fuseformer::fused_mlp_fwd", mutates_args=())(_fwd_impl)
_bwd_op = torch.library.custom_op("fuseformer::fused_mlp_bwd", mutates_args=())(_bwd_impl)


@_fwd_op.register_fake
def _(x, w_gate_up, w_down, activation, save_pre):
    t = x.shape[0]
    i2 = w_gate_up.shape[0]
    out = x.new_empty((t, w_down.shape[0]))
    if not save_pre:
        return out, x.new_empty(0), x.new_empty(0)
    return out, x.new_empty((t, i2)), x.new_empty((t, i2 // 2))


@_bwd_op.register_fake
def _(dout, x, w_gate_up, w_down, pre, y, activation):
    return torch.empty_like(x), torch.empty_like(w_gate_up), torch.empty_like(w_down)


def _setup_context(ctx, inputs, output):
    x, w_gate_up, w_down, activation, save_pre = inputs
    _, pre, y = output
    ctx.activation = activation
    ctx.mark_non_differentiable(pre, y)
    ctx.save_for_backward(x, w_gate_up, w_down, pre, y)


def _backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile, the plain impl in eager."""

    def _backward(ctx, dout, _dpre, _dy):
        x, w_gate_up, w_down, pre, y = ctx.saved_tensors
        if pre.numel() == 0 and x.shape[0] > 0 and w_down.shape[1] > 0:
            raise RuntimeError(f"{_OP}: backward without the saved pre-activation (forward ran with save_pre=False)")
        dx, dwgu, dwd = bwd(dout.contiguous(), x, w_gate_up, w_down, pre, y, ctx.activation)
        return dx, dwgu, dwd, None, None

    return _backward


_fwd_op.register_autograd(_backward_with(_bwd_op), setup_context=_setup_context)
_FusedMLPFunction = autograd_function("_FusedMLPFunction", _fwd_impl, _setup_context, _backward_with(_bwd_impl))


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def fused_mlp(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """(act(x W_g^T) * (x W_u^T)) W_down^T, the Llama/Qwen/Mistral MLP, with the gate-up GEMM and the
    activation in one kernel (the (T, 2I) pre-activation is written only when training needs it).

    Args:
        x: (..., H) fp16, bf16 or fp32 (fp64 runs on the reference).
        w_gate_up: (2I, H), x's dtype: rows [0, I) the gate projection, [I, 2I) the up projection
            (the packed weight of ``nn.Linear(H, 2I)``).
        w_down: (H, I), x's dtype (``nn.Linear(I, H).weight``).
        activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU with the tanh approximation) or "gelu" (erf).

    Under ``torch.autocast`` all three are cast to the autocast dtype first (fp32 weights included).

    Returns:
        (..., H) in x's dtype (the autocast dtype under autocast). Gradients for x and both weights.
    """
    check_tensor(_OP, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x must have at least 1 dim, got a scalar")
    x, w_gate_up, w_down = autocast_inputs(x, w_gate_up, w_down)
    h = x.shape[-1]
    check_tensor(_OP, "w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=2, device=x.device)
    if w_gate_up.shape[1] != h or w_gate_up.shape[0] % 2:
        raise ValueError(
            f"{_OP}: w_gate_up has shape {tuple(w_gate_up.shape)}; expected (2I, {h}) (an even row count, H from x)"
        )
    i = w_gate_up.shape[0] // 2
    check_tensor(_OP, "w_down", w_down, dtypes=(x.dtype,), ndim=2, device=x.device)
    if tuple(w_down.shape) != (h, i):
        raise ValueError(f"{_OP}: w_down has shape {tuple(w_down.shape)}; expected ({h}, {i}) (H, I)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    backend = choose_backend(_OP, x.device, x.dtype in KERNEL_DTYPES, "float64 runs on the reference")
    if backend == "reference":
        return fused_mlp_ref(x, w_gate_up, w_down, activation)
    shape = x.shape
    x2 = rows_2d(x)
    save_pre = torch.is_grad_enabled() and (x.requires_grad or w_gate_up.requires_grad or w_down.requires_grad)
    # Without grad, dispatch calls fused_mlp_fwd itself: no placeholder outputs (decode's host time).
    out = dispatch(
        _fwd_op, _FusedMLPFunction, fused_mlp_fwd, x2, w_gate_up.contiguous(), w_down.contiguous(), activation, save_pre
    )[0]
    return out if x.dim() == 2 else out.view(shape)


# --------------------------------------------------------------------------------------------
# Tuning (``fuseformer bench --tune`` through autotune.tune_all)
# --------------------------------------------------------------------------------------------
TUNE_SHAPES = ((4096, 14336), (2048, 8192), (8192, 28672))  # (H, I): Llama-3 8B, 1B, 70B
TUNE_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


_SMEM_LIMIT = SM90_SMEM_BYTES


def _smem_bytes(cfg: dict, element_size: int = 2) -> int:
    """Shared memory of the pipelined operand tiles (x, gate and up rows) over all stages."""
    return cfg["num_stages"] * (cfg["BLOCK_M"] + 2 * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * element_size


def candidate_configs(t: int, dtype: torch.dtype) -> list[dict]:
    """The tuner's candidates for one T bucket: tile shapes, stages, warps, split-K, descriptors;
    configs whose operand stages overflow shared memory are left out. (Until session 19 also the
    warp-specialized K loop and a persistent tile loop: no tuning run picked either for a shipped
    table; removed.)"""
    es = torch.empty((), dtype=dtype).element_size()
    return [c for c in _candidates(t) if _smem_bytes(c, es) + 16384 <= _SMEM_LIMIT]


def _candidates(t: int) -> list[dict]:
    out = []
    if t <= 64:
        bm = max(16, next_pow2(t))
        for bn in (16, 32, 64):
            for bk in (128, 256):
                for stages in (3, 4, 6):
                    for desc in (True, False):
                        for split in (1, 2, 4):
                            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split,
                                            num_warps=4, num_stages=stages, USE_DESC=desc))  # fmt: skip
        return out
    for bm, bn, warps in ((128, 128, 8), (128, 64, 4), (64, 128, 4), (128, 64, 8), (64, 64, 4)):
        if bm > max(64, next_pow2(t)):
            continue
        for stages in (3, 4, 5):
            for desc in (True, False):
                out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=warps,
                                num_stages=stages, USE_DESC=desc))  # fmt: skip
    return out


def tune_mlp_gate_up(quick: bool = False) -> list[dict]:
    """Tune the gate-up kernel over T buckets and model shapes on this GPU (bf16); one record each."""
    from fuseformer.bench._timing import bench_ms

    records = []
    shapes = TUNE_SHAPES[:1] if quick else TUNE_SHAPES
    tokens = (16, 64, 8192) if quick else TUNE_TOKENS
    dtype = torch.bfloat16
    for h, i in shapes:
        w = torch.randn(2 * i, h, device="cuda", dtype=dtype) / h**0.5
        for t in tokens:
            x = torch.randn(t, h, device="cuda", dtype=dtype)
            key = config_key(t, h, i, dtype)
            try:
                best = autotune.tune(
                    KERNEL, candidate_configs(t, dtype),
                    lambda cfg, x=x, w=w: (lambda: mlp_gate_up_fwd(x, w, "silu", config=cfg)), key, force=True,
                )  # fmt: skip
                ms = bench_ms(lambda x=x, w=w, best=best: mlp_gate_up_fwd(x, w, "silu", config=best))
                records.append(dict(kernel=KERNEL, key=key, config=best, ms=ms,
                                    tflop_s=2 * t * h * 2 * i / (ms * 1e-3) / 1e12,
                                    weight_gb_s=2 * i * h * 2 / (ms * 1e-3) / 1e9))  # fmt: skip
            except Exception as exc:
                records.append(dict(kernel=KERNEL, key=key, error=f"{type(exc).__name__}: {exc}"[:300]))
    return records


autotune.register_tuner(KERNEL, tune_mlp_gate_up)
