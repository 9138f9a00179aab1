"""Helpers shared by every op: the one input-check helper and small launch utilities."""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fuseformer.runtime.autotune import bucket, dtype_name

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


# --------------------------------------------------------------------------------------------
# Low-overhead Triton launches
# --------------------------------------------------------------------------------------------
# ``kernel[grid](...)`` costs ~15-25 us of host time per launch on the H200 host (Triton 3.6):
# JITFunction.run binds every argument, specializes it, builds a cache-key string, looks up the
# current device, builds launch metadata for the launch hooks; the C launcher then calls
# ``data_ptr()`` and ``cuPointerGetAttribute`` for every pointer and calls the (empty) enter/exit
# hook chains. After the first launch of a specialization, :class:`Launcher` keeps the compiled
# kernel under a key that determines Triton's own key and calls its C launcher directly.
#
# FUSEFORMER_FAST_LAUNCH=0 (read at import) or ``fast_launch(False)`` turn it off: every launch
# is then ``kernel[grid](...)``.
_fast_launch_on = os.environ.get("FUSEFORMER_FAST_LAUNCH", "1").strip().lower() not in ("0", "false", "off", "no")


def fast_launch_enabled() -> bool:
    """Whether :class:`Launcher` calls compiled kernels directly after their first launch."""
    return _fast_launch_on


@contextlib.contextmanager
def fast_launch(enabled: bool) -> Iterator[None]:
    """Within the block, turn the direct launch path on or off (process-wide; tests and benchmarks)."""
    global _fast_launch_on
    previous, _fast_launch_on = _fast_launch_on, bool(enabled)
    try:
        yield
    finally:
        _fast_launch_on = previous


class LaunchConfig:
    """The constexprs and launch options (num_warps, ...) of one kernel configuration.

    Get one from :func:`launch_config`, which returns the same object for the same values: the
    direct-launch cache is keyed on its identity (a cheap hash), never on its contents.
    """

    __slots__ = ("kwargs",)

    def __init__(self, kwargs: dict[str, Any]):
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"LaunchConfig({self.kwargs})"


@functools.cache
def launch_config(**kwargs: Any) -> LaunchConfig:
    """The (one) :class:`LaunchConfig` for these constexprs and options; values must be hashable."""
    return LaunchConfig(dict(kwargs))


def spec_key(tensors: Sequence[torch.Tensor], ints: Sequence[int]) -> tuple[list[int], tuple]:
    """The pointers of ``tensors``, and a key that determines Triton 3.6's specialization of these
    arguments (it may be finer, never coarser).

    Triton specializes a pointer on its dtype and on ``ptr % 16 == 0``; an int on being 1 (then a
    constexpr), on ``% 16 == 0`` and on its range (i32 within [-2^31, 2^31), else i64 / u64). The
    key holds each dtype; then 0 when every pointer is 16-byte aligned (fresh allocations, the
    common case), else the tuple of each ``ptr & 15``; then the ints' key (:func:`_int_key`). Equal
    keys mean equal specializations (tests check this against Triton's own
    ``native_specialize_impl``).

    Per call this reads each tensor's pointer and dtype and looks the ints up in ``_INT_KEYS``
    (one hash of the tuple instead of a branch per int). CPU (2026-11-30, timeit), rms_norm's
    backward launch (9 tensors, 7 ints) 2.8 -> 2.4 us, its forward's (6, 6) 2.05 -> 1.75 us.
    """
    ptrs = []
    key = []
    bits = 0
    for t in tensors:
        p = t.data_ptr()
        ptrs.append(p)
        key.append(t.dtype)
        bits |= p
    key.append(tuple([p & 15 for p in ptrs]) if bits & 15 else 0)
    if type(ints) is not tuple:
        ints = tuple(ints)
    int_key = _INT_KEYS.get(ints)
    if int_key is None:
        int_key = _int_key(ints)
    key.append(int_key)
    return ptrs, tuple(key)


# The ints' keys already computed (the launch arguments' int tuples repeat: one per shape and flags).
_INT_KEYS: dict[tuple[int, ...], tuple[int, ...]] = {}


def _int_key(ints: tuple[int, ...]) -> tuple[int, ...]:
    """Per int: the value itself below 16, ``16 | (v & 15)`` in [16, 2^31), the value itself from
    2^31 on (three disjoint ranges of key values); remembered in ``_INT_KEYS``."""
    key = tuple([v if v < 16 else (v & 15) | 16 if v < 0x80000000 else v for v in ints])
    if len(_INT_KEYS) >= 4096:  # values >= 2^31 are kept exact: bound the table, just in case
        _INT_KEYS.clear()
    _INT_KEYS[ints] = key
    return key


