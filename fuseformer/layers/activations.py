"""Gated activations as modules: SwiGLU and GeGLU (no parameters; they call the fused op)."""

from __future__ import annotations

import torch
from torch import nn

from fuseformer.ops import activations as ops


def _split_packed(module: str, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 2I) -> gate (..., I) = gate_up[..., :I], up = gate_up[..., I:], both views (no copy)."""
    if not isinstance(gate_up, torch.Tensor):
        raise ValueError(f"{module}: gate_up must be a torch.Tensor, got {type(gate_up).__name__}")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"{module}: gate_up has shape {tuple(gate_up.shape)}; expected (..., 2I), last dim even")
    gate, up = gate_up.chunk(2, dim=-1)
    return gate, up


class SwiGLU(nn.Module):
    """silu(gate) * up (Llama, Mistral, Qwen MLPs)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up (..., I) fp16/bf16/fp32 -> (..., I)."""
        return ops.swiglu(gate, up)

    def forward_packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (..., 2I), gate in [0, I) and up in [I, 2I) of the last dim (the packed gate_up
        GEMM's output) -> (..., I). The halves are read in place."""
        return ops.swiglu(*_split_packed("SwiGLU", gate_up))


class GeGLU(nn.Module):
    """gelu(gate, approximate) * up (Gemma, T5 v1.1 MLPs); approximate "tanh" or "none" as in F.gelu."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        ops.gelu_activation("GeGLU", approximate)  # raises ValueError naming approximate
        self.approximate = approximate

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up (..., I) fp16/bf16/fp32 -> (..., I)."""
        return ops.geglu(gate, up, self.approximate)

    def forward_packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (..., 2I), gate in [0, I) and up in [I, 2I) of the last dim -> (..., I)."""
        return ops.geglu(*_split_packed("GeGLU", gate_up), self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
