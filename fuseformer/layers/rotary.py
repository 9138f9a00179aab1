"""Rotary position embedding module: the cos/sin tables, with Hugging Face's ``rope_scaling`` types.

``RotaryEmbedding`` computes ``inv_freq`` exactly as transformers' ``ROPE_INIT_FUNCTIONS`` (and
``LlamaRotaryEmbedding``'s default) do, keeps cos/sin tables in fp32 for positions
[0, max_position_embeddings), grows them when a longer position is asked, and applies them to q and
k through :func:`fuseformer.ops.apply_rotary` (flash-attn layout: (B, S, H, D) or packed (T, H, D)).

Scaling types (``scaling`` is HF's ``rope_scaling`` / ``rope_parameters`` dict, key ``rope_type`` or
the older ``type``):

- None / "default": inv_freq[i] = 1 / base^(2i / rotary_dim)
- "linear" (factor): inv_freq / factor (position interpolation)
- "dynamic" (factor): NTK-aware: for a sequence of L > max_position_embeddings positions the base
  becomes base * (factor * L / max_pos - (factor - 1))^(d / (d - 2)), recomputed for the current L.
  HF keeps the frequencies of the longest L seen until a sequence shorter than max_pos resets them;
  here they are always those of the current L (the same whenever L only grows, as in decoding).
- "llama3" (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings): Llama 3.1's
  wavelength-dependent interpolation.

``attention_scaling`` is 1.0 for all of these (HF's post-scaling of cos/sin, kept for parity).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import fuseformer.ops as F

_TYPES = ("default", "linear", "dynamic", "llama3")
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


def rope_inv_freq(
    dim: int,
    base: float,
    rope_type: str,
    scaling: dict,
    max_position_embeddings: int,
    seq_len: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(dim / 2,) fp32 inverse frequencies, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them.

    The one copy of these formulas (the module below and the Llama-family model both use it).
    "dynamic" with ``seq_len`` (a tensor of any shape, e.g. (T,) per token, no host sync) gives
    (*seq_len.shape, dim / 2): a length past max_position_embeddings rescales the base, as HF's
    forward does; without ``seq_len`` it is the init value (the plain frequencies).
    """
    if seq_len is not None:
        device = seq_len.device
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if rope_type == "dynamic" and seq_len is not None:
        factor = scaling["factor"]
        length = torch.clamp(seq_len.float(), min=max_position_embeddings)
        scaled_base = base * ((factor * length / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled_base[..., None] ** exponent)
    inv_freq = 1.0 / (base**exponent)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context_len = scaling.get("original_max_position_embeddings", max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (past old_len / low) are divided by factor, short ones (below
        # old_len / high) kept, the band between interpolated smoothly.
        scaled = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_context_len / high) * ~(wavelen > old_context_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE and their application to q and k.

    Args:
        head_dim: D, the head dim of q and k.
        max_position_embeddings: positions the tables hold from the start (grown on demand), and the
            reference length of "dynamic" scaling.
        base: rope_theta.
        rotary_dim: the leading dims of each head that rotate (partial rotary); D when None. Even.
        interleaved: pairs (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim/2) (NeoX, Llama).
        scaling: HF ``rope_scaling`` dict, or None.
        device: where the tables are first built (they follow the inputs' device afterwards).
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scaling: dict | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"{name}: head_dim must be a positive int, got {head_dim!r}")
        if isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, int):
            raise ValueError(f"{name}: max_position_embeddings must be an int, got {max_position_embeddings!r}")
        if max_position_embeddings <= 0:
            raise ValueError(f"{name}: max_position_embeddings must be positive, got {max_position_embeddings}")
        if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 1:
            raise ValueError(f"{name}: base must be a number above 1, got {base!r}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 2 <= rotary_dim <= head_dim:
            raise ValueError(f"{name}: rotary_dim must be an int in [2, head_dim={head_dim}], got {rotary_dim!r}")
        if rotary_dim % 2:
            raise ValueError(f"{name}: rotary_dim must be even, got {rotary_dim}")
        if rotary_dim == 2 and scaling is not None:
            # dynamic divides by (d - 2); keep every type's formula defined.
            raise ValueError(f"{name}: rotary_dim 2 is too small for rope scaling")
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.rotary_dim = rotary_dim
        self.interleaved = bool(interleaved)
        self.scaling = dict(scaling) if scaling else {}
        self.rope_type = _parse_scaling(name, self.scaling)
        self.attention_scaling = 1.0

        device = torch.device(device) if device is not None else torch.device("cpu")
        # Plain attributes, not buffers: module.to(dtype) must not cast the fp32 tables, and they are
        # rebuilt on the inputs' device on first use there.
        self.inv_freq = self._inv_freq(device)
        self._cos, self._sin = self._table(self.inv_freq, max_position_embeddings)
        self._dynamic: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (L, cos, sin) for L > max_pos

    # ----------------------------------------------------------------------------------------
    # inv_freq, as transformers computes it
    # ----------------------------------------------------------------------------------------
    def _inv_freq(self, device: torch.device, seq_len: int | None = None) -> torch.Tensor:
        """(rotary_dim / 2,) fp32. ``seq_len`` only matters for "dynamic" (None: the init value)."""
        length = None if seq_len is None else torch.tensor(seq_len, device=device)
        return rope_inv_freq(
            self.rotary_dim, self.base, self.rope_type, self.scaling, self.max_position_embeddings, length, device
        )

    def _table(self, inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, rotary_dim / 2) fp32 for positions 0..n-1 (HF's position * inv_freq)."""
        positions = torch.arange(n, device=inv_freq.device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    # ----------------------------------------------------------------------------------------
    # Tables
    # ----------------------------------------------------------------------------------------
    def cos_sin(
        self, seqlen: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (seqlen, rotary_dim / 2) for positions 0..seqlen-1, in ``dtype`` on ``device``.

        With "dynamic" scaling and seqlen > max_position_embeddings, the tables of a sequence of
        ``seqlen`` positions (the base depends on it).
        """
        device = torch.device(device) if device is not None else self._cos.device
        if self.rope_type == "dynamic" and seqlen > self.max_position_embeddings:
            if self._dynamic is None or self._dynamic[0] != seqlen or self._dynamic[1].device != device:
                cos, sin = self._table(self._inv_freq(device, seq_len=seqlen), seqlen)
                self._dynamic = (seqlen, cos, sin)
            cos, sin = self._dynamic[1], self._dynamic[2]
        else:
            if self._cos.device != device:
                self.inv_freq = self.inv_freq.to(device)
                self._cos, self._sin = self._table(self.inv_freq, self._cos.shape[0])
            if self._cos.shape[0] < seqlen:
                # Grow geometrically so that decoding past the end does not rebuild every step.
                self._cos, self._sin = self._table(self.inv_freq, max(seqlen, 2 * self._cos.shape[0]))
            cos, sin = self._cos[:seqlen], self._sin[:seqlen]
        return cos.to(dtype), sin.to(dtype)

    def _positions_needed(
        self,
        q: torch.Tensor,
        seqlen_offsets: int | torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int | None,
    ) -> tuple[int | None, int | None]:
        """(positions the tables must hold, max_seqlen). None when unknown without a host sync that
        torch.compile cannot trace: then the tables as they are (>= max_position_embeddings)."""
        readable = not torch.compiler.is_compiling()
        if cu_seqlens is not None:
            if max_seqlen is None and readable and cu_seqlens.numel() > 1:
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            length = max_seqlen
        else:
            length = q.shape[1] if q.dim() == 4 else None
        if length is None:
            return None, max_seqlen
        if isinstance(seqlen_offsets, torch.Tensor):
            if not readable:
                return None, max_seqlen
            hi = int(seqlen_offsets.max()) if seqlen_offsets.numel() else 0
        else:
            hi = seqlen_offsets if isinstance(seqlen_offsets, int) else 0
        return length + max(hi, 0), max_seqlen

    # ----------------------------------------------------------------------------------------
    # Forward
    # ----------------------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        seqlen_offsets: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, S, Hq, D) and k (B, S, Hk, D), or packed (T, H, D) with ``cu_seqlens``.

        Arguments as :func:`fuseformer.ops.apply_rotary`. Returns new (q, k); gradients reach q and k.
        """
        needed, max_seqlen = self._positions_needed(q, seqlen_offsets, cu_seqlens, max_seqlen)
        device = q.device if isinstance(q, torch.Tensor) else None
        if needed is None:
            cos, sin = self._cos, self._sin
            if cos.device != device:
                cos, sin = self.cos_sin(cos.shape[0], device)
        else:
            cos, sin = self.cos_sin(max(needed, 1), device)
        kw = dict(seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        q = F.apply_rotary(q, cos, sin, self.interleaved, **kw)
        k = F.apply_rotary(k, cos, sin, self.interleaved, **kw)
        return q, k

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
            f"max_position_embeddings={self.max_position_embeddings}, rope_type={self.rope_type!r}, "
            f"interleaved={self.interleaved}"
        )


def _parse_scaling(cls: str, scaling: dict) -> str:
    """The rope type of an HF ``rope_scaling`` dict, its required keys checked."""
    if not scaling:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _TYPES:
        raise ValueError(f"{cls}: scaling rope_type {rope_type!r} is not supported; expected one of {_TYPES}")
    for key in _REQUIRED[rope_type]:
        if not isinstance(scaling.get(key), (int, float)) or isinstance(scaling.get(key), bool):
            raise ValueError(f"{cls}: scaling of rope_type {rope_type!r} needs a number {key!r}, got {scaling!r}")
    if rope_type in ("linear", "dynamic", "llama3") and scaling["factor"] <= 0:
        raise ValueError(f"{cls}: scaling factor must be positive, got {scaling['factor']}")
    if rope_type == "llama3" and scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        raise ValueError(f"{cls}: scaling high_freq_factor must differ from low_freq_factor, got {scaling!r}")
    return rope_type
