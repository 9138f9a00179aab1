"""Rotary position embedding (RoPE), applied to a query or key tensor, with flash-attn's conventions.

For a token at position p (its index in its sequence plus the sequence's offset) and each pair
(x1, x2) of the first ``rotary_dim`` dims of every head:

    out1 = x1 * cos[p, i] - x2 * sin[p, i]
    out2 = x2 * cos[p, i] + x1 * sin[p, i]          i in [0, rotary_dim / 2)

The pairs are (i, i + rotary_dim/2) ("rotate half", GPT-NeoX / Llama) or, with ``interleaved``,
(2i, 2i + 1) (GPT-J). Dims past ``rotary_dim`` pass through unchanged (partial rotary).

Everything below autograd lives here (STYLE.md §1): the reference ``apply_rotary_ref``, the one
Triton kernel, the launchers ``apply_rotary_fwd``/``apply_rotary_bwd`` (no autograd; the engine
calls them), the ``torch.library`` registration with fake and autograd, and the public ``apply_rotary``.

Shapes: x (B, S, H, D), or packed varlen (T, H, D) with ``cu_seqlens`` (B + 1,) int32 and
``max_seqlen``; cos, sin (S_max, rotary_dim / 2). The kernel takes x's strides, so q or k sliced out
of a packed QKV tensor goes in without a copy as long as the last dim has unit stride.

Backward: the rotation is orthogonal, so dx is dout rotated by -p: the same kernel with sin negated
(the ``CONJUGATE`` switch). Gradients flow to x only: cos and sin are tables of constants and get none.

Host overhead: at the bench shape (q and k of B 8, S 4096, D 128 bf16) the two kernels take ~170 us,
and do_bench's L2 flush hides ~60 us of host time: tens of microseconds of Python per call showed on a
slow host (run 39: 3.35 TB/s against 3.93 of GPU time). The launch plan (config,
constexprs, grid's head blocks) is looked up once per shape bucket, switches, dtype and device, and the
kernel goes through ``_utils.Launcher`` (direct calls of the compiled kernel after the first launch).
One eager call with grad on an H200 host: 58 -> 32 us (no grad 45 -> 25 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    LaunchConfig,
    Launcher,
    as_dtype,
    autograd_function,
    check_tensor,
    dispatch,
    empty,
    float_dtype_of,
    launch_config,
    next_pow2,
    read_offsets,
)
from fuseformer.runtime import autotune
from fuseformer.runtime.backend import choose_backend, forced_backend

_OP = "apply_rotary"
_MAX_HEAD_DIM = 256
# CUDA caps grid dims y and z at 65535; the batch (sequences) goes on y.
_MAX_BATCH = 65535
# Rotary pairs a program handles: 4096 pairs = 16 KiB of bf16 read and 16 KiB written per program
# (2 tokens of a 32-head q, 8 tokens of an 8-head k at D 128). A guess from rms_norm's H200 sweep,
# where 16-32 KiB per program with 8 warps beat 8 KiB with 4 (4.03 vs 3.4 TB/s); not yet swept here.
_PAIRS_PER_PROGRAM = 4096


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def _positions(x: torch.Tensor, seqlen_offsets: int | torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The position of every token: (B, S) for x (B, S, H, D), (T,) for packed x (T, H, D)."""
    if cu_seqlens is None:
        b, s = x.shape[:2]
        pos = torch.arange(s, device=x.device).expand(b, s)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=x.device, dtype=torch.int64)[:, None]
        return pos + seqlen_offsets
    cu = cu_seqlens.to(torch.int64)
    tok = torch.arange(x.shape[0], device=x.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)  # (T,) the sequence each token belongs to
    pos = tok - cu[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=x.device, dtype=torch.int64)[seq]
    return pos + seqlen_offsets


