"""Cross-entropy fused with the linear layer (LM head) before it: reference, launchers, registration, op.

    loss = cross_entropy(hidden @ weight.T + bias, target, ...)      (ops/cross_entropy.py has the formulas)

hidden (N, H), weight (V, H), bias (V,): logits = hidden @ weight.T never exist for all N tokens at
once. The tokens are processed in chunks of C (C x V logits, about the size of the hidden states): per
chunk the logits come from cuBLAS into one buffer reused by every chunk (with grad_hidden to compute,
an arena shared with grad_hidden, so that chunks also use its rows not yet written: see
``_growing_chunks``; with grad_weight to compute, the first min(N, H) tokens are one chunk whose logits
lie, transposed, in grad_weight's memory: ``_first_chunk_in_dw``), the cross-entropy kernel
(cross_entropy.py) overwrites them with dlogits (scaled by 1/n for ``mean``), then grad_hidden[chunk] =
dlogits @ weight and grad_weight += dlogits.T @ hidden[chunk] (grad_bias += column sums): all in the
forward, as Liger does, so the backward only multiplies by the incoming scalar gradient. For
``reduction="none"`` the incoming gradient differs per token, and grad_weight = sum_i g_i dlogits_i^T h_i
cannot be formed before it is known: the forward then computes only the losses, and the backward
recomputes the chunks with dlogits scaled by g_i (one extra logits GEMM, exact gradients; Liger's FLCE
has given wrong ones there).

Everything below autograd lives here (STYLE.md §1): the reference ``fused_linear_cross_entropy_ref``,
the launchers ``fused_linear_cross_entropy_fwd``/``_bwd`` (no autograd), the in-place gradient scaling
kernel of the eager backward, the ``torch.library`` registration and the public
``fused_linear_cross_entropy``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    autocast_inputs,
    check_shape,
    check_tensor,
    dispatch,
    empty,
    float_dtype_of,
    sm_count,
)
from fuseformer.ops.cross_entropy import _check_common, _launch, _launch_cols, cross_entropy_ref
from fuseformer.runtime.backend import INTERPRET, choose_backend

# The FLCE chunk may hold up to 15/16 of this many bytes of logits even when the hidden states are
# smaller (see _chunk_size): small inputs still get GEMM-sized chunks.
_MIN_CHUNK_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def fused_linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    upcast: bool = True,
    softcap: float = 0.0,
) -> torch.Tensor:
    """cross_entropy_ref(hidden @ weight.T + bias, ...) with the logits fully materialized.

    hidden (..., H), target hidden's leading shape; "none" returns that leading shape."""
    dtype, lead = hidden.dtype, tuple(hidden.shape[:-1])
    compute = float_dtype_of(hidden) if upcast else dtype
    logits = hidden.reshape(-1, hidden.shape[-1]).to(compute) @ weight.to(compute).T
    if bias is not None:
        logits = logits + bias.to(compute)
    loss = cross_entropy_ref(
        logits, target.reshape(-1), ignore_index, reduction, label_smoothing, z_loss, upcast=False, softcap=softcap
    )
    return loss.to(dtype).view(lead) if reduction == "none" else loss.to(dtype)


