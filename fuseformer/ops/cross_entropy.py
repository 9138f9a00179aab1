"""Cross-entropy over a vocabulary: the reference, the Triton kernels, launchers, registration and the op.

    lse_i  = log sum_j exp(x_ij)
    loss_i = lse_i - (1 - eps) x_i,y_i - (eps / V) sum_j x_ij + z * lse_i^2      (0 where y_i == ignore_index)
    dx_ij  = s_i * (p_ij (1 + 2 z lse_i) - eps / V - (1 - eps) [j == y_i]),      p = softmax(x)

which is ``torch.nn.functional.cross_entropy(x, y, ignore_index, label_smoothing=eps)`` plus the
optional z-loss of PaLM (``z * lse^2``, z = ``z_loss``). With ``softcap`` c > 0 the logits are capped
first, x <- c tanh(x / c) (Gemma 2's final logit soft-capping), and the gradient of the raw logits is
the one above times 1 - tanh(x / c)^2: the kernels cap each value as they load it, in both passes. ``mean`` divides by the number of targets
that are not ignored; **all targets ignored gives loss 0 and zero gradients** (torch gives NaN: the
issue asks for 0, so that a batch of padding does not poison training).

Everything below autograd lives here (STYLE.md §1): the reference, the Triton kernels (a row of
logits a program: online logsumexp in one pass over the vocabulary, then, when asked, the gradient
written in a second pass, in place over the logits if the caller wants; and the same on transposed
(V, C) logits, ``_launch_cols``), the launchers ``cross_entropy_fwd``/``cross_entropy_bwd`` (no
autograd), the ``torch.library`` registration and the public ``cross_entropy``.

The forward reads the logits once (loss and lse per row); the backward reads them again and writes
the gradient (the softmax is recomputed from the saved lse). The reduction is done by torch on the
fp32 per-row losses, so every reduction's gradient is exactly autograd's.

The LM head fused with its loss, ``fused_linear_cross_entropy``, is in fused_linear_cross_entropy.py;
it runs these kernels on its chunks of logits (``_launch`` on rows, ``_launch_cols`` on the transposed
first chunk) and checks its arguments with ``_check_common``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._attention_common import tanh
from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    autograd_function,
    check_shape,
    check_tensor,
    dispatch,
    empty,
    float_dtype_of,
    next_pow2,
)
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend

REDUCTIONS = ("mean", "sum", "none")
_TARGET_DTYPES = (torch.int64, torch.int32)
# Vocabulary elements a program holds per step (fp32 in registers, 16 a thread). One row a program,
# so an FLCE chunk of 256 tokens is only ~2 programs an SM: large vocabularies take 8192-wide steps
# at 16 warps to keep ~32 KiB of loads in flight per SM (a guess from Little's law, unmeasured).
_BLOCK_V = 4096
_BLOCK_V_LARGE = 8192


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def cross_entropy_ref(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    upcast: bool = True,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Pure PyTorch cross-entropy (logits (N, V), target (N,)); fp32 (fp64 stays fp64) when ``upcast``;
    ``softcap`` > 0 caps the logits first (c tanh(x / c)).

    Returns the loss in logits' dtype: a scalar, or (N,) for ``reduction="none"``. All targets
    ignored with ``mean`` gives 0 (not torch's NaN).
    """
    dtype = logits.dtype
    x = logits.to(float_dtype_of(logits)) if upcast else logits
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    valid = target != ignore_index
    v = x.shape[-1]
    lse = torch.logsumexp(x, dim=-1)
    safe_t = torch.where(valid, target, 0).long()
    x_t = x.gather(-1, safe_t[:, None]).squeeze(-1)
    loss = lse - (1.0 - label_smoothing) * x_t
    if label_smoothing:
        loss = loss - (label_smoothing / v) * x.sum(-1)
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.to(dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / valid.sum().clamp(min=1)
    return total.to(dtype)


# --------------------------------------------------------------------------------------------
# Kernels (rows, and transposed logits for the FLCE's first chunk)
# --------------------------------------------------------------------------------------------
@triton.jit
def _cross_entropy_kernel(
    X, T, LOSS, LSE, DX, SCALE,
    stride_x, stride_dx, stride_scale,
    V, ignore_index, label_smoothing, z_loss, softcap,
    LSE_GIVEN: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # One row a program. DX may be X itself (the gradient overwrites the logits, FLCE); each block
    # is read before it is written, by the same program, so that is safe.
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 (8192 x 128256 already does)
    x_row = X + row * stride_x
    target = tl.load(T + row).to(tl.int64)
    valid = target != ignore_index
    in_range = valid & (target >= 0) & (target < V)
    if LSE_GIVEN:
        lse = tl.load(LSE + row)
    else:
        m = -float("inf")
        s = 0.0
        sum_x = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            if SOFTCAP:  # the cap of -inf is -softcap: masked columns stay -inf
                x = tl.where(mask, softcap * tanh(x / softcap), -float("inf"))
            new_m = tl.maximum(m, tl.max(x, axis=0))
            # Shift by 0 while everything so far is -inf (a padded vocabulary masked with -inf),
            # so that -inf - -inf does not turn the sum into NaN. NaN in x propagates through s.
            shift = tl.where(new_m == -float("inf"), 0.0, new_m)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
            m = new_m
            if HAS_SMOOTHING:
                sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
        lse = tl.where(m == -float("inf"), m, m + tl.log(s))
        tl.store(LSE + row, lse)
        if WRITE_LOSS:
            x_t = tl.load(x_row + target, mask=in_range, other=0.0).to(tl.float32)
            if SOFTCAP:
                x_t = softcap * tanh(x_t / softcap)
            loss = lse - (1.0 - label_smoothing) * x_t
            if HAS_SMOOTHING:
                loss -= (label_smoothing / V) * sum_x
            if HAS_Z_LOSS:
                loss += z_loss * lse * lse
            tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if WRITE_GRAD:
        scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
        p_scale = scale
        if HAS_Z_LOSS:
            p_scale = scale * (1.0 + 2.0 * z_loss * lse)
        smooth = scale * (label_smoothing / V)
        hit = scale * (1.0 - label_smoothing)
        dx_row = DX + row * stride_dx
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                t = tanh(x / softcap)
                x = softcap * t
            dx = tl.exp(x - lse) * p_scale - smooth - tl.where(cols == target, hit, 0.0)
            if SOFTCAP:
                dx = dx * (1.0 - t * t)
            dx = tl.where(valid, dx, 0.0)
            tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_cols_stats_kernel(
    X, T, PART,
    stride_v, C, V, V_SPLIT, softcap,
    HAS_SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # The row kernel's first pass on transposed logits: X is (V, C), column t holding token t's logits
    # (the FLCE's first chunk, laid out in grad_weight's memory; see _first_chunk_in_dw). Program
    # (i, k) takes BLOCK_T tokens (every load is BLOCK_T contiguous elements of a vocabulary row) and
    # vocabulary rows [k V_SPLIT, (k + 1) V_SPLIT): the vocabulary is split so that a chunk of a few
    # thousand tokens still makes ~1000 programs. Each writes its partial max, sum of exponentials,
    # sum of logits (label smoothing) and the target's logit (0 unless the target lies in its rows)
    # to PART (splits, 4, C) for _cross_entropy_cols_grad_kernel.
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    split = tl.program_id(1)
    tmask = toks < C
    v0 = split * V_SPLIT
    v1 = tl.minimum(V, v0 + V_SPLIT)
    m = tl.full((BLOCK_T,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    sum_x = tl.zeros((BLOCK_T,), tl.float32)
    for start in range(v0, v1, BLOCK_V):
        rows = start + tl.arange(0, BLOCK_V)  # (BV,)
        mask = (rows[:, None] < v1) & tmask[None, :]
        ptrs = X + rows[:, None].to(tl.int64) * stride_v + toks[None, :]
        x = tl.load(ptrs, mask=mask, other=-float("inf")).to(tl.float32)  # (BV, BT)
        if SOFTCAP:
            x = tl.where(mask, softcap * tanh(x / softcap), -float("inf"))
        new_m = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(new_m == -float("inf"), 0.0, new_m)  # as in the row kernel
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[None, :]), axis=0)
        m = new_m
        if HAS_SMOOTHING:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
    # The target's logit, read here: the gradient kernel overwrites X, one split's rows a program.
    target = tl.load(T + toks, mask=tmask, other=-1).to(tl.int64)
    mine = tmask & (target >= v0) & (target < v1)
    x_t = tl.load(X + target * stride_v + toks, mask=mine, other=0.0).to(tl.float32)
    if SOFTCAP:
        x_t = tl.where(mine, softcap * tanh(x_t / softcap), 0.0)
    part = PART + split.to(tl.int64) * 4 * C + toks
    tl.store(part, m, mask=tmask)
    tl.store(part + C, s, mask=tmask)
    tl.store(part + 2 * C, sum_x, mask=tmask)
    tl.store(part + 3 * C, x_t, mask=tmask)


@triton.jit
def _cross_entropy_cols_grad_kernel(
    X, T, LOSS, LSE, SCALE, PART,
    stride_v, stride_scale,
    C, V, V_SPLIT, SPLITS, ignore_index, label_smoothing, z_loss, softcap,
    WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # Program (i, k): combine the SPLITS partials of its tokens (in split order: every program of a
    # token gets the same lse), write lse and the loss (split 0), then dlogits^T in place over its
    # vocabulary rows [k V_SPLIT, (k + 1) V_SPLIT) (each tile read before this program writes it).
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    tmask = toks < C
    target = tl.load(T + toks, mask=tmask, other=ignore_index).to(tl.int64)
    valid = tmask & (target != ignore_index)
    m = tl.full((BLOCK_T,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    sum_x = tl.zeros((BLOCK_T,), tl.float32)
    x_t = tl.zeros((BLOCK_T,), tl.float32)
    for k in range(0, SPLITS):
        part = PART + k * 4 * C + toks
        m_k = tl.load(part, mask=tmask, other=-float("inf"))
        new_m = tl.maximum(m, m_k)
        shift = tl.where(new_m == -float("inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.load(part + C, mask=tmask, other=0.0) * tl.exp(m_k - shift)
        m = new_m
        if HAS_SMOOTHING:
            sum_x += tl.load(part + 2 * C, mask=tmask, other=0.0)
        x_t += tl.load(part + 3 * C, mask=tmask, other=0.0)
    lse = tl.where(m == -float("inf"), m, m + tl.log(tl.where(s > 0.0, s, 1.0)))  # s >= 1 unless m is -inf
    if split == 0:
        tl.store(LSE + toks, lse, mask=tmask)
        if WRITE_LOSS:
            loss = lse - (1.0 - label_smoothing) * x_t
            if HAS_SMOOTHING:
                loss -= (label_smoothing / V) * sum_x
            if HAS_Z_LOSS:
                loss += z_loss * lse * lse
            tl.store(LOSS + toks, tl.where(valid, loss, 0.0), mask=tmask)
    if WRITE_GRAD:
        scale = tl.load(SCALE + toks * stride_scale, mask=tmask, other=0.0).to(tl.float32)
        lse_safe = tl.where(tmask, lse, 0.0)  # padding tokens (past C): no arithmetic on -inf
        p_scale = scale
        if HAS_Z_LOSS:
            p_scale = scale * (1.0 + 2.0 * z_loss * lse_safe)
        smooth = scale * (label_smoothing / V)
        hit = scale * (1.0 - label_smoothing)
        v0 = split * V_SPLIT
        v1 = tl.minimum(V, v0 + V_SPLIT)
        for start in range(v0, v1, BLOCK_V):
            rows = start + tl.arange(0, BLOCK_V)
            mask = (rows[:, None] < v1) & tmask[None, :]
            ptrs = X + rows[:, None].to(tl.int64) * stride_v + toks[None, :]
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                t = tanh(x / softcap)
                x = softcap * t
            dx = tl.exp(x - lse_safe[None, :]) * p_scale[None, :] - smooth[None, :]
            dx -= tl.where(rows[:, None] == target[None, :], hit[None, :], 0.0)
            if SOFTCAP:
                dx = dx * (1.0 - t * t)
            dx = tl.where(valid[None, :], dx, 0.0)
            tl.store(ptrs, dx.to(X.dtype.element_ty), mask=mask)


# The transposed kernels' tile and how many programs to aim for (the vocabulary is split to get
# them). Run 72 (H200, 2026-12-01), one program a 16-token column over the whole vocabulary (256
# programs at the goal shape): 1.96-2.4 ms for its 3 x 1.05 GB (~1.5 TB/s) at every tile tried. Run 73,
# split to ~1000 programs: 32 x 256 / 4 1.69 ms, 64 x 128 / 4 1.39 (the best of 8; 16-token tiles
# 1.93-2.03): the longer a contiguous segment of a vocabulary row, the better.
_COLS_CONFIG = dict(BLOCK_T=64, BLOCK_V=128, num_warps=4, PROGRAMS=1024)


def _cols_splits(c: int, v: int, block_t: int, block_v: int, programs: int) -> tuple[int, int]:
    """(splits, rows a split) of the vocabulary: about ``programs`` programs in all, every split a
    multiple of ``block_v`` rows and none empty."""
    blocks = triton.cdiv(c, block_t)
    splits = max(1, min(triton.cdiv(v, block_v), triton.cdiv(programs, blocks)))
    rows = triton.cdiv(triton.cdiv(v, splits), block_v) * block_v
    return triton.cdiv(v, rows), rows


def _launch_cols(
    xt, target, loss, lse, scale, ignore_index, label_smoothing, z_loss, *, write_loss, write_grad, scratch=None,
    softcap=0.0,
):  # fmt: skip
    """The CE kernels on transposed logits ``xt`` (V, C) (unit column stride): loss and lse per token
    (C,), and dlogits^T in place over ``xt`` when ``write_grad``. ``scratch``: free memory of any
    dtype for the per-split partials (4 x splits x C fp32), else they are allocated."""
    v, c = xt.shape
    if c == 0:
        return
    assert xt.stride(1) == 1
    cfg = dict(_COLS_CONFIG)
    bt, bv = cfg["BLOCK_T"], cfg["BLOCK_V"]
    splits, rows = _cols_splits(c, v, bt, bv, cfg.pop("PROGRAMS"))
    floats = 4 * splits * c
    nbytes = 4 * floats
    if scratch is not None and scratch.numel() * scratch.element_size() >= nbytes + 16:
        raw = scratch.view(-1).view(torch.uint8)
        off = (-raw.data_ptr()) % 16
        part = raw[off : off + nbytes].view(torch.float32)
    else:
        part = empty((floats,), dtype=torch.float32, device=xt.device)
    grid = (triton.cdiv(c, bt), splits)
    has_smoothing = label_smoothing != 0.0
    _cross_entropy_cols_stats_kernel[grid](
        xt, target, part, xt.stride(0), c, v, rows, float(softcap), HAS_SMOOTHING=has_smoothing,
        SOFTCAP=softcap != 0.0, **cfg
    )  # fmt: skip
    _cross_entropy_cols_grad_kernel[grid](
        xt, target, loss if loss is not None else lse, lse, scale if scale is not None else lse, part,
        xt.stride(0), (scale.stride(0) if scale.dim() else 0) if scale is not None else 0,
        c, v, rows, splits, ignore_index, float(label_smoothing), float(z_loss), float(softcap),
        WRITE_LOSS=write_loss, WRITE_GRAD=write_grad, HAS_SMOOTHING=has_smoothing,
        HAS_Z_LOSS=z_loss != 0.0, SOFTCAP=softcap != 0.0, **cfg,
    )  # fmt: skip


KERNEL = "cross_entropy"
_FIELDS = ("BLOCK_V", "num_warps")


def config_key(v: int, write_grad: bool, dtype: torch.dtype) -> str:
    """The autotune key: the vocabulary's bucket, the pass (loss only, or writing the gradient:
    a second sweep over the row), the logits' dtype."""
    return f"V{autotune.bucket(v)}-{'grad' if write_grad else 'loss'}-{autotune.dtype_name(dtype)}"


def _config(v: int) -> dict:
    """The default: _BLOCK_V-wide steps (fewer for a short vocabulary), _BLOCK_V_LARGE from 32768."""
    block_v = _BLOCK_V_LARGE if v >= 32768 else min(_BLOCK_V, next_pow2(v))
    return dict(BLOCK_V=block_v, num_warps=16 if block_v >= 8192 else 8 if block_v >= 2048 else 4)


@autotune.plan_cache
def ce_config(v: int, write_grad: bool, dtype: torch.dtype, device: torch.device | str | None = None) -> dict:
    """The launch config (BLOCK_V, num_warps) for a vocabulary of ``v``, looked up once per (v, pass,
    dtype, device): the autotune cache's, else the default rule (which needs the exact v)."""
    return autotune.get_config(
        KERNEL, config_key(v, write_grad, dtype), device=device, default=lambda: _config(v), fields=_FIELDS
    )


def _launch(
    x, target, loss, lse, dx, scale, ignore_index, label_smoothing, z_loss, *, lse_given, write_loss, write_grad,
    softcap=0.0,
):  # fmt: skip
    n, v = x.shape
    if n == 0:
        return
    assert x.stride(1) == 1 and (dx is None or dx.stride(1) == 1)
    cfg = ce_config(v, write_grad, x.dtype, x.device)
    _cross_entropy_kernel[(n,)](
        x, target, loss if loss is not None else lse, lse, dx if dx is not None else x,
        scale if scale is not None else lse,
        x.stride(0), dx.stride(0) if dx is not None else 0,
        (scale.stride(0) if scale.dim() else 0) if scale is not None else 0,
        v, ignore_index, float(label_smoothing), float(z_loss), float(softcap),
        LSE_GIVEN=lse_given, WRITE_LOSS=write_loss, WRITE_GRAD=write_grad,
        HAS_SMOOTHING=label_smoothing != 0.0, HAS_Z_LOSS=z_loss != 0.0, SOFTCAP=softcap != 0.0, **cfg,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; logits (N, V) with a unit column stride)
# --------------------------------------------------------------------------------------------
def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V), target (N,) -> loss (N,) fp32 (0 where ignored), lse (N,) fp32."""
    n = logits.shape[0]
    loss = empty((n,), dtype=torch.float32, device=logits.device)
    lse = empty((n,), dtype=torch.float32, device=logits.device)
    _launch(logits, target, loss, lse, None, None, ignore_index, label_smoothing, z_loss,
            lse_given=False, write_loss=True, write_grad=False, softcap=softcap)  # fmt: skip
    return loss, lse


def cross_entropy_bwd(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """dloss (N,) (any stride, e.g. an expanded scalar), logits (N, V), lse (N,) -> dlogits (N, V)."""
    dx = empty(tuple(logits.shape), dtype=logits.dtype, device=logits.device)
    _launch(logits, target, None, lse, dx, dloss, ignore_index, label_smoothing, z_loss,
            lse_given=True, write_loss=False, write_grad=True, softcap=softcap)  # fmt: skip
    return dx


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------
def _ce_fwd_impl(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd(logits, target, ignore_index, label_smoothing, z_loss, softcap)


def _ce_bwd_impl(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> torch.Tensor:
    return cross_entropy_bwd(dloss, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap)


_ce_fwd_op = torch.library.custom_op("fuseformer::cross_entropy_fwd", mutates_args=())(_ce_fwd_impl)
_ce_bwd_op = torch.library.custom_op("fuseformer::cross_entropy_bwd", mutates_args=())(_ce_bwd_impl)


@_ce_fwd_op.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32)


@_ce_bwd_op.register_fake
def _(dloss, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap):
    return torch.empty_like(logits)


def _ce_setup_context(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, z_loss, softcap = inputs
    ctx.args = (ignore_index, label_smoothing, z_loss, softcap)
    ctx.save_for_backward(logits, target, output[1])
    ctx.mark_non_differentiable(output[1])


def _ce_backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile, the plain impl in eager."""

    def _backward(ctx, dloss, _dlse):
        logits, target, lse = ctx.saved_tensors
        return bwd(dloss, logits, target, lse, *ctx.args), None, None, None, None, None

    return _backward


_ce_fwd_op.register_autograd(_ce_backward_with(_ce_bwd_op), setup_context=_ce_setup_context)
_CrossEntropyFunction = autograd_function(
    "_CrossEntropyFunction", _ce_fwd_impl, _ce_setup_context, _ce_backward_with(_ce_bwd_impl)
)


# --------------------------------------------------------------------------------------------
# Public function (and the argument checks it shares with fused_linear_cross_entropy)
# --------------------------------------------------------------------------------------------
def _check_common(op, target, n, device, ignore_index, reduction, label_smoothing, z_loss, softcap):
    check_tensor(op, "target", target, dtypes=_TARGET_DTYPES, ndim=1, device=device)
    check_shape(op, "target", target, (n,), "one class index per row")
    if not isinstance(ignore_index, int):
        raise ValueError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or z_loss < 0:
        raise ValueError(f"{op}: z_loss must be a non-negative float, got {z_loss!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < float("inf"):
        raise ValueError(f"{op}: softcap must be a finite float >= 0 (0 turns it off), got {softcap!r}")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` over class logits, gradients included, plus optional z-loss.

    Args:
        logits: (N, V) fp16, bf16 or fp32 (fp64 runs on the reference). A row-strided view is read
            in place.
        target: (N,) int64 or int32 class indices in [0, V), or ``ignore_index``.
        ignore_index: targets equal to it add nothing to the loss or gradient and are not counted
            by ``mean``.
        reduction: "mean" (over the targets not ignored), "sum" or "none" (per-row losses).
        label_smoothing: in [0, 1], as in torch.
        z_loss: weight of ``lse^2`` added to each row's loss (PaLM's z-loss); 0 turns it off.
        softcap: > 0 caps the logits first, ``softcap * tanh(logits / softcap)`` (Gemma 2's
            ``final_logit_softcapping``), the gradient taken through the cap; 0 turns it off.

    Returns:
        The loss in logits' dtype, accumulated in fp32: a scalar, or (N,) for "none". All targets
        ignored gives 0 for "mean" (torch gives NaN).
    """
    op = "cross_entropy"
    check_tensor(op, "logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    n, v = logits.shape
    _check_common(op, target, n, logits.device, ignore_index, reduction, label_smoothing, z_loss, softcap)
    backend = choose_backend(op, logits.device, logits.dtype in KERNEL_DTYPES, "float64 runs on the reference")
    if backend == "reference":
        return cross_entropy_ref(logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap=softcap)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    rows, _ = dispatch(
        _ce_fwd_op, _CrossEntropyFunction, _ce_fwd_impl, x, target.contiguous(), ignore_index,
        float(label_smoothing), float(z_loss), float(softcap),
    )  # fmt: skip
    if reduction == "none":
        return rows.to(logits.dtype)
    total = rows.sum()
    if reduction == "mean":
        total = total / (target != ignore_index).sum().clamp(min=1)
    return total.to(logits.dtype)
