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


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, softcap: float) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # (C, V), recomputed in backward
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return TF.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")


# Logits per chunk of the fused linear cross-entropy in training: each chunk reads and writes the
# LM head's gradient once, so the op's memory-lean default (logits of about the hidden states' size:
# 67 chunks at Llama 1B, B 4 x S 4096) spends ~70 GB of traffic on it a step; at 512 MiB, 8 chunks.
# The loss runs at the forward's end, before any layer's gradient exists, below the backward's peak.
LOSS_CHUNK_BYTES = 512 << 20


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    chunk_bytes: int = LOSS_CHUNK_BYTES,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight.T, target), targets -100 ignored.

    hidden (T, H) in the compute dtype, weight (V, H) (cast to hidden's dtype: the fp32 master
    weight's gradient flows back through the cast), target (T,) int64. Returns an fp32 scalar.
    ``chunk_bytes``: the logits of one chunk of the fused op. ``softcap`` > 0 caps the logits first,
    cap * tanh(logits / cap) (Gemma2's ``final_logit_softcapping``).
    """
    weight = weight.to(hidden.dtype)
    fused = getattr(F, "fused_linear_cross_entropy", None)
    if fused is not None:
        # The op returns the loss in hidden's dtype: a bf16/fp16 sum over thousands of tokens would
        # round badly (fp16 overflows past 65504), so ask for the mean (O(1)) and scale it in fp32.
        # Without grad (eval) take the per-token losses and sum them in fp32: a bf16 mean keeps
        # three digits, too few for a held-out loss.
        chunk = max(1, chunk_bytes // (weight.shape[0] * hidden.element_size()))
        if not torch.is_grad_enabled():
            per_token = fused(
                hidden, weight, target, ignore_index=IGNORE_INDEX, reduction="none", chunk_size=chunk, softcap=softcap
            )
            return per_token.float().sum()
        valid = (target != IGNORE_INDEX).sum().float()
        loss = fused(
            hidden, weight, target, ignore_index=IGNORE_INDEX, reduction="mean", chunk_size=chunk, softcap=softcap
        )
        return loss.float() * valid
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.split(_CHUNK), target.split(_CHUNK)):
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, h, weight, t, softcap, use_reentrant=False)
        else:
            total = total + _chunk_loss(h, weight, t, softcap)
    return total
