"""Weight-only FP8 at decode: activations in bf16/fp16 times e4m3 weights with per-channel scales.

    fp8_weight_gemm:  out = x @ (w * w_scale[:, None])^T (+ bias)                          (M, N) x's dtype
    fp8_weight_mlp:   h = act(x Wg^T) * (x Wu^T) in x's dtype, out = h @ Wd^T,
                      each W its e4m3 weight times its scales                               (M, H) x's dtype

A decode step (a few tokens) is bound by the bytes of weight it reads: e4m3 halves them, while
quantizing the few activation rows saves nothing and costs a kernel and accuracy. So at decode the FP8
layers (layers/fp8.py) leave the activations in the model's dtype and run these: ``mlp_decode``'s
weight-streaming kernel (host-built tensor descriptors, the down GEMM a programmatic dependent launch of
the gate-up GEMM) with e4m3 weight tiles, each widened to fp16 in registers (exact: every e4m3 value is
an fp16 value; one cvt for two elements, where e4m3 -> bf16 takes three) for an fp16 MMA, x's tile
rounded to fp16 (bf16's 8 bits fit in fp16's 11) and clamped to fp16's range, +-65504 (decoder layer
inputs stay far below it), and the per-channel scales applied to the fp32 sums before the activation
and the store. Past decode the layers quantize the activations and run
``fp8_gemm`` (W8A8 on the FP8 tensor cores), where the GEMMs are compute-bound.

Backends: the decode kernel where it applies (CUDA, 1..64 rows, fp16/bf16 x, rows the descriptors can
read: K a multiple of 16 and 16-byte aligned bases, checked as the op runs), otherwise the references (the weight dequantized
to fp32, matmuls in fp32, cast), which are correct at any size. Inference only (no autograd);
CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from fuseformer.ops import mlp_decode
from fuseformer.ops._mlp_common import _aligned
from fuseformer.ops._utils import FLOAT_DTYPES, check_tensor, next_pow2
from fuseformer.ops.activations import ACTIVATIONS
from fuseformer.ops.mlp import fused_mlp_ref
from fuseformer.ops.quant_fp8 import FP8_DTYPE, call_op, dequantize_fp8
from fuseformer.runtime.backend import choose_backend

_OP, _MLP_OP = "fp8_weight_gemm", "fp8_weight_mlp"


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------
def _dequantized(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8(w, w_scale[:, None], dtype=torch.float32)


def fp8_weight_gemm_ref(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ (w * w_scale[:, None])^T (+ bias) in fp32, cast to x's dtype."""
    out = x.float() @ _dequantized(w, w_scale).T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def fp8_weight_mlp_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    w_down: torch.Tensor,
    down_scale: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The gated MLP of the dequantized weights in fp32 (``fused_mlp_ref``), cast to x's dtype."""
    wgu, wd = _dequantized(w_gate_up, gate_up_scale), _dequantized(w_down, down_scale)
    return fused_mlp_ref(x.float(), wgu, wd, activation).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Launchers (x (M, K) contiguous; the checks below have run)
