"""C += A^T @ B in place on Hopper, in Gluon: the FLCE's per-chunk grad_weight update.

C is grad_weight (V, H), A a chunk's dlogits (K, V), B its hidden states (K, H), K a few hundred
tokens. At such K the update is bound by the pass over C (read and written: 2.1 GB at V 128256,
H 4096) more than by its FLOPs, and cuBLAS's kernel (0.81-0.84 ms a chunk on the H200, run 75) loads
C in its epilogue, after the MMAs, so the two barely overlap. Here each program is persistent and
keeps two C tiles in shared memory: the next tile's C is fetched by TMA while this tile's MMAs run,
and this tile's sum is stored by TMA while the next tile's run. Triton's own compiler did not give
that overlap (a Triton kernel with TMA descriptors, C loaded before or after the K loop, persistent
or not: 0.94-1.50 ms, run 75).

Gluon has no interpreter: the kernel runs on sm_90 GPUs only; :func:`usable` says where, and the FLCE
falls back to cuBLAS elsewhere. The GPU tests compare it with ``addmm_``.
"""

from __future__ import annotations

import functools

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; its Hopper module is what this kernel needs.
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
    HAVE_GLUON = False

# Launch config (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): two C tiles of BLOCK_M x BLOCK_N and
# ``stages`` A/B stages must fit in 227 KB of shared memory.
CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32, STAGES=4, num_warps=8)


if HAVE_GLUON:

    @gluon.jit
    def _issue_ab(a_desc, b_desc, a_bufs, b_bufs, bars, g, pid, nprog, num_n, k_steps,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        # Step g of this program's flattened (tile, k) sequence: A^T's and B's boxes into stage g % STAGES.
        tile = pid + (g // k_steps) * nprog
        k = (g % k_steps) * BLOCK_K
        s = g % STAGES
        bar = bars.index(s)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [k, (tile // num_n) * BLOCK_M], bar, a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [k, (tile % num_n) * BLOCK_N], bar, b_bufs.index(s))

    @gluon.jit
    def _issue_c(c_desc, c_bufs, c_bars, j, tile, num_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        # This program's j-th tile's C into buffer j % 2.
        bar = c_bars.index(j % 2)
        mbarrier.expect(bar, c_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(c_desc, [(tile // num_n) * BLOCK_M, (tile % num_n) * BLOCK_N], bar,
                                        c_bufs.index(j % 2))  # fmt: skip

    @gluon.jit
    def _dw_update_kernel(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
        dtype: gl.constexpr = c_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2] + c_desc.block_type.shape, c_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(c_bars.index(i), count=1)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_n = gl.cdiv(N, BLOCK_N)
        num_tiles = gl.cdiv(M, BLOCK_M) * num_n
        my_tiles = gl.cdiv(num_tiles - pid, nprog)
        k_steps = gl.cdiv(K, BLOCK_K)
        total = my_tiles * k_steps

        if my_tiles > 0:
            _issue_c(c_desc, c_bufs, c_bars, 0, pid, num_n, BLOCK_M, BLOCK_N)
        for g in gl.static_range(STAGES - 1):
            if g < total:
                _issue_ab(a_desc, b_desc, a_bufs, b_bufs, bars, g, pid, nprog, num_n, k_steps,
                          BLOCK_M, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip

        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for g in range(total):
            s = g % STAGES
            ks = g % k_steps
            mbarrier.wait(bars.index(s), (g // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, use_acc=ks > 0, is_async=True)
            # The MMA of step g - 1 is done: its stage takes step g + STAGES - 1's loads.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            if g + STAGES - 1 < total:
                _issue_ab(a_desc, b_desc, a_bufs, b_bufs, bars, g + STAGES - 1, pid, nprog, num_n, k_steps,
                          BLOCK_M, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
            if ks == k_steps - 1:
                acc = warpgroup_mma_wait(0, deps=(acc,))
                j = g // k_steps
                tile = pid + j * nprog
                # The other C buffer held tile j - 1, whose store must have left it before the next
                # tile's C lands there; that store has had this tile's MMAs to finish.
                tma.store_wait(pendings=0)
                if j + 1 < my_tiles:
                    _issue_c(c_desc, c_bufs, c_bars, j + 1, tile + nprog, num_n, BLOCK_M, BLOCK_N)
                c_buf = c_bufs.index(j % 2)
                mbarrier.wait(c_bars.index(j % 2), (j // 2) & 1)
                c_old = c_buf.load(acc_layout)
                c_buf.store((acc + c_old.to(gl.float32)).to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [(tile // num_n) * BLOCK_M, (tile % num_n) * BLOCK_N], c_buf)
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(c_bars.index(i))


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def usable(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the Gluon kernel can run ``c += a.T @ b``: Gluon present, an sm_90 GPU, 16-bit float
    operands of one dtype, row-major rows on 16-byte boundaries (TMA's rules), shapes that agree."""
    if not HAVE_GLUON or c.device.type != "cuda":
        return False
    if not _sm90(c.device.index if c.device.index is not None else torch.cuda.current_device()):
        return False
    if c.dtype not in (torch.bfloat16, torch.float16) or a.dtype != c.dtype or b.dtype != c.dtype:
        return False
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2 or a.shape[0] != b.shape[0]:
        return False
    if a.shape[1] != c.shape[0] or b.shape[1] != c.shape[1] or a.shape[0] == 0:
        return False
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in (c, a, b))  # fmt: skip


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def dw_update(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: dict | None = None) -> None:
    """c (M, N) += a.T @ b in place, a (K, M), b (K, N), fp32 accumulation, c rounded once. The caller
    checks :func:`usable` first."""
    cfg = dict(config or CONFIG)
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    programs_per_sm = cfg.pop("programs_per_sm", 1)
    (k, m), n = a.shape, b.shape[1]
    dt = _gl_dtype(c.dtype)
    a_desc = TensorDescriptor.from_tensor(a, [bk, bm], gl.NVMMASharedLayout.get_default_for([bk, bm], dt))
    b_desc = TensorDescriptor.from_tensor(b, [bk, bn], gl.NVMMASharedLayout.get_default_for([bk, bn], dt))
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], dt))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(c.device).multi_processor_count
    grid = (min(tiles, sms * programs_per_sm),)
    _dw_update_kernel[grid](a_desc, b_desc, c_desc, m, n, k, **cfg)


__all__ = ["CONFIG", "HAVE_GLUON", "dw_update", "usable"]
