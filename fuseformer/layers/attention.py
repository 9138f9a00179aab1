"""Self-attention module: packed QKV projection, optional q/k RMSNorm (Qwen3), rotary, flash attention.

    qkv = x W_qkv^T (+ b)                 one GEMM of (Hq + 2 Hkv) * D outputs, rows [q | k | v]
    q, k = rms_norm(q), rms_norm(k)       per head over D, when ``qk_norm`` (Qwen3)
    q, k = rotary(q, cos, sin), ...       when cos/sin are given
    out = flash_attention(q, k, v) W_o^T

It holds the parameters and calls the ops; nothing more (STYLE.md §2).
"""

from __future__ import annotations

import torch
from torch import nn

import fuseformer.ops as F
from fuseformer.layers.linear import Linear
from fuseformer.layers.norms import RMSNorm


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention on flash attention.

    Args:
        hidden_size: model width.
        num_heads: Hq.
        num_kv_heads: Hkv (Hq a multiple of it); Hq when None (MHA).
        head_dim: D; hidden_size // num_heads when None.
        bias: bias on the QKV projection (Qwen2 has one); ``o_bias`` on the output projection.
        qk_norm: RMSNorm of q and k per head over D before rotary (Qwen3), weights ``q_norm.weight``,
            ``k_norm.weight`` (D,).
        norm_eps: eps of those norms.
        causal, window_size, softmax_scale: passed to :func:`fuseformer.ops.flash_attention`.
        interleaved_rotary: GPT-J pairs (2i, 2i + 1) instead of NeoX/Llama halves.

    Parameters: ``qkv_proj`` (Linear hidden -> (Hq + 2 Hkv) * D), ``o_proj`` (Linear Hq * D -> hidden).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        softmax_scale: float | None = None,
        interleaved_rotary: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"Attention: num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
            )
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(f"Attention: hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
            head_dim = hidden_size // num_heads
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_kv_heads = num_kv_heads
        self.causal, self.window_size, self.softmax_scale = causal, tuple(window_size), softmax_scale
        self.interleaved_rotary = interleaved_rotary
        factory = dict(device=device, dtype=dtype)
        self.qkv_proj = Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, **factory)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias, **factory)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, **factory)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, **factory)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """x (B, S, hidden), or packed (T, hidden) with ``cu_seqlens`` (B + 1,) int32 -> like x.

        cos, sin: (S_max, rotary_dim / 2) tables (see :class:`RotaryEmbedding`), or None for no
        rotary. Position s of each sequence uses row s.
        """
        lead = x.shape[:-1]
        qkv = self.qkv_proj(x).view(*lead, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=-2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            rot = dict(interleaved=self.interleaved_rotary, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            q = F.apply_rotary(q, cos, sin, **rot)
            k = F.apply_rotary(k, cos, sin, **rot)
        out = F.flash_attention(
            q,
            k,
            v,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            window_size=self.window_size,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
        )
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, qk_norm={self.qk_norm}, causal={self.causal}, window_size={self.window_size}"
        )
