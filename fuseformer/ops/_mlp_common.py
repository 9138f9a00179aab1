"""What the gated MLP's two Triton GEMMs share (mlp.py's gate-up kernel, mlp_decode.py's decode kernel):
the epilogue y = act(g) * u (and the pre-activation saved for the backward), the split-K reduction of
fp32 partials, and the alignment a tensor descriptor needs. Both modules import from here; mlp.py
imports mlp_decode.py (its forward dispatches to the decode kernels), never the other way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import next_pow2
from fuseformer.ops.activations import _act_fwd


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _gate_up_epilogue(acc_g, acc_u, Y, PRE, rows, rn, mask, stride_ym, stride_pm, N, ACTIVATION: tl.constexpr,
                      SAVE_PRE: tl.constexpr):  # fmt: skip
    """y = act(g) * u from fp32 g, u tiles; [g | u] rounded to PRE when saving for the backward."""
    if SAVE_PRE:
        # The backward reads the pre-activation rounded to the input dtype, as eager PyTorch's does.
        g = acc_g.to(PRE.dtype.element_ty)
        u = acc_u.to(PRE.dtype.element_ty)
        tl.store(PRE + rows * stride_pm + rn[None, :], g, mask=mask)
        tl.store(PRE + rows * stride_pm + (N + rn)[None, :], u, mask=mask)
    y = _act_fwd(acc_g, ACTIVATION) * acc_u
    tl.store(Y + rows * stride_ym + rn[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _mlp_split_k_epilogue_kernel(
    WS, Y, PRE,
    M, N,
    stride_ym, stride_pm,
    ACTIVATION: tl.constexpr, SAVE_PRE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GLU: tl.constexpr = True,
):  # fmt: skip
    # Sums the SPLIT_K fp32 partials of WS in split order (deterministic): (SPLIT_K, M, 2N) [g | u]
    # then the activation (GLU), or (SPLIT_K, M, N) rounded to Y as they are (the down GEMM).
    col_blocks = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    rm = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)[:, None]
    width = 2 * N if GLU else N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ws = WS + (s * M + rows) * width
        acc_g += tl.load(ws + rn[None, :], mask=mask, other=0.0)
        if GLU:
            acc_u += tl.load(ws + (N + rn)[None, :], mask=mask, other=0.0)
    if GLU:
        _gate_up_epilogue(acc_g, acc_u, Y, PRE, rows, rn, mask, stride_ym, stride_pm, N, ACTIVATION, SAVE_PRE)
    else:
        tl.store(Y + rows * stride_ym + rn[None, :], acc_g.to(Y.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host helpers
# --------------------------------------------------------------------------------------------
def _split_k_reduce(ws: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None, activation: str, glu: bool) -> None:
    """Sum the fp32 split-K partials ws (S, T, 2N [g | u] with ``glu``, else N) in split order into
    out (T, N): act(g) * u (and [g | u] into ``pre`` when given), or the plain sum."""
    split, t, _ = ws.shape
    n = out.shape[1]
    bm, bn = min(16, next_pow2(t)), 256
    _mlp_split_k_epilogue_kernel[(triton.cdiv(t, bm) * triton.cdiv(n, bn),)](
        ws, out, pre if pre is not None else out,
        t, n,
        out.stride(0), pre.stride(0) if pre is not None else 0,
        ACTIVATION=activation, SAVE_PRE=pre is not None, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, GLU=glu,
        num_warps=4,
    )  # fmt: skip


def _aligned(t: torch.Tensor) -> bool:
    """What a tensor descriptor needs: a 16-byte aligned base and row stride."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0
