"""The LM-head loss without full logits: ``fuseformer.ops.fused_linear_cross_entropy`` when the op
is there, else a chunked PyTorch fallback that recomputes each chunk's logits in backward."""

from __future__ import annotations

import torch
import torch.nn.functional as TF
from torch.utils.checkpoint import checkpoint

import fuseformer.ops as F
from fuseformer.train.data import IGNORE_INDEX

# Tokens per chunk of the fallback: at vocab 128256 one fp32 chunk of logits is 4096 * 128256 * 4 B
# = 2 GiB, the same order as the rest of a 1B model's activations at B 4 x S 4096.
_CHUNK = 4096


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.t()  # (C, V), recomputed in backward
    return TF.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight.T, target), targets -100 ignored.

    hidden (T, H) in the compute dtype, weight (V, H) (cast to hidden's dtype: the fp32 master
    weight's gradient flows back through the cast), target (T,) int64. Returns an fp32 scalar.
    """
    weight = weight.to(hidden.dtype)
    fused = getattr(F, "fused_linear_cross_entropy", None)
    if fused is not None:
        # The op returns the loss in hidden's dtype: a bf16/fp16 sum over thousands of tokens would
        # round badly (fp16 overflows past 65504), so ask for the mean (O(1)) and scale it in fp32.
        # Without grad (eval) take the per-token losses and sum them in fp32: a bf16 mean keeps
        # three digits, too few for a held-out loss.
        if not torch.is_grad_enabled():
            return fused(hidden, weight, target, ignore_index=IGNORE_INDEX, reduction="none").float().sum()
        valid = (target != IGNORE_INDEX).sum().float()
        return fused(hidden, weight, target, ignore_index=IGNORE_INDEX, reduction="mean").float() * valid
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.split(_CHUNK), target.split(_CHUNK)):
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, h, weight, t, use_reentrant=False)
        else:
            total = total + _chunk_loss(h, weight, t)
    return total
