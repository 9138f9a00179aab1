"""Helpers shared by every op: the one input-check helper, output allocation, autograd dispatch and small
launch utilities. The launch path itself is runtime/launch.py (re-exported here for the ops that import it
from this module)."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fuseformer.runtime.autotune import bucket, dtype_name

# The launch path lives in runtime/launch.py; the ops (and tests) that import these from here get the same
# objects. New code imports fuseformer.runtime.launch.
from fuseformer.runtime.launch import LaunchConfig, Launcher, fast_launch, launch_config, spec_key  # noqa: F401

# Dtypes the Triton kernels take. float64 is accepted by the public ops and runs on the reference.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    ndim: int | tuple[int, ...] | None = None,
    device: torch.device | None = None,
    device_of: str = "x",
    shape: tuple[int, ...] | None = None,
    what: str = "",
) -> torch.Tensor:
    """Check one input and raise a ValueError naming it: type, dtype, rank, device and shape.

    ``device``/``device_of``: the device the tensor must share, and the argument it comes from.
    ``shape``/``what``: the exact shape it must have (a tuple or torch.Size), and where that shape
    comes from (as :func:`check_shape`; one call instead of two, ~0.5 us, CPU 2026-12-01). A valid
    input costs one isinstance, one dtype lookup and (with ``device``, ``shape``) one device and one
    shape compare; the messages are built only when a check fails.
    """
    if (
        isinstance(t, torch.Tensor)
        and t.dtype in dtypes
        and ndim is None
        and (device is None or t.device == device)
        and (shape is None or t.shape == shape)
    ):
        return t  # the common case, checked with the fewest attribute reads
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; expected one of {allowed}")
    if ndim is not None:
        allowed_ndim = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed_ndim:
            raise ValueError(
                f"{op}: {name} must have {' or '.join(map(str, allowed_ndim))} dims, got shape {tuple(t.shape)}"
            )
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but {device_of} is on {device}; move them to one device")
    if shape is not None:
        check_shape(op, name, t, shape, what)
    return t


def check_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    """Raise a ValueError naming ``name`` if ``t.shape != expected``."""
    # torch.Size is a tuple: compared with a tuple (or another Size) without converting either.
    if t.shape != (expected if isinstance(expected, tuple) else tuple(expected)):
        suffix = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected {tuple(expected)}{suffix}")


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as (rows, last dim) with a unit stride in the last dim, copying only if needed.

    Kernels take the row stride as an argument, so a row-strided view (e.g. a slice of a wider
    tensor) goes in without a copy; anything else is made contiguous. ``reshape`` returns a view
    whenever the leading dims collapse and copies otherwise (no try/except: torch.compile traces
    it without a graph break).
    """
    if t.dim() == 0:
        t = t.reshape(1)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


# Offsets tensors (cu_seqlens) already read and checked: id -> (weak reference, version counter, last
# offset, longest sequence). A model passes one cu_seqlens tensor to every layer (and again in each
# checkpointed recompute): reading it once saves a host sync a call (Llama 1B training, 16 layers:
# 64 syncs a step, each draining the GPU's queue). An in-place change bumps the version: read again.
_CHECKED_OFFSETS: dict[int, tuple[weakref.ref, int, int, int]] = {}


def _forget_offsets(ref: weakref.ref, key: int) -> None:
    entry = _CHECKED_OFFSETS.get(key)
    if entry is not None and entry[0] is ref:
        del _CHECKED_OFFSETS[key]


def read_offsets(op: str, name: str, cu: torch.Tensor) -> tuple[int, int]:
    """(last offset, longest sequence) of the offsets ``cu`` (B + 1,), checked to start at 0 and never
    decrease (ValueError naming ``name`` otherwise).

    Reads ``cu`` on the host (one sync) unless this very tensor, unchanged since (same version
    counter), was read before. Inference tensors have no version counter: always read.
    """
    version = None if cu.is_inference() else cu._version
    key = id(cu)
    if version is not None:
        entry = _CHECKED_OFFSETS.get(key)
        if entry is not None and entry[0]() is cu and entry[1] == version:
            return entry[2], entry[3]
    offsets = cu.tolist()
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{op}: {name} must start at 0 and be non-decreasing, got {offsets[:8]}...")
    last, longest = offsets[-1], max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    if version is not None:
        ref = weakref.ref(cu, lambda r, key=key: _forget_offsets(r, key))
        _CHECKED_OFFSETS[key] = (ref, version, last, longest)
    return last, longest


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Multiprocessors on a CUDA device; a small stand-in on CPU (the interpreter)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 4


def sm_count(t: torch.Tensor) -> int:
    return num_sms(t.device.index or 0) if t.is_cuda else num_sms(-1)


def row_norm_config_key(n: int, fused: bool, dtype: torch.dtype) -> str:
    """The autotune key of a row norm's (rms_norm, layer_norm) forward and backward: the row length's
    bucket (their default configs depend on nothing finer), whether the residual add (forward) or
    dh (backward) is fused, and the dtype."""
    return f"N{bucket(n)}-{'add' if fused else 'norm'}-{dtype_name(dtype)}"


def covers_row(n: int) -> Callable[[dict], bool]:
    """A stored row-norm config's test (``autotune.get_config(check=...)``): a one-pass block must
    cover the whole row of ``n``."""
    return lambda cfg: not cfg["SINGLE_PASS"] or cfg["BLOCK_N"] >= n


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself when it is already (a no-op ``.to()`` still costs ~0.7 us on the CPU,
    and the references run per layer per decode step there)."""
    return t if t.dtype == dtype else t.to(dtype)


def float_dtype_of(t: torch.Tensor) -> torch.dtype:
    """The dtype a reference computes in: fp64 stays fp64, everything else goes to fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# Tests set this (through ``poison_outputs``) so every output buffer starts as NaN (or -1 for
