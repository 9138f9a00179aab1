"""AttentionMetadata: what every model's attention needs to know about one step, whatever the architecture.

The engine's model runner and the trainer build it; each model's attention reads it (a plain causal
varlen forward without cache, or attention over the paged KV cache). No model code lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs to know about a step of T new tokens from B sequences.

    cu_seqlens_q: (B+1,) int32, prefix sums of the new tokens per sequence.
    max_seqlen_q: the largest new-token count (host int; sizes the kernel grid without a sync).
    kv_caches: one (k_cache, v_cache) per layer, each (num_blocks, block_size, Hkv, D); or None for a
        plain causal varlen forward over the new tokens only (prefill without cache, training).
    context_lens: (B,) int32, cached + new tokens per sequence (with kv_caches).
    slot_mapping: (T,) int64, flat slot block * block_size + offset where each new token's K/V is
        written; -1 skips (with kv_caches).
    block_tables: (B, max_blocks) int32, each sequence's blocks in order (with kv_caches).
    split: with kv_caches, set by the engine's graph pieces (``engine/cuda_graphs.PiecewiseGraphs``):
        each attention layer calls ``split(layer, q, k, v)`` and uses what it returns (T, Hq, D)
        instead of attending over the cache itself; the pieces run ``layer.attend_cache`` between
        them. None: the layer attends.
    """

    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    context_lens: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    split: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def varlen(cls, seqlens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for plain causal attention over packed sequences of ``seqlens`` tokens, no cache."""
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        return cls(cu_seqlens_q=cu, max_seqlen_q=max(seqlens, default=0))
