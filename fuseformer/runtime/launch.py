"""The one launch path of the ops' Triton kernels (STYLE.md §16): ``Launcher`` and ``DescLauncher`` launch a
``@triton.jit`` kernel as ``kernel[grid](...)`` the first time a specialization runs, then call its
compiled form's C launcher directly, on the Triton release whose launch path this re-implements
(``DIRECT_LAUNCH_TRITON``, version-gated: any other Triton, the interpreter, or
``fast_launch(False)`` take ``kernel[grid]`` every time). ``launch_path()`` says which one this
process takes (``fuseformer info``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# ``kernel[grid](...)`` costs ~15-25 us of host time per launch on the H200 host (Triton 3.6):
# JITFunction.run binds every argument, specializes it, builds a cache-key string, looks up the
# current device, builds launch metadata for the launch hooks; the C launcher then calls
# ``data_ptr()`` and ``cuPointerGetAttribute`` for every pointer and calls the (empty) enter/exit
# hook chains. After the first launch of a specialization, :class:`Launcher` keeps the compiled
# kernel under a key that determines Triton's own key and calls its C launcher directly.
#
# ``fast_launch(False)`` turns it off (tests that compare both paths): every launch is then
# ``kernel[grid](...)``. No environment switch: the version gate decides where it runs.
_fast_launch_on = True


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


_UNHANDLED: Any = object()  # a direct-launch cache value: this key always takes kernel[grid]


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
        return "kernel[grid]", "the direct launch is turned off (fast_launch(False))"
    problem = _installed_layout_problem()
    if problem is None and not torch.cuda.is_available():
        problem = "no CUDA device"
    if problem is not None:
        return "kernel[grid]", problem
    why = (
        f"Triton {_triton_version()} on CUDA: a specialization's first launch is kernel[grid], "
        "later ones its C launcher"
    )
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
                if entry is _UNHANDLED:
                    entry = key = None  # this specialization's compiled form is not one the direct path handles
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
            self._remember(key, entry)

    def _remember(self, key: tuple, entry: tuple | None) -> None:
        """Cache one specialization's direct-launch entry; None (a compiled form the direct path does
        not handle, e.g. one candidate config that needs scratch memory) is remembered for that key
        alone, so the kernel's other configs keep the direct path."""
        if len(self._cache) >= self._MAX_ENTRIES:
            self._cache.clear()
        self._cache[key] = _UNHANDLED if entry is None else entry

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
            if entry is _UNHANDLED:
                entry = full_key = None
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
            self._remember(full_key, self._desc_entry(compiled, config, args))

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
