"""The FP8 KV cache's pieces shared by its writer (ops/reshape_and_cache.py) and its reader
(ops/paged_attention.py): the cache dtype, the scale checks, the references' quantization and
dequantization, and where the kernels can run.

An FP8 KV cache (vLLM's ``kv_cache_dtype="fp8"``) stores K and V as e4m3 (``torch.float8_e4m3fn``)
with one fp32 scale for K and one for V per layer (DESIGN.md §4):

    stored = e4m3(clamp(x / scale, -448, 448))     (x / scale in fp32, round to nearest even)
    read   = stored * scale

Half the bytes of a bf16 cache: twice the blocks in the same memory, and half the bytes a decode
step's attention reads. The scales are device tensors (0-dim or (1,)), never host floats, so that a
CUDA graph captures them by address and a scale loaded later is the one its replays read.
"""

from __future__ import annotations

import functools

import torch

from fuseformer.ops._utils import KERNEL_DTYPES, check_tensor

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: e4m3fn has no inf, |x| > 448 saturates


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an FP8 (e4m3) KV cache."""
    return cache.dtype == FP8_KV_DTYPE


def check_scale(op: str, name: str, scale: object, device: torch.device, device_of: str) -> None:
    """A KV-cache scale: None (1.0), or a one-element fp32 tensor (0-dim or (1,)) on ``device`` (that
    of the argument ``device_of``)."""
    if scale is None:
        return
    check_tensor(op, name, scale, dtypes=(torch.float32,), ndim=(0, 1), device=device, device_of=device_of)
    if scale.numel() != 1:
        raise ValueError(f"{op}: {name} must hold one value (shape () or (1,)), got shape {tuple(scale.shape)}")


def quantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x (any shape, float) -> e4m3 ``clamp(x / scale, ±448)``, the division in fp32 (the kernel's
    arithmetic: IEEE division, round to nearest even). NaN stays NaN; ±inf saturates to ±448."""
    x = x.float()
    if scale is not None:
        x = x / scale.float().reshape(())
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``stored`` -> ``stored * scale`` in ``dtype`` (the e4m3 values are exact in fp16, bf16 and
    wider; the product is rounded to ``dtype``)."""
    x = stored.to(dtype)
    return x if scale is None else x * scale.to(dtype).reshape(())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def kernels_support_fp8(device: torch.device) -> bool:
    """Whether the Triton kernels can read and write e4m3 on ``device``: CUDA compute capability 8.9+
    (Ada, Hopper: the e4m3 conversions are instructions there; Triton has no fp8e4nv before it), or
    the CPU (the interpreter). Elsewhere the ops take the reference."""
    if device.type != "cuda":
        return True
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


# Why an op over a KV cache takes the reference (``choose_backend``'s reason), for both ops' ``supported``.
UNSUPPORTED_WHY = "float64, a cache with non-unit stride in D, or an e4m3 cache on a GPU before sm_89"


def check_cache_scales(
    op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, k_scale: object, v_scale: object,
    device: torch.device, device_of: str,
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:  # fmt: skip
    """The checks and the kernel question shared by the cache's writer and reader: ``(k_scale, v_scale,
    supported)``, the scales checked for an e4m3 cache and dropped (None) for another, and whether the
    Triton kernels take inputs of ``dtype`` over these caches (unit stride in D; e4m3 only on sm_89+ or
    the interpreter)."""
    fp8 = is_fp8(k_cache)
    if fp8:
        check_scale(op, "k_scale", k_scale, device, device_of)
        check_scale(op, "v_scale", v_scale, device, device_of)
    else:
        k_scale = v_scale = None
    supported = (
        dtype in KERNEL_DTYPES
        and k_cache.stride(3) == 1
        and v_cache.stride(3) == 1
        and (not fp8 or kernels_support_fp8(device))
    )
    return k_scale, v_scale, supported
