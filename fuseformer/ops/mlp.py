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

Decode (inference, T <= 64 tokens, fp16/bf16 on CUDA): both GEMMs through one weight-streaming kernel,
in mlp_decode.py (``fused_mlp_fwd`` dispatches there when ``decode_supported``). The epilogue and the
split-K reduction the two kernels share are in _mlp_common.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from fuseformer.ops import _gluon, mlp_hopper
from fuseformer.ops._cpu_linear import cpu_linear
from fuseformer.ops._mlp_common import _aligned, _gate_up_epilogue, _split_k_reduce
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
    next_pow2,
    rows_2d,
)
from fuseformer.ops.activations import ACTIVATIONS, _act_ref, glu_bwd, glu_fwd
from fuseformer.ops.mlp_decode import decode_supported, mlp_decode_fwd
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend, forced_backend

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
    # Casts only where a dtype differs: a no-op .to() still costs ~0.7 us, and this runs per layer per
    # CPU decode step (fp32 SmolLM-135M shape, 1 thread: 421 -> 409 us a call, 2026-12-05).
    gu = as_dtype(x, compute) @ as_dtype(w_gate_up, compute).T
    gate, up = gu.chunk(2, dim=-1)
    y = _act_ref(gate, activation) * up
    return as_dtype(y @ as_dtype(w_down, compute).T, dtype)


def _fused_mlp_cpu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str) -> torch.Tensor:
    """What the reference backend runs on CPU tensors unless forced: both GEMMs in x's dtype (fp32 by
    ``cpu_linear``, its faster form at a decode step's few rows), the activation in fp32 between them.
    fp16/bf16 round gate and up to x's dtype as eager PyTorch does (fused_mlp_ref's upcast casts both
    weights to fp32 at every call: SmolLM-135M bf16 decode, 2026-12-06, ~40% of the step)."""
    gate, up = cpu_linear(x, w_gate_up).float().chunk(2, dim=-1)
    return cpu_linear(as_dtype(_act_ref(gate, activation) * up, x.dtype), w_down)


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


def _known_form(cfg: dict) -> bool:
    """Whether a stored gate-up config asks for a form this kernel has: caches written before session
    19 also hold ``WARP_SPECIALIZE`` and ``PERSISTENT`` (the warp-specialized K loop and the persistent
    tile loop, which no shipped config used; removed): False is dropped, True is ignored with a
    warning (``autotune.get_config``'s check) and the rule's config runs."""
    return not (cfg.get("WARP_SPECIALIZE") or cfg.get("PERSISTENT"))


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


# Token counts (exclusive, inclusive) where inference's MLP runs unfused on CUDA: cuBLAS's gate-up GEMM
# and glu_fwd are level with or ahead of the fused gate-up there (H200, 8B shape, under CUDA graphs, run
# 115 in docs/perf-notes.md: T 192 137 against 161 us; the fused one wins at T <= 64 and T >= 1024).
_UNFUSED_TOKENS = (64, 512)
UNFUSED_DEVICE_TYPES = frozenset({"cuda"})  # (the CPU tests add "cpu" to take the path)


def fused_mlp_fwd(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
    save_pre: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x (T, H) -> out (T, H), pre (T, 2I) or None, y (T, I): the fused gate-up GEMM, then cuBLAS. For
    inference (no ``save_pre``, no ``config``): at T <= 64 (``decode_supported``) the two decode GEMMs;
    on CUDA at 64 < T <= 512, cuBLAS's gate-up GEMM and the GLU kernel (``_UNFUSED_TOKENS``)."""
    if not save_pre and config is None:
        if decode_supported(x, w_gate_up, w_down):
            out, y = mlp_decode_fwd(x, w_gate_up, w_down, activation)
            return out, None, y
        if x.device.type in UNFUSED_DEVICE_TYPES and _UNFUSED_TOKENS[0] < x.shape[0] <= _UNFUSED_TOKENS[1]:
            i = w_down.shape[1]
            pre = torch.matmul(x, w_gate_up.T)
            y = glu_fwd(pre[:, :i], pre[:, i:], activation)
            return torch.matmul(y, w_down.T), None, y
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
        if x.is_cpu and x.dtype in KERNEL_DTYPES and forced_backend() is None:
            return _fused_mlp_cpu(x, w_gate_up, w_down, activation)
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
# Tuning candidates (``fuseformer bench --tune``: bench/tune.py)
# --------------------------------------------------------------------------------------------
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
