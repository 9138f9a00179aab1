"""The fused linear cross-entropy's grad_weight update for Hopper in Gluon: dW (V, H) += L^T h, with L
a chunk's dlogits (K, V) and h its hidden states (K, H), K a few hundred tokens, in the shape of the
gate-up kernel of ops/mlp_hopper.py: two consumer warpgroups (64 of a tile's 128 vocabulary rows each)
that meet only at mbarriers, and a producer warp streaming L, h and dW's tile by TMA.

Why: at K ~256 tokens the update moves more bytes (dW read and written, 2.1 GB at V 128256, H 4096:
0.49 ms at the H200's copy rate) than its MMAs take time (~0.4 ms), and cuBLAS's kernel (0.81-0.85 ms
a pass, runs 74-79) overlaps the two poorly: its time is ~0.78 ms + 0.2 us a token. A one-partition
Gluon kernel (run 79, removed) added them instead: ~0.44 ms + 1.7 us a token. Here the producer
fetches each tile's dW while the consumers run the tile's MMAs, and the consumers add and store it
(TMA) while the producer already streams the next tile's operands, so the pass over dW and the MMAs
overlap. The gate-up kernel of the same shape runs level with cuBLAS's GEMM (run 86).

Scope (else cuBLAS's addmm_): sm_90, bf16/fp16, row-major operands on 16-byte boundaries (TMA's rules).
Gluon has no interpreter: the GPU tests check it against the exact sum, and CI compiles it for sm_90
offline (tests/ops/test_cross_entropy.py).
"""

from __future__ import annotations

import torch
import triton

