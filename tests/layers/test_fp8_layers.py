"""The FP8 modules (fuseformer/layers/fp8.py) against references built from dequantized operands.

Fp8Linear and Fp8GatedMLP: the DESIGN.md §3 criterion, with the reference the same quantized
computation in fp64 (activations quantized per token by ``quantize_fp8``, weights dequantized) and the
baseline that computation in fp32; and, against the unquantized layer, the error bound that FP8
rounding itself allows (derived in ``_fp8_bound``). Fp8RMSNorm: what ``quantize_fp8(rms_norm(...))``
gives. Module names, buffers and dtype casts as the engine and the loader need them."""

import math

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.layers import GatedMLP, RMSNorm
from fuseformer.layers.fp8 import FP8_DTYPE, Fp8Activation, Fp8GatedMLP, Fp8Linear, Fp8RMSNorm
from fuseformer.testing import assert_close


@pytest.fixture(autouse=True)
def _reference_ops():
    """The FP8 ops' PyTorch references: the kernels are checked against them bit for bit (and under
    DESIGN.md §3) in tests/ops/test_fp8.py; here the modules and the loader are, without the interpreter's
    cost; tests/engine/test_llm_fp8.py runs them end to end."""
    with fuseformer.use_backend("reference"):
        yield


# e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 of a normal value; below the smallest
# normal (2^-6, times the scale) the absolute error is at most half the subnormal step 2^-9 * scale.
_REL = 2.0**-4
_SUBNORMAL = 2.0**-10