# --------------------------------------------------------------------------------------------
def _kernel_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the decode kernel takes x (M, K) and these e4m3 weights by shape and dtype: M 1..64,
    fp16/bf16 on a decode device, rows of 16-byte multiples (the tensor descriptors'). The bases'
    alignment is checked where the op runs (``_aligned_bases``: not traceable by torch.compile)."""
    m = x.shape[0]
    return (
        0 < m <= mlp_decode.DECODE_MAX_T and x.device.type in mlp_decode.DECODE_DEVICE_TYPES
        and x.dtype in (torch.float16, torch.bfloat16) and all(w.shape[0] > 0 and w.shape[1] % 16 == 0 for w in weights)
    )  # fmt: skip


def _aligned_bases(*tensors: torch.Tensor) -> bool:
    return all(_aligned(t) for t in tensors)


def _config(kernel: str, m: int, n: int, k: int, x: torch.Tensor) -> dict:
    return mlp_decode.decode_plan(kernel, next_pow2(m), n, k, x.dtype, x.device, w_fp8=True)


def fp8_weight_gemm_fwd(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if not _aligned_bases(x, w):
        return fp8_weight_gemm_ref(x, w, w_scale, bias)
    m, k = x.shape
    n = w.shape[0]
    cfg = _config(mlp_decode.DOWN_DECODE, m, n, k, x)
    out = mlp_decode._decode_gemm(x, w, False, "silu", cfg, w_scale=w_scale)
    return out if bias is None else out.add_(bias)


def fp8_weight_mlp_fwd(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    w_down: torch.Tensor,
    down_scale: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    if not _aligned_bases(x, w_gate_up, w_down):
        return fp8_weight_mlp_ref(x, w_gate_up, gate_up_scale, w_down, down_scale, activation)
    m, h = x.shape
    i = w_down.shape[1]
    gate_up_config = _config(mlp_decode.GATE_UP_DECODE, m, i, h, x)
    down_config = _config(mlp_decode.DOWN_DECODE, m, h, i, x)
    out, _ = mlp_decode.mlp_decode_fwd(
        x, w_gate_up, w_down, activation, gate_up_config, down_config, scales=(gate_up_scale, down_scale)
    )
    return out


# --------------------------------------------------------------------------------------------
# Registration: custom ops for torch.compile (opaque, with fakes); eager calls run the launchers
# --------------------------------------------------------------------------------------------
_gemm_op = torch.library.custom_op("fuseformer::fp8_weight_gemm", mutates_args=())(fp8_weight_gemm_fwd)
_mlp_op = torch.library.custom_op("fuseformer::fp8_weight_mlp", mutates_args=())(fp8_weight_mlp_fwd)


@_gemm_op.register_fake
def _(x, w, w_scale, bias):
    return x.new_empty((x.shape[0], w.shape[0]))


@_mlp_op.register_fake
def _(x, w_gate_up, gate_up_scale, w_down, down_scale, activation):
    return x.new_empty((x.shape[0], w_down.shape[0]))


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------
def _check_x(op: str, x: object) -> torch.Tensor:
    check_tensor(op, "x", x, dtypes=FLOAT_DTYPES, ndim=2)
    return x.contiguous()


def _check_weight(op: str, name: str, w: object, w_scale: object, x: torch.Tensor, k: int) -> torch.Tensor:
    check_tensor(op, name, w, dtypes=(FP8_DTYPE,), ndim=2, device=x.device, device_of="x")
    if w.shape[1] != k:
        raise ValueError(f"{op}: {name} has shape {tuple(w.shape)}; expected (*, {k})")
    scale_name = name.removeprefix("w_") + "_scale" if name != "w" else "w_scale"
    check_tensor(op, scale_name, w_scale, dtypes=(torch.float32,), device=x.device, device_of="x",
                 shape=(w.shape[0],), what=f"one per row of {name}")  # fmt: skip
    return w.contiguous()


def fp8_weight_gemm(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """out = x @ (w * w_scale[:, None])^T (+ bias): a linear layer with an e4m3 weight, x unquantized.

    Args:
        x: (M, K) fp16, bf16 or fp32 (the decode kernel takes fp16/bf16 at M <= 64).
        w: (N, K) float8_e4m3fn (``quantize_weight_fp8`` of ``nn.Linear(K, N).weight``).
        w_scale: (N,) fp32, per output channel.
        bias: (N,) any float dtype, or None.

    Returns:
        (M, N) in x's dtype, the products summed in fp32.
    """
    x = _check_x(_OP, x)
    w = _check_weight(_OP, "w", w, w_scale, x, x.shape[1])
    if bias is not None:
        check_tensor(_OP, "bias", bias, dtypes=FLOAT_DTYPES, device=x.device, device_of="x", shape=(w.shape[0],),
                     what="one per row of w")  # fmt: skip
        bias = bias.to(x.dtype).contiguous()
    supported = _kernel_applies(x, w)
    if choose_backend(_OP, x.device, supported, "the decode kernel takes 1..64 fp16/bf16 rows") == "reference":
        return fp8_weight_gemm_ref(x, w, w_scale, bias)
    return call_op(_gemm_op, fp8_weight_gemm_fwd, x, w, w_scale.contiguous(), bias)


def fp8_weight_mlp(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    w_down: torch.Tensor,
    down_scale: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The gated MLP ``(act(x Wg^T) * (x Wu^T)) Wd^T`` with e4m3 weights, x unquantized (fused_mlp's
    packing: w_gate_up's rows [0, I) the gate, [I, 2I) the up projection).

    Args:
        x: (M, H) fp16, bf16 or fp32 (the decode kernels take fp16/bf16 at M <= 64).
        w_gate_up: (2I, H) float8_e4m3fn; gate_up_scale (2I,) fp32 per output channel.
        w_down: (H, I) float8_e4m3fn; down_scale (H,) fp32 per output channel.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (erf).

    Returns:
        (M, H) in x's dtype. The product act(gate) * up is rounded to x's dtype between the GEMMs (the
        decode kernels write it so), the sums are fp32.
    """
    x = _check_x(_MLP_OP, x)
    h = x.shape[1]
    w_gate_up = _check_weight(_MLP_OP, "w_gate_up", w_gate_up, gate_up_scale, x, h)
    if w_gate_up.shape[0] % 2:
        raise ValueError(
            f"{_MLP_OP}: w_gate_up has shape {tuple(w_gate_up.shape)}; expected (2I, H): an even row count"
        )
    w_down = _check_weight(_MLP_OP, "w_down", w_down, down_scale, x, w_gate_up.shape[0] // 2)
    if w_down.shape[0] != h:
        raise ValueError(f"{_MLP_OP}: w_down has shape {tuple(w_down.shape)}; expected ({h}, {w_down.shape[1]})")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_MLP_OP}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    supported = _kernel_applies(x, w_gate_up, w_down)
    why = "the decode kernels take 1..64 fp16/bf16 rows"
    if choose_backend(_MLP_OP, x.device, supported, why) == "reference":
        return fp8_weight_mlp_ref(x, w_gate_up, gate_up_scale, w_down, down_scale, activation)
    args = (x, w_gate_up, gate_up_scale.contiguous(), w_down, down_scale.contiguous(), activation)
    return call_op(_mlp_op, fp8_weight_mlp_fwd, *args)
