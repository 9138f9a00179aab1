"""Native (C++) autograd nodes for small eager calls: ``fuseformer/csrc/native.cpp``, built on first use.

A small eager call is host-bound, and a Python ``autograd.Function``'s backward runs on autograd's
device thread, where the H200 hosts ran our Python ~2.4x slower than on the main thread (run 69). The
native module's node launches the kernels Triton has already compiled from C++ (the driver's
``cuLaunchKernel``), in both directions; what it launches is a *plan* an op builds once per key (see
``fuseformer/csrc/native.cpp`` for the layout and ``ops/rms_norm.py`` for the one op using it).

On by default since the GPU check of 2026-12-01 (run 71: bit-equal to the Python path, and the
4096x1024 backward 62.4 us against F.rms_norm's 70.2); ``FUSEFORMER_NATIVE=0`` or
``set_enabled(False)`` turns it off. The first eligible
call starts the build (a C++ compiler and torch's headers; ~30 s on two cores) on a background thread
and the ops keep their Python path until it is done; :func:`module` with ``wait=True`` waits for it
(benchmarks). The built module is cached under ``$FUSEFORMER_CACHE_DIR/native`` (default
``~/.cache/fuseformer/native``), keyed on the source, torch, Python and the compiler. A failed build
warns once and leaves every op on its Python path.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "native.cpp"
_NAME = "fuseformer_native"

# Kinds of launch arguments (native.cpp's Kind).
POINTER, INT32, INT64, FLOAT32 = 0, 1, 2, 3

_enabled = os.environ.get("FUSEFORMER_NATIVE", "1") != "0"
_module: Any = None
_state = "idle"  # idle -> building -> ready | failed
_error = ""
_lock = threading.Lock()
_done = threading.Event()
_driver_ok: bool | None = None


def enabled() -> bool:
    """Whether ops may take their native path (on unless ``FUSEFORMER_NATIVE=0`` or ``set_enabled(False)``)."""
    return _enabled


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def status() -> str:
    """One line for ``fuseformer info``."""
    if not _enabled:
        return "off (FUSEFORMER_NATIVE=0 or set_enabled(False))"
    if _state == "ready":
        return f"on, built ({_build_path()})"
    if _state == "failed":
        return f"on, build failed: {_error}"
    if _state == "idle":
        cached = " (a cached build exists)" if _build_path().exists() else " (~30 s, on a background thread)"
        return "on, built at the first eligible call" + cached
    return f"on, {_state}"


def _cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cxx_std() -> str:
    """The C++ standard torch's own extension builder uses (c++20 from torch 2.10 on, else c++17)."""
    try:
        import inspect

        from torch.utils import cpp_extension

        found = re.findall(r"-std=c\+\+(\d+)", inspect.getsource(cpp_extension))
        if found:
            return f"c++{max(found, key=int)}"
    except Exception:
        pass
    return "c++17"