from fuseformer.ops._gluon import (
    HAVE_GLUON,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    maxnreg,
    mbarrier,
    runs_on,
    tma,
    tma_rows,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from fuseformer.ops._utils import sm_count

BLOCK_M = 128  # vocabulary rows a tile: 64 a consumer warpgroup
# dW columns a tile, the token step, ring stages (each 24 KB a 32-token step), dW tile buffers (64 KB
# each), the register split of the 12 warps. Unmeasured.
CONFIG = dict(BLOCK_N=256, BLOCK_K=32, STAGES=4, C_BUFS=2, CONSUMER_REGS=240, PRODUCER_REGS=24)


if HAVE_GLUON:

    @gluon.jit
    def _producer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, c_ready, c_empty, M, N, K,
                  STAGES: gl.constexpr, C_BUFS: gl.constexpr):  # fmt: skip
        # This program's tiles (pid, pid + programs, ...; the dW columns fastest, so the tiles of one band
        # of vocabulary rows reuse its L boxes from L2), each one's token steps through one ring. dW's
        # tile t goes into buffer t % C_BUFS once the consumers release it (tile t - C_BUFS's store has
        # left it); that wait comes after the tile's first step is issued, so it never holds the ring up.
        HALF: gl.constexpr = a_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[1]
        nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        steps = gl.cdiv(K, BK)
        num_n = gl.cdiv(N, BN)
        num_tiles = gl.cdiv(M, 2 * HALF) * num_n
        j = 0
        t = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_m = (tile // num_n) * (2 * HALF)
            off_n = (tile % num_n) * BN
            for kk in range(steps):
                s = j % STAGES
                mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                for w in gl.static_range(2):  # each consumer's 64 vocabulary rows in their own box
                    tma.async_copy_global_to_shared(a_desc, [kk * BK, off_m + w * HALF], bar,
                                                    a_bufs.index(2 * s + w))  # fmt: skip
                tma.async_copy_global_to_shared(b_desc, [kk * BK, off_n], bar, b_bufs.index(s))
                j += 1
                if kk == 0:
                    b = t % C_BUFS
                    mbarrier.wait(c_empty.index(b), ((t // C_BUFS) & 1) ^ 1)
                    bar = c_ready.index(b)
                    mbarrier.expect(bar, 2 * c_desc.block_type.nbytes)
                    for w in gl.static_range(2):
                        tma.async_copy_global_to_shared(c_desc, [off_m + w * HALF, off_n], bar,
                                                        c_bufs.index(2 * b + w))  # fmt: skip
            t += 1

    @gluon.jit
    def _consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, c_ready, c_empty, M, N, K, WG: gl.constexpr,
                  STAGES: gl.constexpr, C_BUFS: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[1]  # a_bufs (2 STAGES, BK, 64): stage s, warpgroup w at 2 s + w
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
        zero = gl.zeros([HALF, BN], gl.float32, layout)
        steps = gl.cdiv(K, BK)
        # Where tile t releases tile t - 1's dW buffer (waiting for its store): one buffer, at the first
        # step (the producer then fetches tile t's dW under the other steps); two, at the last step (that
        # store has had the whole tile to finish, and tile t + 1's dW the whole of tile t + 1).
        release = 0 if C_BUFS == 1 else steps - 1
        num_n = gl.cdiv(N, BN)
        num_tiles = gl.cdiv(M, 2 * HALF) * num_n
        j = 0
        t = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_m = (tile // num_n) * (2 * HALF)
            off_n = (tile % num_n) * BN
            acc = zero
            for kk in range(steps):
                s = j % STAGES
                mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(2 * s + WG).permute((1, 0)), b_bufs.index(s), acc,
                                    use_acc=kk > 0, is_async=True)  # fmt: skip
                if kk == release and t > 0:
                    tma.store_wait(pendings=0)
                    mbarrier.arrive(c_empty.index((t - 1) % C_BUFS), count=1)
                # The previous step's MMA is done: its stage goes back to the producer.
                acc = warpgroup_mma_wait(1, deps=(acc,))
                if kk > 0:
                    mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
                j += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            b = t % C_BUFS
            mbarrier.wait(c_ready.index(b), (t // C_BUFS) & 1)
            c_buf = c_bufs.index(2 * b + WG)
            c_buf.store((acc + c_buf.load(layout).to(gl.float32)).to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m + WG * HALF, off_n], c_buf)
            t += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _dw_update_kernel(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr, C_BUFS: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):  # fmt: skip
        # c (M, N) += a^T b: a (K, M), b (K, N); M vocabulary rows, N = H, K tokens. Persistent.
        dtype: gl.constexpr = c_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2 * C_BUFS] + c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [C_BUFS, 1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [C_BUFS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive a consumer warpgroup
        for i in gl.static_range(C_BUFS):
            mbarrier.init(c_ready.index(i), count=1)
            mbarrier.init(c_empty.index(i), count=2)
        fence_async_shared()
        c0 = (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, c_ready, c_empty, M, N, K, 0, STAGES, C_BUFS)
        c1 = (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, c_ready, c_empty, M, N, K, 1, STAGES, C_BUFS)
        pr = (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, c_ready, c_empty, M, N, K, STAGES, C_BUFS)
        gl.warp_specialize([(_consumer, c0), (_consumer, c1), (_producer, pr)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


def usable(dw: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether the Gluon kernel can run ``dw += dlogits.T @ h``: an sm_90 GPU, 16-bit float operands of
    one dtype, 2-D row-major rows on 16-byte boundaries (TMA's rules), shapes that agree."""
    if not runs_on(dw.device) or dw.dtype not in (torch.bfloat16, torch.float16):
        return False
    if dlogits.dtype != dw.dtype or h.dtype != dw.dtype or dlogits.dim() != 2 or h.dim() != 2 or dw.dim() != 2:
        return False
    (k, v), (k2, n) = dlogits.shape, h.shape
    if k == 0 or k != k2 or (v, n) != tuple(dw.shape):
        return False
    return tma_rows(dw) and tma_rows(dlogits) and tma_rows(h)


def dw_update(dw: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor, config: dict | None = None) -> None:
    """dw (V, H) += dlogits.T @ h in place: dlogits (K, V), h (K, H), fp32 accumulation, dw rounded once
    (as ``addmm_``), for inputs :func:`usable` took."""
    cfg = dict(CONFIG, **(config or {}))
    v, n = dw.shape
    k = h.shape[0]
    dt = gl.bfloat16 if dw.dtype == torch.bfloat16 else gl.float16
    bn, bk, half = cfg["BLOCK_N"], cfg["BLOCK_K"], BLOCK_M // 2
    a_desc = TensorDescriptor.from_tensor(dlogits, [bk, half], gl.NVMMASharedLayout.get_default_for([bk, half], dt))
    b_desc = TensorDescriptor.from_tensor(h, [bk, bn], gl.NVMMASharedLayout.get_default_for([bk, bn], dt))
    c_desc = TensorDescriptor.from_tensor(dw, [half, bn], gl.NVMMASharedLayout.get_default_for([half, bn], dt))
    consumer_regs, producer_regs = cfg["CONSUMER_REGS"], cfg["PRODUCER_REGS"]
    tiles = triton.cdiv(v, BLOCK_M) * triton.cdiv(n, bn)
    _dw_update_kernel[(min(tiles, sm_count(dw)),)](
        a_desc, b_desc, c_desc, v, n, k, STAGES=cfg["STAGES"], C_BUFS=cfg["C_BUFS"], CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=maxnreg(consumer_regs, producer_regs),
    )  # fmt: skip


__all__ = ["CONFIG", "HAVE_GLUON", "dw_update", "usable"]
