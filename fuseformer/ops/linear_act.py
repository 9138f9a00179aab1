"""A linear layer with its bias and activation fused: the up projection of a plain (non-gated) MLP.

    z = x @ W^T + b                  (T, N)   written only when training needs it (see below)
    y = act(z)                       (T, N)   act: "gelu" (erf: BERT, RoBERTa), "gelu_tanh" (GPT-2's
                                              gelu_new), "silu"

In eager PyTorch this is cuBLAS's GEMM (bias in its epilogue) writing z in x's dtype, then an elementwise
GELU reading z and writing y: at BERT-base's shape (T 16384, K 768, N 3072, bf16) the GELU pass moves
200 MB a layer, 0.87 ms of a 7.45 ms forward on an H100 (run 132). Here one Triton GEMM applies the bias
and the activation to its fp32 accumulator in registers and writes y alone (z is not rounded before the
activation, so the result is at least as accurate as eager's).

Everything below autograd lives here (STYLE.md §1): the reference ``linear_act_ref``, the kernel, the
launchers ``linear_act_fwd``/``linear_act_bwd`` (no autograd), the ``torch.library`` registration and the
public ``linear_act``.

Weights: ``nn.Linear``'s (N, K), or the transpose view of a (K, N) weight (transformers' ``Conv1D``:
GPT-2), each read in its own layout (``W_KN``) with no copy. The kernel's loads go through device-side
tensor descriptors (TMA on sm_90) when the strides are 16-byte aligned, else plain pointers.

Backward (training): the forward also writes z rounded to x's dtype (as eager's saved GEMM output);
dz = dy * act'(z) in one elementwise kernel, then cuBLAS: dx = dz W, dW = dz^T x, db = sum(dz).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as TF
import triton
import triton.language as tl

from fuseformer.ops._mlp_common import _aligned
from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    SM90_SMEM_BYTES,
    as_dtype,
    autocast_inputs,
    autograd_function,
    check_tensor,
    dispatch,
    empty,
    float_dtype_of,
    rows_2d,
)
from fuseformer.ops.activations import ACTIVATIONS, _act_fwd, _act_fwd_bwd, _act_ref
from fuseformer.ops.mlp import _ensure_allocator, _grouped
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend, forced_backend

_OP = "linear_act"
KERNEL = "linear_act"


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def linear_act_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "gelu",
    upcast: bool = True,
) -> torch.Tensor:
    """act(x W^T + b) in pure PyTorch: fp32 (fp64 stays fp64) when ``upcast``, else in x's dtype with z
    rounded to it before the activation (what eager PyTorch does). Returns x's dtype."""
    dtype = x.dtype
    compute = float_dtype_of(x) if upcast else dtype
    z = TF.linear(as_dtype(x, compute), as_dtype(weight, compute), None if bias is None else as_dtype(bias, compute))
    return as_dtype(_act_ref(z, activation), dtype)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _linear_act_kernel(
    X, W, B, Y, PRE,
    M, N, K,
    stride_xm, stride_w, stride_ym, stride_pm,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr, W_KN: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_DESC: tl.constexpr, PERSISTENT: tl.constexpr,
):  # fmt: skip
    # X (M, K); W (N, K) rows of stride_w, or with W_KN the (K, N) tensor whose transpose is the weight;
    # B (N,); Y and PRE (M, N). Grouped tile order as the gate-up GEMM's (GROUP_M row blocks a column block).
    # PERSISTENT (descriptors only): one program an SM walks the tiles in one flattened loop, so the
    # pipeliner loads the next tile's first K blocks during this tile's epilogue (K 768: 12 K blocks a tile).
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if PERSISTENT:
        x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
        if W_KN:
            w_desc = tl.make_tensor_descriptor(W, shape=[K, N], strides=[stride_w, 1], block_shape=[BLOCK_K, BLOCK_N])
        else:
            w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[stride_w, 1], block_shape=[BLOCK_N, BLOCK_K])
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(k_tiles):
                k = kt * BLOCK_K
                x = x_desc.load([off_m, k])
                if W_KN:
                    acc = tl.dot(x, w_desc.load([k, off_n]), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(x, w_desc.load([off_n, k]).T, acc, input_precision=PRECISION)
            _epilogue(acc, B, Y, PRE, off_m, off_n, M, N, stride_ym, stride_pm, ACTIVATION, HAS_BIAS, SAVE_PRE,
                      BLOCK_M, BLOCK_N)  # fmt: skip
        return
    pid_m, pid_n = _grouped(tl.program_id(0), num_m, num_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_DESC:  # out-of-bounds boxes read as zero
        x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
        if W_KN:
            w_desc = tl.make_tensor_descriptor(W, shape=[K, N], strides=[stride_w, 1], block_shape=[BLOCK_K, BLOCK_N])
        else:
            w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[stride_w, 1], block_shape=[BLOCK_N, BLOCK_K])
        for kt in tl.range(0, k_tiles):
            k = kt * BLOCK_K
            x = x_desc.load([off_m, k])
            if W_KN:
                acc = tl.dot(x, w_desc.load([k, off_n]), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, w_desc.load([off_n, k]).T, acc, input_precision=PRECISION)
    else:
        x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]  # row * stride can pass 2^31
        m_mask = (rm < M)[:, None]
        if W_KN:
            w_ptrs = W + rk.to(tl.int64)[:, None] * stride_w + rn[None, :]
            n_mask = (rn < N)[None, :]
        else:
            w_ptrs = W + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
            n_mask = (rn < N)[:, None]
        for kt in tl.range(0, k_tiles):
            k = kt * BLOCK_K
            x = tl.load(x_ptrs + k, mask=m_mask & (rk < K - k)[None, :], other=0.0)
            if W_KN:
                w = tl.load(w_ptrs + k * stride_w, mask=n_mask & (rk < K - k)[:, None], other=0.0)
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            else:
                w = tl.load(w_ptrs + k, mask=n_mask & (rk < K - k)[None, :], other=0.0)
                acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
    _epilogue(acc, B, Y, PRE, off_m, off_n, M, N, stride_ym, stride_pm, ACTIVATION, HAS_BIAS, SAVE_PRE, BLOCK_M, BLOCK_N)


