"""FP8 (e4m3) quantization of activations with dynamic scales, per token or per token-group (issue 31).

    scale = max(amax(|x| over the row or group) * (1 / 448), MIN_SCALE)      fp32
    q     = clamp(x / scale, -448, 448) cast to float8_e4m3fn                 (round to nearest even)
    x    ~= q * scale

Scales: per token, ``scale`` (M, 1); per token-group of ``group_size`` columns (DeepSeek-V3's and vLLM's
1x128 activation blocks), ``scale`` (M, ceil(K / group_size)), the last group possibly partial. The scale
is ``amax * (1/448)``, a multiply by the fp32 constant, not a division: torch's CUDA ``div`` by a Python
scalar multiplies by the reciprocal while its CPU ``div`` divides, so a product is the one formula that
the reference computes alike on every device and the kernel reproduces bit for bit. ``MIN_SCALE``
(1 / (448 * 512), vLLM's) keeps an all-zero row from dividing by zero: its q is 0. ``x / scale`` is an
IEEE division (``div_rn`` in the kernel: Triton's ``/`` on fp32 is the approximate ``div.full``), so the
kernel's q and scale equal the reference's bit for bit on the GPU. NaN propagates as in torch: a row or
group holding NaN gets a NaN scale and NaN q (the kernel's max and clamp propagate NaN explicitly, where
the GPU's max/min would drop it); an inf gives scale inf, its own q NaN and the others 0.

Everything below autograd lives here (STYLE.md §1; inference only: no autograd): the reference
``quantize_fp8_ref``, the Triton kernel ``_quantize_fp8_kernel`` (one program a block of rows and one
group; per token the group is the whole row), the launcher ``quantize_fp8_fwd``, the ``torch.library``
registration with its fake, and the public ``quantize_fp8``; also ``quantize_weight_fp8`` (per output
channel, reference only: it runs once at load) and ``dequantize_fp8``.

The jit helpers ``_row_amax``, ``_fp8_scale`` and ``_to_fp8`` are the quantization step that the fused
producers share (rms_norm_quant.py's norm kernel, fp8_gemm.py's GLU epilogue), so every FP8 producer
rounds exactly as this file does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    LaunchConfig,
    Launcher,
    check_tensor,
    covers_row,
    launch_config,
    new_empty,
    next_pow2,
    rows_2d,
)
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
GROUP_SIZE = 128  # the token-group width of group scales (fp8_gemm's A operand, fp8_gemm_glu's output)
# The smallest scale: an all-zero row quantizes to 0 instead of 0 / 0 (vLLM's MIN_SCALE_FACTOR).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
_OP = "quantize_fp8"


def fp8_groups(k: int, group_size: int = GROUP_SIZE) -> int:
    """The scales a row of ``k`` columns has per token-group of ``group_size``: ceil(k / group_size)."""
    return -(-k // group_size)


# Globals a kernel reads must be tl.constexpr instances.
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)  # rounded to fp32 in the kernel as torch rounds the scalar
_MIN_SCALE = tl.constexpr(MIN_SCALE)
# Longest row (or group) held in registers in one pass; longer ones take two passes (amax, then q).
_SINGLE_PASS_MAX = 16384


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def fp8_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """The scale of an fp32 ``amax``: max(amax * (1/448), MIN_SCALE), NaN propagated."""
    return (amax * (1.0 / FP8_MAX)).clamp_min(MIN_SCALE)


def quantize_fp8_ref(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization in pure PyTorch, in fp32 (the scale's dtype; fp64 input is rounded to it).

    x (..., K) -> q (..., K) float8_e4m3fn, scale (..., 1) fp32 per token (``group_size`` None) or
    (..., ceil(K / group_size)) per token-group.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k).float()
    groups = 1 if group_size is None else fp8_groups(k, group_size)
    if k == 0:  # no columns: q is empty and a per-token row has amax 0
        scale = torch.full((m, groups), MIN_SCALE, dtype=torch.float32, device=x.device)
        return x2.to(FP8_DTYPE).reshape(x.shape), scale.reshape(*lead, groups)
    if group_size is None:
        scale = fp8_scale_ref(x2.abs().amax(-1, keepdim=True))  # (M, 1)
        expanded = scale
    else:
        padded = torch.nn.functional.pad(x2, (0, groups * group_size - k))
        scale = fp8_scale_ref(padded.view(m, groups, group_size).abs().amax(-1))  # (M, G)
        expanded = scale.repeat_interleave(group_size, dim=1)[:, :k]
    q = (x2 / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale.reshape(*lead, groups)


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 quantization of a weight, once at load (reference only).

    w (N, K) float -> q (N, K) float8_e4m3fn, scale (N,) fp32 (each row's amax * (1/448), at least
    MIN_SCALE), so that ``w ~= q * scale[:, None]``: the ``b``, ``b_scale`` of :func:`fp8_gemm`.
    """
    check_tensor("quantize_weight_fp8", "w", w, dtypes=FLOAT_DTYPES, ndim=2)
    q, scale = quantize_fp8_ref(w)
    return q, scale.view(w.shape[0])


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *, group_size: int = GROUP_SIZE
) -> torch.Tensor:
    """q * scale in ``dtype`` (computed in fp32, fp64 when ``dtype`` is fp64).

    q (..., K) float8_e4m3fn; scale fp32: (..., 1) per token, (..., ceil(K / group_size)) per
    token-group, or (N,) per output channel of a 2-D weight q (N, K).
    """
    op = "dequantize_fp8"
    check_tensor(op, "q", q, dtypes=(FP8_DTYPE,))
    if q.dim() == 0:
        raise ValueError(f"{op}: q must have at least 1 dim, got a scalar")
    check_tensor(op, "scale", scale, dtypes=(torch.float32,), device=q.device, device_of="q")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    k = q.shape[-1]
    if scale.dim() == 1 and q.dim() == 2 and scale.shape[0] == q.shape[0]:
        return (q.to(compute) * scale.to(compute)[:, None]).to(dtype)  # per output channel
    groups = fp8_groups(k, group_size)
    if scale.shape[:-1] != q.shape[:-1] or scale.dim() != q.dim() or scale.shape[-1] not in (1, groups):
        raise ValueError(
            f"{op}: scale has shape {tuple(scale.shape)}; expected {(*q.shape[:-1], 1)} per token, "
            f"{(*q.shape[:-1], groups)} per group of {group_size}, or ({q.shape[0]},) per channel of a 2-D q"
        )
    s = scale.to(compute)
    if scale.shape[-1] != 1:
        s = s.repeat_interleave(group_size, dim=-1)[..., :k]
    return (q.to(compute) * s).to(dtype)


