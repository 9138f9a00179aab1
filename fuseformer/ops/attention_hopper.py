"""Flash attention for Hopper in Gluon (forward, and the backward's dK/dV and dq kernels): two consumer
warpgroups that never meet at a CTA barrier, and a producer warp that streams the tiles by TMA.

Why: the Triton forward (ops/attention.py) runs a 128-row q tile on 8 warps, and its two warpgroups
meet at a CTA barrier every key block (Nsight Compute, run 46: barrier stalls 36% of the cycles
between issues, tensor pipe ~50% busy), so neither warpgroup's softmax runs under the other's MMAs.
Here each consumer warpgroup owns 64 of the tile's 128 q rows and only waits on mbarriers: the K/V
stage it needs has landed, and (the producer) a stage both consumers have released. The warp
scheduler then runs one warpgroup's exp2s while the other's wgmmas run, as FlashAttention-3 does.

Each consumer issues key block j+1's q k^T before block j's PV MMA, so block j+1's softmax runs while
block j's PV MMA does (FlashAttention-3's in-warpgroup overlap).
Run 82 (H200, bf16, 16384 tokens, H 32): causal S4096 534.6 TFLOP/s, full S16384 643.6, against
cuDNN's 518.2 / 606.8 and this package's Triton kernel's 443.5 / 523.4 in the same run. The backward
(dK/dV, then dq, each recomputing the scores; run 85): causal S4096 418.0, full S16384 476.8, against
cuDNN's 454.5 / 541.7 and the Triton kernels' 349.2 / 397.3.

Scope (everything else takes the Triton kernel): sm_90, fp16/bf16, head dim 64 or 128 (HEAD_DIMS; the dq
kernel at 128 only, DQ_HEAD_DIMS), batched (B, S, H, D)
with unit-stride rows, seqlen_q == seqlen_k a multiple of 128, no window or causal (aligned, which
is the same for equal lengths), GQA/MQA through the head index, a positive softmax scale. Gluon has
no interpreter: the GPU tests check these kernels against the fp64 reference, and CI compiles them
for sm_90 offline (tests/ops/test_attention.py).
"""

from __future__ import annotations

import torch

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
    warpgroup_mma,
    warpgroup_mma_wait,
)
from fuseformer.ops._utils import empty
from fuseformer.runtime import autotune

BLOCK_M = 128  # q rows a program: 64 a consumer warpgroup
BLOCK_N = 128  # keys a stage
# Head dims the kernels take. Run 89 (H200, hd 64 causal S4096, B 4, H 32, ms): forward Triton 0.697,
# Gluon 3 stages 0.696, 4 stages 0.677 (cuDNN 0.663); backward all Triton 2.416, Gluon dK/dV + Triton dq
# 1.917, Gluon dK/dV + Gluon dq 2.04-2.08 (cuDNN 1.805). So hd 64 takes 4 stages forward (HD_CONFIGS)
# and the Triton dq kernel (DQ_HEAD_DIMS). Runs 98-100 also tried the Gluon dq at hd 64 with 128 keys a
# stage: the whole backward 1.898-1.982 ms against the Triton dq's 1.918-1.943, alternated (commits
# f61fb9f-4d987ea have that variant and its sweep attention_dq64).
HEAD_DIMS = (64, 128)
DQ_HEAD_DIMS = (128,)
# The forward at head dim 64 takes sequences from this length: run 138 (H100, bf16, B x S 16384, H 32, us
# Gluon / Triton, eager calls) full S 512 242 / 219, 2048 692 / 656, 4096 1276 / 1290, 8192 2448 / 2515;
# causal 512 247 / 165, 2048 400 / 395, 4096 695 / 726; BERT-base's layer (B 32, S 512, H 12) 152 / 91.
# At head dim 128 it is ahead from S 512 (full 315 / 360, causal 261 / 330).
FWD_MIN_SEQ = {64: 4096, 128: 0}
# Stages of the K/V ring, registers of each consumer warpgroup and of the producer (12 warps, 3
# warpgroups, share 64K registers; the kernel's maxnreg follows). Run 82 (H200, TFLOP/s, causal S4096 /
# full S16384): 3 stages 534.6 / 643.6; 2 stages 456.0 / 531.6 (the early q k^T waits for its K);
# without the in-warpgroup overlap (removed) 485.6–488.4 / 537.2–546.1; cuDNN 518.2 / 606.8.
CONFIG = dict(STAGES=3, CONSUMER_REGS=240, PRODUCER_REGS=24)
# Per head dim, per kernel, what replaces the module defaults (run 89, above).
HD_CONFIGS = {64: {"fwd": dict(STAGES=4, CONSUMER_REGS=232, PRODUCER_REGS=40)}}


