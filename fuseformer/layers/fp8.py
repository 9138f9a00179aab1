"""FP8 (e4m3) inference modules: the linear layers, the MLP and the norms of a decoder in W8A8.

Weights are e4m3 (``torch.float8_e4m3fn``, max 448) with one fp32 scale per output channel; activations
are quantized per token as they go (dynamic scales, no calibration), either by the norm that produces
them (:class:`Fp8RMSNorm`: RMSNorm and quantization in one kernel) or by the linear that reads them.
The GEMMs accumulate in fp32 and write the model's dtype. ``models/quantization.py`` puts these modules
in a loaded model, from outside (STYLE.md §4): each keeps the name and the sub-module names of the
module it replaces (``qkv_proj``, ``mlp.gate_up_proj``, ``input_layernorm``), so the engine and the
state dict find them where they were.

At decode (``decode_weight_only``: at most 64 tokens, fp16/bf16 activations on CUDA) the layers leave
the activations unquantized and run the weight-only ops (``fp8_weight_gemm``, ``fp8_weight_mlp``): a
step of a few tokens is bound by its weight bytes, which e4m3 halves either way, and the decode kernel
streams them at the bf16 decode kernel's rate; the norm is then the plain ``rms_norm``. Past decode the
activations are quantized as above and the GEMMs run on the FP8 tensor cores.

Every forward is CUDA-graph safe: shapes only are read on the host, never a value.

Dtype casts (``model.to(torch.bfloat16)``, ``.half()``) leave the e4m3 weights and their fp32 scales
as they are and change the output dtype; moves (``.to(device)``, ``to_empty``) move them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

import fuseformer.ops as F
from fuseformer.layers.mlp import activation_of
from fuseformer.ops import mlp_decode

FP8_DTYPE = torch.float8_e4m3fn


def decode_weight_only(x: torch.Tensor | Fp8Activation) -> bool:
    """Whether an FP8 layer takes x unquantized (weight-only FP8, the decode kernels): a plain fp16/bf16
    tensor of at most ``DECODE_MAX_T`` (64) tokens on a device the decode kernels run on (CUDA)."""
    return (
        isinstance(x, torch.Tensor) and x.device.type in mlp_decode.DECODE_DEVICE_TYPES
        and x.dtype in (torch.float16, torch.bfloat16) and x.numel() // max(1, x.shape[-1]) <= mlp_decode.DECODE_MAX_T
    )  # fmt: skip


class Fp8Activation(NamedTuple):
    """An activation quantized to e4m3: ``data`` (..., K) e4m3 and its fp32 ``scale``, (..., 1) per token
    or (..., ceil(K/g)) per token group; the value is ``data * scale`` (groups broadcast along K).

    ``shape`` is ``data.shape``, so that model code reading ``x.shape[0]`` of a layer's input runs
    unchanged when a norm hands it an Fp8Activation."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _as_rows(x: torch.Tensor | Fp8Activation, k: int, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) as an e4m3 (M, K) and its fp32 (M, S) scales: an Fp8Activation's own, or a plain tensor
    quantized per token now."""
    if x.shape[-1:] != (k,):
        raise ValueError(f"{who}: x has shape {tuple(x.shape)}; expected (..., {k})")
    if isinstance(x, Fp8Activation):
        return x.data.reshape(-1, k), x.scale.reshape(-1, x.scale.shape[-1])
    return F.quantize_fp8(x.reshape(-1, k))


def _keep_fp8(module: nn.Module, names: tuple[str, ...], fn, recurse: bool, out_dtype: torch.dtype) -> torch.dtype:
    """``Module._apply(fn)`` for a module whose buffers ``names`` are FP8 data or fp32 scales: ``fn`` moves
    them but does not cast them (a cast would turn the weight into plain floats and round the scales);
    the other parameters (a bias) take ``fn`` as usual. Returns the new output dtype: ``out_dtype`` after
    ``fn`` (a cast to fp32 makes the module write fp32, as the rest of the model will)."""
    held = {name: module._buffers.pop(name) for name in names}
    try:
        nn.Module._apply(module, fn, recurse)
    finally:
        for name, t in held.items():
            out = fn(t)
            module._buffers[name] = out if out.dtype == t.dtype else t.to(out.device)
    probe = torch.empty(0, dtype=out_dtype, device=module._buffers[names[0]].device)
    return fn(probe).dtype


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with W (N, K) in e4m3 and a scale per output channel, x quantized per token.

    Args:
        in_features: K.
        out_features: N.
        bias: hold a bias (N,) in ``dtype``.
        dtype: the output's (and the bias's) dtype: the model's.

    Buffers: ``weight`` (N, K) e4m3 and ``weight_scale`` (N,) fp32; the weight's value is
    ``weight * weight_scale[:, None]``. ``bias`` (N,) is a Parameter, as in ``nn.Linear``.

    ``forward(x)``: x (..., K) a tensor of any float dtype (quantized per token here) or an
    :class:`Fp8Activation` (a norm quantized it) -> (..., N) in ``out_dtype``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Fp8Linear: {name} must be a positive int, got {value!r}")
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ValueError(f"Fp8Linear: dtype must be float32, float16 or bfloat16 (the output's), got {dtype}")
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """An Fp8Linear of ``linear``'s weight quantized per output channel (``quantize_weight_fp8``), on its
        device, writing its dtype; the bias is shared (the same Parameter)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"Fp8Linear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        return cls.from_weight(linear.weight, linear.bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: nn.Parameter | None = None) -> Fp8Linear:
        """An Fp8Linear of a (N, K) weight quantized per output channel, on its device, writing its dtype;
        ``bias`` shared. Rows quantize independently, so a packed weight (gate and up stacked) gives the
        packed quantizations of its parts."""
        w = weight.detach()
        new = cls(w.shape[1], w.shape[0], dtype=w.dtype, device="meta")
        new.weight, new.weight_scale = F.quantize_weight_fp8(w)
        new.bias = bias
        return new

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's value ``weight * weight_scale[:, None]``, (N, K) in ``dtype``."""
        return F.dequantize_fp8(self.weight, self.weight_scale[:, None], dtype=dtype)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if decode_weight_only(x) and x.shape[-1:] == (self.in_features,):
            out = F.fp8_weight_gemm(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias)
            return out.to(self.out_dtype).view(*x.shape[:-1], self.out_features)
        q, s = _as_rows(x, self.in_features, "Fp8Linear")
        out = F.fp8_gemm(q, s, self.weight, self.weight_scale, self.bias, out_dtype=self.out_dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        self.out_dtype = _keep_fp8(self, ("weight", "weight_scale"), fn, recurse, self.out_dtype)
        return self

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, out_dtype={self.out_dtype}"
        )


