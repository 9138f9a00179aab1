"""The gated MLP as a module: a drop-in for the Llama/Qwen/Mistral MLP with a packed gate_up weight."""

from __future__ import annotations

import torch
from torch import nn

import fuseformer.ops as F
from fuseformer.ops.activations import ACTIVATIONS

# Hugging Face ``hidden_act`` names -> the kernel's activation names.
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}


def activation_of(module: str, name: str) -> str:
    """The kernel activation for an HF ``hidden_act`` or kernel name; ValueError naming it otherwise."""
    if name in ACTIVATIONS:
        return name
    if name not in HF_ACTIVATIONS:
        allowed = sorted(set(HF_ACTIVATIONS) | set(ACTIVATIONS))
        raise ValueError(f"{module}: activation must be one of {allowed}, got {name!r}")
    return HF_ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with gate_proj and up_proj packed into one weight.

    Args:
        hidden_size: H.
        intermediate_size: I.
        activation: "silu" (Llama, Mistral, Qwen), "gelu_tanh" (Gemma), "gelu", or an HF
            ``hidden_act`` name ("gelu_pytorch_tanh", ...).

    Parameters (no biases, as in those models): ``gate_up_proj.weight`` (2I, H), rows [0, I) the
    gate projection and [I, 2I) the up projection; ``down_proj.weight`` (H, I). Load an HF
    checkpoint's ``gate_proj``/``up_proj`` by concatenating them along dim 0 (:meth:`from_hf`).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GatedMLP: {name} must be a positive int, got {value!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation_of("GatedMLP", activation)
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_hf(cls, mlp: nn.Module, activation: str | None = None) -> GatedMLP:
        """A GatedMLP with the weights of an HF MLP (``gate_proj``, ``up_proj``, ``down_proj`` Linear
        layers without bias, ``act_fn``/``config.hidden_act``); the gate and up weights are copied
        into the packed one, ``down_proj`` is shared."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(mlp, name, None)
            if not isinstance(layer, nn.Linear) or layer.bias is not None:
                got = type(layer).__name__ if layer is None or layer.bias is None else "Linear with bias"
                raise ValueError(f"GatedMLP.from_hf: {name} must be an nn.Linear without bias, got {got}")
        if activation is None:
            config = getattr(mlp, "config", None)
            activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
        new = cls(gate.shape[1], gate.shape[0], activation, dtype=gate.dtype, device=gate.device)
        with torch.no_grad():
            new.gate_up_proj.weight.copy_(torch.cat([gate, up], dim=0))
        new.down_proj = mlp.down_proj
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) -> (..., H), x's dtype."""
        if x.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"GatedMLP: x has shape {tuple(x.shape)}; expected (..., {self.hidden_size})")
        return F.fused_mlp(x, self.gate_up_proj.weight, self.down_proj.weight, self.activation)

    def extra_repr(self) -> str:
        sizes = f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
        return f"{sizes}, activation={self.activation!r}"
