"""SwiGLU / GeGLU modules against torch's F.silu(g) * u and F.gelu(g, approximate) * u."""

import pytest
import torch
import torch.nn.functional as TF

import fuseformer
from fuseformer.layers import GeGLU, SwiGLU
from fuseformer.testing import assert_close

MODULES = {
    "swiglu": (SwiGLU, lambda g, u: TF.silu(g) * u),
    "geglu_tanh": (lambda: GeGLU("tanh"), lambda g, u: TF.gelu(g, approximate="tanh") * u),
    "geglu_none": (lambda: GeGLU(approximate="none"), lambda g, u: TF.gelu(g) * u),
}


def _compare(module, torch_fn, gate_up, packed, device):
    """Run the module (on gate_up (..., 2I), packed or as two halves) and torch in fp64 (reference)
    and in the input dtype (baseline); check the output and the gradient of gate_up (§3)."""
    dtype = gate_up.dtype
    i = gate_up.shape[-1] // 2

    def leaf(cast):
        return gate_up.detach().to(cast).requires_grad_()

    with fuseformer.use_backend("triton"):
        gu = leaf(dtype)
        out = module.forward_packed(gu) if packed else module(gu[..., :i], gu[..., i:])
    gu_ref, gu_base = leaf(torch.float64), leaf(dtype)
    ref = torch_fn(gu_ref[..., :i], gu_ref[..., i:])
    base = torch_fn(gu_base[..., :i], gu_base[..., i:])
    assert_close("y", out, ref, base)
    dy = torch.randn(out.shape, dtype=dtype, device=device)
    for y in (out, ref, base):
        y.backward(dy.to(y.dtype))
    assert_close("dgate_up", gu.grad, gu_ref.grad, gu_base.grad)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(MODULES))
def test_module_matches_torch(name, dtype, packed, device):
    make, torch_fn = MODULES[name]
    gate_up = (2 * torch.randn(2, 9, 2 * 131, device=device)).to(dtype)
    _compare(make(), torch_fn, gate_up, packed, device)


def test_forward_packed_takes_gate_first(device):
    """gate is the first half of the last dim, up the second: swapping them changes the result."""
    gate_up = torch.randn(4, 2 * 16, device=device)
    gate, up = gate_up[:, :16], gate_up[:, 16:]
    with fuseformer.use_backend("triton"):
        y = SwiGLU().forward_packed(gate_up)
        y_swapped = SwiGLU()(up, gate)
    torch.testing.assert_close(y, TF.silu(gate) * up)
    assert not torch.allclose(y, y_swapped)


def test_modules_hold_no_parameters_and_repr():
    assert list(SwiGLU().parameters()) == [] and list(GeGLU().parameters()) == []
    assert "approximate='none'" in repr(GeGLU("none"))
    assert GeGLU().approximate == "tanh"


def test_module_in_an_mlp_and_compile(device, compile_backend):
    """The use in a model: a packed gate_up projection, the activation, the down projection."""
    torch.manual_seed(0)
    gate_up_proj = torch.nn.Linear(32, 2 * 48, bias=False, device=device)
    down_proj = torch.nn.Linear(48, 32, bias=False, device=device)
    act = GeGLU("tanh")

    def mlp(x):
        return down_proj(act.forward_packed(gate_up_proj(x)))

    def mlp_torch(x):
        g, u = gate_up_proj(x).chunk(2, dim=-1)
        return down_proj(TF.gelu(g, approximate="tanh") * u)

    x = torch.randn(3, 5, 32, device=device)
    with fuseformer.use_backend("triton"):
        y = mlp(x)
        y_compiled = torch.compile(mlp, fullgraph=True, backend=compile_backend)(x)
    torch.testing.assert_close(y, mlp_torch(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_compiled, y)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: GeGLU("erf"), "GeGLU: approximate must be 'tanh' or 'none'"),
        (lambda: SwiGLU().forward_packed(torch.randn(3, 7)), r"SwiGLU: gate_up has shape \(3, 7\)"),
        (lambda: GeGLU().forward_packed(torch.randn(())), r"GeGLU: gate_up has shape \(\)"),
        (lambda: SwiGLU().forward_packed([1.0, 2.0]), "gate_up must be a torch.Tensor"),
        (lambda: SwiGLU()(torch.randn(3, 8), torch.randn(3, 4)), r"swiglu: up has shape \(3, 4\)"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