def _build_key() -> str:
    text = SOURCE.read_bytes()
    parts = [text, torch.__version__.encode(), sys.version.encode(), (_cxx() or "").encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build_dir() -> Path:
    from fuseformer.runtime.autotune import cache_dir

    return cache_dir() / "native" / _build_key()


def _build_path() -> Path:
    return _build_dir() / (_NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _compile(out: Path) -> None:
    """Compile the module to ``out`` (atomically: a temporary file renamed into place)."""
    from torch.utils import cpp_extension

    cxx = _cxx()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [
        cxx, "-O2", "-shared", "-fPIC", f"-std={_cxx_std()}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DTORCH_EXTENSION_NAME={_NAME}", *[f"-I{p}" for p in includes], str(SOURCE), "-o", str(tmp),
        *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    os.replace(tmp, out)


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build_and_load() -> None:
    """Build (unless cached) and import the module; sets the state. One process builds at a time (a
    file lock), so ranks of one job share one build."""
    global _module, _state, _error
    try:
        path = _build_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            with open(path.parent / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    if not path.exists():
                        _compile(path)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        _module = _load(path)
        _state = "ready"
    except Exception as exc:  # no compiler, no headers, a build error: the ops keep their Python path
        _error = f"{type(exc).__name__}: {exc}"
        _state = "failed"
        warnings.warn(f"fuseformer: the native autograd module is unavailable ({_error}); "
                      "ops use their Python path", RuntimeWarning, stacklevel=2)  # fmt: skip
    finally:
        _done.set()


def module(wait: bool = False) -> Any:
    """The built module, or None (not enabled, still building, or failed). The first call starts the
    build: on a background thread, or here with ``wait=True``."""
    global _state
    if _module is not None:
        return _module
    if not _enabled or _state == "failed":
        return None
    if _state == "idle":
        with _lock:
            if _state == "idle":
                _state = "building"
                if wait:
                    _build_and_load()
                    return _module
                threading.Thread(target=_build_and_load, name="fuseformer-native-build", daemon=True).start()
    if wait:
        _done.wait()
    return _module


def cuda_module() -> Any:
    """:func:`module` (not waiting) with the CUDA driver's entry points found and a Triton whose
    parameter layout plans know, else None."""
    global _driver_ok
    mod = module()
    if mod is None:
        return None
    if _driver_ok is None:
        from fuseformer.ops._utils import triton_launch_layout_known

        _driver_ok = triton_launch_layout_known() and bool(mod.load_driver())
    return mod if _driver_ok else None


def register_fallback(fn: Callable[..., tuple]) -> int:
    """Register a Python backward ``fn(*grads, *saved) -> (g_a, g_b, g_c)`` for plans (see native.cpp)."""
    return module(wait=True).register_fallback(fn)


# --------------------------------------------------------------------------------------------
# Compiled Triton kernels as launches
# --------------------------------------------------------------------------------------------
def compiled_launch(
    kernel: Any,
    grid: tuple[int, ...],
    config: Any,
    tensors: list[tuple[Any, torch.Tensor]],
    ints: tuple[int, ...],
    floats: tuple[float, ...] = (),
) -> tuple:
    """One launch of a plan: ``(CUfunction, grid, threads, shared bytes, args)``, args in native.cpp's
    encoding. ``tensors`` pairs each pointer parameter's slot with a tensor standing in for it at
    compile time (same dtype, 16-byte aligned, like every tensor the plan will pass there); ``ints``
    and ``floats`` are the values, as the op's Launcher would pass them; ``config`` its LaunchConfig.

    Compiles (or finds) the kernel Triton would launch for these arguments (``JITFunction.warmup``)
    and reads its signature: parameters Triton specialized to constexpr (ints equal to 1) are not
    passed, i32 and i64 ints keep their width. Raises ValueError for a compiled form a plan cannot
    launch (scratch memory, launch hooks' needs, an unexpected signature)."""
    compiled = kernel.warmup(*[t for _, t in tensors], *ints, *floats, grid=grid, **config.kwargs)
    if hasattr(compiled, "result"):  # Triton's async compile mode hands back a future
        compiled = compiled.result()
    if compiled is None:
        raise ValueError(f"{kernel.fn.__name__}: Triton did not compile it (a JIT cache hook took it)")
    compiled._init_handles()
    return launch_of(compiled, kernel, grid, [s for s, _ in tensors], ints, floats)


def launch_of(
    compiled: Any, kernel: Any, grid: tuple[int, ...], slots: list[int], ints: tuple[int, ...], floats: tuple
) -> tuple:
    """:func:`compiled_launch` from a CompiledKernel (tests build one offline, with no GPU)."""
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise ValueError(f"{kernel.fn.__name__}: needs scratch memory")
    special = getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False)
    if getattr(md, "num_ctas", 1) != 1 or special:
        raise ValueError(f"{kernel.fn.__name__}: clusters, cooperative or PDL launches are not planned")
    if kernel.used_global_vals or kernel.pre_run_hooks:
        raise ValueError(f"{kernel.fn.__name__}: global-value checks or pre-run hooks")
    signature = list(compiled.src.signature.values())
    n_ptr, n_int, n_float = len(slots), len(ints), len(floats)
    args = []
    for i, ty in enumerate(signature):
        if i < n_ptr:
            if not (isinstance(ty, str) and ty.startswith("*")):
                raise ValueError(f"{kernel.fn.__name__}: parameter {i} is {ty}, not a pointer")
            args.append((POINTER, slots[i]))
        elif i < n_ptr + n_int:
            v = ints[i - n_ptr]
            if ty == "constexpr":
                continue  # specialized (== 1): compiled in
            if ty == "i32":
                args.append((INT32, v))
            elif ty in ("i64", "u64"):
                args.append((INT64, v))
            else:
                raise ValueError(f"{kernel.fn.__name__}: parameter {i} is {ty}, not an int")
        elif i < n_ptr + n_int + n_float:
            if ty != "fp32":
                raise ValueError(f"{kernel.fn.__name__}: parameter {i} is {ty}, not fp32")
            args.append((FLOAT32, floats[i - n_ptr - n_int]))
        elif ty != "constexpr":
            raise ValueError(f"{kernel.fn.__name__}: parameter {i} ({ty}) is a runtime one past those given")
    grid3 = (tuple(grid) + (1, 1))[:3]
    return (int(compiled.function or 0), grid3, 32 * md.num_warps, md.shared, args)
