"""RMSNorm and LayerNorm modules: same outputs and gradients as their torch twins from the same
state dict (fp32, the kernels through the interpreter on CPU), from_module sharing, bad args."""

import copy

import pytest
import torch
from torch import nn

import fuseformer
from fuseformer.layers import LayerNorm, RMSNorm
from fuseformer.testing import assert_close


def _randomize(module: nn.Module) -> nn.Module:
    """Random affine parameters, so that a weight or bias dropped or swapped shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


def _compare(ours: nn.Module, theirs: nn.Module, shape, *, residual=False, device="cpu"):
    """ours (fp32, Triton) against theirs in fp64 (reference) and fp32 (baseline), §3 criterion:
    outputs, dx and every parameter gradient. With ``residual`` theirs sees x + residual."""
    ours, theirs = ours.to(device), theirs.to(device)
    ref = copy.deepcopy(theirs).double()
    x = torch.randn(shape, device=device)
    r = torch.randn(shape, device=device) if residual else None
    g = torch.randn(shape, device=device)

    x1 = x.clone().requires_grad_()
    with fuseformer.use_backend("triton"):
        out = ours(x1, residual=r) if residual else ours(x1)
    y = out[0] if residual else out
    if residual:
        torch.testing.assert_close(out[1], x + r, rtol=0, atol=0)
    y.backward(g)

    results = []
    for module, dtype in ((ref, torch.float64), (theirs, torch.float32)):
        xi = x.to(dtype).requires_grad_()
        yi = module(xi + r.to(dtype) if residual else xi)
        yi.backward(g.to(dtype))
        results.append((yi, xi.grad, dict(module.named_parameters())))
    (y_ref, dx_ref, p_ref), (y_base, dx_base, p_base) = results

    assert y.dtype == x.dtype
    assert_close("y", y, y_ref, y_base)
    assert_close("dx", x1.grad, dx_ref, dx_base)
    ours_params = dict(ours.named_parameters())
    assert ours_params.keys() == p_ref.keys()
    for name, p in ours_params.items():
        assert_close(f"d{name}", p.grad, p_ref[name].grad, p_base[name].grad)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("elementwise_affine", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 64), (4, 257)])
def test_rms_norm_matches_torch_rms_norm(shape, elementwise_affine, residual, device):
    n = shape[-1]
    theirs = _randomize(nn.RMSNorm(n, eps=1e-5, elementwise_affine=elementwise_affine))
    ours = RMSNorm(n, eps=1e-5, elementwise_affine=elementwise_affine)
    ours.load_state_dict(theirs.state_dict())
    _compare(ours, theirs, shape, residual=residual, device=device)


def test_rms_norm_eps_none_is_finfo_eps_like_torch(device):
    # torch.nn.RMSNorm(eps=None) uses finfo(x.dtype).eps; with a small spread of x the eps shows.
    theirs = _randomize(nn.RMSNorm(64, eps=None))
    ours = RMSNorm(64, eps=None)
    ours.load_state_dict(theirs.state_dict())
    x = 1e-4 * torch.randn(5, 64, device=device)
    with fuseformer.use_backend("triton"):
        y = ours.to(device)(x)
    torch.testing.assert_close(y, theirs.to(device)(x))


def test_rms_norm_matches_hf_llama_rms_norm(device):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    theirs = _randomize(modeling_llama.LlamaRMSNorm(96, eps=1e-6))
    ours = RMSNorm(96, eps=1e-6)
    ours.load_state_dict(theirs.state_dict())
    assert ours.variance_epsilon == theirs.variance_epsilon
    _compare(ours, theirs, (2, 7, 96), device=device)
    shared = RMSNorm.from_module(theirs)
    assert shared.weight is theirs.weight and shared.eps == 1e-6


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_offset_matches_hf_gemma_rms_norm(residual, device):
    """offset=1 is Gemma's x * (1 + w): outputs and gradients against HF GemmaRMSNorm (weight 0 at
    init, so the scale starts at one either way)."""
    modeling_gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    assert torch.equal(RMSNorm(8, offset=1.0).weight, modeling_gemma.GemmaRMSNorm(8).weight)
    theirs = _randomize(modeling_gemma.GemmaRMSNorm(96, eps=1e-6))
    ours = RMSNorm(96, eps=1e-6, offset=1.0)
    ours.load_state_dict(theirs.state_dict())
    _compare(ours, theirs, (2, 7, 96), residual=residual, device=device)
    shared = RMSNorm.from_module(theirs, offset=1.0)
    assert shared.weight is theirs.weight and shared.offset == 1.0
    assert repr(shared) == "RMSNorm((96,), eps=1e-06, elementwise_affine=True, offset=1.0)"


def test_rms_norm_offset_without_weight_scales_by_the_offset():
    x = torch.randn(3, 16)
    with fuseformer.use_backend("triton"):
        one = RMSNorm(16, elementwise_affine=False, offset=1.0)(x)
        two = RMSNorm(16, elementwise_affine=False, offset=2.0)(x)
    plain = RMSNorm(16, elementwise_affine=False)(x)
    torch.testing.assert_close(one, plain)
    torch.testing.assert_close(two, 2 * plain)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("elementwise_affine, bias", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [(3, 5, 64), (4, 257)])
def test_layer_norm_matches_torch_layer_norm(shape, elementwise_affine, bias, residual, device):
    n = shape[-1]
    theirs = _randomize(nn.LayerNorm(n, eps=1e-4, elementwise_affine=elementwise_affine, bias=bias))
    ours = LayerNorm(n, eps=1e-4, elementwise_affine=elementwise_affine, bias=bias)
    ours.load_state_dict(theirs.state_dict())
    _compare(ours, theirs, shape, residual=residual, device=device)


def test_default_parameters_match_torch():
    ln, tln = LayerNorm(10), nn.LayerNorm(10)
    assert ln.state_dict().keys() == tln.state_dict().keys()
    for k, v in tln.state_dict().items():
        torch.testing.assert_close(ln.state_dict()[k], v)
    assert ln.eps == tln.eps and ln.normalized_shape == tln.normalized_shape
    rn, trn = RMSNorm(10), nn.RMSNorm(10)
    assert rn.state_dict().keys() == trn.state_dict().keys()
    torch.testing.assert_close(rn.weight, trn.weight)
    assert rn.eps == 1e-6 and rn.normalized_shape == trn.normalized_shape


def test_dtype_and_device_arguments():
    rn = RMSNorm(8, dtype=torch.float16, device="cpu")
    ln = LayerNorm((8,), dtype=torch.bfloat16, device="cpu")
    assert rn.weight.dtype == torch.float16 and rn.weight.device.type == "cpu"
    assert ln.weight.dtype == ln.bias.dtype == torch.bfloat16


def test_rms_norm_from_module_shares_parameters():
    m = nn.RMSNorm(32, eps=1e-5)
    ours = RMSNorm.from_module(m)
    assert ours.weight is m.weight and ours.eps == 1e-5 and ours.hidden_size == 32
    assert list(ours.parameters())[0] is m.weight
    with torch.no_grad():
        m.weight.mul_(3)  # an update to the original is seen by the fused module (same storage)
    x = torch.randn(4, 32)
    with fuseformer.use_backend("triton"):
        torch.testing.assert_close(ours(x), m(x))

    no_affine = RMSNorm.from_module(nn.RMSNorm(32, eps=None, elementwise_affine=False))
    assert no_affine.weight is None and no_affine.eps is None and not no_affine.elementwise_affine


def test_rms_norm_from_module_with_eps_attribute():
    class MyNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16))
            self.eps = 1e-3

    m = MyNorm()
    ours = RMSNorm.from_module(m)
    assert ours.weight is m.weight and ours.eps == 1e-3 and ours.variance_epsilon == 1e-3


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_from_module_shares_parameters(bias):
    m = _randomize(nn.LayerNorm(48, eps=1e-3, bias=bias))
    ours = LayerNorm.from_module(m)
    assert ours.weight is m.weight and ours.eps == 1e-3 and ours.normalized_shape == (48,)
    assert ours.bias is m.bias if bias else ours.bias is None
    assert {id(p) for p in ours.parameters()} == {id(p) for p in m.parameters()}
    x = torch.randn(3, 48)
    with fuseformer.use_backend("triton"):
        torch.testing.assert_close(ours(x), m(x))

    plain = LayerNorm.from_module(nn.LayerNorm(48, elementwise_affine=False))
    assert plain.weight is None and plain.bias is None and not plain.elementwise_affine


def test_variance_epsilon_alias():
    rn = RMSNorm(8, eps=1e-5)
    assert rn.variance_epsilon == 1e-5
    rn.variance_epsilon = 1e-3
    assert rn.eps == 1e-3


def test_extra_repr():
    assert repr(RMSNorm(64, eps=1e-5)) == "RMSNorm((64,), eps=1e-05, elementwise_affine=True)"
    assert repr(LayerNorm(64, bias=False)) == "LayerNorm((64,), eps=1e-05, elementwise_affine=True, bias=False)"


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (((2, 3),), {}, "normalized_shape must be one non-negative int"),
        (([],), {}, "normalized_shape must be one non-negative int"),
        ((-4,), {}, "normalized_shape must be one non-negative int"),
        ((8.0,), {}, "normalized_shape must be an int or a 1-tuple"),
        ((8,), {"eps": -1.0}, "eps must be a non-negative float"),
    ],
)
def test_bad_constructor_args(cls, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(*args, **kwargs)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_forward_rejects_wrong_last_dim(cls):
    with pytest.raises(ValueError, match=r"x has shape \(3, 9\); expected a last dim of 8"):
        cls(8, elementwise_affine=False)(torch.randn(3, 9))


class _OnlyEps(nn.Module):
    eps = 1e-5


@pytest.mark.parametrize(
    "cls, module, match",
    [
        (RMSNorm, nn.Linear(4, 4), "neither `variance_epsilon` nor `eps`"),
        (LayerNorm, nn.LayerNorm((4, 5)), "normalized_shape must be one non-negative int"),
        (RMSNorm, nn.RMSNorm((2, 8)), "normalized_shape must be one non-negative int"),
        (LayerNorm, nn.Identity(), "neither `variance_epsilon` nor `eps`"),
        (LayerNorm, _OnlyEps(), "neither `normalized_shape` nor a `weight`"),
    ],
)
def test_from_module_bad_modules(cls, module, match):
    with pytest.raises(ValueError, match=match):
        cls.from_module(module)


def test_modules_compile_fullgraph(device, compile_backend):
    rms, ln = RMSNorm(64).to(device), _randomize(LayerNorm(64)).to(device)
    x, r = torch.randn(4, 64, device=device), torch.randn(4, 64, device=device)

    def fn(x, r):
        y, h = rms(x, residual=r)
        return ln(y) + h

    with fuseformer.use_backend("triton"):
        eager = fn(x, r)
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(x, r)
    torch.testing.assert_close(compiled, eager)
