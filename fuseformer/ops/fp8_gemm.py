"""FP8 (e4m3) GEMMs with scales: the plain GEMM, and the MLP's gate-up GEMM with its GLU and the
quantization of its output fused into the epilogue (issue 31).

    fp8_gemm:      out = (a * a_scale) @ (b * b_scale[:, None])^T (+ bias)           (M, N) out_dtype
    fp8_gemm_glu:  g, u = the two halves of (a * a_scale) @ (w * w_scale[:, None])^T (M, I) each, fp32
                   h = act(g) * u, quantized per token per 128 columns -> h_q (M, I) e4m3, h_scale (M, ceil(I/128))

a (M, K) e4m3 is an activation with per-token scales (M, 1) or per token-group scales (M, ceil(K/128));
b (N, K) e4m3 a weight with per-output-channel scales (N,) fp32 (``quantize_weight_fp8``). Products
accumulate in fp32. The MLP is ``fp8_gemm(*fp8_gemm_glu(x_q, x_s, w_gate_up_q, w_gate_up_s), w_down_q,
w_down_s)``: its (M, I) activation goes to HBM only as FP8 with its group scales, never in bf16.

The Triton kernels follow the tutorial matmul (grouped tile order, fp32 accumulator, ``tl.dot`` on the
fp8 tiles; device-side tensor descriptors when the config asks and the rows are 16-byte aligned). Each
K tile's product is added to the fp32 accumulator on its own (``acc += dot``) instead of accumulating
inside the tensor cores: Hopper's FP8 MMA keeps about 14 bits of the running sum (DeepSeek-V3 §3.3.2),
which would cost accuracy at K 4096 and more. Group scales are applied there, per K tile (BLOCK_K must
divide 128, so a tile never spans two groups); the per-channel b_scale and a per-token a_scale are
applied once in the epilogue. In the GLU kernel each program owns BLOCK_N = 128 columns of gate and the
matching 128 of up, so the row amax over its tile of h is exactly that group's amax: the quantization
(quant_fp8.py's step, so it rounds as ``quantize_fp8`` does) needs nothing from other programs.

Backends on CUDA, per shape through the autotune cache (kernel ``fp8_gemm``, field ``backend``):
``torch._scaled_mm`` with rowwise scales (cuBLASLt/CUTLASS; per-token scales, bf16 out, K and N
multiples of 16) or the Triton kernel; the default rule takes ``_scaled_mm`` wherever it applies, so a
GPU tuning run can move a shape to Triton with no code edit. ``fp8_gemm_glu`` is Triton (kernel
``fp8_gemm_glu``). Off CUDA: the Triton kernels under the interpreter, else the references (dequantize
to fp32, matmul, cast). Inference only (no autograd); both are CUDA-graph capturable (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._mlp_common import _aligned
from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    LaunchConfig,
    Launcher,
    check_tensor,
    empty,
    launch_config,
    next_pow2,
)
from fuseformer.ops.activations import ACTIVATIONS, _act_fwd, _act_ref
from fuseformer.ops.mlp import _ensure_allocator, _grouped
from fuseformer.ops.quant_fp8 import (
    FP8_DTYPE,
    GROUP_SIZE,
    _fp8_scale,
    _row_amax,
    _to_fp8,
    call_op,
    dequantize_fp8,
    fp8_groups,
    quantize_fp8_ref,
)
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend

_OP, _GLU_OP = "fp8_gemm", "fp8_gemm_glu"
OUT_DTYPES = KERNEL_DTYPES  # bf16, fp16, fp32
BACKENDS = ("scaled_mm", "triton")


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------
def fp8_gemm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a and b to ``compute_dtype`` (fp32; fp64 in tests), matmul, add bias, cast to out_dtype."""
    out = dequantize_fp8(a, a_scale, compute_dtype) @ dequantize_fp8(b, b_scale, compute_dtype).T
    if bias is not None:
        out = out + bias.to(compute_dtype)
    return out.to(out_dtype)


