"""What the Gluon kernels (ops/attention_hopper.py, ops/mlp_hopper.py) share: Triton's Gluon imports
(``HAVE_GLUON`` False where this Triton has none), whether they are switched on, which devices run
them, and the register budget of their warp-specialized launches.

Gluon has no interpreter: the kernels run on sm_90 GPUs only, and CI compiles them for sm_90 offline.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Gluon ships with Triton >= 3.5; its Hopper module is what the kernels need.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except Exception:  # pragma: no cover - older Triton
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    HAVE_GLUON = False

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
    "HAVE_GLUON",
    "TensorDescriptor",
    "fence_async_shared",
    "gl",
    "gluon",
    "maxnreg",
    "mbarrier",
    "runs_on",
    "tma",
    "tma_rows",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]
