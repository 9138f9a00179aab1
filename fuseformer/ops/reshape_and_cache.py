"""Write new keys and values into the paged KV cache (inference only; no autograd): the op the engine
calls once per layer before ``paged_attention`` reads the cache (ops/paged_attention.py).

KV cache layout per layer (DESIGN.md §4): k_cache, v_cache (num_blocks, block_size, Hkv, D).
``slot_mapping`` (T,) int64 gives each new token's flat slot ``block * block_size + offset`` (-1: do
not write). The caches are in k's dtype, or e4m3 (an FP8 KV cache, ops/_fp8_kv_cache.py): then each
value is stored as e4m3(clamp(x / scale, ±448)) with the layer's ``k_scale`` / ``v_scale``.

Everything below autograd lives here (STYLE.md §1): the reference ``reshape_and_cache_ref``, its CPU
path, the Triton kernel, the launcher ``reshape_and_cache_fwd`` (the engine calls it), the
``torch.library`` registration and the public ``reshape_and_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._fp8_kv_cache import FP8_KV_DTYPE, FP8_MAX, UNSUPPORTED_WHY, check_cache_scales, is_fp8, quantize
from fuseformer.ops._utils import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    Launcher,
    check_shape,
    check_tensor,
    launch_config,
    next_pow2,
)
from fuseformer.ops.quant_fp8 import _e4m3_rne
from fuseformer.runtime.backend import choose_backend, forced_backend

_OP = "reshape_and_cache"
_INT_DTYPES = (torch.int32, torch.int64)
_E4M3_MAX = tl.constexpr(FP8_MAX)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def reshape_and_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v (T, Hkv, D) into the caches at ``slot_mapping`` (T,); slots < 0 are skipped. e4m3
    caches get clamp(x / scale, ±448) (the scales None: 1.0); other caches a cast, the scales unused."""
    nb, bs = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    if is_fp8(k_cache):
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