# --------------------------------------------------------------------------------------------
# Kernels (and the quantization step every FP8 producer shares)
# --------------------------------------------------------------------------------------------
@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_amax(x):
    """max |x| along axis 1 of an fp32 tile (masked elements loaded as 0), NaN propagated."""
    return tl.reduce(tl.abs(x), 1, _max_nan)


@triton.jit
def _fp8_scale(amax):
    """max(amax * (1/448), MIN_SCALE): the product and max torch's reference computes (fp8_scale_ref)."""
    return tl.maximum(amax * _INV_FP8_MAX, _MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e4m3_rne(y):
    """fp32 y (|y| <= 448, or NaN) rounded to the nearest e4m3 value, ties to even, still in fp32: the
    cast to e4m3 that follows is then exact. On sm_90 cvt.rn.satfinite rounds the same way; Triton's
    interpreter does not (3.6: a mantissa carry with an odd exponent halves the value, 7.98 -> 4; ties go
    away from zero; subnormals truncate), and every exact e4m3 value it casts right, so CPU tests check
    the kernels bit for bit. ~15 integer ops an element: nothing beside a memory-bound pass or a GEMM.

    The magnitude is mant * 2^(exp - 23) with the implicit bit in mant (< 2^24); e4m3's last bit is
    2^(max(exp, -6) - 3) (3 mantissa bits; the fixed subnormal step 2^-9 below 2^-6), so ``shift`` bits
    of mant go, rounded to even. Zero and fp32 subnormals shift everything out (r = 0)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    exp = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    mant = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(20 + tl.maximum(-6 - exp, 0), 31)
    r = mant >> shift.to(tl.uint32)
    rem = mant - (r << shift.to(tl.uint32))
    half = (1 << (shift - 1)).to(tl.uint32)
    r += ((rem > half) | ((rem == half) & ((r & 1) == 1))).to(tl.uint32)
    pow2 = ((exp + shift - 23 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exp + shift - 23), >= 2^-9
    out = (r.to(tl.float32) * pow2).to(tl.uint32, bitcast=True) | sign
    return tl.where(y != y, y, out.to(tl.float32, bitcast=True))


@triton.jit
def _to_fp8(x, scale):
    """clamp(x / scale[:, None], -448, 448) as e4m3, round to nearest even (``_e4m3_rne``)."""
    y = tl.math.div_rn(x, scale[:, None])  # IEEE division, as torch's
    y = tl.clamp(y, -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _e4m3_rne(y).to(tl.float8e4nv)


@triton.jit
def _quantize_fp8_kernel(
    X, Q, S,
    stride_x, stride_q, stride_s,
    M, K, GROUP, N_GROUPS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    # X (M, K) -> Q (M, K) e4m3, S (M, N_GROUPS) fp32. Program = (row block, group); per token the
    # group is the whole row (GROUP = K, N_GROUPS = 1). Consecutive programs take consecutive groups.
    pid = tl.program_id(0)
    g = pid % N_GROUPS
    rows = (pid // N_GROUPS) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)[:, None]  # row * stride can pass 2^31
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    if SINGLE_PASS:
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < end)[None, :]
        x = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = _fp8_scale(_row_amax(x))
        tl.store(Q + rows * stride_q + cols[None, :], _to_fp8(x, scale), mask=mask)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(start, end, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < end)[None, :]
            x = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = _max_nan(amax, _row_amax(x))
        scale = _fp8_scale(amax)
        for c0 in range(start, end, BLOCK_N):  # the second read mostly hits L2
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < end)[None, :]
            x = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(Q + rows * stride_q + cols[None, :], _to_fp8(x, scale), mask=mask)
    tl.store(S + rows * stride_s + g, scale[:, None], mask=row_mask[:, None])


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache; the rule below is the default)
# --------------------------------------------------------------------------------------------
KERNEL = "quantize_fp8"
_FIELDS = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps")


def config_key(n: int, dtype: torch.dtype) -> str:
    """The autotune key: the span one scale covers (K per token, the group size per group), bucketed,
    and the input dtype."""
    return f"N{autotune.bucket(n)}-{autotune.dtype_name(dtype)}"


def default_config(n: int) -> dict:
    """The default config for spans of ``n`` columns (not yet swept on the H200).

    About 4096 elements a program (a 128-column group: 32 rows; a 4096 row: 1), as rms_norm's one-pass
    rule packs short rows; spans above 16384 in two passes of 4096-column chunks.
    """
    if n > _SINGLE_PASS_MAX:
        return dict(BLOCK_M=1, BLOCK_N=4096, SINGLE_PASS=False, num_warps=8)
    block_n = next_pow2(n)
    block_m = max(1, min(32, 4096 // block_n))
    elems = block_m * block_n
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=True, num_warps=4 if elems <= 4096 else 8)


def candidate_configs(n: int) -> list[dict]:
    """The tuning sweep for spans of ``n`` (the default first: it wins ties)."""
    out = [default_config(n)]
    if n > _SINGLE_PASS_MAX:
        out += [
            dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_PASS=False, num_warps=w) for bn in (2048, 4096, 8192) for w in (4, 8)
        ]
    else:
        bn = next_pow2(n)
        out += [dict(BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=True, num_warps=w)
                for bm in (1, 2, 4, 8, 16, 32, 64) if 1024 <= bm * bn <= 16384 for w in (2, 4, 8, 16)]  # fmt: skip
    return [c for i, c in enumerate(out) if c not in out[:i]]


@autotune.plan_cache
def _plan(n: int, dtype: torch.dtype, device: torch.device) -> tuple[LaunchConfig, int]:
    """(launch config, BLOCK_M) for spans of ``n``: looked up once per (bucket, dtype, device)."""
    cfg = autotune.get_config(
        KERNEL, config_key(n, dtype), device=device, default=lambda: default_config(n), fields=_FIELDS,
        check=covers_row(n),
    )  # fmt: skip
    return launch_config(**cfg), cfg["BLOCK_M"]


# --------------------------------------------------------------------------------------------
# Launcher (no autograd; x (M, K) with a unit column stride)
# --------------------------------------------------------------------------------------------
def quantize_fp8_fwd(
    x: torch.Tensor, group_size: int | None = None, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) e4m3, scale (M, 1) or (M, ceil(K / group_size)) fp32 (module doc).

    ``config`` overrides the launch configuration (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps); for sweeps.
    """
    m, k = x.shape
    span = k if group_size is None else group_size
    groups = 1 if group_size is None else fp8_groups(k, group_size)
    q = new_empty(x, m, k, dtype=FP8_DTYPE)
    scale = new_empty(x, m, groups, dtype=torch.float32)
    if m == 0 or k == 0:
        if k == 0 and groups:  # per token: amax of nothing is 0
            scale.fill_(MIN_SCALE)
        return q, scale
    sx = x.stride()
    assert sx[1] == 1
    if config is None:
        cfg, block_m = _plan(span, x.dtype, x.device)
    else:
        cfg, block_m = launch_config(**config), config["BLOCK_M"]
    grid = (triton.cdiv(m, block_m) * groups,)
    _launcher(grid, cfg, (x, q, scale), (sx[0], k, groups, m, k, span, groups))
    return q, scale


_launcher = Launcher(_quantize_fp8_kernel)


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with its fake); eager calls run the launcher
# --------------------------------------------------------------------------------------------
def call_op(op: Callable[..., Any], impl: Callable[..., Any], *args: Any) -> Any:
    """Run an inference-only op: the registered custom op under torch.compile (no graph break), else the
    launcher itself (no dispatcher overhead). The FP8 ops have no autograd (``_utils.dispatch`` without
    the Function)."""
    return op(*args) if torch.compiler.is_compiling() else impl(*args)