@triton.jit
def _epilogue(acc, B, Y, PRE, off_m, off_n, M, N, stride_ym, stride_pm, ACTIVATION: tl.constexpr,
              HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """z = acc + b; PRE = z rounded (the backward's, as eager PyTorch saves it) when SAVE_PRE; Y = act(z)."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)[:, None]
    if SAVE_PRE:
        tl.store(PRE + rows * stride_pm + rn[None, :], acc.to(PRE.dtype.element_ty), mask=mask)
    y = _act_fwd(acc, ACTIVATION)
    tl.store(Y + rows * stride_ym + rn[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _act_grad_kernel(DY, Z, DZ, numel, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """dz = dy * act'(z) over contiguous tensors, in fp32, rounded to DZ's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    _, da = _act_fwd_bwd(z, ACTIVATION)
    tl.store(DZ + offs, (dy * da).to(DZ.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration (from the autotune cache)
# --------------------------------------------------------------------------------------------
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "USE_DESC", "PERSISTENT")


def config_key(t: int, k: int, n: int, dtype: torch.dtype) -> str:
    """The autotune key: T bucketed to a power of two (16 at least), K and N as they are, the dtype."""
    return f"T{max(16, triton.next_power_of_2(t))}-K{k}-N{n}-{autotune.dtype_name(dtype)}"


def default_config(t: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """A config by rule. GPU: 128x128 output tiles (8 warps), BLOCK_K 64, 4 stages of (128 + 128) x 64
    bf16 (128 KB), descriptors; fewer rows for few tokens; fp32 (FMA loops) smaller tiles. Off the GPU
    (the interpreter): small tiles that exercise every mask."""
    if not on_gpu:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=1, USE_DESC=False,
                    PERSISTENT=False)  # fmt: skip
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, GROUP_M=8, num_warps=8, num_stages=3, USE_DESC=True,
                    PERSISTENT=False)  # fmt: skip
    if t <= 64:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(t)), BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4,
                    num_stages=4, USE_DESC=True, PERSISTENT=False)  # fmt: skip
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, USE_DESC=True,
                PERSISTENT=False)  # fmt: skip