# The Triton releases (version prefixes) whose launch path the direct launches re-implement: read from
# 3.6's jit.py, compiler.py and nvidia driver, and tested and timed on it. On any other Triton every
# launch is ``kernel[grid]`` (Triton 3.9's driver, for one, no longer has 3.6's launcher argument format).
DIRECT_LAUNCH_TRITON = ("3.6.",)
# Triton 3.6's C launcher's leading arguments (nvidia driver's ``_BASE_ARGS_FORMAT``): grid, stream,
# function, cooperative, pdl, then the launch metadata and the hooks.
_LAUNCH_ARGS_FORMAT = "iiiKKppOOOOOO"


def _triton_version() -> str:
    import triton

    return triton.__version__


def launch_layout_problem(version: str, interpret: bool, args_format: str | None) -> str | None:
    """Why Triton ``version`` (its interpreter on or off, its C launcher's ``args_format``) does not take
    launch arguments as the direct paths lay them out, or None when it does (the decision itself: tests
    pin it for other versions)."""
    if not version.startswith(DIRECT_LAUNCH_TRITON):
        tested = ", ".join(v + "x" for v in DIRECT_LAUNCH_TRITON)
        return f"Triton {version}: the direct launch re-implements Triton {tested}'s launch path"
    if interpret:
        return "the Triton interpreter runs the kernels (TRITON_INTERPRET=1)"
    if args_format != _LAUNCH_ARGS_FORMAT:
        return f"this Triton's C launcher takes {args_format!r}, not Triton 3.6's {_LAUNCH_ARGS_FORMAT!r}"
    return None


def _installed_layout_problem() -> str | None:
    try:
        from triton import knobs
        from triton.backends.nvidia import driver as nvidia_driver

        version = _triton_version()
    except Exception as e:
        return f"Triton's NVIDIA backend cannot be imported ({type(e).__name__}: {e})"
    args_format = getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None)
    return launch_layout_problem(version, bool(knobs.runtime.interpret), args_format)


def triton_launch_layout_known() -> bool:
    """Whether Triton's compiled kernels take their launch arguments as this module's direct paths
    lay them out: Triton 3.6's C launcher (runtime arguments in order, ints specialized to 1 left out,
    then the global and profile scratch pointers), not the interpreter."""
    return _installed_layout_problem() is None


def launch_path() -> tuple[str, str]:
    """Which launch path :class:`Launcher` takes in this process, and why: ``("direct", why)`` when a
    compiled kernel's C launcher is called directly after a specialization's first ``kernel[grid]``
    (Triton 3.6.x, compiled kernels, CUDA), else ``("kernel[grid]", why not)``. For ``fuseformer info``."""
    if not _fast_launch_on:
        return "kernel[grid]", "the direct launch is turned off (FUSEFORMER_FAST_LAUNCH=0 or fast_launch(False))"
    problem = _installed_layout_problem()
    if problem is None and not torch.cuda.is_available():
        problem = "no CUDA device"
    if problem is not None:
        return "kernel[grid]", problem
    why = f"Triton {_triton_version()} on CUDA: a specialization's first launch is kernel[grid], later ones its C launcher"
    return "direct", why


# Resolved at the first direct launch: a CPU build of torch has no _cuda_* functions.
_cuda_get_device: Callable[[], int] | None = None
_cuda_current_stream: Callable[[int], int] | None = None


