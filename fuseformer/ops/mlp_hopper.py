"""The fused MLP's gate-up GEMM for Hopper in Gluon, in the shape of the attention kernels of
ops/attention_hopper.py: two consumer warpgroups (64 of a tile's 128 token rows each) that meet only at
mbarriers, and a producer warp streaming x, gate and up boxes by TMA through a ring.

y = act(x Wg^T) * (x Wu^T), x (T, H), w_gate_up (2I, H) = [Wg; Wu], y (T, I): each consumer keeps
its 64 x BLOCK_N gate and up accumulators in registers and applies act(g) * u in its epilogue, so
the (T, 2I) pre-activation is never written.

Why: the Triton gate-up kernel (ops/mlp.py) runs at 0.92-0.93x cuBLAS's GEMM (runs 47, 86, 88); the
same structure took the attention kernels from 0.82x to 1.0x cuDNN's forward (runs 81-83). Measured on
the H200 (bf16, T 8192, H 4096, I 14336, act*mul included): 2.845 ms against cuBLAS's plain gate-up
GEMM's 2.826 (run 86) and 2.789 against 2.767 (run 88): 0.99x; the fused MLP 1.03-1.05x torch.compile's.
On by default (`mlp._GLUON_GATE_UP`) from `mlp._GLUON_MIN_TOKENS` tokens. Scope: sm_90, bf16/fp16, silu
or gelu_tanh, no saved pre-activation (inference and the forward of a recomputing backward), H a
multiple of 64 and I of 128, row-major operands on 16-byte boundaries.
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
from fuseformer.ops._utils import SM90_SMEM_BYTES, empty, sm_count
from fuseformer.runtime import autotune

BLOCK_M = 128  # token rows a program: 64 a consumer warpgroup
# Output columns a tile (its gate and up boxes each), the K step, ring stages, tile grouping, the
# register split of the 12 warps, and one program a SM walking the tiles (else one a tile); four 48 KB
# stages and a 32 KB output box fit in 227 KB. Runs 86 / 88 (ms at the goal shape, bench_ms): this
# config 2.660 / 2.772; one program a tile 2.943 / 2.853; 3 stages 2.785 / 2.748; GROUP_M 16 2.766 /
# 2.748; GROUP_M 4 2.842 / 2.788.
CONFIG = dict(BLOCK_N=128, BLOCK_K=64, STAGES=4, GROUP_M=8, CONSUMER_REGS=240, PRODUCER_REGS=24, PERSISTENT=True)


if HAVE_GLUON:
    _LOG2E = gl.constexpr(1.4426950408889634)
    _SQRT_2_OVER_PI = gl.constexpr(0.7978845608028654)
    _GELU_C = gl.constexpr(0.044715)

    @gluon.jit
    def _tile(tile, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        # (first row, first column) of output tile ``tile`` in grouped order: GROUP_M row blocks share
        # each column block's weights while they sit in L2.
        num_m = gl.cdiv(M, BM)
        width = GROUP_M * gl.cdiv(N, BN)
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        return (first_m + (tile % width) % size_m) * BM, ((tile % width) // size_m) * BN

    @gluon.jit
    def _producer(x_desc, w_desc, x_bufs, g_bufs, u_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr):  # fmt: skip
        # Every tile of this program (tiles pid, pid + programs, ...), its K steps through one ring: the
        # next tile's first boxes load while the consumers run this tile's epilogue.
        HALF: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        nbytes: gl.constexpr = 2 * x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
        steps = gl.cdiv(K, BK)
        num_tiles = gl.cdiv(M, 2 * HALF) * gl.cdiv(N, BN)
        j = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_m, off_n = _tile(tile, M, N, 2 * HALF, BN, GROUP_M)
            for kk in range(steps):
                s = j % STAGES
                mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                for w in gl.static_range(2):  # each consumer's 64 rows in their own box
                    tma.async_copy_global_to_shared(x_desc, [off_m + w * HALF, kk * BK], bar,
                                                    x_bufs.index(2 * s + w))  # fmt: skip
                tma.async_copy_global_to_shared(w_desc, [off_n, kk * BK], bar, g_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [N + off_n, kk * BK], bar, u_bufs.index(s))
                j += 1

    @gluon.jit
    def _consumer(y_desc, x_bufs, g_bufs, u_bufs, y_smem, ready, empty, M, N, K,
                  WG: gl.constexpr, GELU: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = y_desc.block_type.shape[0]
        BN: gl.constexpr = y_desc.block_type.shape[1]
        BK: gl.constexpr = x_bufs.type.shape[2]  # x_bufs (2 STAGES, 64, BK): stage s, warpgroup w at 2 s + w
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
        zero = gl.zeros([HALF, BN], gl.float32, layout)
        out = y_smem.index(WG)
        steps = gl.cdiv(K, BK)
        num_tiles = gl.cdiv(M, 2 * HALF) * gl.cdiv(N, BN)
        j = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_m, off_n = _tile(tile, M, N, 2 * HALF, BN, GROUP_M)
            acc_g = zero
            acc_u = zero
            for kk in range(steps):
                s = j % STAGES
                mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                x = x_bufs.index(2 * s + WG)  # (64, BK), this warpgroup's rows
                acc_g = warpgroup_mma(x, g_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(x, u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                # The previous step's two MMAs are done: its stage goes back to the producer.
                acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))
                if kk > 0:
                    mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
                j += 1
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            if GELU:  # gelu_tanh: g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3), as ops/activations.py
                z2 = (2.0 * _SQRT_2_OVER_PI) * acc_g * (1.0 + _GELU_C * acc_g * acc_g)
                act = acc_g / (1.0 + gl.exp2(-_LOG2E * z2))
            else:  # silu: g / (1 + e^-g)
                act = acc_g / (1.0 + gl.exp2(-_LOG2E * acc_g))
            tma.store_wait(pendings=0)  # the previous tile's store has left the output box
            out.store((act * acc_u).to(y_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(y_desc, [off_m + WG * HALF, off_n], out)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gate_up_kernel(x_desc, w_desc, y_desc, M, N, K, ACTIVATION: gl.constexpr, STAGES: gl.constexpr,
                        GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):  # fmt: skip
        # x (M, K), w (2N, K) = [gate rows; up rows], y (M, N); M tokens, N = I, K = H. Persistent: the
        # grid's programs share the tiles (one program a tile when the grid covers them all).
        dtype: gl.constexpr = x_desc.dtype
        x_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        y_smem = gl.allocate_shared_memory(dtype, [2] + y_desc.block_type.shape, y_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive a consumer warpgroup
        fence_async_shared()
        GELU: gl.constexpr = ACTIVATION == "gelu_tanh"
        c0 = (y_desc, x_bufs, g_bufs, u_bufs, y_smem, ready, empty, M, N, K, 0, GELU, GROUP_M, STAGES)
        c1 = (y_desc, x_bufs, g_bufs, u_bufs, y_smem, ready, empty, M, N, K, 1, GELU, GROUP_M, STAGES)
        pr = (x_desc, w_desc, x_bufs, g_bufs, u_bufs, ready, empty, M, N, K, GROUP_M, STAGES)
        gl.warp_specialize([(_consumer, c0), (_consumer, c1), (_producer, pr)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


def usable(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str, save_pre: bool) -> bool:
    """Whether this kernel can take the gate-up GEMM (see the module's scope); else the Triton one does."""
    if save_pre or activation not in ("silu", "gelu_tanh") or not runs_on(x.device):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w_gate_up.dtype != x.dtype or x.dim() != 2:
        return False
    (t, h), (i2, h2) = x.shape, w_gate_up.shape
    if t == 0 or h != h2 or h % 64 or i2 % 256:
        return False
    return tma_rows(x) and tma_rows(w_gate_up)


# The autotune cache's name for this kernel (runtime/autotune.py): a config stored for (kernel, GPU,
# Triton version, "bfloat16" / "float16") replaces CONFIG.
KERNEL = "mlp_gluon_gate_up"


def _fits(cfg: dict) -> bool:
    # The ring (x boxes for both consumers, gate and up boxes) and the two output boxes in shared memory,
    # 16-bit elements; tile sizes the kernel's layouts take.
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if bn not in (64, 128, 256) or bk not in (32, 64, 128) or cfg["STAGES"] < 2:
        return False
    ring = cfg["STAGES"] * (BLOCK_M * bk + 2 * bn * bk) * 2
    return ring + BLOCK_M * bn * 2 <= SM90_SMEM_BYTES


def launch_config(dtype: torch.dtype, device=None, config: dict | None = None) -> dict:
    """The launch config: the autotune cache's for this GPU and dtype (a stored entry with other fields,
    or one that does not fit in shared memory, is ignored with a warning), else CONFIG; ``config`` on
    top (sweeps)."""
    stored = autotune.get_config(KERNEL, autotune.dtype_name(dtype), device=device, fields=tuple(CONFIG), check=_fits)
    return dict(stored if stored is not None else CONFIG, **(config or {}))


def gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str, config: dict | None = None) -> torch.Tensor:
    """y (T, I) = act(x Wg^T) * (x Wu^T) for x (T, H), w_gate_up (2I, H), inputs :func:`usable` took."""
    cfg = launch_config(x.dtype, x.device, config)
    t, h = x.shape
    i = w_gate_up.shape[0] // 2
    y = empty((t, i), dtype=x.dtype, device=x.device)
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    bn, bk, half = cfg["BLOCK_N"], cfg["BLOCK_K"], BLOCK_M // 2
    x_desc = TensorDescriptor.from_tensor(x, [half, bk], gl.NVMMASharedLayout.get_default_for([half, bk], dt))
    w_desc = TensorDescriptor.from_tensor(w_gate_up, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    y_desc = TensorDescriptor.from_tensor(y, [half, bn], gl.NVMMASharedLayout.get_default_for([half, bn], dt))
    consumer_regs, producer_regs = cfg["CONSUMER_REGS"], cfg["PRODUCER_REGS"]
    tiles = triton.cdiv(t, BLOCK_M) * triton.cdiv(i, bn)
    grid = (min(tiles, sm_count(x)) if cfg["PERSISTENT"] else tiles,)
    _gate_up_kernel[grid](
        x_desc, w_desc, y_desc, t, i, h, ACTIVATION=activation, STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"],
        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4,
        maxnreg=maxnreg(consumer_regs, producer_regs),
    )  # fmt: skip
    return y


__all__ = ["CONFIG", "HAVE_GLUON", "KERNEL", "gate_up", "launch_config", "usable"]