if HAVE_GLUON:

    @gluon.constexpr_function
    def _mma_layout(n):
        # A warpgroup's wgmma accumulator of 64 rows by n columns (4 warps stacked along the rows).
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _q_tile(seqlen, hq, group, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr):
        # This program's tile of BM q rows of one q head (grid: q tiles, B * Hq; causal: the longest rows
        # first) and the key blocks it sees: (b * Hq + h, first q position, q row and column in the
        # (B * S, Hq * D) view, K/V row and column in the (B * S, Hkv * D) view, key blocks).
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        m_tile = seqlen // BM - 1 - pid_m if CAUSAL else pid_m
        b = bh // hq
        h = bh % hq
        q_pos = m_tile * BM
        n_blocks = (q_pos + BM) // BN if CAUSAL else seqlen // BN
        return bh, q_pos, b * seqlen + q_pos, h * D, b * seqlen, (h // group) * D, n_blocks

    @gluon.jit
    def _kv_ring(k_desc, v_desc, STAGES: gl.constexpr):
        # K/V stages and their barriers: ready (the producer's TMA landed), empty (both consumers done),
        # and the barrier of the q-side tiles loaded once a program.
        dtype: gl.constexpr = k_desc.dtype
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive a consumer warpgroup
        fence_async_shared()
        return k_bufs, v_bufs, q_bar, ready, empty

    @gluon.jit
    def _store_tile(desc, smem, row, col, value):
        # value into shared memory it no longer needs, then to global memory by TMA.
        smem.store(value)
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [row, col], smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty,
                  q_row, q_col, kv_row, kv_col, n_blocks, HAS_DO: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        # The forward's and the dq kernel's producer warp: the program's q rows (and dO rows) once, then K
        # and V blocks into the ring as the consumers free its stages.
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        if HAS_DO:
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
        else:
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [q_row + w * HALF, q_col], q_bar, q_smem.index(w))
            if HAS_DO:
                tma.async_copy_global_to_shared(do_desc, [q_row + w * HALF, q_col], q_bar, do_smem.index(w))
        for j in range(n_blocks):
            s = j % STAGES
            # A fresh barrier passes a wait on parity 1: the first round finds every stage free.
            mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = kv_ready.index(s)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + j * BN, kv_col], bar, k_bufs.index(s))
            tma.async_copy_global_to_shared(v_desc, [kv_row + j * BN, kv_col], bar, v_bufs.index(s))

    @gluon.jit
    def _softmax_step(sc, m_i, l_i, rows, j, n_blocks, qk_scale, CAUSAL: gl.constexpr, p_layout: gl.constexpr,
                      dtype: gl.constexpr):  # fmt: skip
        # Key block j's scores (raw q k^T) -> its probabilities as the PV MMA's A operand, the running max
        # and sum, and the factor the output accumulated so far is rescaled by. The scale is folded into
        # the exponent's FMA (qk_scale > 0: the max of raw scores is the max of scaled ones).
        BN: gl.constexpr = sc.type.shape[1]
        if CAUSAL:
            if j == n_blocks - 1:  # the diagonal block: keys after the query are masked
                cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, sc.type.layout))
                sc = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale)
        p = gl.exp2(gl.fma(sc, qk_scale, -gl.expand_dims(m_new, 1)))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return m_new, l_i, gl.convert_layout(p.to(dtype), p_layout), alpha

    @gluon.jit
    def _consumer(o_desc, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, lse_ptr,
                  q_row, q_col, q_pos, lse_off, n_blocks, qk_scale,
                  WG: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        # 64 q rows: block j + 1's q k^T is issued before block j's PV MMA, so the softmax of block j + 1
        # runs while block j's PV MMA does (FlashAttention-3's in-warpgroup overlap).
        HALF: gl.constexpr = o_desc.block_type.shape[0]
        BN: gl.constexpr = k_bufs.type.shape[1]
        D: gl.constexpr = k_bufs.type.shape[2]
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = _mma_layout(BN)
        o_layout: gl.constexpr = _mma_layout(D)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        orows_l: gl.constexpr = gl.SliceLayout(1, o_layout)

        q = q_smem.index(WG)
        rows = q_pos + WG * HALF + gl.arange(0, HALF, layout=rows_l)
        acc = gl.zeros([HALF, D], gl.float32, o_layout)
        s_zero = gl.zeros([HALF, BN], gl.float32, s_layout)
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(kv_ready.index(0), 0)
        sc = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc,))
        m_i, l_i, p16, alpha = _softmax_step(sc, gl.full([HALF], float("-inf"), gl.float32, rows_l),
                                             gl.full([HALF], 0.0, gl.float32, rows_l), rows, 0, n_blocks,
                                             qk_scale, CAUSAL, p_layout, dtype)  # fmt: skip
        for j in range(n_blocks - 1):
            s = j % STAGES
            s1 = (j + 1) % STAGES
            mbarrier.wait(kv_ready.index(s1), ((j + 1) // STAGES) & 1)
            sc = warpgroup_mma(q, k_bufs.index(s1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p16, v_bufs.index(s), acc, is_async=True)
            sc = warpgroup_mma_wait(1, deps=(sc,))  # q k^T of block j + 1 done; block j's PV may run on
            m_i, l_i, p_next, alpha = _softmax_step(sc, m_i, l_i, rows, j + 1, n_blocks, qk_scale, CAUSAL,
                                                    p_layout, dtype)  # fmt: skip
            # p16 stays live until its MMA is done: an in-flight wgmma reads its A registers.
            acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
            mbarrier.arrive(kv_empty.index(s), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orows_l), 1)
            p16 = p_next
        last = (n_blocks - 1) % STAGES
        acc = warpgroup_mma(p16, v_bufs.index(last), acc, is_async=True)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
        mbarrier.arrive(kv_empty.index(last), count=1)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        gl.store(lse_ptr + lse_off + WG * HALF + gl.arange(0, HALF, layout=rows_l), lse)
        out = acc / gl.expand_dims(gl.convert_layout(l_i, orows_l), 1)
        _store_tile(o_desc, q, q_row + WG * HALF, q_col, out.to(dtype))  # q's rows are no longer needed

    @gluon.jit
    def _attention_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, seqlen, hq, group, qk_scale,
                              CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        bh, q_pos, q_row, q_col, kv_row, kv_col, n_blocks = _q_tile(
            seqlen, hq, group, 2 * HALF, k_desc.block_type.shape[0], D, CAUSAL
        )
        lse_off = bh * seqlen + q_pos
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, D], q_desc.layout)
        k_bufs, v_bufs, q_bar, kv_ready, kv_empty = _kv_ring(k_desc, v_desc, STAGES)
        c_args0 = (o_desc, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, lse_ptr, q_row, q_col, q_pos, lse_off,
                   n_blocks, qk_scale, 0, CAUSAL, STAGES)  # fmt: skip
        c_args1 = (o_desc, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, lse_ptr, q_row, q_col, q_pos, lse_off,
                   n_blocks, qk_scale, 1, CAUSAL, STAGES)  # fmt: skip
        p_args = (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, q_row,
                  q_col, kv_row, kv_col, n_blocks, False, STAGES)  # fmt: skip
        gl.warp_specialize([(_consumer, c_args0), (_consumer, c_args1), (_producer, p_args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


# The backward's dK/dV kernel: one program a 128-key block of one KV head, each consumer warpgroup 64
# of its keys; q tiles of BWD_BLOCK_M rows streamed with their dO, lse (log2 units) and delta. Run 84
# (H200, whole backward TFLOP/s, stages 2 / 3 / 4): causal S4096 386.4 / 383.4 / 392.8, full S16384
# 447.0 / 450.9 / 445.1, against the Triton dK/dV's 362.7 / 397.2. STAGES None: 4 causal, 3 full.
BWD_BLOCK_M = 64
BWD_CONFIG = dict(STAGES=None, CONSUMER_REGS=240, PRODUCER_REGS=24)


if HAVE_GLUON:

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
                      k_smem, v_smem, kv_bar, ready, empty, kv_row, kv_col, q_row0, stat_row0, seqlen, group,
                      first_tile, n_tiles, STAGES: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = k_desc.block_type.shape[0]
        BM: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [kv_row + w * HALF, kv_col], kv_bar, k_smem.index(w))
            tma.async_copy_global_to_shared(v_desc, [kv_row + w * HALF, kv_col], kv_bar, v_smem.index(w))
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                + delta_desc.block_type.nbytes)  # fmt: skip
        for t in range(group * n_tiles):
            g = t // n_tiles
            q0 = (first_tile + t % n_tiles) * BM
            s = t % STAGES
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            col = (kv_col // D * group + g) * D  # q head kv_h * group + g
            tma.async_copy_global_to_shared(q_desc, [q_row0 + q0, col], bar, q_bufs.index(s))
            tma.async_copy_global_to_shared(do_desc, [q_row0 + q0, col], bar, do_bufs.index(s))
            stat = (stat_row0 + col // D) * seqlen + q0
            tma.async_copy_global_to_shared(lse_desc, [stat], bar, lse_bufs.index(s))
            tma.async_copy_global_to_shared(delta_desc, [stat], bar, delta_bufs.index(s))

    @gluon.jit
    def _bwd_consumer(dk_desc, dv_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready, empty,
                      kv_row, kv_col, key0, first_tile, n_tiles, group, qk_scale, sm_scale,
                      WG: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = k_smem.type.shape[1]  # keys of this warpgroup
        D: gl.constexpr = k_smem.type.shape[2]
        BM: gl.constexpr = q_bufs.type.shape[1]
        dtype: gl.constexpr = dk_desc.dtype
        s_layout: gl.constexpr = _mma_layout(BM)
        g_layout: gl.constexpr = _mma_layout(D)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
        qcols_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        keys_l: gl.constexpr = gl.SliceLayout(1, s_layout)

        k = k_smem.index(WG)
        v = v_smem.index(WG)
        keys = key0 + WG * HALF + gl.arange(0, HALF, layout=keys_l)
        dk = gl.zeros([HALF, D], gl.float32, g_layout)
        dv = gl.zeros([HALF, D], gl.float32, g_layout)
        s_zero = gl.zeros([HALF, BM], gl.float32, s_layout)
        mbarrier.wait(kv_bar, 0)
        for t in range(group * n_tiles):
            s = t % STAGES
            q0 = (first_tile + t % n_tiles) * BM
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            q = q_bufs.index(s)
            do = do_bufs.index(s)
            st = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # (keys, q rows)
            dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
            lse2 = lse_bufs.index(s).load(qcols_l)
            delta = delta_bufs.index(s).load(qcols_l)
            pt = gl.exp2(gl.fma(st, qk_scale, -gl.expand_dims(lse2, 0)))
            if CAUSAL:
                if q0 < key0 + 2 * HALF:  # the q tile meets the block's diagonal: keys after the query masked
                    rows = q0 + gl.arange(0, BM, layout=qcols_l)
                    pt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0), pt, 0.0)
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            pt16 = gl.convert_layout(pt.to(dtype), a_layout)
            dst16 = gl.convert_layout(dst.to(dtype), a_layout)
            dv = warpgroup_mma(pt16, do, dv, is_async=True)
            dk = warpgroup_mma(dst16, q, dk, is_async=True)
            dv, dk, pt16, dst16 = warpgroup_mma_wait(0, deps=(dv, dk, pt16, dst16))
            mbarrier.arrive(empty.index(s), count=1)
        # This warpgroup's K and V rows are no longer needed: the gradients are staged there.
        k.store((dk * sm_scale).to(dtype))
        v.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [kv_row + WG * HALF, kv_col], k)
        tma.async_copy_shared_to_global(dv_desc, [kv_row + WG * HALF, kv_col], v)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _dkdv_kernel(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, dk_desc, dv_desc, seqlen, hkv, group,
                     qk_scale, sm_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = k_desc.block_type.shape[0]
        BN: gl.constexpr = 2 * HALF
        BM: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        dtype: gl.constexpr = q_desc.dtype
        pid_n = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // hkv
        kv_h = bh % hkv
        key0 = pid_n * BN
        kv_row = b * seqlen + key0
        kv_col = kv_h * D
        q_row0 = b * seqlen
        stat_row0 = b * hkv * group  # row b * Hq of the (B * Hq, S) statistics
        first_tile = key0 // BM if CAUSAL else 0  # causal: q rows before the block's first key see none of it
        n_tiles = seqlen // BM - first_tile

        q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], lse_desc.layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], delta_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, HALF, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, HALF, D], v_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        c0 = (dk_desc, dv_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready, empty, kv_row, kv_col,
              key0, first_tile, n_tiles, group, qk_scale, sm_scale, 0, CAUSAL, STAGES)  # fmt: skip
        c1 = (dk_desc, dv_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ready, empty, kv_row, kv_col,
              key0, first_tile, n_tiles, group, qk_scale, sm_scale, 1, CAUSAL, STAGES)  # fmt: skip
        pr = (q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem,
              v_smem, kv_bar, ready, empty, kv_row, kv_col, q_row0, stat_row0, seqlen, group, first_tile, n_tiles,
              STAGES)  # fmt: skip
        gl.warp_specialize([(_bwd_consumer, c0), (_bwd_consumer, c1), (_bwd_producer, pr)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


# The backward's dq kernel: one program 128 q rows of one q head (64 a consumer warpgroup), key blocks
# of DQ_BLOCK_N streamed with their V. Run 85 (H200, whole backward TFLOP/s with the Gluon dK/dV, dq
# stages 2 / 3 / 4): causal S4096 414.6 / 418.0 / 415.3, full S16384 476.8 / 476.8 / 478.1.
DQ_BLOCK_N = 64
DQ_CONFIG = dict(STAGES=3, CONSUMER_REGS=240, PRODUCER_REGS=24)


if HAVE_GLUON:

    @gluon.jit
    def _dq_consumer(dq_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, lse_ptr, delta_ptr,
                     q_row, q_col, q_pos, stat_off, n_blocks, qk_scale, sm_scale,
                     WG: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = q_smem.type.shape[1]
        BN: gl.constexpr = k_bufs.type.shape[1]
        D: gl.constexpr = k_bufs.type.shape[2]
        dtype: gl.constexpr = dq_desc.dtype
        s_layout: gl.constexpr = _mma_layout(BN)
        g_layout: gl.constexpr = _mma_layout(D)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
        rows_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        cols_l: gl.constexpr = gl.SliceLayout(0, s_layout)

        q = q_smem.index(WG)
        do = do_smem.index(WG)
        offs = WG * HALF + gl.arange(0, HALF, layout=rows_l)
        rows = q_pos + offs
        lse2 = gl.load(lse_ptr + stat_off + offs) * 1.4426950408889634  # log2 units
        delta = gl.load(delta_ptr + stat_off + offs)
        dq = gl.zeros([HALF, D], gl.float32, g_layout)
        s_zero = gl.zeros([HALF, BN], gl.float32, s_layout)
        mbarrier.wait(q_bar, 0)
        for j in range(n_blocks):
            s = j % STAGES
            mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
            k = k_bufs.index(s)
            sc = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do, v_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc, dp = warpgroup_mma_wait(0, deps=(sc, dp))
            p = gl.exp2(gl.fma(sc, qk_scale, -gl.expand_dims(lse2, 1)))
            if CAUSAL:
                if j * BN + BN > q_pos:  # blocks that reach past the tile's first row: keys after the query masked
                    cols = j * BN + gl.arange(0, BN, layout=cols_l)
                    p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), p, 0.0)
            ds16 = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)
            dq = warpgroup_mma(ds16, k, dq, is_async=True)
            dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))
            mbarrier.arrive(kv_empty.index(s), count=1)
        _store_tile(dq_desc, q, q_row + WG * HALF, q_col, (dq * sm_scale).to(dtype))  # q no longer needed

    @gluon.jit
    def _dq_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_ptr, delta_ptr, seqlen, hq, group, qk_scale,
                   sm_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr):  # fmt: skip
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        dtype: gl.constexpr = q_desc.dtype
        bh, q_pos, q_row, q_col, kv_row, kv_col, n_blocks = _q_tile(
            seqlen, hq, group, 2 * HALF, k_desc.block_type.shape[0], D, CAUSAL
        )
        stat_off = bh * seqlen + q_pos
        q_smem = gl.allocate_shared_memory(dtype, [2, HALF, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, HALF, D], do_desc.layout)
        k_bufs, v_bufs, q_bar, kv_ready, kv_empty = _kv_ring(k_desc, v_desc, STAGES)
        c0 = (dq_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, lse_ptr, delta_ptr, q_row, q_col,
              q_pos, stat_off, n_blocks, qk_scale, sm_scale, 0, CAUSAL, STAGES)  # fmt: skip
        c1 = (dq_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, lse_ptr, delta_ptr, q_row, q_col,
              q_pos, stat_off, n_blocks, qk_scale, sm_scale, 1, CAUSAL, STAGES)  # fmt: skip
        pr = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, kv_ready, kv_empty, q_row,
              q_col, kv_row, kv_col, n_blocks, True, STAGES)  # fmt: skip
        gl.warp_specialize([(_dq_consumer, c0), (_dq_consumer, c1), (_producer, pr)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


# The autotune cache's names for the three kernels (runtime/autotune.py): a config stored for (kernel,
# GPU, Triton version, "causal-bfloat16" / "full-float16" ... at hd 128, "causal-bfloat16-hd64" ... at
# other head dims) replaces the module's defaults above.
KERNELS = {"fwd": "attention_gluon_fwd", "dkdv": "attention_gluon_dkdv", "dq": "attention_gluon_dq"}
_FIELDS = ("STAGES", "CONSUMER_REGS", "PRODUCER_REGS")


def launch_config(
    kind: str, causal: bool, dtype: torch.dtype, device=None, config: dict | None = None, head_dim: int = 128
) -> dict:
    """The launch config of kernel ``kind`` ("fwd", "dkdv", "dq") at ``head_dim``: the autotune cache's
    for this GPU and key, else the module default (with HD_CONFIGS' changes); ``config`` on top (sweeps)."""
    defaults = {"fwd": CONFIG, "dkdv": BWD_CONFIG, "dq": DQ_CONFIG}[kind]
    defaults = dict(defaults, **HD_CONFIGS.get(head_dim, {}).get(kind, {}))
    key = f"{'causal' if causal else 'full'}-{autotune.dtype_name(dtype)}"
    if head_dim != 128:
        key += f"-hd{head_dim}"
    stored = autotune.get_config(KERNELS[kind], key, device=device, fields=_FIELDS)
    cfg = dict(stored if stored is not None else defaults, **(config or {}))
    if cfg["STAGES"] is None:  # the dK/dV kernel's default: 4 stages causal, 3 full (run 84)
        cfg["STAGES"] = 4 if causal else 3
    return cfg


def usable(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    varlen: bool,
    window_left: int,
    window_right: int,
    softmax_scale: float,
) -> bool:
    """Whether this kernel takes the forward (see the module's scope); else the Triton kernel does."""
    if varlen or window_left >= 0 or window_right not in (-1, 0) or not runs_on(q.device):
        return False
    if not softmax_scale > 0:  # the scale is folded into the exponent's FMA after the row max
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.dim() != 4 or q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    b, s, hq, _ = q.shape
    if k.shape[:2] != (b, s) or v.shape != k.shape or s == 0 or s % BLOCK_M or hq % k.shape[2]:
        return False
    # Rows of (B * S, H * D) with unit stride: what the TMA descriptors read.
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v))