# --------------------------------------------------------------------------------------------
# CPU path: what the reference backend runs on CPU tensors (fp16, bf16, fp32) unless the reference is
# forced. The reference's result in fewer ops: a decode step calls it once per layer, and on a CPU
# each op's dispatch costs as much as its arithmetic at one token.
# --------------------------------------------------------------------------------------------
def _reshape_and_cache_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """reshape_and_cache_ref by two index_copy_ (no boolean-mask gathers); skipped slots go to the reference."""
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return
    if int(slots.min()) < 0:
        reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    nb, bs = k_cache.shape[:2]
    k_rows, v_rows = k_cache.view(nb * bs, *k_cache.shape[2:]), v_cache.view(nb * bs, *v_cache.shape[2:])
    if is_fp8(k_cache):  # torch's CPU index_copy_ has no e4m3 kernel: copy the bytes
        k, v = quantize(k, k_scale).view(torch.uint8), quantize(v, v_scale).view(torch.uint8)
        k_rows, v_rows = k_rows.view(torch.uint8), v_rows.view(torch.uint8)
    k_rows.index_copy_(0, slots, k)
    v_rows.index_copy_(0, slots, v)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _fp8(x, SCALE, SCALED: tl.constexpr):
    """x -> clamp(x / scale, ±448) in fp32, rounded to e4m3's grid (``_e4m3_rne``): the cast after it is exact.
    div_rn: IEEE division, as torch's; Triton's ``/`` on fp32 is div.full (2 ulp), which would differ."""
    x = x.to(tl.float32)
    if SCALED:
        x = tl.math.div_rn(x, tl.load(SCALE))
    return _e4m3_rne(tl.clamp(x, -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _reshape_and_cache_kernel(
    K, V, K_CACHE, V_CACHE, SLOTS, K_SCALE, V_SCALE,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, K_SCALED: tl.constexpr = False, V_SCALED: tl.constexpr = False,
):  # fmt: skip
    # One program per (token, kv head): copy one D-vector of K and of V (e4m3 caches: quantized by
    # the scales, which a K_SCALED / V_SCALED of False reads as 1.0 and then does not load).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
        kc = K_CACHE + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
        vc = V_CACHE + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
        if K_CACHE.dtype.element_ty.is_fp8():
            k = _fp8(k, K_SCALE, K_SCALED)
            v = _fp8(v, V_SCALE, V_SCALED)
        tl.store(kc, k.to(K_CACHE.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(V_CACHE.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launcher (no autograd; inputs already checked; unit stride in the head dim)
# --------------------------------------------------------------------------------------------
def reshape_and_cache_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v (T, Hkv, D) -> k_cache, v_cache (num_blocks, block_size, Hkv, D) at slot_mapping (T,);
    e4m3 caches quantized by ``k_scale``, ``v_scale`` (one-element fp32 tensors, or None: 1.0)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    fp8 = is_fp8(k_cache)
    k_scaled, v_scaled = fp8 and k_scale is not None, fp8 and v_scale is not None
    # An unused scale's pointer is slot_mapping's (the launcher takes tensors only; never loaded).
    config = launch_config(
        HEAD_DIM=d, BLOCK_D=next_pow2(d), K_SCALED=k_scaled, V_SCALED=v_scaled, num_warps=1 if d <= 128 else 2
    )
    _launcher(
        (t, hkv), config,
        (k, v, k_cache, v_cache, slot_mapping, k_scale if k_scaled else slot_mapping,
         v_scale if v_scaled else slot_mapping),
        (k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         k_cache.shape[1]),
    )  # fmt: skip


# The one launch path (runtime/launch.py; kernel[grid] costs ~15-25 us of host time a launch there): the
# engine calls this once per layer per step. The host-time saving here is not measured yet.
_launcher = Launcher(_reshape_and_cache_kernel)


# --------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile; CUDA-graph capturable (no host syncs)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fuseformer::reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def _reshape_and_cache_op(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    reshape_and_cache_fwd(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_reshape_and_cache_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new keys and values into their slots of the paged KV cache, in place.

    Args:
        k, v: (T, Hkv, D) fp16, bf16, fp32 (fp64 runs on the reference); any strides with a unit
            stride in D (e.g. slices of a packed qkv projection go in without a copy).
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), both k's dtype, or both float8_e4m3fn (an
            FP8 KV cache: each value stored as e4m3(clamp(x / scale, ±448)), x / scale in fp32,
            rounded to nearest even). Written in place.
        slot_mapping: (T,) int64 (or int32): flat slot ``block * block_size + offset`` of each token;
            -1 skips the token (e.g. padding).
        k_scale, v_scale: the layer's K and V scales for e4m3 caches: one-element fp32 tensors (shape
            () or (1,)) on k's device, read by the kernel (a CUDA graph captures them by address);
            None means 1.0. Unused (and unchecked) for caches in k's dtype.
    """
    check_tensor(_OP, "k", k, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(_OP, "v", v, dtypes=(k.dtype,), ndim=3, device=k.device, device_of="k")
    check_shape(_OP, "v", v, tuple(k.shape), "the shape of k")
    check_tensor(_OP, "k_cache", k_cache, dtypes=(k.dtype, FP8_KV_DTYPE), ndim=4, device=k.device, device_of="k")
    check_tensor(_OP, "v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4, device=k.device, device_of="k")
    check_shape(_OP, "v_cache", v_cache, tuple(k_cache.shape), "the shape of k_cache")
    check_shape(
        _OP,
        "k_cache",
        k_cache,
        (k_cache.shape[0], k_cache.shape[1], *k.shape[1:]),
        "(blocks, block_size, Hkv, D) of k",
    )
    check_tensor(_OP, "slot_mapping", slot_mapping, dtypes=_INT_DTYPES, ndim=1, device=k.device, device_of="k")
    check_shape(_OP, "slot_mapping", slot_mapping, (k.shape[0],), "one slot per token of k")
    k_scale, v_scale, supported = check_cache_scales(_OP, k_cache, v_cache, k.dtype, k_scale, v_scale, k.device, "k")
    backend = choose_backend(_OP, k.device, supported, UNSUPPORTED_WHY)
    if backend == "reference":
        cpu = k.is_cpu and k.dtype in KERNEL_DTYPES and forced_backend() is None
        run_ref = _reshape_and_cache_cpu if cpu else reshape_and_cache_ref
        run_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    # The custom op only under torch.compile: eager (the engine's per-layer decode path) calls the
    # launcher itself and skips the dispatcher's host time.
    run = _reshape_and_cache_op if torch.compiler.is_compiling() else reshape_and_cache_fwd
    run(k, v, k_cache, v_cache, slot_mapping.contiguous(), k_scale, v_scale)