def _quantize_impl(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A custom op's int cannot be None: 0 stands for per token.
    return quantize_fp8_fwd(x, group_size or None)


_quantize_fp8_op = torch.library.custom_op("fuseformer::quantize_fp8", mutates_args=())(_quantize_impl)


@_quantize_fp8_op.register_fake
def _(x, group_size):
    m, k = x.shape
    groups = 1 if not group_size else fp8_groups(k, group_size)
    return x.new_empty((m, k), dtype=FP8_DTYPE), x.new_empty((m, groups), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def check_group_size(op: str, group_size: object) -> None:
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"{op}: group_size must be None (per token) or a positive int, got {group_size!r}")


def quantize_fp8(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 (e4m3) quantization per token, or per token-group of ``group_size`` columns.

    Args:
        x: (..., K) fp32, bf16 or fp16 (fp64 runs on the reference, rounded to fp32 first). Leading dims
            are flattened for the kernel and restored on the outputs.
        group_size: None: one scale per row (token); an int (e.g. ``GROUP_SIZE`` 128): one scale per
            ``group_size`` consecutive columns of a row, the last group possibly partial.

    Returns:
        q (..., K) float8_e4m3fn and scale fp32, (..., 1) per token or (..., ceil(K / group_size)) per
        group: ``scale = max(amax / 448, MIN_SCALE)`` (as ``amax * (1/448)``), ``q = clamp(x / scale,
        -448, 448)`` rounded to nearest even; ``x ~= q * scale``.
    """
    check_tensor(_OP, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x must have at least 1 dim, got a scalar")
    check_group_size(_OP, group_size)
    backend = choose_backend(_OP, x.device, x.dtype in KERNEL_DTYPES, "float64 runs on the reference")
    if backend == "reference" or (x.numel() == 0 and x.dim() != 2):  # (rows_2d cannot view 0 columns)
        return quantize_fp8_ref(x, group_size)
    q, scale = call_op(_quantize_fp8_op, _quantize_impl, rows_2d(x), group_size or 0)
    if x.dim() == 2:
        return q, scale
    return q.view(*x.shape), scale.view(*x.shape[:-1], scale.shape[-1])
