"""cpu_linear's few-row form and the Linear module (ops/_cpu_linear.py, layers/linear.py), and fused_mlp's
fp32 CPU path that uses it: the same product as F.linear (§3 against fp64, F.linear in fp32 the
baseline), taken exactly where the rule says, and the module a drop-in nn.Linear."""

import pytest
import torch
from torch import nn

import fuseformer
import fuseformer.ops.mlp as mlp_module
from fuseformer.layers import Linear
from fuseformer.ops._cpu_linear import SMALL_ROWS, cpu_linear
from fuseformer.testing import assert_close


@pytest.fixture
def linear_calls(monkeypatch):
    """Counts the calls that reach torch's F.linear (cpu_linear's fallback)."""
    calls = []
    real = torch.nn.functional.linear

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    return calls


@pytest.mark.parametrize("n, k", [(48, 16), (32, 32), (16, 48)])
@pytest.mark.parametrize("rows", [1, 2, 3, SMALL_ROWS, SMALL_ROWS + 1, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_linear(n, k, rows, bias):
    x = torch.randn(rows, k)
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    out = cpu_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    base = torch.nn.functional.linear(x, w, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    assert_close("y", out, ref, base)


@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 1, 24), (24,)])
def test_cpu_linear_keeps_leading_dims(shape):
    x, w = torch.randn(shape), torch.randn(40, 24)
    out = cpu_linear(x, w)
    assert out.shape == (*shape[:-1], 40)
    assert_close("y", out, torch.nn.functional.linear(x.double(), w.double()), torch.nn.functional.linear(x, w))


def test_cpu_linear_takes_the_gemm_form_only_where_the_rule_says(linear_calls):
    tall = torch.randn(64, 16)
    for rows in range(1, SMALL_ROWS + 1):
        cpu_linear(torch.randn(rows, 16), tall)
    cpu_linear(torch.randn(1, 16), tall, torch.randn(64))
    cpu_linear(torch.randn(2, 1, 16), tall)
    assert linear_calls == []  # every one of those took (W @ x^T)^T
    cases = [
        (torch.randn(SMALL_ROWS + 1, 16), tall),  # too many rows
        (torch.randn(1, 64), tall.t().contiguous()),  # wide weight (N < K)
        (torch.randn(1, 16).double(), tall.double()),  # not fp32
        (torch.randn(1, 16), torch.randn(16, 64).t()),  # a transposed (non-contiguous) weight
        (torch.randn(0, 16), tall),  # no rows
    ]
    for x, w in cases:
        cpu_linear(x, w)
    assert len(linear_calls) == len(cases)


def test_linear_is_a_drop_in_nn_linear():
    torch.manual_seed(0)
    plain = nn.Linear(16, 48)
    ours = Linear(16, 48)
    assert isinstance(ours, nn.Linear)
    ours.load_state_dict(plain.state_dict())
    assert list(ours.state_dict()) == list(plain.state_dict())
    seen = []
    ours.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    x = torch.randn(1, 16, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    y, y_plain = ours(x), plain(x_plain)
    assert seen == [(1, 48)]
    torch.testing.assert_close(y, y_plain)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_plain.backward(dy)
    torch.testing.assert_close(x.grad, x_plain.grad)
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad)
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_fused_mlp_cpu_path(rows, dtype, monkeypatch):
    """fused_mlp's reference backend on CPU tensors (_fused_mlp_cpu: GEMMs in x's dtype, the activation
    in fp32) within §3 of the fp64 MLP, eager PyTorch in x's dtype the baseline; forced, the reference."""
    x = torch.randn(rows, 16).to(dtype)
    w_gate_up, w_down = (torch.randn(64, 16) * 0.3).to(dtype), (torch.randn(16, 32) * 0.3).to(dtype)
    # Under TRITON_INTERPRET the tests' CPU tensors go to Triton; choose "reference" as a CPU-only install would.
    monkeypatch.setattr(mlp_module, "choose_backend", lambda *args: "reference")
    ran = []
    real_cpu = mlp_module._fused_mlp_cpu
    monkeypatch.setattr(mlp_module, "_fused_mlp_cpu", lambda *a: ran.append("cpu") or real_cpu(*a))
    out = fuseformer.ops.fused_mlp(x, w_gate_up, w_down)
    ref = mlp_module.fused_mlp_ref(x.double(), w_gate_up.double(), w_down.double())
    assert out.dtype == dtype
    assert_close("y", out, ref, mlp_module.fused_mlp_ref(x, w_gate_up, w_down, upcast=False))
    assert ran == ["cpu"]
    with fuseformer.use_backend("reference"):  # a forced reference runs fused_mlp_ref itself
        fuseformer.ops.fused_mlp(x, w_gate_up, w_down)
    assert ran == ["cpu"]