def forward_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool, window_left: int,
                   window_right: int, softmax_scale: float) -> bool:  # fmt: skip
    """Whether the Gluon forward takes the call: :func:`usable`, and the sequence at least
    ``FWD_MIN_SEQ`` for the head dim (shorter ones run faster on the Triton kernel)."""
    return usable(q, k, v, varlen, window_left, window_right, softmax_scale) and q.shape[1] >= FWD_MIN_SEQ[q.shape[-1]]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
            config: dict | None = None, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """out (B, S, Hq, D) like q and lse (B, Hq, S) fp32 (natural log), for inputs :func:`usable` took;
    into ``out`` and ``lse`` where given (contiguous, those shapes)."""
    cfg = launch_config("fwd", causal, q.dtype, q.device, config, q.shape[-1])
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    out = empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    lse = empty((b, hq, s), dtype=torch.float32, device=q.device) if lse is None else lse
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    half = BLOCK_M // 2
    q_layout = gl.NVMMASharedLayout.get_default_for([half, d], dt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], dt)
    q_desc = TensorDescriptor.from_tensor(q.view(b * s, hq * d), [half, d], q_layout)
    o_desc = TensorDescriptor.from_tensor(out.view(b * s, hq * d), [half, d], q_layout)
    k_desc = TensorDescriptor.from_tensor(k.view(b * s, hkv * d), [BLOCK_N, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(b * s, hkv * d), [BLOCK_N, d], kv_layout)
    consumer_regs, producer_regs = cfg["CONSUMER_REGS"], cfg["PRODUCER_REGS"]
    _attention_fwd_kernel[(s // BLOCK_M, b * hq)](
        q_desc, k_desc, v_desc, o_desc, lse, s, hq, hq // hkv, softmax_scale * 1.4426950408889634,
        CAUSAL=causal, STAGES=cfg["STAGES"], CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        num_warps=4, maxnreg=maxnreg(consumer_regs, producer_regs),
    )  # fmt: skip
    return out, lse


def backward_dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    config: dict | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dk, dv (B, S, Hkv, D) of the attention :func:`usable` took, from q, k, v, dout (contiguous), the
    forward's lse (B, Hq, S) and delta = rowsum(out * dout) (B, Hq, S), both fp32 (delta already less
    lse's gradient); into ``dk`` and ``dv`` where given (contiguous, like k and v)."""
    cfg = launch_config("dkdv", causal, q.dtype, q.device, config, q.shape[-1])
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    dk = empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    lse2 = (lse * 1.4426950408889634).reshape(-1)  # log2 units, as exp2 takes them
    delta = delta.contiguous().reshape(-1)
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    bm, half = BWD_BLOCK_M, BLOCK_N // 2
    q_layout = gl.NVMMASharedLayout.get_default_for([bm, d], dt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([half, d], dt)
    stat_layout = gl.NVMMASharedLayout.get_default_for([bm], gl.float32)
    q_desc = TensorDescriptor.from_tensor(q.view(b * s, hq * d), [bm, d], q_layout)
    do_desc = TensorDescriptor.from_tensor(dout.view(b * s, hq * d), [bm, d], q_layout)
    lse_desc = TensorDescriptor.from_tensor(lse2, [bm], stat_layout)
    delta_desc = TensorDescriptor.from_tensor(delta, [bm], stat_layout)
    k_desc, v_desc, dk_desc, dv_desc = (TensorDescriptor.from_tensor(t.view(b * s, hkv * d), [half, d], kv_layout)
                                        for t in (k, v, dk, dv))  # fmt: skip
    consumer_regs, producer_regs = cfg["CONSUMER_REGS"], cfg["PRODUCER_REGS"]
    _dkdv_kernel[(s // BLOCK_N, b * hkv)](
        q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, dk_desc, dv_desc, s, hkv, hq // hkv,
        softmax_scale * 1.4426950408889634, softmax_scale,
        CAUSAL=causal, STAGES=cfg["STAGES"], CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=maxnreg(consumer_regs, producer_regs),
    )  # fmt: skip
    return dk, dv


def backward_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    config: dict | None = None,
    dq: torch.Tensor | None = None,
) -> torch.Tensor:
    """dq (B, S, Hq, D) of the attention :func:`usable` took, into ``dq`` where given (contiguous, like
    q); arguments as :func:`backward_dkdv`'s."""
    cfg = launch_config("dq", causal, q.dtype, q.device, config, q.shape[-1])
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    dq = empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    half = BLOCK_M // 2
    q_layout = gl.NVMMASharedLayout.get_default_for([half, d], dt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([DQ_BLOCK_N, d], dt)
    q_desc, do_desc, dq_desc = (TensorDescriptor.from_tensor(t.view(b * s, hq * d), [half, d], q_layout)
                                for t in (q, dout, dq))  # fmt: skip
    k_desc, v_desc = (TensorDescriptor.from_tensor(t.view(b * s, hkv * d), [DQ_BLOCK_N, d], kv_layout) for t in (k, v))
    consumer_regs, producer_regs = cfg["CONSUMER_REGS"], cfg["PRODUCER_REGS"]
    _dq_kernel[(s // BLOCK_M, b * hq)](
        q_desc, do_desc, k_desc, v_desc, dq_desc, lse.contiguous(), delta.contiguous(), s, hq, hq // hkv,
        softmax_scale * 1.4426950408889634, softmax_scale,
        CAUSAL=causal, STAGES=cfg["STAGES"], CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        num_warps=4, maxnreg=maxnreg(consumer_regs, producer_regs),
    )  # fmt: skip
    return dq


__all__ = [
    "BWD_CONFIG",
    "CONFIG",
    "DQ_CONFIG",
    "DQ_HEAD_DIMS",
    "HAVE_GLUON",
    "HD_CONFIGS",
    "HEAD_DIMS",
    "KERNELS",
    "backward_dkdv",
    "backward_dq",
    "forward",
    "launch_config",
    "usable",
]