# integers): an element a kernel fails to write then fails the comparison instead of passing on
# whatever the allocator left there.
_POISON = False


# Shared memory a block may use on sm_90 (H100, H200).
SM90_SMEM_BYTES = 227 * 1024


def empty(shape: tuple[int, ...] | list[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output. The one allocation helper, so that tests can poison outputs."""
    if _POISON:
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    # Sizes as separate ints: torch's argument parser takes them ~0.7 us faster than one tuple.
    return torch.empty(*shape, dtype=dtype, device=device) if shape else torch.empty((), dtype=dtype, device=device)


def new_empty(t: torch.Tensor, *sizes: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`empty` of ``sizes`` (at least one) on ``t``'s device, in ``dtype`` (default ``t``'s):
    contiguous, and poisoned in tests like every kernel output. ``t.new_empty`` has no device
    argument to parse: CPU (2026-11-30), 1.2 us against 1.5-1.8 for ``torch.empty(m, n, dtype=,
    device=)``; with a dtype (rms_norm's rstd), CPU 2026-12-01, ~1.5 us of the eager forward under
    ``torch.empty((m,), dtype=, device=)``."""
    if _POISON:
        return empty(sizes, dtype=t.dtype if dtype is None else dtype, device=t.device)
    return t.new_empty(*sizes) if dtype is None else t.new_empty(*sizes, dtype=dtype)


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Within the block, every buffer from :func:`empty` starts filled with NaN (tests only)."""
    global _POISON
    previous, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = previous


# functorch internals the classic Function.apply goes through (torch/autograd/function.py); when a
# torch build lacks one, every call takes Function.apply itself.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def autograd_function(
    name: str,
    forward: Callable[..., Any],
    setup_context: Callable[..., None] | None,
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    """An autograd.Function from the same three pieces a custom op's ``register_autograd`` takes.

    Eager calls go through it instead of the custom op, for host overhead: on the H200 host a
    4096x1024 rms_norm (a 9 us kernel) took 178 us per call through the custom op. It is built in
    the classic ``forward(ctx, ...)`` style on purpose: a Function with a separate
    ``setup_context`` makes every ``apply`` call ``inspect.signature`` (~60% of the host time of
    an eager call, measured with cProfile on the CPU).

    ``setup_context=None``: ``forward`` is that classic ``forward(ctx, *args)`` itself, which saves
    what the backward needs and returns the Function's outputs. For ops whose eager Function differs
    from the custom op (rms_norm keeps its saved rstd out of the outputs: each output costs autograd
    ~0.5 us, and one nobody differentiates would get a zero-filled gradient), and one Python frame
    where the pieces take three (CPU 2026-12-01: ~1 us of rms_norm's eager forward).

    The class also gets ``fast_apply``, which :func:`dispatch` calls: what ``Function.apply`` does
    for a classic-style Function outside functorch transforms (unwrap dead functorch wrappers, then
    the C++ apply), without its Python frame, its setup_context probe and its generator (~2 us of
    ~15 on the CPU). Inside functorch transforms it is ``apply`` itself.
    """
    if setup_context is None:
        _forward = forward
    else:

        def _forward(ctx, *args):
            output = forward(*args)
            setup_context(ctx, args, output)
            return output

    cls = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(_forward), "backward": staticmethod(backward)},
    )
    # The engine runs a graph node of this Function as ``node.apply(*grads)``; the node's class
    # (``_backward_cls``) inherits BackwardCFunction.apply, which looks the user's function up on
    # every call (``vjp`` or ``backward``, boxed grads or not) in two Python frames. Here ``vjp`` is
    # Function's and grads are not boxed, so that lookup always yields ``backward``: the node calls it
    # directly. CPU (2026-11-30, timeit): node.apply 0.9 us over calling backward, now 0.
    backward_cls = getattr(cls, "_backward_cls", None)
    if (
        backward_cls is not None
        and cls.vjp is torch.autograd.Function.vjp
        and not getattr(cls, "boxed_grads_call", False)
    ):
        backward_cls.apply = backward
    if _functorch_active is None or _unwrap_if_dead is None:
        cls.fast_apply = cls.apply
        return cls
    c_apply = super(torch.autograd.Function, cls).apply  # torch._C._FunctionBase.apply, bound to cls
    full_apply = cls.apply

    def fast_apply(*args):
        if _functorch_active():
            return full_apply(*args)
        # A loop, not a list comprehension (a frame of its own in Python 3.11): CPU (2026-12-01),
        # rms_norm's eager forward with grad ~1 us less.
        live = []
        for a in args:
            live.append(_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a)
        return c_apply(*live)

    cls.fast_apply = staticmethod(fast_apply)
    return cls


def dispatch(
    op: Callable[..., Any], function: type[torch.autograd.Function], impl: Callable[..., Any], *args: Any
) -> Any:
    """Run one fused op the cheapest correct way.

    - Under torch.compile: the registered custom op (opaque to the compiler, with its fake and
      autograd), so graphs have no breaks.
    - Eager with a gradient to track: the autograd.Function built from the same pieces.
    - Otherwise (inference, no_grad): the implementation itself, with no autograd bookkeeping.
    """
    if torch.compiler.is_compiling():
        return op(*args)
    if torch.is_grad_enabled():
        for a in args:  # a plain loop: a generator in any() costs ~0.5 us a call
            if isinstance(a, torch.Tensor) and a.requires_grad:
                apply = getattr(function, "fast_apply", None) or function.apply
                return apply(*args)
    return impl(*args)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under torch.autocast, the float inputs in the autocast dtype (as F.linear would take them;
    the casts are differentiable, so fp32 master weights get their gradients); else unchanged."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)