def fp8_gemm_glu_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    activation: str = "silu",
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize, the gate and up matmuls in ``compute_dtype``, act(gate) * up, then
    ``quantize_fp8_ref(h, 128)``: (h_q (M, I) e4m3, h_scale (M, ceil(I/128)) fp32)."""
    gu = dequantize_fp8(a, a_scale, compute_dtype) @ dequantize_fp8(w, w_scale, compute_dtype).T
    gate, up = gu.chunk(2, dim=-1)
    return quantize_fp8_ref(_act_ref(gate, activation) * up, GROUP_SIZE)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _add_tile(acc, part, AS, rows, m_mask, stride_as, k, GROUP_K: tl.constexpr):
    """acc + one K tile's product (fp32), times its group's a_scale when GROUP_K (else in the epilogue)."""
    if GROUP_K > 0:
        s = tl.load(AS + rows * stride_as + k // GROUP_K, mask=m_mask, other=0.0)
        return acc + part * s[:, None]
    return acc + part


@triton.jit
def _fp8_gemm_kernel(
    A, B, AS, BS, BIAS, C,
    M, N, K, stride_am, stride_bn, stride_as, stride_cm,
    GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_DESC: tl.constexpr,
):  # fmt: skip
    # A (M, K) e4m3, B (N, K) e4m3, AS (M, 1) or (M, ceil(K/GROUP_K)) fp32, BS (N,) fp32, C (M, N).
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rows = rm.to(tl.int64)  # row * stride can pass 2^31
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_DESC:  # out-of-bounds boxes read as zero
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
        for k in tl.range(0, K, BLOCK_K):
            part = tl.dot(a_desc.load([off_m, k]), b_desc.load([off_n, k]).T)
            acc = _add_tile(acc, part, AS, rows, m_mask, stride_as, k, GROUP_K)
    else:
        a_ptrs = A + rows[:, None] * stride_am + rk[None, :]
        b_ptrs = B + rn.to(tl.int64)[:, None] * stride_bn + rk[None, :]
        for k in tl.range(0, K, BLOCK_K):
            k_mask = (rk < K - k)[None, :]
            a = tl.load(a_ptrs + k, mask=m_mask[:, None] & k_mask, other=0.0)
            b = tl.load(b_ptrs + k, mask=n_mask[:, None] & k_mask, other=0.0)
            acc = _add_tile(acc, tl.dot(a, b.T), AS, rows, m_mask, stride_as, k, GROUP_K)
    if GROUP_K == 0:
        acc = acc * tl.load(AS + rows * stride_as, mask=m_mask, other=0.0)[:, None]
    acc = acc * tl.load(BS + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(C + rows[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_glu_kernel(
    A, W, AS, WS, HQ, HS,
    M, N, K, stride_am, stride_wn, stride_as, stride_hq, stride_hs,
    GROUP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_DESC: tl.constexpr,
):  # fmt: skip
    # A (M, K) e4m3; W (2N, K) e4m3 = [gate rows; up rows], N = I; WS (2N,) fp32; HQ (M, N) e4m3;
    # HS (M, ceil(N / BLOCK_N)) fp32. BLOCK_N is the output group (128): column block j is group j.
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rows = rm.to(tl.int64)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_DESC:
        # A gate box crossing row N reads up rows into columns >= N: masked out of h below.
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(W, shape=[2 * N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
        for k in tl.range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k])
            acc_g = _add_tile(acc_g, tl.dot(a, w_desc.load([off_n, k]).T), AS, rows, m_mask, stride_as, k, GROUP_K)
            acc_u = _add_tile(acc_u, tl.dot(a, w_desc.load([N + off_n, k]).T), AS, rows, m_mask, stride_as, k,
                              GROUP_K)  # fmt: skip
    else:
        a_ptrs = A + rows[:, None] * stride_am + rk[None, :]
        wg_ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        wu_ptrs = W + (N + rn).to(tl.int64)[:, None] * stride_wn + rk[None, :]
        for k in tl.range(0, K, BLOCK_K):
            k_mask = (rk < K - k)[None, :]
            a = tl.load(a_ptrs + k, mask=m_mask[:, None] & k_mask, other=0.0)
            wg = tl.load(wg_ptrs + k, mask=n_mask[:, None] & k_mask, other=0.0)
            wu = tl.load(wu_ptrs + k, mask=n_mask[:, None] & k_mask, other=0.0)
            acc_g = _add_tile(acc_g, tl.dot(a, wg.T), AS, rows, m_mask, stride_as, k, GROUP_K)
            acc_u = _add_tile(acc_u, tl.dot(a, wu.T), AS, rows, m_mask, stride_as, k, GROUP_K)
    g = acc_g * tl.load(WS + rn, mask=n_mask, other=0.0)[None, :]
    u = acc_u * tl.load(WS + N + rn, mask=n_mask, other=0.0)[None, :]
    if GROUP_K == 0:
        s = tl.load(AS + rows * stride_as, mask=m_mask, other=0.0)[:, None]
        g = g * s
        u = u * s
    mask = m_mask[:, None] & n_mask[None, :]
    h = tl.where(mask, _act_fwd(g, ACTIVATION) * u, 0.0)  # (BLOCK_M, 128): one output group a row
    scale = _fp8_scale(_row_amax(h))
    tl.store(HQ + rows[:, None] * stride_hq + rn[None, :], _to_fp8(h, scale), mask=mask)
    tl.store(HS + rows * stride_hs + pid_n, scale, mask=m_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache; the rules below are the defaults)
# --------------------------------------------------------------------------------------------
KERNEL, GLU_KERNEL = "fp8_gemm", "fp8_gemm_glu"
_TRITON_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "USE_DESC")
CONFIG_KEYS = ("backend",) + _TRITON_FIELDS
GLU_CONFIG_KEYS = ("BLOCK_M", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "USE_DESC")


def _scale_kind(grouped: bool) -> str:
    return "group" if grouped else "token"


def config_key(m: int, n: int, k: int, grouped: bool, out_dtype: torch.dtype) -> str:
    """The autotune key: M bucketed (16 at least), N and K as they are (fixed per weight), the a_scale
    kind (``token``/``group``) and the out dtype."""
    return f"M{autotune.bucket(m, 16)}-N{n}-K{k}-{_scale_kind(grouped)}-{autotune.dtype_name(out_dtype)}"


def glu_config_key(m: int, i: int, k: int, grouped: bool) -> str:
    """The GLU kernel's autotune key: M bucketed (16 at least), I and K, the a_scale kind."""
    return f"M{autotune.bucket(m, 16)}-I{i}-K{k}-{_scale_kind(grouped)}"