class Fp8RMSNorm(nn.Module):
    """RMSNorm whose output is quantized to e4m3 per token in the same kernel (``rms_norm_quant_fp8``),
    for norms whose output feeds FP8 linears only.

    Args:
        weight: the norm's ``weight`` (N,) (shared: the same Parameter as the RMSNorm it replaces).
        eps: as RMSNorm's; None means ``torch.finfo(x.dtype).eps``.
        offset: as RMSNorm's (1 for Gemma's ``x * (1 + weight)``).

    ``forward(x, residual=None)``: x (..., N) -> :class:`Fp8Activation` of ``norm(x)``; with ``residual``
    (like x): ``(Fp8Activation of norm(x + residual), x + residual)``, the sum in x's dtype. At decode
    (``decode_weight_only(x)``) the norm is plain ``rms_norm`` and its output a tensor in x's dtype: the
    FP8 layers after it read it unquantized there.
    """

    def __init__(self, weight: nn.Parameter, eps: float | None = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise ValueError(f"Fp8RMSNorm: weight must be a 1-D tensor (N,), got {weight!r:.80}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.hidden_size, self.eps, self.offset = weight.shape[0], eps, float(offset)

    @classmethod
    def from_norm(cls, norm: nn.Module) -> Fp8RMSNorm:
        """An Fp8RMSNorm of a :class:`fuseformer.layers.RMSNorm` (its weight shared, its eps and offset)."""
        weight = getattr(norm, "weight", None)
        if weight is None:
            raise ValueError(f"Fp8RMSNorm.from_norm: {type(norm).__name__} has no weight")
        return cls(weight, getattr(norm, "eps", 1e-6), getattr(norm, "offset", 0.0))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
        if x.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"Fp8RMSNorm: x has shape {tuple(x.shape)}; expected (..., {self.hidden_size})")
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if decode_weight_only(x):
            return F.rms_norm(x, self.weight, eps, residual, offset=self.offset)
        out = F.rms_norm_quant_fp8(x, self.weight, eps=eps, residual=residual, offset=self.offset)
        if residual is None:
            return Fp8Activation(*out)
        q, s, summed = out
        return Fp8Activation(q, s), summed

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"({self.hidden_size},), eps={self.eps}{offset}"


class Fp8GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` in FP8. Three paths:

    - decode (``decode_weight_only(x)``): both GEMMs read x unquantized, ``fp8_weight_mlp``;
    - CUDA otherwise, per-token scales: cuBLASLt's FP8 gate-up GEMM to the model's dtype, the GLU, a
      per-token quantization, cuBLASLt's down GEMM (``_unfused``). H100, 2026-12-06 (8B MLP, CUDA graphs):
      our Triton FP8 GEMMs ran ~700 TFLOP/s, half of cuBLASLt's rate (the o projection's ~1.15 PFLOP/s),
      so the fused gate-up below (170 us at M 256, 2,052 at M 4096) only tied bf16's fused_mlp (174,
      2,129); prefill 1 x 4096 went from 1.05x to 1.25x bf16 on this path (run 120);
    - elsewhere (the CPU's references, group-scaled inputs): the gate-up GEMM with act * mul and the
      quantization of the product in its epilogue (``fp8_gemm_glu``, per 128-column group scales), then
      the down GEMM (``fp8_gemm``) reading those groups.

    Sub-modules as the MLP it replaces: ``gate_up_proj`` (an :class:`Fp8Linear` (2I, H), rows [0, I) the
    gate and [I, 2I) the up projection) and ``down_proj`` (an Fp8Linear (H, I)); no biases.

    ``forward(x)``: x (..., H) a tensor or an :class:`Fp8Activation` -> (..., H) in the model's dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.act = activation_of("Fp8GatedMLP", activation)
        self.gate_up_proj = Fp8Linear(hidden_size, 2 * intermediate_size, dtype=dtype, device=device)
        self.down_proj = Fp8Linear(intermediate_size, hidden_size, dtype=dtype, device=device)

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> Fp8GatedMLP:
        """An Fp8GatedMLP of a gated MLP with a packed ``gate_up_proj`` and a ``down_proj`` (nn.Linear
        without bias: the models' MLP, or :class:`fuseformer.layers.GatedMLP`), both quantized per output
        channel; the activation is its ``act`` (or ``activation``)."""
        for name in ("gate_up_proj", "down_proj"):
            layer = getattr(mlp, name, None)
            if not isinstance(layer, nn.Linear) or layer.bias is not None:
                raise ValueError(f"Fp8GatedMLP.from_mlp: {name} must be an nn.Linear without bias")
        activation = getattr(mlp, "act", None) or getattr(mlp, "activation", None) or "silu"
        new = cls(mlp.down_proj.out_features, mlp.down_proj.in_features, activation, device="meta")
        new.gate_up_proj = Fp8Linear.from_linear(mlp.gate_up_proj)
        new.down_proj = Fp8Linear.from_linear(mlp.down_proj)
        return new

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if decode_weight_only(x) and x.shape[-1:] == (self.hidden_size,):
            out = F.fp8_weight_mlp(x.reshape(-1, self.hidden_size), gate_up.weight, gate_up.weight_scale,
                                   down.weight, down.weight_scale, self.act)  # fmt: skip
            return out.to(down.out_dtype).view(*x.shape[:-1], self.hidden_size)
        q, s = _as_rows(x, self.hidden_size, "Fp8GatedMLP")
        if q.is_cuda and s.shape[-1] == 1:
            out = self._unfused(q, s)
        else:
            h, h_scale = F.fp8_gemm_glu(q, s, gate_up.weight, gate_up.weight_scale, activation=self.act)  # (M, I)
            out = F.fp8_gemm(h, h_scale, down.weight, down.weight_scale, out_dtype=down.out_dtype)
        return out.view(*x.shape[:-1], self.hidden_size)

    def _unfused(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """On CUDA past decode: the gate-up GEMM to the model's dtype (cuBLASLt's FP8 GEMM where it applies), the
        GLU, a per-token quantization, the down GEMM (cuBLASLt again): (M, K) e4m3, (M, 1) -> (M, H)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        gu = F.fp8_gemm(q, s, gate_up.weight, gate_up.weight_scale, out_dtype=gate_up.out_dtype)  # (M, 2I)
        h = (
            F.swiglu(gu)
            if self.act == "silu"
            else F.geglu(gu, approximate="tanh" if self.act == "gelu_tanh" else "none")
        )
        return F.fp8_gemm(*F.quantize_fp8(h), down.weight, down.weight_scale, out_dtype=down.out_dtype)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, activation={self.act!r}"