def _fp8_bound(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The largest |x_q w_q^T - x w^T| that e4m3 rounding of both operands allows, per output (M, N):
    x_j w_j becomes x_j (1 + d) w_j (1 + e) (+ the subnormal terms), |d|, |e| <= 2^-4, so each product is
    off by at most (2 * 2^-4 + 2^-8) |x_j w_j| plus subnormal steps times the other operand."""
    x, w = x.double(), w.double()
    rel = (2 * _REL + _REL**2) * (x.abs() @ w.abs().T)
    sub_x = _SUBNORMAL * x_scale.double()[:, None] * w.abs().sum(1)[None, :] * (1 + _REL)
    sub_w = _SUBNORMAL * w_scale.double()[None, :] * x.abs().sum(1)[:, None] * (1 + _REL)
    return rel + sub_x + sub_w + 1e-6 * (x.abs() @ w.abs().T)  # + fp32 accumulation


def _linear_ref(x: torch.Tensor, layer: Fp8Linear, dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) quantized per token, times the layer's dequantized weight, in ``dtype`` (+ bias)."""
    q, s = F.quantize_fp8(x)
    out = F.dequantize_fp8(q, s, dtype) @ layer.dequantized_weight(dtype).T
    return out + layer.bias.to(dtype) if layer.bias is not None else out


@pytest.mark.parametrize("m, k, n", [(1, 64, 48), (7, 123, 77), (5, 200, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_dequantized_reference(m, k, n, bias):
    linear = torch.nn.Linear(k, n, bias=bias)
    layer = Fp8Linear.from_linear(linear)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight.shape == (n, k)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (n,)
    assert layer.bias is linear.bias  # shared, as nn.Linear's
    x = torch.randn(m, k) * 3
    with torch.no_grad():
        out = layer(x)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        assert_close("Fp8Linear", out, _linear_ref(x, layer, torch.float64), _linear_ref(x, layer, torch.float32))
        # Against the unquantized layer: within what e4m3 rounding of x and W allows.
        exact = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
        _, x_scale = F.quantize_fp8(x)
        bound = _fp8_bound(x, linear.weight, x_scale[:, 0], layer.weight_scale)
        assert ((out.double() - exact).abs() <= bound).all()
        assert (out.double() - exact).abs().max() > 0  # it does quantize


def test_fp8_linear_takes_an_fp8_activation_and_leading_dims():
    layer = Fp8Linear.from_linear(torch.nn.Linear(40, 24))
    x = torch.randn(2, 3, 40)
    with torch.no_grad():
        plain = layer(x)
        q, s = F.quantize_fp8(x)
        act = Fp8Activation(q, s)
        assert act.shape == (2, 3, 40) and act.shape[0] == 2  # as model code reads a layer input
        assert plain.shape == (2, 3, 24)
        torch.testing.assert_close(layer(act), plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"Fp8Linear: x has shape \(2, 39\); expected \(\.\.\., 40\)"):
        layer(torch.randn(2, 39))


def test_fp8_linear_state_dict_and_dtype_casts():
    """The names the loader fills (weight, weight_scale, bias); a cast of the model keeps the e4m3 weight
    and fp32 scales as they are and changes the output dtype; the bias follows."""
    layer = Fp8Linear.from_linear(torch.nn.Linear(32, 16, bias=True))
    assert list(layer.state_dict()) == ["bias", "weight", "weight_scale"]
    weight, scale = layer.weight.clone(), layer.weight_scale.clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == FP8_DTYPE and torch.equal(layer.weight.float(), weight.float())
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale)
    assert layer.out_dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    with torch.no_grad():
        assert layer(torch.randn(3, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
    layer.to_empty(device="cpu")  # a move: the dtypes stay
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    meta = Fp8Linear(32, 16, dtype=torch.float32, device="meta")
    assert meta.weight.is_meta and meta.bias is None and meta.out_dtype == torch.float32


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rms_norm_is_quantized_rms_norm(offset, dtype):
    norm = RMSNorm(123, eps=1e-5, offset=offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(123) * 0.3 + (0 if offset else 1))
    fp8 = Fp8RMSNorm.from_norm(norm)
    assert fp8.weight is norm.weight and fp8.eps == 1e-5 and fp8.offset == offset
    x, r = torch.randn(6, 123, dtype=dtype) * 2, torch.randn(6, 123, dtype=dtype)
    with torch.no_grad():
        act = fp8(x)
        assert isinstance(act, Fp8Activation) and act.data.dtype == FP8_DTYPE and act.scale.shape == (6, 1)
        q, s = F.quantize_fp8(norm(x))
        torch.testing.assert_close(act.scale, s, rtol=1e-6, atol=0)
        assert (act.data.float() != q.float()).float().mean() < 0.01  # rare ties of the rounding
        act, summed = fp8(x, r)
        y, ref_sum = norm(x, r)
        torch.testing.assert_close(summed, ref_sum, rtol=0, atol=0)
        deq = F.dequantize_fp8(act.data, act.scale)
        torch.testing.assert_close(deq, y.float(), rtol=2**-4, atol=float(act.scale.max()) * 2**-9)


def _mlp_ref(x: torch.Tensor, mlp: Fp8GatedMLP, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 MLP's computation from dequantized operands: x per token, the product act(gate) * up (in
    fp32, as the GEMM's epilogue forms it) per group of 128, both GEMMs in ``dtype``."""
    q, s = F.quantize_fp8(x)
    gu = F.dequantize_fp8(q, s, dtype) @ mlp.gate_up_proj.dequantized_weight(dtype).T
    gate, up = gu.float().chunk(2, dim=-1)
    act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}
    hq, hs = F.quantize_fp8(act[mlp.act](gate) * up, group_size=128)
    return F.dequantize_fp8(hq, hs, dtype) @ mlp.down_proj.dequantized_weight(dtype).T


@pytest.mark.parametrize("hidden, inter", [(64, 96), (48, 200)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fp8_gated_mlp_matches_dequantized_reference(hidden, inter, activation):
    ref_mlp = GatedMLP(hidden, inter, activation)
    with torch.no_grad():
        ref_mlp.gate_up_proj.weight.normal_(0, 1 / math.sqrt(hidden))
        ref_mlp.down_proj.weight.normal_(0, 1 / math.sqrt(inter))
    mlp = Fp8GatedMLP.from_mlp(ref_mlp)
    assert [n for n, _ in mlp.named_children()] == ["gate_up_proj", "down_proj"]
    assert mlp.gate_up_proj.weight.shape == (2 * inter, hidden) and mlp.act == activation
    x = torch.randn(5, hidden)
    with torch.no_grad():
        out = mlp(x)
        assert out.shape == (5, hidden) and out.dtype == torch.float32
        assert_close("Fp8GatedMLP", out, _mlp_ref(x, mlp, torch.float64), _mlp_ref(x, mlp, torch.float32))
        q, s = F.quantize_fp8(x)
        torch.testing.assert_close(mlp(Fp8Activation(q, s)), out, rtol=0, atol=0)
        # Against the unquantized MLP: three roundings of relative 2^-4 (x, the weights, the product).
        exact = ref_mlp.double()(x.double())
        assert (out.double() - exact).norm() <= 4 * _REL * exact.norm()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_fp8_gated_mlp_unfused_path_matches_its_reference(activation):
    """On CUDA past decode (per-token scales): gate-up GEMM, GLU in the model's dtype, per-token quantization,
    down GEMM. Here through its method (the CPU takes the fused path), against the same steps in fp64."""
    ref_mlp = GatedMLP(64, 96, activation)
    with torch.no_grad():
        ref_mlp.gate_up_proj.weight.normal_(0, 1 / math.sqrt(64))
        ref_mlp.down_proj.weight.normal_(0, 1 / math.sqrt(96))
    mlp = Fp8GatedMLP.from_mlp(ref_mlp)
    q, s = F.quantize_fp8(torch.randn(70, 64))
    act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
           "gelu": torch.nn.functional.gelu}[activation]  # fmt: skip

    def ref(dtype, h_dtype):
        gu = F.dequantize_fp8(q, s, dtype) @ mlp.gate_up_proj.dequantized_weight(dtype).T
        gate, up = gu.to(h_dtype).chunk(2, dim=-1)
        hq, hs = F.quantize_fp8(act(gate) * up)
        return F.dequantize_fp8(hq, hs, dtype) @ mlp.down_proj.dequantized_weight(dtype).T

    with torch.no_grad():
        out = mlp._unfused(q, s)
    assert out.shape == (70, 64) and out.dtype == torch.float32
    assert_close("Fp8GatedMLP._unfused", out, ref(torch.float64, torch.float64), ref(torch.float32, torch.float32))


def test_fp8_mlp_refuses_biases():
    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj, self.down_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 8)

    with pytest.raises(ValueError, match="gate_up_proj must be an nn.Linear without bias"):
        Fp8GatedMLP.from_mlp(Biased())