class Launcher:
    """Launch one ``@triton.jit`` kernel as ``kernel[grid](*tensors, *ints, *floats, **config)``,
    with a direct path for launches Triton has already compiled.

    The kernel's parameters must be, in this order: the pointers (``tensors``), the integers
    (``ints``, Python ints), the floats (``floats``, Python floats), then constexprs only (from
    ``config``, or their defaults). The first launch of each key goes through ``kernel[grid]``
    (which compiles); its CompiledKernel is kept under (config, current device, Triton's debug
    and instrumentation knobs, :func:`spec_key`): together what Triton keys its own cache on, or
    finer. Later launches with that key call the kernel's C launcher with the pointers as
    integers. Everything unusual takes ``kernel[grid]``: a Triton other than 3.6, the interpreter,
    fast launch turned off, launch hooks installed (e.g. the proton profiler), tensors on a device
    other than the current one, and compiled kernels that need scratch memory, tensor
    descriptors, global-variable checks or pre-run hooks.

    What the direct path skips, per launch (Triton 3.6, read from jit.py, compiler.py and the
    nvidia driver): JITFunction.run's kwargs handling, the Python binder and its specialization of
    every argument (replaced by :func:`spec_key`), the cache-key tuple of specializations and
    ``str(options)``, ``torch.cuda.current_device()`` through the lazy driver proxy, the
    global-variable check loop, ``launch_metadata`` (a LazyDict built for the launch hooks on
    every launch, since the hook chains are never None), CudaLauncher.__call__ (a Python frame and
    two scratch-allocation calls), and in C, per pointer, a ``data_ptr()`` method call and a
    ``cuPointerGetAttribute`` driver call, plus the two empty hook-chain calls. Kept: argument
    parsing and ``cuLaunchKernelEx``.
    """

    __slots__ = ("kernel", "misses", "_cache", "_direct")

    _MAX_ENTRIES = 4096  # keys with values >= 2^31 are exact: bound the cache, just in case

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.misses = 0  # launches through kernel[grid] (tests check that the direct path is taken)
        self._cache: dict[tuple, tuple] = {}
        self._direct: bool | None = None  # decided at the first launch

    def __call__(
        self,
        grid: tuple[int, ...],
        config: LaunchConfig,
        tensors: Sequence[torch.Tensor],
        ints: Sequence[int],
        floats: Sequence[float] = (),
    ) -> None:
        key = None
        if _fast_launch_on and (self._direct or (self._direct is None and self._decide())):
            device = _cuda_get_device()
            if tensors[0].get_device() == device:
                ptrs, spec = spec_key(tensors, ints)
                # Triton's key also holds the options: config's, and the debug and instrumentation knobs.
                runtime = _triton_knobs.runtime
                key = (config, device, runtime.debug, _triton_knobs.compilation.instrumentation_mode, spec)
                entry = self._cache.get(key)
                if entry is not None and not self.kernel.pre_run_hooks:
                    if self._hooks_clear(runtime):
                        launch, function, packed_metadata, cooperative, pdl, constexprs = entry
                        n = len(grid)
                        launch(
                            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                            _cuda_current_stream(device), function, cooperative, pdl, None, None,
                            packed_metadata, None, None, None, *ptrs, *ints, *floats, *constexprs,
                        )  # fmt: skip
                        return
                if entry is not None:
                    key = None  # hooks installed (e.g. a profiler's): Triton's own launch calls them
        self.misses += 1
        compiled = self.kernel[grid](*tensors, *ints, *floats, **config.kwargs)
        if key is not None:
            entry = self._entry(compiled, config, len(tensors), len(ints), len(floats))
            if entry is None:
                self._direct = False  # this kernel's compiled form is not one the direct path handles
                return
            if len(self._cache) >= self._MAX_ENTRIES:
                self._cache.clear()
            self._cache[key] = entry

    def _decide(self) -> bool:
        self._direct = self._direct_possible()
        return self._direct

    def _direct_possible(self) -> bool:
        """Triton 3.6 (the runtime this was written against: launcher argument layout, knobs,
        CompiledKernel fields), a compiled (not interpreted) kernel, and CUDA."""
        global _cuda_get_device, _cuda_current_stream, _triton_knobs, _HookChain
        if not triton_launch_layout_known():
            return False
        try:
            from triton import knobs
            from triton.runtime.jit import JITFunction

            ok = (
                isinstance(self.kernel, JITFunction)
                and isinstance(knobs.compilation.instrumentation_mode, str)
                and isinstance(knobs.runtime.launch_enter_hook, knobs.HookChain)
                and torch.cuda.is_available()
            )
        except Exception:
            return False
        if not ok:
            return False
        _triton_knobs, _HookChain = knobs, knobs.HookChain
        _cuda_get_device = torch._C._cuda_getDevice
        _cuda_current_stream = torch._C._cuda_getCurrentRawStream
        return True

    def _plain_launcher(self, compiled: Any) -> Any:
        """The CudaLauncher of a compiled kernel the direct call can launch (no global-variable checks,
        pre-run hooks or scratch memory), else None."""
        kernel = self.kernel
        if kernel.used_global_vals or kernel.pre_run_hooks or type(compiled).__name__ != "CompiledKernel":
            return None
        launcher = getattr(compiled, "_run", None)
        if type(launcher).__name__ != "CudaLauncher" or compiled.function is None:
            return None
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        return launcher

    @staticmethod
    def _constexpr_values(params: Sequence[Any], config: LaunchConfig) -> tuple | None:
        """The values of trailing constexpr ``params``: from ``config``, else their defaults (None if
        one has neither, or is not a constexpr)."""
        values = []
        for p in params:
            if not p.is_constexpr:
                return None
            if p.name in config.kwargs:
                values.append(config.kwargs[p.name])
            elif p.has_default:
                values.append(p.default)
            else:
                return None
        return tuple(values)

    @staticmethod
    def _hooks_clear(runtime: Any) -> bool:
        """Whether no launch hooks are installed (a profiler's would need Triton's own launch)."""
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        return (enter is None or (type(enter) is _HookChain and not enter.calls)) and (
            exit_ is None or (type(exit_) is _HookChain and not exit_.calls)
        )

    def _entry(self, compiled: Any, config: LaunchConfig, n_ptr: int, n_int: int, n_float: int) -> tuple | None:
        """(C launch, CUfunction, packed metadata, cooperative, pdl, constexpr values) for a compiled
        kernel, or None when it is not the plain form the direct call handles."""
        kernel = self.kernel
        launcher = self._plain_launcher(compiled)
        if launcher is None:
            return None
        signature = list(compiled.src.signature.values())
        params = kernel.params
        n_runtime = n_ptr + n_int + n_float
        if len(signature) != len(params) or len(params) < n_runtime:
            return None
        for i, ty in enumerate(signature):
            if not isinstance(ty, str):
                return None
            if i < n_ptr:
                ok = ty.startswith("*") and not params[i].is_constexpr
            elif i < n_ptr + n_int:
                ok = ty in ("i32", "i64", "u64", "constexpr") and not params[i].is_constexpr
            elif i < n_runtime:
                ok = ty == "fp32" and not params[i].is_constexpr
            else:
                ok = ty == "constexpr" and params[i].is_constexpr
            if not ok:
                return None
        constexprs = self._constexpr_values(params[n_runtime:], config)
        if constexprs is None:
            return None
        return (
            launcher.launch, compiled.function, compiled.packed_metadata,
            launcher.launch_cooperative_grid, launcher.launch_pdl, constexprs,
        )  # fmt: skip


