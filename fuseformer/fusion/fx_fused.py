"""The fused twins of the FX pass's submodules (``fusion/fx.py``).

Each takes the inputs of the original subgraph (the same tuple, in the same order), calls one
fuseformer op, and falls back to the original subgraph, which it holds, for inputs the op does not
take (a head dim above the limit, mixed dtypes, a broadcast), so a call never fails where the
model's own code would not. None holds a parameter: weights come in as inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fuseformer.ops as ops
from fuseformer.ops.attention import MAX_HEAD_DIM

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_float(*ts: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype in _FLOATS for t in ts)


class _Fused(nn.Module):
    """original: the subgraph's GraphModule (the fallback); idx: role -> position in the inputs."""

    def __init__(self, original: nn.Module, idx: dict[str, int | None]) -> None:
        super().__init__()
        self.original = original
        self.idx = dict(idx)

    def _get(self, ins: tuple, role: str) -> Any:
        i = self.idx.get(role)
        return None if i is None else ins[i]

    def forward(self, *ins: Any) -> Any:
        out = self.fused(ins)
        return self.original(*ins) if out is NotImplemented else out

    def fused(self, ins: tuple) -> Any:  # pragma: no cover (each subclass has one)
        raise NotImplementedError


class FusedNorm(_Fused):
    """RMSNorm or LayerNorm over the last dim, with the residual add when the pattern had one:
    returns y, or (y, x + residual)."""

    def __init__(self, original, idx, *, op: str, eps: float | None, n: int | None) -> None:
        super().__init__(original, idx)
        self.op, self.eps, self.n = op, eps, n

    def fused(self, ins):
        x, res = self._get(ins, "x"), self._get(ins, "residual")
        w, b = self._get(ins, "w"), self._get(ins, "b")
        if not _is_float(x) or x.dim() == 0 or (self.n is not None and x.shape[-1] != self.n):
            return NotImplemented
        n = x.shape[-1]
        for t in (w, b):
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != (n,) or t.dtype != x.dtype):
                return NotImplemented
        if res is not None and (not isinstance(res, torch.Tensor) or res.shape != x.shape or res.dtype != x.dtype):
            return NotImplemented
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        if self.op == "rms_norm":
            return ops.rms_norm(x, w, eps, residual=res)
        return ops.layer_norm(x, w, b, eps, residual=res)

    def extra_repr(self) -> str:
        return f"op={self.op}, eps={self.eps}, residual={self.idx.get('residual') is not None}"


class FusedGLU(_Fused):
    """act(gate) * up as one op: swiglu or geglu (approximate "tanh" or "none")."""

    def __init__(self, original, idx, *, op: str, approximate: str) -> None:
        super().__init__(original, idx)
        self.op, self.approximate = op, approximate

    def fused(self, ins):
        g, u = self._get(ins, "gate"), self._get(ins, "up")
        if not _is_float(g, u) or g.shape != u.shape or g.dtype != u.dtype or g.dim() == 0:
            return NotImplemented
        if self.op == "swiglu":
            return ops.swiglu(g, u)
        if self.approximate not in ("tanh", "none"):
            return NotImplemented
        return ops.geglu(g, u, approximate=self.approximate)

    def extra_repr(self) -> str:
        return self.op if self.op == "swiglu" else f"{self.op}, approximate={self.approximate}"