# --------------------------------------------------------------------------------------------
# Launchers (no autograd)
# --------------------------------------------------------------------------------------------
def _chunk_size(n: int, h: int, v: int, element_size: int) -> int:
    """Tokens per chunk: C x V logits of at most 15/16 of the hidden states' size (or of
    _MIN_CHUNK_BYTES, if larger), in chunks of equal size. At the goal shape (8192 tokens, H 4096,
    V 128256) that is 34 chunks of 241 tokens: grad_weight + grad_hidden + one chunk = 1.098 GiB (a
    power-of-two 256 made it 1.102)."""
    per_token = v * element_size
    budget = max(n * h * element_size, _MIN_CHUNK_BYTES) * 15 // 16
    c_max = max(1, min(n, budget // per_token))
    chunks = triton.cdiv(n, c_max)
    return triton.cdiv(n, chunks) if n else 1


# Offsets of each chunk's logits in the shared arena are rounded up to this many elements (>= 128
# bytes for every dtype here): cuBLAS and the CE kernel read them as well aligned rows.
_ARENA_ALIGN = 64


# Growing chunks are multiples of this many tokens (but the last), for the GEMMs.
_CHUNK_ALIGN = 16


def _growing_chunks(n: int, h: int, v: int, scratch: int, first: int = 0) -> list[tuple[int, int, int]]:
    """(start, end, logits offset) of each chunk when grad_hidden and the logits share one arena:
    grad_hidden's n x h elements first, then ``scratch`` (+ ``_ARENA_ALIGN``) more. Chunk [s, e) writes grad_hidden rows
    s..e-1 (at the end of the chunk); its (e - s, V) logits start at the arena's first aligned
    element past row e - 1, so they fill the scratch *and* the rows no chunk has written yet. Early
    chunks are larger than ``scratch // v`` tokens, late ones about as large: fewer chunks, and each
    chunk reads and writes grad_weight once.

    At the goal shape (8192 tokens, H 4096, V 128256; scratch = 241 tokens of logits) the chunks
    run from 480 tokens down to 224: 24 instead of 34 (grad_weight's read and write is ~2.1 GB a
    chunk: ~0.78 ms of cuBLAS's ~1.7 ms a chunk on the H200, run 15). Sizes are multiples of 16
    tokens (but the last), for the GEMMs. ``first``: the tokens before it are done (by
    :func:`_first_chunk_in_dw`)."""
    total = n * h + scratch + _ARENA_ALIGN  # the arena's size: the slack absorbs the alignment
    out = []
    s = first
    while s < n:
        c = min(n - s, max(1, (total - s * h) // (v + h)))
        if c < n - s and c > _CHUNK_ALIGN:
            c -= c % _CHUNK_ALIGN
        while c > 1:
            off = -(-(s + c) * h // _ARENA_ALIGN) * _ARENA_ALIGN
            if off + c * v <= total:
                break
            c -= 1
        off = -(-(s + c) * h // _ARENA_ALIGN) * _ARENA_ALIGN
        out.append((s, s + c, off))
        s += c
    return out


def _growing_plan(n: int, h: int, v: int, c: int, first: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Tokens of logits scratch for the growing chunks and the chunks (:func:`_growing_chunks`): ``c``,
    or c + c // 64 where that saves a chunk (two plans computed, at most). At the goal shape (8192
    tokens, H 4096, V 128256) 244 instead of 241 tokens take the 4096 tokens past the first chunk in 14
    chunks instead of 15, whose last had 32 tokens yet streamed all of W twice and read and wrote all
    of grad_weight (~1 ms); +0.7 MB, a peak of 1.0994 GiB."""
    plan = _growing_chunks(n, h, v, c * v, first)
    more = c + c // 64
    if more > c:
        bigger = _growing_chunks(n, h, v, more * v, first)
        if len(bigger) < len(plan):
            return more, bigger
    return c, plan


def _first_chunk_in_dw(
    hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, scale, loss, lse, dh, dw, db, spare, c,
    softcap=0.0,
):  # fmt: skip
    """Tokens [0, c) (c <= H) as one chunk whose logits live in grad_weight's memory, before any of
    grad_weight is written: transposed, (V, c), so that vocabulary row j of the logits lies inside
    grad_weight's row j (c <= H elements of its H). Then:
      logits^T = W @ h_c^T (+ bias), the CE kernel on columns (dlogits^T in place),
      grad_hidden[:c] = dlogits @ W, grad_bias += row sums,
      grad_weight = dlogits^T @ h_c in slices of vocabulary rows, each computed into ``spare`` and
      copied into place, from the last slice to the first: grad_weight rows [j0, j1) cover logits
      rows >= j0 only, all of them consumed by then.
    grad_weight is written once, never read and written back: the pass over it that every chunk of
    the growing schedule pays (~0.8 ms at the goal shape) is saved for the c tokens, at the cost of
    one copy of it (~0.5 ms). At the goal shape c = 4096: half the tokens."""
    v, h = dw.shape
    h_c = hidden[:c]
    lt = dw.view(-1)[: v * c].view(v, c)  # (V, c) logits^T in grad_weight's memory
    torch.matmul(weight, h_c.T, out=lt)
    if bias is not None:
        lt += bias[:, None]
    s_c = scale[:c] if scale.dim() else scale
    # The spare room is free until the grad_weight slices: the CE kernels' partials go there.
    _launch_cols(lt, target[:c], loss[:c] if loss is not None else None, lse[:c], s_c, ignore_index,
                 label_smoothing, z_loss, write_loss=loss is not None, write_grad=True, scratch=spare,
                 softcap=softcap)  # fmt: skip
    if dh is not None:
        torch.matmul(lt.T, weight, out=dh[:c])  # (c, H)
    if db is not None:
        db += lt.sum(1, dtype=torch.float32)
    if spare.numel() < h:  # tiny problems (a few tokens of a tiny vocabulary): one row's room
        spare = torch.empty(h, dtype=dw.dtype, device=dw.device)
    rows = spare.numel() // h
    for j0 in reversed(range(0, v, rows)):
        j1 = min(v, j0 + rows)
        tmp = spare[: (j1 - j0) * h].view(j1 - j0, h)
        torch.matmul(lt[j0:j1], h_c, out=tmp)  # (rows, H)
        dw[j0:j1].copy_(tmp)


def _chunks(
    hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, scale, loss, lse, want_dh, dw, db, chunk_size,
    softcap=0.0,
):  # fmt: skip
    """Run the chunked pass: per chunk logits, the kernel (loss and/or dlogits in place), the
    gradient GEMMs. ``scale`` (N,) or a 0-dim tensor scales dlogits per row (None: no gradient).
    Returns grad_hidden (N, H) when ``want_dh`` (with a gradient to compute), else None.

    Memory: one allocation for the logits of every chunk. With a gradient to compute and no
    ``chunk_size`` given:
    - with grad_weight to compute, the first min(N, H) tokens are one chunk in grad_weight's memory
      (:func:`_first_chunk_in_dw`);
    - with grad_hidden to compute, grad_hidden and the logits scratch share one arena and the chunks
      grow into grad_hidden's unwritten rows (:func:`_growing_chunks`); grad_hidden is then a view of
      the arena, which stays allocated (its scratch part included: the size of one chunk of logits)
      while grad_hidden lives.
    Otherwise one (C, V) buffer serves every chunk: ``logits = h_c @ W.T`` per chunk would allocate
    the next chunk while the previous one is still bound (two chunks at the peak, +63 MiB at the goal
    shape)."""
    n, h = hidden.shape
    v = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    c = chunk_size or _chunk_size(n, h, v, hidden.element_size())
    write_grad = scale is not None
    default = write_grad and chunk_size is None and n > 0  # the first chunk and growing chunks apply
    first = min(n, h) if default and dw is not None else 0
    if default and want_dh:
        c, growing = _growing_plan(n, h, v, c, first)
    arena = empty((n * h + c * v + _ARENA_ALIGN,), dtype=dtype, device=device) if default and want_dh else None
    dh = None
    if arena is not None:
        dh = arena[: n * h].view(n, h)
    elif want_dh and write_grad:
        dh = empty((n, h), dtype=dtype, device=device)
    buf = empty((min(c, n), v), dtype=dtype, device=device) if arena is None and n else None
    if first:
        # Room for _first_chunk_in_dw's grad_weight slices: grad_hidden's rows past the first chunk and
        # the scratch, or the logits buffer.
        spare = arena[first * h :] if arena is not None else buf.view(-1)
        _first_chunk_in_dw(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, scale, loss, lse,
                           dh, dw, db, spare, first, softcap=softcap)  # fmt: skip
    if arena is not None:
        plan = [(s, e, arena[off : off + (e - s) * v].view(e - s, v))
                for s, e, off in growing]  # fmt: skip
    else:
        plan = [(s, min(n, s + c), buf[: min(n, s + c) - s]) for s in range(first, n, c)]
    for start, end, out in plan:
        h_c = hidden[start:end]
        logits = torch.matmul(h_c, weight.T, out=out)  # (C, V)
        if bias is not None:
            logits += bias
        s_c = None
        if write_grad:
            s_c = scale[start:end] if scale.dim() else scale
        _launch(logits, target[start:end], loss[start:end] if loss is not None else None, lse[start:end],
                logits if write_grad else None, s_c, ignore_index, label_smoothing, z_loss,
                lse_given=False, write_loss=loss is not None, write_grad=write_grad, softcap=softcap)  # fmt: skip
        if not write_grad:
            continue
        if dh is not None:
            torch.matmul(logits, weight, out=dh[start:end])  # (C, H)
        if dw is not None:
            # Triton kernels for this update ran slower than cuBLAS's 0.81-0.84 ms a chunk: pointer
            # loads 1.38 ms (2026-11-30); TMA descriptors, 14 tiles / stage counts / persistent or not,
            # C loaded before or after the K loop, 0.94-1.50 ms (run 75, 2026-12-01); a one-partition
            # Gluon kernel 0.85-1.07 (run 79); a warp-specialized Gluon kernel 0.69-0.82 alone, but the
            # whole FLCE 0.7-2 ms slower with it (run 87: the H200 at its power cap). cuBLAS it is.
            if start == 0:
                torch.matmul(logits.T, h_c, out=dw)  # (V, H)
            else:
                dw.addmm_(logits.T, h_c)
        if db is not None:
            db += logits.sum(0, dtype=torch.float32)
    return dh


def fused_linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    chunk_size: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """hidden (N, H), weight (V, H), target (N,), bias (V,) -> (loss, dhidden, dweight, dbias).

    loss: fp32, a 0-dim tensor (mean/sum) or (N,) (none). The gradients (for a unit gradient of
    the loss; None when not asked for) are computed here for mean and sum; for ``none`` they are
    left to :func:`fused_linear_cross_entropy_bwd`, which needs the per-token gradient. Contiguous
    inputs. ``chunk_size`` overrides the tokens per chunk; ``softcap`` > 0 caps the logits first.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    loss = empty((n,), dtype=torch.float32, device=dev)
    lse = empty((n,), dtype=torch.float32, device=dev)
    valid = (target != ignore_index).sum()
    count = valid.clamp(min=1).to(torch.float32)
    wants_grad = reduction != "none" and (grad_hidden or grad_weight or grad_bias)
    scale = None
    if wants_grad:
        scale = 1.0 / count if reduction == "mean" else torch.ones((), dtype=torch.float32, device=dev)
    dw = empty((v, h), dtype=weight.dtype, device=dev) if wants_grad and grad_weight else None
    db = torch.zeros((v,), dtype=torch.float32, device=dev) if wants_grad and grad_bias else None
    if dw is not None and n == 0:
        dw.zero_()
    dh = _chunks(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, scale, loss, lse,
                 wants_grad and grad_hidden, dw, db, chunk_size, softcap=softcap)  # fmt: skip
    if reduction != "none":
        loss = loss.sum()
        if reduction == "mean":
            loss = loss / count
    if db is not None:
        db = db.to(bias.dtype)
    return loss, dh, dw, db


def fused_linear_cross_entropy_bwd(
    dloss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    chunk_size: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients for ``reduction="none"``: dloss (N,) -> dhidden, dweight, dbias (None when not
    asked for), recomputing each chunk's logits with dlogits scaled by dloss per token."""
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    lse = empty((n,), dtype=torch.float32, device=dev)
    dw = empty((v, h), dtype=weight.dtype, device=dev) if grad_weight else None
    db = torch.zeros((v,), dtype=torch.float32, device=dev) if grad_bias else None
    if dw is not None and n == 0:
        dw.zero_()
    dh = _chunks(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, dloss.to(torch.float32), None,
                 lse, grad_hidden, dw, db, chunk_size, softcap=softcap)  # fmt: skip
    return dh, dw, (db.to(bias.dtype) if db is not None else None)


# --------------------------------------------------------------------------------------------
# Registration. The forward returns the gradients it computed (mean and
# sum) as extra, non-differentiable outputs; the backward scales them by the incoming gradient.
# --------------------------------------------------------------------------------------------
_FLAGS = ("grad_hidden", "grad_weight", "grad_bias")


def _flce_fwd_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    chunk_size: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, dh, dw, db = fused_linear_cross_entropy_fwd(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss,
        grad_hidden, grad_weight, grad_bias, chunk_size or None, softcap,
    )  # fmt: skip
    # A custom op cannot return None: an empty tensor stands for "not computed".
    return loss, *(t if t is not None else hidden.new_empty(0) for t in (dh, dw, db))


def _flce_bwd_impl(
    dloss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    dh: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    chunk_size: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flags = (grad_hidden, grad_weight, grad_bias)
    if reduction == "none":
        grads = fused_linear_cross_entropy_bwd(
            dloss, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, *flags, chunk_size or None,
            softcap,
        )  # fmt: skip
    else:
        g = dloss.to(torch.float32)
        grads = tuple(t * g if flag else None for t, flag in zip((dh, dw, db), flags))
    return tuple(t if t is not None else hidden.new_empty(0) for t in grads)


@triton.jit
def _scale_unless_one_kernel(X, G, N, BLOCK: tl.constexpr):
    # X *= g in place, computed in fp32, unless g == 1: then nothing is read or written. The
    # common case (loss.backward() on the loss itself) thus costs a launch instead of a pass over
    # grad_weight (2.1 GB read and written at V 128256, H 4096 bf16: ~0.5 ms), with no host sync.
    g = tl.load(G).to(tl.float32)
    if g != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, N, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < N
            x = tl.load(X + offs, mask=mask)
            tl.store(X + offs, (x.to(tl.float32) * g).to(x.dtype), mask=mask)


_SCALE_BLOCK = 4096


def _scale_unless_one_(t: torch.Tensor, g: torch.Tensor) -> None:
    """``t *= g`` in place (``t`` contiguous, ``g`` a 0-dim fp32 tensor on its device), skipped on the
    device when g is 1 (the kernel, on a GPU or interpreted), else torch's ``mul_``."""
    if t.numel() == 0:
        return
    if not (t.is_cuda or INTERPRET) or not t.is_contiguous():
        t.mul_(g)
        return
    programs = min(triton.cdiv(t.numel(), _SCALE_BLOCK), 8 * sm_count(t))
    _scale_unless_one_kernel[(programs,)](t, g, t.numel(), BLOCK=_SCALE_BLOCK, num_warps=8)
    # As mul_ would: autograd's check that a saved tensor was not modified sees the write.
    torch.autograd.graph.increment_version(t)


def _flce_bwd_inplace(dloss, hidden, weight, target, bias, dh, dw, db, ignore_index, reduction, *rest):
    """Eager backward: for mean/sum scale the saved gradients in place (grad_weight is as large as
    the weight; a scaled copy would double the peak memory), skipping the pass on the device when
    the incoming gradient is 1. A second backward through the same graph then raises autograd's
    in-place error instead of returning twice-scaled gradients."""
    if reduction == "none":
        return _flce_bwd_impl(dloss, hidden, weight, target, bias, dh, dw, db, ignore_index, reduction, *rest)
    g = dloss.to(torch.float32)
    for t in (dh, dw, db):
        _scale_unless_one_(t, g)
    return dh, dw, db


_flce_fwd_op = torch.library.custom_op("fuseformer::fused_linear_cross_entropy_fwd", mutates_args=())(_flce_fwd_impl)
_flce_bwd_op = torch.library.custom_op("fuseformer::fused_linear_cross_entropy_bwd", mutates_args=())(_flce_bwd_impl)


@_flce_fwd_op.register_fake
def _(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, gh, gw, gb, chunk_size, softcap):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    grads = reduction != "none"
    dh = torch.empty_like(hidden) if grads and gh else hidden.new_empty(0)
    dw = torch.empty_like(weight) if grads and gw else hidden.new_empty(0)
    db = torch.empty_like(bias) if grads and gb else hidden.new_empty(0)
    return loss, dh, dw, db


@_flce_bwd_op.register_fake
def _(dloss, hidden, weight, target, bias, dh, dw, db, ignore_index, reduction, label_smoothing, z_loss, gh, gw, gb,
      chunk_size, softcap):  # fmt: skip
    # mean/sum: the saved gradients, scaled; none: recomputed, shaped like the inputs.
    likes = (hidden, weight, bias) if reduction == "none" else (dh, dw, db)
    return tuple(torch.empty_like(t) if flag else dh.new_empty(0) for t, flag in zip(likes, (gh, gw, gb)))


def _flce_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    _flce_save(ctx, inputs, *output[1:])


def _flce_save(ctx, inputs, dh, dw, db):
    hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, gh, gw, gb, chunk_size, cap = inputs
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss, gh, gw, gb, chunk_size, cap)
    ctx.has_bias = bias is not None
    if reduction == "none":  # recomputed in the backward
        ctx.save_for_backward(hidden, weight, target, bias, dh, dw, db)
    else:  # the backward only scales the gradients
        ctx.save_for_backward(None, None, None, None, dh, dw, db)


def _flce_backward_with(bwd):
    """The backward calling ``bwd``: the custom op under compile, the in-place impl in eager."""

    def _backward(ctx, dloss, _dh, _dw, _db):
        hidden, weight, target, bias, dh, dw, db = ctx.saved_tensors
        if hidden is None:  # mean/sum: the inputs were not kept; the bwd does not read them
            hidden = weight = target = dh.new_empty(0)
        gh, gw, gb = bwd(dloss, hidden, weight, target, bias, dh, dw, db, *ctx.args)
        flag_h, flag_w, flag_b = ctx.args[4:7]
        return (gh if flag_h else None), (gw if flag_w else None), None, (gb if flag_b else None), *([None] * 9)

    return _backward


_flce_fwd_op.register_autograd(_flce_backward_with(_flce_bwd_op), setup_context=_flce_setup_context)
_flce_eager_backward = _flce_backward_with(_flce_bwd_inplace)


class _FLCEFunction(torch.autograd.Function):
    """The eager path. Unlike the custom op, it returns the loss alone and keeps the gradients
    computed in the forward as detached aliases in ``save_for_backward``, never as outputs: a
    gradient buffer that was an output of the forward keeps a Python wrapper alive until the
    backward, and where autograd counts that wrapper as a reference (it does on some torch
    versions), AccumulateGrad deep-copies the gradient instead of taking it, a second grad_weight
    (+0.98 GiB at V 128256, H 4096 bf16; the H200 run measured 2.08 GiB = 2 x (dW + dH)).
    Liger's FLCE, which saves its gradients this way, measured 1.10 GiB in the same run.
    Classic ``forward(ctx, ...)`` style for host overhead (see _utils.autograd_function)."""

    @staticmethod
    def forward(ctx, *args):
        loss, dh, dw, db = _flce_fwd_impl(*args)
        _flce_save(ctx, args, dh.detach(), dw.detach(), db.detach())
        return loss

    @staticmethod
    def backward(ctx, dloss):
        return _flce_eager_backward(ctx, dloss, None, None, None)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without the full (N, V) logits.

    The tokens go through in chunks (about the hidden states' size of logits each); the gradients
    of hidden, weight and bias are computed in the forward for "mean" and "sum" (the backward scales
    them), and recomputed per chunk in the backward for "none".

    Args:
        hidden: (..., H) fp16, bf16 or fp32 (fp64 runs on the reference); the leading dims are tokens.
        weight: (V, H), hidden's dtype (the LM head's weight).
        target: (...) int64 or int32, hidden's leading shape, class indices or ``ignore_index``.
        bias: (V,) hidden's dtype, or None.
        ignore_index, reduction, label_smoothing, z_loss: as in :func:`cross_entropy`.
        chunk_size: tokens per chunk; None picks the memory-lean default: logits of about the
            hidden states' size, the first min(N, H) tokens as one chunk in grad_weight's memory
            (before it is written), and chunks that grow into grad_hidden's rows not yet written.
            In the same memory, 15 chunks instead of 34 at 8192 tokens, H 4096, V 128256 (4096
            tokens, then 14 of 352 down to 240). Larger chunks cost C x V logits of memory and save
            passes over grad_weight (one read and write of it per chunk): at that shape, fwd + bwd
            on an H200 (2026-12-03, BENCHMARKS.md runs 106-107) took 46.2-46.6 ms at 1.10 GiB above
            the inputs with None, 45.0 ms at 1.16 GiB with 512, 41.6 ms at 1.29 GiB with 1024.
        out_dtype: the loss's dtype; None is hidden's. torch.float32 returns the fp32 accumulation
            itself, as Hugging Face's losses (computed on upcast logits) are: a bf16 loss of ~7
            is only good to ~0.03.
        softcap: > 0 caps the logits, ``softcap * tanh(logits / softcap)``, before the loss (Gemma 2's
            ``final_logit_softcapping``), inside the kernels: no extra pass over the logits.

    Under ``torch.autocast`` hidden, weight and bias are cast to the autocast dtype first (an fp32
    LM head weight included, as F.linear would).

    Returns:
        The loss in ``out_dtype`` (hidden's dtype by default), accumulated in fp32: a scalar, or per
        token (hidden's leading shape) for "none". All targets ignored gives 0 for "mean".
    """
    op = "fused_linear_cross_entropy"
    check_tensor(op, "hidden", hidden, dtypes=FLOAT_DTYPES)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be a floating-point dtype or None, got {out_dtype!r}")
    if hidden.dim() == 0:
        raise ValueError(f"{op}: hidden must have at least 1 dim, got a scalar")
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    h = hidden.shape[-1]
    check_tensor(op, "weight", weight, dtypes=(hidden.dtype,), ndim=2, device=hidden.device, device_of="hidden")
    if weight.shape[1] != h:
        raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}; expected (V, {h}) (H from hidden)")
    v = weight.shape[0]
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=(hidden.dtype,), device=hidden.device, device_of="hidden")
        check_shape(op, "bias", bias, (v,), "the rows of weight")
    lead = tuple(hidden.shape[:-1])
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != lead:
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"{op}: target has shape {got}; expected {lead} (the leading dims of hidden)")
    n = hidden.numel() // h if h else 0
    x = hidden.reshape(n, h)
    t = target.reshape(n)
    _check_common(op, t, n, hidden.device, ignore_index, reduction, label_smoothing, z_loss, softcap)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{op}: chunk_size must be a positive int or None, got {chunk_size!r}")
    backend = choose_backend(op, hidden.device, hidden.dtype in KERNEL_DTYPES, "float64 runs on the reference")
    if backend == "reference":
        loss = fused_linear_cross_entropy_ref(
            hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap=softcap
        )
        return loss if out_dtype is None else loss.to(out_dtype)
    grad = torch.is_grad_enabled()
    flags = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    out = dispatch(
        _flce_fwd_op, _FLCEFunction, _flce_fwd_impl, x.contiguous(), weight.contiguous(), t.contiguous(),
        bias.contiguous() if bias is not None else None, ignore_index, reduction, float(label_smoothing),
        float(z_loss), *flags, int(chunk_size or 0), float(softcap),
    )  # fmt: skip
    loss = out[0] if isinstance(out, tuple) else out  # the eager Function returns the loss alone
    loss = loss.to(out_dtype or hidden.dtype)
    return loss.view(lead) if reduction == "none" else loss
