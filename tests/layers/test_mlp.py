"""GatedMLP: same outputs and gradients as transformers' LlamaMLP with the same weights (fp32, the
kernel through the interpreter on CPU; §3 criterion against an fp64 copy), from_hf, bad args, compile."""

import copy

import pytest
import torch
from torch import nn

import fuseformer
from fuseformer.layers import GatedMLP
from fuseformer.testing import assert_close

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig  # noqa: E402


def _hf_mlp(h, i, act="silu"):
    config = LlamaConfig(
        hidden_size=h, intermediate_size=i, hidden_act=act, num_attention_heads=4, num_key_value_heads=4
    )
    mlp = modeling_llama.LlamaMLP(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return mlp


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_matches_llama_mlp(act, device):
    h, i = 40, 72
    theirs = _hf_mlp(h, i, act).to(device)
    ours = GatedMLP.from_hf(theirs)
    assert ours.activation == ("silu" if act == "silu" else "gelu_tanh")
    assert ours.down_proj is theirs.down_proj  # shared, not copied
    ours.down_proj = copy.deepcopy(theirs.down_proj)  # separate here, so each side's gradient shows alone
    ref = copy.deepcopy(theirs).double()
    x = torch.randn(2, 5, h, device=device)
    g = torch.randn(2, 5, h, device=device)
    outs = []
    for module, cast in ((ours, torch.float32), (ref, torch.float64), (theirs, torch.float32)):
        xs = x.detach().to(cast).clone().requires_grad_()
        with fuseformer.use_backend("triton"):
            y = module(xs)
        y.backward(g.to(cast))
        outs.append((y, xs.grad))
    assert_close("out", outs[0][0], outs[1][0], outs[2][0])
    assert_close("dx", outs[0][1], outs[1][1], outs[2][1])
    # Parameter gradients: ours packs gate/up; compare against the HF pair concatenated.
    d_gu = ours.gate_up_proj.weight.grad
    for name, part in (("gate_proj", d_gu[:i]), ("up_proj", d_gu[i:])):
        assert_close(name, part, getattr(ref, name).weight.grad, getattr(theirs, name).weight.grad)
    assert_close("down_proj", ours.down_proj.weight.grad, ref.down_proj.weight.grad, theirs.down_proj.weight.grad)


def test_gated_mlp_init_state_dict_and_repr():
    m = GatedMLP(16, 24, "gelu_pytorch_tanh", dtype=torch.float16)
    assert m.gate_up_proj.weight.shape == (48, 16) and m.down_proj.weight.shape == (16, 24)
    assert m.gate_up_proj.weight.dtype == torch.float16
    assert set(m.state_dict()) == {"gate_up_proj.weight", "down_proj.weight"}
    assert "activation='gelu_tanh'" in repr(m)


def test_gated_mlp_forward_is_the_op(device):
    m = GatedMLP(24, 40).to(device)
    x = torch.randn(3, 24, device=device)
    with fuseformer.use_backend("triton"):
        torch.testing.assert_close(
            m(x), fuseformer.ops.fused_mlp_ref(x, m.gate_up_proj.weight, m.down_proj.weight), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GatedMLP(0, 8), "hidden_size must be"),
        (lambda: GatedMLP(8, 8, "relu"), "activation must be"),
        (lambda: GatedMLP(8, 8)(torch.randn(2, 7)), r"x has shape \(2, 7\)"),
        (lambda: GatedMLP.from_hf(nn.Module()), "gate_proj must be an nn.Linear"),
    ],
)
def test_gated_mlp_bad_args(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_gated_mlp_compiles_fullgraph(device, compile_backend):
    m = GatedMLP(32, 48).to(device)
    x = torch.randn(4, 32, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True, backend=compile_backend)(x)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert m.gate_up_proj.weight.grad is not None and x.grad is not None
