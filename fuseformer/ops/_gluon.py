"""What the Gluon kernels (ops/attention_hopper.py, ops/mlp_hopper.py) share: Triton's Gluon imports
(``HAVE_GLUON`` False where this Triton has none, or not the Gluon API they were written for), whether
they are switched on, which devices run them, and the register budget of their warp-specialized launches.

Gluon has no interpreter: the kernels run on sm_90 GPUs only, and CI compiles them for sm_90 offline.

Gluon is experimental and its API changes between Triton releases: the kernels were written, compiled and
timed against Triton 3.6's (``GLUON_TRITON``). On any other Triton, or where the calls they make no longer
have 3.6's parameters (import-time detection, ``api_problem``), ``HAVE_GLUON`` is False, ``UNAVAILABLE``
says why, and the Triton kernels of ops/attention.py and ops/mlp.py run instead.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

# The Triton releases (version prefixes) whose Gluon the kernels were written for and checked on.
# Triton 3.9's, for one, removed tma.async_copy_shared_to_global (now async_store; the old name raises)
# and turned async_copy_global_to_shared into a forwarding shim: the kernels no longer compile there.
GLUON_TRITON = ("3.6.",)

# The Gluon calls the kernels make and the leading parameters they pass, as Triton 3.6 declares them:
# (module, function, the parameters it must declare by name; the positional ones in this order).
_SIGNATURES = (
    ("tma", "async_copy_global_to_shared", ("tensor_desc", "coord", "barrier", "result", "pred")),
    ("tma", "async_copy_shared_to_global", ("tensor_desc", "coord", "src")),
    ("tma", "store_wait", ("pendings",)),
    ("mbarrier", "init", ("mbarrier", "count")),
    ("mbarrier", "expect", ("mbarrier", "bytes")),
    ("mbarrier", "wait", ("mbarrier", "phase")),
    ("mbarrier", "arrive", ("mbarrier", "count")),
    ("hopper", "warpgroup_mma", ("a", "b", "acc", "use_acc", "is_async")),
    ("hopper", "warpgroup_mma_wait", ("num_outstanding", "deps")),
    ("hopper", "fence_async_shared", ()),
    ("gl", "warp_specialize", ("functions_and_args", "worker_num_warps", "worker_num_regs")),
    ("gl", "allocate_shared_memory", ("element_ty", "shape", "layout")),
    ("gl", "NVMMADistributedLayout", ("version", "warps_per_cta", "instr_shape")),
    ("gl", "NVMMASharedLayout", ()),
    ("gl", "DotOperandLayout", ("operand_index", "parent", "k_width")),
    ("gluon", "constexpr_function", ()),
    ("gluon", "jit", ()),
)


def api_problem(version: str, modules: dict[str, Any]) -> str | None:
    """Why the Gluon kernels cannot run on this Triton (``version``, and its Gluon ``modules``: "gl",
    "gluon", "tma", "mbarrier", "hopper" for the language's nvidia.hopper module), or None when it is
    a release they were written for and every call they make has the parameters they pass."""
    if not version.startswith(GLUON_TRITON):
        return f"Triton {version}: the Gluon kernels are written for Triton {', '.join(v + 'x' for v in GLUON_TRITON)}"
    for module, name, params in _SIGNATURES:
        fn = getattr(modules.get(module), name, None)
        if fn is None:
            return f"this Triton's Gluon has no {module}.{name}"
        if not params:
            continue
        try:
            declared = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return f"this Triton's Gluon {module}.{name} has no readable signature"
        named = {p.name for p in declared if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        positional = [p.name for p in declared if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        expected = [p for p in params if p in positional]  # in the order the kernels pass them
        if any(p not in named for p in params) or positional[: len(expected)] != expected:
            return f"this Triton's Gluon {module}.{name}{inspect.signature(fn)} is not the API the kernels call"
    return None


try:  # Gluon ships with Triton >= 3.5; its Hopper module is what the kernels need.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper as _hopper
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Why the Gluon kernels are off on this Triton (None: they are available).
    UNAVAILABLE: str | None = api_problem(
        triton.__version__, {"gl": gl, "gluon": gluon, "tma": tma, "mbarrier": mbarrier, "hopper": _hopper}
    )
except Exception as e:  # pragma: no cover - older Triton
    UNAVAILABLE = f"this Triton has no Gluon Hopper module ({type(e).__name__}: {e})"
HAVE_GLUON = UNAVAILABLE is None
if not HAVE_GLUON:  # nothing of another Gluon API is used by mistake: the kernels' modules define none
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

# FUSEFORMER_GLUON=0 turns off the Gluon kernels that are on by default (the attention kernels).
ENABLED = os.environ.get("FUSEFORMER_GLUON", "1") != "0"


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def runs_on(device: torch.device | str) -> bool:
    """Whether Gluon's Hopper kernels can run on ``device``: Gluon present and an sm_90 CUDA device."""
    device = torch.device(device)
    if not HAVE_GLUON or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def tma_rows(t: torch.Tensor) -> bool:
    """Whether a 2-D view's rows can be TMA boxes: unit column stride, 16-byte aligned base and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def maxnreg(consumer_regs: int, producer_regs: int) -> int:
    """The per-thread register budget of a launch with two consumer warpgroups and one producer
    warpgroup (12 warps sharing 64K registers), which setmaxnreg then shares out."""
    return (2 * consumer_regs + producer_regs) // 3


__all__ = [
    "ENABLED",
    "GLUON_TRITON",
    "HAVE_GLUON",
    "UNAVAILABLE",
    "TensorDescriptor",
    "fence_async_shared",
    "gl",
    "gluon",
    "api_problem",
    "maxnreg",
    "mbarrier",
    "runs_on",
    "tma",
    "tma_rows",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]