def apply_rotary_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Pure PyTorch rotary embedding, every mode of :func:`apply_rotary` (varlen included).

    Computes in fp32 (fp64 stays fp64) when ``upcast``, else in x's dtype (cos and sin cast to it).
    ``max_seqlen`` is accepted for signature parity and not needed here. Returns x's shape and dtype.
    """
    del max_seqlen
    dtype = x.dtype
    compute = float_dtype_of(x) if upcast else dtype
    half = cos.shape[-1]
    rot = 2 * half
    pos = _positions(x, seqlen_offsets, cu_seqlens)
    c = cos[pos].to(compute).unsqueeze(-2)  # (..., 1, half), broadcast over heads
    s = sin[pos].to(compute).unsqueeze(-2)
    xr = x[..., :rot].to(compute)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return torch.cat((out.to(dtype), x[..., rot:]), dim=-1)


def _needs_grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def _apply_rotary_cpu(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    seqlen_offsets: int | torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """What the reference backend runs on CPU tensors (fp16, bf16, fp32) without autograd: the
    reference's arithmetic in fp32 written into one output (out= ops), instead of its cos/sin gathers
    (an int offset slices them), separate outputs and two cats. SmolLM-135M decode shape
    (1 token, 12 heads of 64), 1 thread, loaded 2-core machine, 2026-12-03: 306 -> 235 us a call of
    apply_rotary (checks included). Returns x's shape and dtype, contiguous."""
    half = cos.shape[-1]
    rot = 2 * half
    if cu_seqlens is None and not isinstance(seqlen_offsets, torch.Tensor):
        c, s = cos[seqlen_offsets : seqlen_offsets + x.shape[1]], sin[seqlen_offsets : seqlen_offsets + x.shape[1]]
    else:
        pos = _positions(x, seqlen_offsets, cu_seqlens)
        c, s = cos[pos], sin[pos]
    f32 = torch.float32
    c = as_dtype(c, f32).unsqueeze(-2)  # (S, 1, half) or (..., 1, half), broadcast over batch and heads
    s = as_dtype(s, f32).unsqueeze(-2)
    dtype, x = x.dtype, as_dtype(x, f32)
    out = torch.empty(x.shape, dtype=torch.float32)
    pairs = (slice(0, rot, 2), slice(1, rot, 2)) if interleaved else (slice(0, half), slice(half, rot))
    x1, x2 = x[..., pairs[0]], x[..., pairs[1]]
    o1, o2 = out[..., pairs[0]], out[..., pairs[1]]
    # The reference's roundings (product, product, sum), not addcmul's: bitwise equal to it.
    torch.mul(x1, c, out=o1).sub_(x2 * s)  # x1 c - x2 s
    torch.mul(x2, c, out=o2).add_(x1 * s)  # x2 c + x1 s
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return as_dtype(out, dtype)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _apply_rotary_kernel(
    X, OUT, COS, SIN, CU_SEQLENS, OFFSETS,
    stride_xb, stride_xs, stride_xh,
    stride_ob, stride_os, stride_oh,
    stride_cos, stride_sin,
    seqlen, nheads, seqlen_ro, offset,
    HALF: tl.constexpr, PASS: tl.constexpr,
    IS_VARLEN: tl.constexpr, OFFSETS_IS_TENSOR: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    # Program (m, b, h): tokens [m*BLOCK_M, +BLOCK_M) of sequence b, heads [h*BLOCK_H, +BLOCK_H).
    # Tile [BLOCK_M, BLOCK_H, BLOCK_K] of rotary pairs; cos/sin are loaded once per token and
    # broadcast over the heads.
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_h = tl.program_id(2)
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + pid_b)
        n_tok = tl.load(CU_SEQLENS + pid_b + 1) - start
        x_seq = X + start.to(tl.int64) * stride_xs
        o_seq = OUT + start.to(tl.int64) * stride_os
    else:
        n_tok = seqlen
        x_seq = X + pid_b.to(tl.int64) * stride_xb
        o_seq = OUT + pid_b.to(tl.int64) * stride_ob
    if OFFSETS_IS_TENSOR:
        off = tl.load(OFFSETS + pid_b).to(tl.int64)
    else:
        off = offset

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_tok
    rows = rows.to(tl.int64)  # row * stride can pass 2^31
    pos = rows + off
    # A position past the cos/sin table yields NaN rather than a read out of bounds. The public op
    # checks this on the host; only the launcher called directly, or under torch.compile / CUDA-graph
    # capture with tensor offsets (where the host check cannot run), can get here with one.
    pos_ok = row_mask & (pos >= 0) & (pos < seqlen_ro)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < nheads
    heads = heads.to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    k_mask = k < HALF

    cs_mask = pos_ok[:, None, None] & k_mask[None, None, :]
    cos = tl.load(COS + pos[:, None, None] * stride_cos + k[None, None, :], mask=cs_mask, other=float("nan"))
    sin = tl.load(SIN + pos[:, None, None] * stride_sin + k[None, None, :], mask=cs_mask, other=float("nan"))
    cos = cos.to(tl.float32)  # (BLOCK_M, 1, BLOCK_K)
    sin = sin.to(tl.float32)
    if CONJUGATE:
        sin = -sin

    x_tile = x_seq + rows[:, None, None] * stride_xs + heads[None, :, None] * stride_xh
    o_tile = o_seq + rows[:, None, None] * stride_os + heads[None, :, None] * stride_oh
    tile_mask = row_mask[:, None, None] & head_mask[None, :, None]
    mask = tile_mask & k_mask[None, None, :]
    if INTERLEAVED:
        # Pairs (2i, 2i+1): one contiguous load of the rotary dims, split into evens and odds in
        # registers (two stride-2 loads compile to scalar 2-byte accesses instead of 16-byte ones).
        cols = tl.arange(0, 2 * BLOCK_K)
        mask2 = tile_mask & (cols < 2 * HALF)[None, None, :]
        xx = tl.load(x_tile + cols[None, None, :], mask=mask2, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(xx, (BLOCK_M, BLOCK_H, BLOCK_K, 2)))
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        out = tl.reshape(tl.join(o1, o2), (BLOCK_M, BLOCK_H, 2 * BLOCK_K))
        tl.store(o_tile + cols[None, None, :], out.to(OUT.dtype.element_ty), mask=mask2)
    else:
        x1 = tl.load(x_tile + k[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_tile + HALF + k[None, None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(o_tile + k[None, None, :], o1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_tile + HALF + k[None, None, :], o2.to(OUT.dtype.element_ty), mask=mask)

    if PASS > 0:
        # Dims [2*HALF, 2*HALF + PASS) are copied unchanged.
        p = 2 * HALF + tl.arange(0, BLOCK_P)
        p_mask = tile_mask & (tl.arange(0, BLOCK_P) < PASS)[None, None, :]
        xp = tl.load(x_tile + p[None, None, :], mask=p_mask, other=0.0)
        tl.store(o_tile + p[None, None, :], xp, mask=p_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
KERNEL = "rotary"
# What the autotune cache chooses; BLOCK_K and BLOCK_P are set by the shape (a tile covers the pairs
# and the pass-through dims).
_FIELDS = ("BLOCK_M", "BLOCK_H", "num_warps")


def _config(seqlen: int, nheads: int, half: int, passthrough: int) -> dict:
    """Tile sizes: all heads of a token in one program where they fit, several tokens per program
    when a token's heads are few (GQA keys), up to _PAIRS_PER_PROGRAM pairs a program."""
    block_k = next_pow2(half)
    block_h = min(next_pow2(nheads), max(1, _PAIRS_PER_PROGRAM // block_k))
    block_m = max(1, min(16, _PAIRS_PER_PROGRAM // (block_h * block_k), next_pow2(max(seqlen, 1))))
    block_p = next_pow2(passthrough) if passthrough > 0 else 1
    pairs = block_m * block_h * block_k
    num_warps = 2 if pairs <= 512 else 4 if pairs <= 2048 else 8
    return dict(BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_P=block_p, num_warps=num_warps)


def _seqlen_bucket(seqlen: int) -> int:
    """Tokens as the config sees them: the next power of two, 16 at most (BLOCK_M's cap)."""
    return 16 if seqlen > 8 else next_pow2(max(seqlen, 1))  # per call: no min() for the common case


def config_key(seqlen_bucket: int, nheads: int, half: int, passthrough: int, dtype: torch.dtype) -> str:
    """The autotune key: tokens (bucket, up to 16), heads, rotary pairs and pass-through dims
    (buckets; the default depends on nothing finer), dtype."""
    p = next_pow2(passthrough) if passthrough > 0 else 0
    return f"S{seqlen_bucket}-H{next_pow2(nheads)}-K{next_pow2(half)}-P{p}-{autotune.dtype_name(dtype)}"


@autotune.plan_cache
def rotary_config(
    seqlen_bucket: int, nheads: int, half: int, passthrough: int, dtype: torch.dtype, device: torch.device | str | None
) -> dict:
    """The launch config (BLOCK_M, BLOCK_H, BLOCK_K, BLOCK_P, num_warps) for ``seqlen_bucket``
    (:func:`_seqlen_bucket`) tokens, looked up once per shape bucket, dtype and device: the
    autotune cache's tile and warps, else the default rule."""
    cfg = _config(seqlen_bucket, nheads, half, passthrough)
    stored = autotune.get_config(
        KERNEL, config_key(seqlen_bucket, nheads, half, passthrough, dtype), device=device, fields=_FIELDS
    )
    return {**cfg, **stored} if stored is not None else cfg


# The per-call launch plan: everything a launch needs that depends only on the shape bucket, the
# switches, the dtype and the device, computed once (the autotune lookup happens here, never per call).
@autotune.plan_cache
def _plan(
    seqlen_bucket: int,
    nheads: int,
    half: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
    varlen: bool,
    offsets_is_tensor: bool,
    interleaved: bool,
    conjugate: bool,
) -> tuple[LaunchConfig, int, int]:
    """(launch config, BLOCK_M, head blocks: the grid's z) of the kernel."""
    cfg = rotary_config(seqlen_bucket, nheads, half, d - 2 * half, dtype, device)
    return _launch_plan(cfg, nheads, half, d, varlen, offsets_is_tensor, interleaved, conjugate)


def _launch_plan(
    cfg: dict,
    nheads: int,
    half: int,
    d: int,
    varlen: bool,
    offsets_is_tensor: bool,
    interleaved: bool,
    conjugate: bool,
) -> tuple[LaunchConfig, int, int]:
    launch = launch_config(
        HALF=half, PASS=d - 2 * half, IS_VARLEN=varlen, OFFSETS_IS_TENSOR=offsets_is_tensor,
        INTERLEAVED=interleaved, CONJUGATE=conjugate, **cfg,
    )  # fmt: skip
    return launch, cfg["BLOCK_M"], (nheads + cfg["BLOCK_H"] - 1) // cfg["BLOCK_H"]


# --------------------------------------------------------------------------------------------
# Launchers (no autograd; inputs already checked; the last dim of x has unit stride)
# --------------------------------------------------------------------------------------------
def apply_rotary_fwd(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
    conjugate: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """x (B, S, H, D) or packed (T, H, D) with cu_seqlens (B + 1,) int32 and max_seqlen -> out, a new
    contiguous tensor of x's shape and dtype. ``conjugate`` rotates by -p (sin negated): the backward.

    cos, sin (S_max, rotary_dim / 2), contiguous in the last dim; seqlen_offsets an int or a (B,)
    int32/int64 tensor. Positions past S_max give NaN (no out-of-bounds read); nothing else is checked.
    ``config`` overrides the launch configuration (BLOCK_M, BLOCK_H, BLOCK_K, BLOCK_P, num_warps);
    for tuning sweeps.
    """
    shape = x.shape
    out = empty(shape, dtype=x.dtype, device=x.device)
    nheads, d = shape[-2], shape[-1]
    varlen = cu_seqlens is not None
    if varlen:
        assert max_seqlen is not None and len(shape) == 3
        batch, seqlen = cu_seqlens.shape[0] - 1, int(max_seqlen)
    else:
        assert len(shape) == 4
        batch, seqlen = shape[0], shape[1]
    if batch == 0 or seqlen == 0 or 0 in shape:
        return out
    sx, sc, ss = x.stride(), cos.stride(), sin.stride()  # one call each: x.stride(i) costs as much
    assert sx[-1] == 1 and sc[1] == 1 and ss[1] == 1
    half = cos.shape[1]
    # Strides (b, s, h) of x and out; out is fresh and contiguous, its strides follow from the shape.
    if varlen:
        ints = [0, sx[0], sx[1], 0, nheads * d, d]
    else:
        ints = [sx[0], sx[1], sx[2], seqlen * nheads * d, nheads * d, d]
    offsets_is_tensor = isinstance(seqlen_offsets, torch.Tensor)
    interleaved, conjugate = bool(interleaved), bool(conjugate)
    if config is None:
        cfg, block_m, head_blocks = _plan(
            _seqlen_bucket(seqlen), nheads, half, d, x.dtype, x.device, varlen, offsets_is_tensor, interleaved, conjugate
        )  # fmt: skip
    else:  # sweeps: the given tile and warps
        cfg, block_m, head_blocks = _launch_plan(
            config, nheads, half, d, varlen, offsets_is_tensor, interleaved, conjugate
        )
    ints += (sc[0], ss[0], seqlen, nheads, cos.shape[0], 0 if offsets_is_tensor else int(seqlen_offsets))
    # Absent optional pointers: x stands in (never read; the constexpr switches are off).
    tensors = (
        x, out, cos, sin,
        cu_seqlens if varlen else x,
        seqlen_offsets if offsets_is_tensor else x,
    )  # fmt: skip
    _launcher(((seqlen + block_m - 1) // block_m, batch, head_blocks), cfg, tensors, ints)
    return out


_launcher = Launcher(_apply_rotary_kernel)


def apply_rotary_bwd(
    dout: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """dout (like x) -> dx: the forward kernel rotating by -p (the inverse, since R(p) is orthogonal)."""
    return apply_rotary_fwd(dout, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, conjugate=True)


# --------------------------------------------------------------------------------------------
# Registration: a custom op for torch.compile (opaque, with fake and autograd), and the same
# pieces as an autograd.Function for eager calls (far less host overhead); see _utils.dispatch.
# --------------------------------------------------------------------------------------------
def _fwd_impl(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    interleaved: bool,
    conjugate: bool,
) -> torch.Tensor:
    # A custom op's argument has one type: the int and the tensor form of seqlen_offsets come apart.
    seqlen_offsets = offsets if offsets is not None else offset
    return apply_rotary_fwd(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, conjugate)


_apply_rotary_op = torch.library.custom_op("fuseformer::apply_rotary", mutates_args=())(_fwd_impl)


@_apply_rotary_op.register_fake
def _(x, cos, sin, offsets, offset, cu_seqlens, max_seqlen, interleaved, conjugate):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, cos, sin, offsets, offset, cu_seqlens, max_seqlen, interleaved, conjugate = inputs
    ctx.save_for_backward(cos, sin, offsets, cu_seqlens)
    ctx.args = (offset, max_seqlen, interleaved, conjugate)


def _backward_with(fwd):
    """The backward, running the rotation by -p through ``fwd``: the custom op for the custom op's
    autograd (so that any tracer, torch.compile's or aot_function's, sees an opaque op), the plain
    implementation for the eager autograd.Function."""

    def backward(ctx, dout):
        cos, sin, offsets, cu_seqlens = ctx.saved_tensors
        offset, max_seqlen, interleaved, conjugate = ctx.args
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dx = fwd(dout, cos, sin, offsets, offset, cu_seqlens, max_seqlen, interleaved, not conjugate)
        # No gradient for cos and sin (constant tables), nor for the integer arguments.
        return dx, None, None, None, None, None, None, None, None

    return backward


_apply_rotary_op.register_autograd(_backward_with(_apply_rotary_op), setup_context=_setup_context)
_ApplyRotaryFunction = autograd_function("_ApplyRotaryFunction", _fwd_impl, _setup_context, _backward_with(_fwd_impl))


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------
def _can_read_device_values(t: torch.Tensor) -> bool:
    """Whether checks may read tensor values on the host (a sync): not while torch.compile traces
    nor while a CUDA graph is captured."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_inputs(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen) -> int | None:
    """Raise ValueError naming the bad argument; return max_seqlen (computed when varlen and None)."""
    varlen = cu_seqlens is not None
    check_tensor(_OP, "x", x, dtypes=FLOAT_DTYPES)
    if varlen and x.dim() != 3:
        raise ValueError(f"{_OP}: x must have 3 dims (T, H, D) with cu_seqlens, got shape {tuple(x.shape)}")
    if not varlen and x.dim() != 4:
        raise ValueError(
            f"{_OP}: x must have 4 dims (B, S, H, D) without cu_seqlens (3 dims (T, H, D) need cu_seqlens), "
            f"got shape {tuple(x.shape)}"
        )
    d = x.shape[-1]
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"{_OP}: head dim {d} of x is above the supported {_MAX_HEAD_DIM}")
    device = x.device  # read once: each x.device builds a new torch.device
    check_tensor(_OP, "cos", cos, dtypes=FLOAT_DTYPES, ndim=2, device=device)
    check_tensor(_OP, "sin", sin, dtypes=FLOAT_DTYPES, ndim=2, device=device)
    if sin.shape != cos.shape:
        raise ValueError(f"{_OP}: sin has shape {tuple(sin.shape)}; expected {tuple(cos.shape)} (the shape of cos)")
    if sin.dtype != cos.dtype:
        raise ValueError(f"{_OP}: sin has dtype {sin.dtype}; expected {cos.dtype} (the dtype of cos)")
    half = cos.shape[1]
    if half == 0 or 2 * half > d:
        raise ValueError(
            f"{_OP}: cos has shape {tuple(cos.shape)}, so rotary_dim = 2 * {half} = {2 * half}; "
            f"expected 2 <= rotary_dim <= head dim {d} of x"
        )
    if not isinstance(interleaved, bool):
        raise ValueError(f"{_OP}: interleaved must be a bool, got {interleaved!r}")

    if varlen:
        check_tensor(_OP, "cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1, device=device)
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"{_OP}: cu_seqlens must have B + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)):
            raise ValueError(f"{_OP}: max_seqlen must be an int, got {max_seqlen!r}")
    elif max_seqlen is not None:
        raise ValueError(f"{_OP}: max_seqlen is only used with cu_seqlens (packed x), got {max_seqlen!r}")
    batch = cu_seqlens.shape[0] - 1 if varlen else x.shape[0]
    if batch > _MAX_BATCH:
        raise ValueError(f"{_OP}: batch {batch} is above the supported {_MAX_BATCH} sequences")

    if isinstance(seqlen_offsets, torch.Tensor):
        check_tensor(_OP, "seqlen_offsets", seqlen_offsets, dtypes=(torch.int32, torch.int64), device=device)
        if tuple(seqlen_offsets.shape) != (batch,):
            raise ValueError(
                f"{_OP}: seqlen_offsets has shape {tuple(seqlen_offsets.shape)}; expected ({batch},) (one per sequence)"
            )
    elif isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
        raise ValueError(f"{_OP}: seqlen_offsets must be an int or a (B,) int tensor, got {seqlen_offsets!r}")
    elif seqlen_offsets < 0:
        raise ValueError(f"{_OP}: seqlen_offsets must be >= 0, got {seqlen_offsets}")

    # Checks that read device values (a host sync): skipped while compiling or capturing a CUDA graph,
    # where the kernel still never reads out of bounds (positions past cos give NaN). Only varlen and
    # tensor offsets have any: the common call (int offset) skips the probe.
    offsets_is_tensor = isinstance(seqlen_offsets, torch.Tensor)
    host = (varlen or offsets_is_tensor) and _can_read_device_values(x)
    if varlen:
        if host:
            last, longest = read_offsets(_OP, "cu_seqlens", cu_seqlens)  # read once per unchanged tensor
            if last != x.shape[0]:
                raise ValueError(f"{_OP}: cu_seqlens ends at {last}; expected the token count {x.shape[0]} of x")
            if max_seqlen is None:
                max_seqlen = longest
            elif max_seqlen < longest:
                raise ValueError(f"{_OP}: max_seqlen {max_seqlen} is below the longest sequence {longest}")
        elif max_seqlen is None:
            raise ValueError(f"{_OP}: pass max_seqlen with cu_seqlens under torch.compile or CUDA-graph capture")
    if offsets_is_tensor:
        if not host or seqlen_offsets.numel() == 0:
            return max_seqlen
        lo, hi = torch.stack(torch.aminmax(seqlen_offsets)).tolist()  # one sync for both
        if lo < 0:
            raise ValueError(f"{_OP}: seqlen_offsets must be >= 0, got a minimum of {lo}")
    else:
        hi = seqlen_offsets
    length = max_seqlen if varlen else x.shape[1]
    if length > 0 and length + hi > cos.shape[0]:
        raise ValueError(
            f"{_OP}: cos and sin have {cos.shape[0]} positions but the input needs {length + hi} "
            f"(seqlen {length} + max seqlen_offsets {hi})"
        )
    return max_seqlen


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Rotary position embedding, as flash-attn's ``apply_rotary_emb`` (not in place).

    Args:
        x: (B, S, H, D), or packed (T, H, D) with ``cu_seqlens``; fp16, bf16 or fp32 (fp64 runs on
            the reference). Any strides with a unit-stride last dim are read without a copy (e.g. q
            sliced out of a packed (B, S, 3, H, D) QKV tensor). D <= 256.
        cos, sin: (S_max, rotary_dim / 2), one dtype (fp32 recommended; the kernel computes in fp32).
            rotary_dim = 2 * cos.shape[1] <= D; dims past rotary_dim are passed through unchanged.
        interleaved: False rotates pairs (i, i + rotary_dim/2) (GPT-NeoX, Llama); True rotates pairs
            (2i, 2i + 1) (GPT-J).
        seqlen_offsets: int, or (B,) int32/int64 tensor: the position of each sequence's first token
            (decode with a KV cache). Positions S + offset (max_seqlen + offset when packed) must fit
            in cos; with a tensor this check reads its max on the host (a sync; skipped while
            torch.compile traces or a CUDA graph is captured, where an out-of-range position gives NaN).
        cu_seqlens: (B + 1,) int32, starting at 0, non-decreasing, ending at T: the sequence
            boundaries of packed x. Checked on the host (a sync, once per unchanged tensor).
        max_seqlen: the longest sequence of packed x; computed from cu_seqlens when None (a sync;
            required under torch.compile).

    Returns:
        A new tensor of x's shape and dtype (contiguous). Differentiable in x only: cos and sin get
        no gradient.
    """
    max_seqlen = _check_inputs(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen)
    supported = x.dtype in KERNEL_DTYPES and cos.dtype in KERNEL_DTYPES
    backend = choose_backend(_OP, x.device, supported, "float64 runs on the reference")
    if backend == "reference":
        if x.is_cpu and x.dtype in KERNEL_DTYPES and forced_backend() is None and not _needs_grad(x):
            return _apply_rotary_cpu(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens)
        return apply_rotary_ref(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen)

    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    offsets = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else None
    offset = 0 if offsets is not None else int(seqlen_offsets)
    max_seqlen = int(max_seqlen) if max_seqlen is not None else 0
    args = (x, cos, sin, offsets, offset, cu_seqlens, max_seqlen, interleaved, False)
    return dispatch(_apply_rotary_op, _ApplyRotaryFunction, _fwd_impl, *args)