class FusedAttention(_Fused):
    """softmax(q k^T * scale [+ causal mask]) v on (..., S, D) tensors, as flash_attention on
    (B, S, H, D): 4-D (B, H, S, D) inputs are transposed (views), others flattened to one head.

    scales: (op, constant or None, role) factors of the scale, "mul" or "div", a role naming the
    input that holds a run-time number; dropout: (p, nn.Dropout or the traced training flag);
    sdpa: the F.scaled_dot_product_attention node (is_causal, scale, enable_gqa read from it).
    """

    def __init__(self, original, idx, *, causal, scales, dropout, sdpa, contiguous) -> None:
        super().__init__(original, idx)
        self.causal, self.scales, self.contiguous = causal, list(scales), contiguous
        self.dropout_p = 0.0 if dropout is None else float(dropout[0])
        self.dropout_module = dropout[1] if dropout is not None and isinstance(dropout[1], nn.Module) else None
        self.dropout_traced = bool(dropout[1]) if dropout is not None and self.dropout_module is None else False
        self.gqa, self.scale = False, None
        if sdpa is not None:
            self.causal = sdpa.kwargs.get("is_causal", sdpa.args[5] if len(sdpa.args) > 5 else False) is True
            self.scale = sdpa.kwargs.get("scale")
            self.gqa = bool(sdpa.kwargs.get("enable_gqa", False))

    def _dropout_active(self) -> bool:
        if self.dropout_p <= 0:
            return False
        return self.dropout_module.training if self.dropout_module is not None else self.dropout_traced

    def fused(self, ins):
        q, k, v = (self._get(ins, r) for r in ("q", "k", "v"))
        if not _is_float(q, k, v) or q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
            return NotImplemented
        if q.dtype != k.dtype or q.dtype != v.dtype or self._dropout_active():
            return NotImplemented
        d, sq, sk = q.shape[-1], q.shape[-2], k.shape[-2]
        if not 1 <= d <= MAX_HEAD_DIM or k.shape[-1] != d or v.shape[-1] != d or v.shape[-2] != sk:
            return NotImplemented
        if self.causal and sq != sk:
            return NotImplemented  # flash_attention's causal is bottom-right aligned; these are top-left
        scale = self.scale
        for op, const, role in self.scales:
            val = const if const is not None else self._get(ins, role)
            if isinstance(val, torch.Tensor) or not isinstance(val, (int, float)) or val == 0:
                return NotImplemented
            scale = (1.0 if scale is None else scale) * (val if op == "mul" else 1.0 / val)
        if scale is not None and not scale > 0:
            return NotImplemented
        if q.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1]:
            if q.shape[1] != k.shape[1] and not (self.gqa and q.shape[1] % k.shape[1] == 0):
                return NotImplemented
            out = ops.flash_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=self.causal, softmax_scale=scale
            ).transpose(1, 2)  # (B, H, S, D), a view of (B, S, H, D)
        elif q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
            lead = q.shape[:-2]
            q3, k3, v3 = (t.reshape(-1, t.shape[-2], d).unsqueeze(2) for t in (q, k, v))  # (N, S, 1, D)
            out = ops.flash_attention(q3, k3, v3, causal=self.causal, softmax_scale=scale)
            out = out.squeeze(2).reshape(*lead, sq, d)
        else:
            return NotImplemented
        return out.contiguous() if self.contiguous else out

    def extra_repr(self) -> str:
        return f"causal={self.causal}"


class FusedLinearCrossEntropy(_Fused):
    """cross_entropy(h @ w^T + b flattened to (tokens, V), target) without the logits."""

    def __init__(self, original, idx, *, ignore_index: int, reduction: str, label_smoothing: float) -> None:
        super().__init__(original, idx)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, float(label_smoothing)

    def fused(self, ins):
        h, w, b, t = (self._get(ins, r) for r in ("h", "w", "b", "target"))
        if not _is_float(h, w) or w.dim() != 2 or h.dim() == 0 or h.shape[-1] != w.shape[1] or w.dtype != h.dtype:
            return NotImplemented
        if b is not None and (not isinstance(b, torch.Tensor) or b.dtype != h.dtype or b.shape != (w.shape[0],)):
            return NotImplemented
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
            return NotImplemented
        if t.numel() * h.shape[-1] != h.numel():
            return NotImplemented
        return ops.fused_linear_cross_entropy(
            h.reshape(-1, h.shape[-1]),
            w,
            t.reshape(-1),
            b,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )

    def extra_repr(self) -> str:
        return f"reduction={self.reduction}, ignore_index={self.ignore_index}"