def scaled_mm_applies(n: int, k: int, grouped: bool, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` with rowwise scales takes this GEMM: per-token a_scale, bf16 out,
    K and N multiples of 16 (and K > 0)."""
    return not grouped and out_dtype == torch.bfloat16 and k > 0 and k % 16 == 0 and n % 16 == 0


def default_config(m: int, n: int, k: int, grouped: bool, out_dtype: torch.dtype, on_gpu: bool) -> dict:
    """The rule's config (not yet swept on the H200): ``_scaled_mm`` on the GPU wherever it applies;
    Triton tiles of 128 K (one scale group a tile) otherwise: decode (M <= 64) narrow column blocks so
    that the weight streams through many programs, prefill 128x128 tiles at 8 warps, 4 stages (128 KB of
    fp8 operands). Off the GPU (the interpreter): small tiles that exercise every mask."""
    if not on_gpu:
        return dict(backend="triton", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1,
                    USE_DESC=False)  # fmt: skip
    backend = "scaled_mm" if scaled_mm_applies(n, k, grouped, out_dtype) else "triton"
    if m <= 64:
        return dict(backend=backend, BLOCK_M=max(16, next_pow2(m)), BLOCK_N=64 if n >= 8192 else 32, BLOCK_K=128,
                    GROUP_M=1, num_warps=4, num_stages=4, USE_DESC=True)  # fmt: skip
    return dict(backend=backend, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4,
                USE_DESC=True)  # fmt: skip


def glu_default_config(m: int, i: int, k: int, on_gpu: bool) -> dict:
    """The GLU kernel's rule (not yet swept): two 128-wide accumulators (gate, up) and the tile product
    beside them; BLOCK_M 64 at 8 warps past decode keeps them in registers."""
    if not on_gpu:
        return dict(BLOCK_M=16, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1, USE_DESC=False)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, USE_DESC=True)
    return dict(BLOCK_M=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, USE_DESC=True)


def _valid(n: int, k: int, grouped: bool, out_dtype: torch.dtype, glu: bool = False):
    """A stored config's test: the backend is known and applies, and with group scales BLOCK_K divides 128."""

    def check(cfg: dict) -> bool:
        if not glu and (cfg["backend"] not in BACKENDS or
                        (cfg["backend"] == "scaled_mm" and not scaled_mm_applies(n, k, grouped, out_dtype))):  # fmt: skip
            return False
        return not grouped or GROUP_SIZE % cfg["BLOCK_K"] == 0

    return check


def cached_config(m: int, n: int, k: int, grouped: bool, out_dtype: torch.dtype, device: torch.device) -> dict:
    """fp8_gemm's config at M rows (its bucket): the autotune cache's, the shipped table's, or the rule's."""
    return autotune.get_config(
        KERNEL, config_key(m, n, k, grouped, out_dtype), device=device, fields=CONFIG_KEYS,
        default=lambda: default_config(m, n, k, grouped, out_dtype, device.type == "cuda"),
        check=_valid(n, k, grouped, out_dtype),
    )  # fmt: skip


def glu_cached_config(m: int, i: int, k: int, grouped: bool, device: torch.device) -> dict:
    """fp8_gemm_glu's config at M rows (its bucket), as :func:`cached_config`."""
    return autotune.get_config(
        GLU_KERNEL, glu_config_key(m, i, k, grouped), device=device, fields=GLU_CONFIG_KEYS,
        default=lambda: glu_default_config(m, i, k, device.type == "cuda"),
        check=_valid(i, k, grouped, torch.float32, glu=True),
    )  # fmt: skip


def candidate_configs(m: int, n: int, k: int, grouped: bool, out_dtype: torch.dtype) -> list[dict]:
    """The tuner's candidates for fp8_gemm (the rule's first): ``_scaled_mm`` where it applies, and
    Triton tiles."""
    out = [default_config(m, n, k, grouped, out_dtype, True)]
    if scaled_mm_applies(n, k, grouped, out_dtype):
        out.append(dict(out[0], backend="scaled_mm"))
    bks = (64, 128) if grouped else (64, 128, 256)
    tiles = ([(max(16, next_pow2(m)), bn, 4) for bn in (32, 64, 128)] if m <= 64 else
             [(128, 128, 8), (128, 256, 8), (64, 128, 4), (128, 64, 4)])  # fmt: skip
    for bm, bn, warps in tiles:
        for bk in bks:
            for stages in (3, 4, 5):
                if stages * (bm + bn) * bk + 16384 > 227 * 1024:
                    continue
                out.append(dict(backend="triton", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1 if m <= 64 else 8,
                                num_warps=warps, num_stages=stages, USE_DESC=True))  # fmt: skip
    return [c for i, c in enumerate(out) if c not in out[:i]]


def glu_candidate_configs(m: int) -> list[dict]:
    """The tuner's candidates for fp8_gemm_glu (the rule's first)."""
    out = [glu_default_config(m, 0, 0, True)]
    for bm, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)) if m > 16 else ((16, 4), (16, 8)):
        for bk in (64, 128):
            for stages in (2, 3, 4):
                if stages * (bm + 256) * bk + 16384 <= 227 * 1024:
                    out.append(dict(BLOCK_M=bm, BLOCK_K=bk, GROUP_M=1 if m <= 64 else 8, num_warps=warps,
                                    num_stages=stages, USE_DESC=True))  # fmt: skip
    return [c for i, c in enumerate(out) if c not in out[:i]]


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs checked; a, b, w with unit column strides, scales contiguous)
# --------------------------------------------------------------------------------------------
def _gemm_launch(cfg: dict, grouped: bool, has_bias: bool, aligned: bool) -> tuple[LaunchConfig, int, int]:
    """(launch config, BLOCK_M, BLOCK_N) of the Triton GEMM for a config; descriptors only where the
    operands' bases and rows are 16-byte aligned."""
    kw = {f: cfg[f] for f in _TRITON_FIELDS} | dict(USE_DESC=bool(cfg["USE_DESC"] and aligned))
    flags = dict(GROUP_K=GROUP_SIZE if grouped else 0, HAS_BIAS=has_bias)
    return launch_config(**flags, **kw), cfg["BLOCK_M"], cfg["BLOCK_N"]


# The per-call plans: everything a launch needs that depends only on the M bucket, the weight's shape,
# the flags, the dtype and the device, computed once (the autotune lookup happens here, never per call).
@autotune.plan_cache
def _gemm_plan(
    mb: int,
    n: int,
    k: int,
    grouped: bool,
    has_bias: bool,
    out_dtype: torch.dtype,
    device: torch.device,
    aligned: bool,
) -> tuple[str, LaunchConfig | None, int, int]:
    """(backend, launch config, BLOCK_M, BLOCK_N) of fp8_gemm at the M bucket ``mb``."""
    cfg = cached_config(mb, n, k, grouped, out_dtype, device)
    if cfg["backend"] == "scaled_mm":
        if aligned:
            return "scaled_mm", None, 0, 0
        cfg = default_config(mb, n, k, grouped, out_dtype, device.type == "cuda") | dict(backend="triton")
    return ("triton", *_gemm_launch(cfg, grouped, has_bias, aligned))


@autotune.plan_cache
def _glu_plan(
    mb: int, i: int, k: int, grouped: bool, activation: str, device: torch.device, aligned: bool
) -> tuple[LaunchConfig, int]:
    """(launch config, BLOCK_M) of fp8_gemm_glu at the M bucket ``mb``."""
    return _glu_launch(glu_cached_config(mb, i, k, grouped, device), grouped, activation, aligned)


def _glu_launch(cfg: dict, grouped: bool, activation: str, aligned: bool) -> tuple[LaunchConfig, int]:
    kw = {f: cfg[f] for f in GLU_CONFIG_KEYS} | dict(USE_DESC=bool(cfg["USE_DESC"] and aligned))
    flags = dict(GROUP_K=GROUP_SIZE if grouped else 0, ACTIVATION=activation, BLOCK_N=GROUP_SIZE)
    return launch_config(**flags, **kw), cfg["BLOCK_M"]


def _descriptors_ready(cfg: LaunchConfig, t: torch.Tensor) -> None:
    """Device-side descriptors take their scratch memory from Triton's allocator: ours where none is set."""
    if t.is_cuda and cfg.kwargs["USE_DESC"]:
        _ensure_allocator()


def fp8_gemm_fwd(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """a (M, K), a_scale (M, 1) or (M, ceil(K/128)), b (N, K), b_scale (N,), bias (N,) in out_dtype or
    None -> (M, N) in out_dtype. ``config`` (with its ``backend``) overrides the cached one; for sweeps."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        out = empty((m, n), dtype=out_dtype, device=a.device)
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    grouped = a_scale.shape[1] != 1
    aligned = _aligned(a) and _aligned(b)
    if config is None:
        backend, cfg, block_m, block_n = _gemm_plan(
            autotune.bucket(m, 16), n, k, grouped, bias is not None, out_dtype, a.device, aligned
        )
    elif config["backend"] == "scaled_mm":
        backend, cfg, block_m, block_n = "scaled_mm", None, 0, 0
    else:
        backend, (cfg, block_m, block_n) = "triton", _gemm_launch(config, grouped, bias is not None, aligned)
    if backend == "scaled_mm":
        # b.t(): the (K, N) column-major operand cuBLASLt's FP8 GEMM takes; rowwise scales (M, 1), (1, N).
        return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.view(1, n), bias=bias, out_dtype=out_dtype)
    out = empty((m, n), dtype=out_dtype, device=a.device)
    _descriptors_ready(cfg, a)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    tensors = (a, b, a_scale, b_scale, bias if bias is not None else out, out)
    _gemm_launcher(grid, cfg, tensors, (m, n, k, a.stride(0), b.stride(0), a_scale.stride(0), n))
    return out


def fp8_gemm_glu_fwd(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    activation: str,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, K), a_scale (M, 1) or (M, ceil(K/128)), w (2I, K), w_scale (2I,) -> h_q (M, I) e4m3,
    h_scale (M, ceil(I/128)) fp32. ``config`` overrides the cached one; for sweeps."""
    m, k = a.shape
    i = w.shape[0] // 2
    groups = fp8_groups(i)
    h_q = empty((m, i), dtype=FP8_DTYPE, device=a.device)
    h_scale = empty((m, groups), dtype=torch.float32, device=a.device)
    if m == 0 or i == 0:
        return h_q, h_scale
    grouped = a_scale.shape[1] != 1
    aligned = k > 0 and _aligned(a) and _aligned(w)
    if config is None:
        cfg, block_m = _glu_plan(autotune.bucket(m, 16), i, k, grouped, activation, a.device, aligned)
    else:
        cfg, block_m = _glu_launch(config, grouped, activation, aligned)
    _descriptors_ready(cfg, a)
    grid = (triton.cdiv(m, block_m) * groups,)
    ints = (m, i, k, a.stride(0), w.stride(0), a_scale.stride(0), i, groups)
    _glu_launcher(grid, cfg, (a, w, a_scale, w_scale, h_q, h_scale), ints)
    return h_q, h_scale


_gemm_launcher = Launcher(_fp8_gemm_kernel)
_glu_launcher = Launcher(_fp8_gemm_glu_kernel)


# --------------------------------------------------------------------------------------------
# Registration: custom ops for torch.compile (opaque, with fakes); eager calls run the launchers
# --------------------------------------------------------------------------------------------
def _gemm_impl(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return fp8_gemm_fwd(a, a_scale, b, b_scale, bias, out_dtype)


def _glu_impl(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_gemm_glu_fwd(a, a_scale, w, w_scale, activation)


_fp8_gemm_op = torch.library.custom_op("fuseformer::fp8_gemm", mutates_args=())(_gemm_impl)
_fp8_gemm_glu_op = torch.library.custom_op("fuseformer::fp8_gemm_glu", mutates_args=())(_glu_impl)


@_fp8_gemm_op.register_fake
def _(a, a_scale, b, b_scale, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@_fp8_gemm_glu_op.register_fake
def _(a, a_scale, w, w_scale, activation):
    m, i = a.shape[0], w.shape[0] // 2
    return a.new_empty((m, i), dtype=FP8_DTYPE), a.new_empty((m, fp8_groups(i)), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------
def _check_a(op: str, a: object, a_scale: object) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, K) e4m3 and its scales (M, 1) or (M, ceil(K/128)) fp32 on a's device; contiguous."""
    check_tensor(op, "a", a, dtypes=(FP8_DTYPE,), ndim=2)
    m, k = a.shape
    check_tensor(op, "a_scale", a_scale, dtypes=(torch.float32,), ndim=2, device=a.device, device_of="a")
    if a_scale.shape[0] != m or a_scale.shape[1] not in (1, fp8_groups(k)):
        raise ValueError(
            f"{op}: a_scale has shape {tuple(a_scale.shape)}; expected ({m}, 1) per token or "
            f"({m}, {fp8_groups(k)}) per group of {GROUP_SIZE} columns of a"
        )
    return a.contiguous(), a_scale.contiguous()


def _check_weight(op: str, name: str, w: object, w_scale: object, a: torch.Tensor) -> torch.Tensor:
    check_tensor(op, name, w, dtypes=(FP8_DTYPE,), ndim=2, device=a.device, device_of="a")
    if w.shape[1] != a.shape[1]:
        raise ValueError(f"{op}: {name} has shape {tuple(w.shape)}; expected (*, {a.shape[1]}) (K from a)")
    check_tensor(op, f"{name}_scale", w_scale, dtypes=(torch.float32,), device=a.device, device_of="a",
                 shape=(w.shape[0],), what=f"one per row of {name}")  # fmt: skip
    return w.contiguous()


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out = (a * a_scale) @ (b * b_scale[:, None])^T (+ bias), accumulated in fp32.

    Args:
        a: (M, K) float8_e4m3fn, the activation (``quantize_fp8``, ``rms_norm_quant_fp8``, ``fp8_gemm_glu``).
        a_scale: (M, 1) fp32 per token, or (M, ceil(K/128)) per token-group of 128 columns.
        b: (N, K) float8_e4m3fn, the weight (``nn.Linear(K, N).weight`` quantized by ``quantize_weight_fp8``).
        b_scale: (N,) fp32, per output channel.
        bias: (N,) any float dtype (rounded to out_dtype first), or None.
        out_dtype: bf16 (default), fp16 or fp32.

    Returns:
        (M, N) in out_dtype. On CUDA the backend (``torch._scaled_mm`` or the Triton kernel) comes from the
        autotune cache per shape (module doc); decode-sized M (1..64) included.
    """
    a, a_scale = _check_a(_OP, a, a_scale)
    b = _check_weight(_OP, "b", b, b_scale, a)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{_OP}: out_dtype must be one of bfloat16, float16, float32, got {out_dtype!r}")
    if bias is not None:
        check_tensor(_OP, "bias", bias, dtypes=FLOAT_DTYPES, device=a.device, device_of="a", shape=(b.shape[0],),
                     what="one per row of b")  # fmt: skip
        bias = bias.to(out_dtype).contiguous()
    if choose_backend(_OP, a.device) == "reference":
        return fp8_gemm_ref(a, a_scale, b, b_scale, bias, out_dtype)
    return call_op(_fp8_gemm_op, _gemm_impl, a, a_scale, b, b_scale.contiguous(), bias, out_dtype)


def fp8_gemm_glu(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate-up GEMM in FP8 with act(gate) * up and its quantization in the epilogue.

    Args:
        a: (M, K) float8_e4m3fn; a_scale (M, 1) fp32 per token or (M, ceil(K/128)) per token-group.
        w: (2I, K) float8_e4m3fn: rows [0, I) the gate projection, [I, 2I) the up projection (fused_mlp's
            packing); w_scale (2I,) fp32 per output channel.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (erf), as ops/activations.py names them.

    Returns:
        h_q (M, I) float8_e4m3fn and h_scale (M, ceil(I/128)) fp32: h = act(gate) * up, computed in fp32
        and quantized per token per 128 columns as ``quantize_fp8(h, 128)`` does; I need not be a multiple
        of 128. ``fp8_gemm(h_q, h_scale, w_down_q, w_down_scale)`` is then the down projection.
    """
    a, a_scale = _check_a(_GLU_OP, a, a_scale)
    w = _check_weight(_GLU_OP, "w", w, w_scale, a)
    if w.shape[0] % 2:
        raise ValueError(f"{_GLU_OP}: w has shape {tuple(w.shape)}; expected (2I, K): an even row count")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_GLU_OP}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if choose_backend(_GLU_OP, a.device) == "reference":
        return fp8_gemm_glu_ref(a, a_scale, w, w_scale, activation)
    return call_op(_fp8_gemm_glu_op, _glu_impl, a, a_scale, w, w_scale.contiguous(), activation)