_triton_knobs: Any = None
_HookChain: Any = None


class HostDesc:
    """A host tensor descriptor's fields (base tensor, shape, strides, block shape) without the checks
    ``TensorDescriptor`` runs when it is built (~4.5 us each on the CPU dev machine, 2026-12-02; this,
    ~0.3): for :class:`DescLauncher` callers that have checked what a descriptor needs (a 16-byte
    aligned base and row strides, a unit last stride). Its direct launches read the fields; the first
    launch of a specialization goes through :meth:`real`, whose checks then run."""

    __slots__ = ("base", "shape", "strides", "block_shape")
    padding = "zero"

    def __init__(self, base: torch.Tensor, shape: tuple, strides: tuple, block_shape: tuple):
        self.base, self.shape, self.strides, self.block_shape = base, shape, strides, block_shape

    def real(self) -> Any:
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape))


class DescLauncher(Launcher):
    """:class:`Launcher` for kernels whose runtime parameters include host-built tensor descriptors
    (``triton.tools.tensor_descriptor.TensorDescriptor``): launched as
    ``kernel[grid](*args, **config)``, with a direct path for launches Triton has already compiled.
    Descriptors may be :class:`HostDesc` (turned into ``TensorDescriptor`` where Triton launches).

    ``args``: every runtime parameter, in order: descriptors, tensors (pointers), ints, or None (a
    parameter Triton then takes as a constexpr); then constexprs only, from ``config`` or their
    defaults. ``key`` (the caller's) must determine Triton's specialization of ``args`` (its own may
    be finer, never coarser): every int's value, every tensor's dtype and 16-byte alignment, every
    descriptor's dtype, shape, strides and block shape, and which args are None.

    The direct path does what Triton 3.6's launch does after its cache lookup (``JITFunction.run``,
    ``CudaLauncher``, the descriptor expansion of ``wrap_handle_tensordesc``) and nothing else: the
    descriptors' CUtensorMaps are encoded by Triton's own ``make_tensordesc_arg`` (cached per base
    pointer, shape, strides and block: a weight's is encoded once), pointers go as integers, and the
    C launcher is called. What it skips per launch is :class:`Launcher`'s list plus the binder's
    specialization of the descriptors. Everything unusual takes ``kernel[grid]``, as there.
    """

    __slots__ = ("_maps",)

    _MAX_MAPS = 256

    def __init__(self, kernel: Any):
        super().__init__(kernel)
        self._maps: dict[tuple, list] = {}

    def launch(self, grid: tuple[int, ...], config: LaunchConfig, key: tuple, args: Sequence[Any]) -> None:
        full_key = None
        if _fast_launch_on and (self._direct or (self._direct is None and self._decide())):
            device = _cuda_get_device()
            runtime = _triton_knobs.runtime
            full_key = (config, device, runtime.debug, _triton_knobs.compilation.instrumentation_mode, key)
            entry = self._cache.get(full_key)
            if entry is not None and not self.kernel.pre_run_hooks:
                if self._hooks_clear(runtime):
                    launch, function, packed_metadata, cooperative, pdl, kinds, constexprs = entry
                    final: list = []
                    for arg, kind in zip(args, kinds):
                        if kind is None:  # a tensor: its pointer
                            final.append(arg.data_ptr() if arg is not None else None)
                        elif kind == "int":
                            final.append(arg)
                        else:  # a descriptor: (index, its tensordesc metadata)
                            final.extend(self._expand(arg, kind))
                    n = len(grid)
                    launch(
                        grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                        _cuda_current_stream(device), function, cooperative, pdl, None, None,
                        packed_metadata, None, None, None, *final, *constexprs,
                    )  # fmt: skip
                    return
            if entry is not None:
                full_key = None  # hooks installed: Triton's own launch calls them
        self.misses += 1
        args = [a.real() if type(a) is HostDesc else a for a in args]
        compiled = self.kernel[grid](*args, **config.kwargs)
        if full_key is not None:
            entry = self._desc_entry(compiled, config, args)
            if entry is None:
                self._direct = False
                return
            if len(self._cache) >= self._MAX_ENTRIES:
                self._cache.clear()
            self._cache[full_key] = entry

    def _expand(self, desc: Any, kind: tuple) -> list:
        """The C launcher's arguments for one descriptor (Triton's ``make_tensordesc_arg``), cached."""
        base = desc.base
        map_key = (base.data_ptr(), base.dtype, tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape),
                   desc.padding, kind[2])  # fmt: skip
        expanded = self._maps.get(map_key)
        if expanded is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            if len(self._maps) >= self._MAX_MAPS:
                self._maps.clear()
            expanded = self._maps[map_key] = make_tensordesc_arg(desc, kind[1])
        return expanded

    def _desc_entry(self, compiled: Any, config: LaunchConfig, args: Sequence[Any]) -> tuple | None:
        """(C launch, CUfunction, packed metadata, cooperative, pdl, per-arg kinds, constexpr values)
        for a compiled kernel, or None when it is not the form the direct call handles."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        kernel = self.kernel
        launcher = self._plain_launcher(compiled)
        if launcher is None:
            return None
        # The C launch under wrap_handle_tensordesc's wrapper (a closure over it), or the launch itself.
        launch = launcher.launch
        code = getattr(launch, "__code__", None)
        if code is not None:
            cells = dict(zip(code.co_freevars, launch.__closure__ or ()))
            if "launcher" not in cells:
                return None
            launch = cells["launcher"].cell_contents
        if getattr(launch, "__code__", None) is not None:  # not the C function
            return None
        signature = list(compiled.src.signature.values())
        params = kernel.params
        if len(signature) != len(params) or len(params) < len(args):
            return None
        metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        kinds: list = []
        n_desc = 0
        for i, arg in enumerate(args):
            ty = signature[i]
            if not isinstance(ty, str) or params[i].is_constexpr:
                return None
            if isinstance(arg, TensorDescriptor):
                if not ty.startswith("tensordesc"):
                    return None
                meta = metas[n_desc] if metas else None
                # (index, Triton's metadata of this descriptor, a hashable form of it for _expand's key)
                kinds.append((n_desc, meta, repr(sorted(meta.items())) if meta is not None else None))
                n_desc += 1
            elif isinstance(arg, torch.Tensor):
                if not ty.startswith("*"):
                    return None
                kinds.append(None)
            elif arg is None:
                if ty != "constexpr":
                    return None
                kinds.append("int")  # passed as is (None): the launcher ignores constexpr slots
            elif isinstance(arg, int) and not isinstance(arg, bool):
                if ty not in ("i32", "i64", "u64", "constexpr"):
                    return None
                kinds.append("int")
            else:
                return None
        if metas and n_desc != len(metas):
            return None
        constexprs = self._constexpr_values(params[len(args) :], config)
        if constexprs is None:
            return None
        return (
            launch, compiled.function, compiled.packed_metadata, launcher.launch_cooperative_grid, launcher.launch_pdl,
            tuple(kinds), tuple(constexprs),
        )  # fmt: skip