def cached_config(t: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The launch config at T tokens: the autotune cache's, else :func:`default_config`."""
    cfg = autotune.get_config(
        KERNEL, config_key(t, k, n, dtype), device=device,
        default=lambda: default_config(t, dtype, torch.device(device).type == "cuda"),
    )  # fmt: skip
    return {key: v for key, v in cfg.items() if key in CONFIG_KEYS}


def candidate_configs(t: int, dtype: torch.dtype) -> list[dict]:
    """The tuner's candidates for one T bucket (tiles, warps, stages, descriptors) that fit shared memory."""
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    tiles = ((128, 128, 8), (128, 256, 8), (128, 64, 4), (64, 128, 4), (64, 64, 4))
    for bm, bn, warps in tiles:
        if bm > max(64, triton.next_power_of_2(t)):
            continue
        for bk in (32, 64, 128):
            for stages in (3, 4, 5):
                if stages * (bm + bn) * bk * es + 16384 > SM90_SMEM_BYTES:
                    continue
                for persistent in (False, True):
                    out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                                    num_stages=stages, USE_DESC=True, PERSISTENT=persistent))  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; x (T, K) with a unit column stride)
# --------------------------------------------------------------------------------------------
def _weight_layout(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the tensor the kernel reads, W_KN): weight (N, K) itself when its rows are unit-stride, else the
    (K, N) tensor of which it is the transpose view (Conv1D), else a contiguous copy."""
    if weight.stride(1) == 1:
        return weight, False
    if weight.stride(0) == 1:
        return weight.T, True
    return weight.contiguous(), False


def linear_act_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    save_pre: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (T, K), weight (N, K) (any strides), bias (N,) or None -> y = act(x W^T + b) (T, N), and z (T, N)
    in x's dtype when ``save_pre`` (else None). ``config`` overrides the cached launch config."""
    t, k = x.shape
    n = weight.shape[0]
    y = empty((t, n), dtype=x.dtype, device=x.device)
    pre = empty((t, n), dtype=x.dtype, device=x.device) if save_pre else None
    if t == 0 or n == 0:
        return y, pre
    if k == 0:  # z = b
        z = (bias.float() if bias is not None else x.new_zeros(n, dtype=torch.float32)).expand(t, n)
        y.copy_(_act_ref(z, activation))
        if pre is not None:
            pre.copy_(z)
        return y, pre
    w, w_kn = _weight_layout(weight)
    bias = bias.contiguous() if bias is not None else None
    assert x.stride(1) == 1
    cfg = dict(config or cached_config(t, k, n, x.dtype, x.device))
    cfg.setdefault("PERSISTENT", False)
    if cfg.get("USE_DESC") and not (_aligned(x) and _aligned(w)):
        cfg["USE_DESC"] = cfg["PERSISTENT"] = False
        if cfg["BLOCK_M"] >= 64:  # plain loads are not pipelined: smaller tiles (see ops/mlp.py)
            cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 64), BLOCK_K=min(cfg["BLOCK_K"], 32))
    if cfg.get("USE_DESC") and x.is_cuda:
        _ensure_allocator()
    if not cfg.get("USE_DESC"):
        cfg["PERSISTENT"] = False  # the persistent loop reads through descriptors only
    tiles = triton.cdiv(t, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if cfg["PERSISTENT"]:
        tiles = min(tiles, _sm_count(x.device))
    _linear_act_kernel[(tiles,)](
        x, w, bias if bias is not None else y, y, pre if pre is not None else y,
        t, n, k,
        x.stride(0), w.stride(0), y.stride(0), pre.stride(0) if pre is not None else 0,
        ACTIVATION=activation, HAS_BIAS=bias is not None, SAVE_PRE=save_pre, W_KN=w_kn,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **cfg,
    )  # fmt: skip
    return y, pre


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each walking several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


_GRAD_BLOCK = 1024


def linear_act_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor, activation: str, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dy (T, N) -> dx (T, K), dweight (N, K), dbias (N,) or None, from the saved z (``pre``)."""
    dz = empty(tuple(pre.shape), dtype=pre.dtype, device=pre.device)
    numel = dz.numel()
    if numel:
        dy = dy.contiguous()
        _act_grad_kernel[(triton.cdiv(numel, _GRAD_BLOCK),)](
            dy, pre, dz, numel, ACTIVATION=activation, BLOCK=_GRAD_BLOCK, num_warps=4
        )
    dbias = dz.sum(0, dtype=torch.float32).to(dz.dtype) if has_bias else None
    return torch.matmul(dz, weight), torch.matmul(dz.T, x), dbias


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with fake and autograd), and the same
# pieces as an autograd.Function for eager calls; see _utils.dispatch.
# --------------------------------------------------------------------------------------------
def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    y, pre = linear_act_fwd(x, weight, bias, activation, save_pre)
    return y, pre if pre is not None else x.new_empty(0)  # a custom op cannot return None


def _bwd_impl(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor, activation: str, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = linear_act_bwd(dy, x, weight, pre, activation, has_bias)
    return dx, dw, db if db is not None else x.new_empty(0)


_fwd_op = torch.library.custom_op("fuseformer::linear_act_fwd", mutates_args=())(_fwd_impl)
_bwd_op = torch.library.custom_op("fuseformer::linear_act_bwd", mutates_args=())(_bwd_impl)


@_fwd_op.register_fake
def _(x, weight, bias, activation, save_pre):
    t, n = x.shape[0], weight.shape[0]
    return x.new_empty((t, n)), x.new_empty((t, n) if save_pre else 0)


@_bwd_op.register_fake
def _(dy, x, weight, pre, activation, has_bias):
    return torch.empty_like(x), weight.new_empty(weight.shape), x.new_empty(weight.shape[0] if has_bias else 0)


def _setup_context(ctx, inputs, output):
    x, weight, bias, activation, save_pre = inputs
    ctx.activation = activation
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile, the plain impl in eager."""

    def _backward(ctx, dy, _dpre):
        x, weight, pre = ctx.saved_tensors
        if pre.numel() == 0 and x.shape[0] > 0 and weight.shape[0] > 0:
            raise RuntimeError(f"{_OP}: backward without the saved pre-activation (forward ran with save_pre=False)")
        dx, dw, db = bwd(dy, x, weight, pre, ctx.activation, ctx.has_bias)
        return dx, dw, db if ctx.has_bias else None, None, None

    return _backward


_fwd_op.register_autograd(_backward_with(_bwd_op), setup_context=_setup_context)
_LinearActFunction = autograd_function("_LinearActFunction", _fwd_impl, _setup_context, _backward_with(_bwd_impl))


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def linear_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "gelu",
) -> torch.Tensor:
    """act(x W^T + b): ``nn.Linear`` followed by its activation, in one GEMM kernel whose epilogue adds the
    bias and applies the activation (the (T, N) pre-activation is written only when training needs it).

    Args:
        x: (..., K) fp16, bf16 or fp32 (fp64 runs on the reference).
        weight: (N, K), x's dtype: ``nn.Linear.weight``, or ``conv1d.weight.T`` for transformers'
            ``Conv1D`` (read in its own layout, no copy).
        bias: (N,) in x's dtype, or None.
        activation: "gelu" (erf), "gelu_tanh" (the tanh approximation: GPT-2's ``gelu_new``) or "silu".

    Under ``torch.autocast`` the inputs are cast to the autocast dtype first (fp32 weights included).

    Returns:
        (..., N) in x's dtype (the autocast dtype under autocast). Gradients for x, weight and bias.
    """
    check_tensor(_OP, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{_OP}: x must have at least 1 dim, got a scalar")
    x, weight, bias = autocast_inputs(x, weight, bias)
    k = x.shape[-1]
    check_tensor(_OP, "weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
    if weight.shape[1] != k:
        raise ValueError(f"{_OP}: weight has shape {tuple(weight.shape)}; expected (N, {k}) (K from x)")
    n = weight.shape[0]
    if bias is not None:
        check_tensor(_OP, "bias", bias, dtypes=(x.dtype,), ndim=1, device=x.device)
        if bias.shape[0] != n:
            raise ValueError(f"{_OP}: bias has shape {tuple(bias.shape)}; expected ({n},) (N from weight)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_OP}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    backend = choose_backend(_OP, x.device, x.dtype in KERNEL_DTYPES, "float64 runs on the reference")
    if backend == "reference":
        if x.is_cpu and x.dtype in KERNEL_DTYPES and forced_backend() is None:
            # Eager's own computation (the GEMM in x's dtype), the activation in fp32 over it.
            return as_dtype(_act_ref(TF.linear(x, weight, bias).float(), activation), x.dtype)
        return linear_act_ref(x, weight, bias, activation)
    shape = x.shape
    x2 = rows_2d(x)
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    save_pre = torch.is_grad_enabled() and needs_grad
    y = dispatch(_fwd_op, _LinearActFunction, linear_act_fwd, x2, weight, bias, activation, save_pre)[0]
    return y if x.dim() == 2 else y.view(*shape[:-1], n)
