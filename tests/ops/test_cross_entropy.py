"""cross_entropy: the Triton path against the fp64 reference (DESIGN.md §3) for every reduction,
ignore_index (all ignored too), label smoothing, z-loss; the reference against torch; strided and NaN
inputs; bad input; opcheck. (fused_linear_cross_entropy: test_fused_linear_cross_entropy.py.)"""

import importlib

import pytest
import torch
import torch.nn.functional as TF

import fuseformer
import fuseformer.ops as F
from fuseformer.testing import assert_close

# The module, not the function of the same name that fuseformer.ops exports.
CE = importlib.import_module("fuseformer.ops.cross_entropy")

REDUCTIONS = ["mean", "sum", "none"]


def _targets(n, v, device, ignore_frac=0.2, ignore_index=-100):
    t = torch.randint(0, v, (n,), device=device)
    t[torch.rand(n, device=device) < ignore_frac] = ignore_index
    return t


def _grad_for(loss):
    return torch.randn(loss.shape, dtype=torch.float32, device=loss.device).to(loss.dtype)


def _check_ce(n, v, dtype, device, reduction, label_smoothing=0.0, z_loss=0.0, gapped=False, ignore_frac=0.2,
              softcap=0.0):  # fmt: skip
    x = (3 * torch.randn(n, v, device=device)).to(dtype)
    if gapped:  # a row-strided view whose gap columns hold NaN
        base = torch.full((n, v + 7), float("nan"), dtype=dtype, device=device)
        base[:, :v] = x
        x = base[:, :v]
    t = _targets(n, v, device, ignore_frac)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)

    def run(fn, cast, **extra):
        xs = x.detach().to(cast).requires_grad_()
        return fn(xs, t, **kw, **extra), xs

    with fuseformer.use_backend("triton"):
        out, xo = run(F.cross_entropy, dtype)
    ref, xr = run(CE.cross_entropy_ref, torch.float64, upcast=True)
    base, xb = run(CE.cross_entropy_ref, dtype, upcast=False)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close("loss", out, ref, base)
    g = _grad_for(out)
    for o in (out, ref, base):
        o.backward(g.to(o.dtype))
    assert_close("dlogits", xo.grad, xr.grad, xb.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n, v", [(1, 1), (37, 1000), (5, 5003)])
def test_cross_entropy_matches_reference(n, v, dtype, reduction, device):
    _check_ce(n, v, dtype, device, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_smoothing_and_z_loss(reduction, device):
    _check_ce(19, 777, torch.float16, device, reduction, label_smoothing=0.1, z_loss=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_softcap(reduction, dtype, device):
    """Logits of std 3 under a cap of 2 (Gemma 2's final soft-cap, low enough to bite), with z-loss and
    smoothing: the loss and the gradient through the tanh."""
    _check_ce(19, 777, dtype, device, reduction, label_smoothing=0.1, z_loss=1e-3, softcap=2.0)
    x, t = 3 * torch.randn(8, 50, dtype=torch.float64), torch.randint(0, 50, (8,))
    assert abs(CE.cross_entropy_ref(x, t, softcap=2.0) - CE.cross_entropy_ref(x, t)) > 0.1  # it bites


def test_cross_entropy_noncontiguous_with_nan_gaps(device):
    _check_ce(9, 300, torch.float32, device, "mean", label_smoothing=0.05, gapped=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_reference_matches_torch(reduction, label_smoothing, ignore_index, device):
    """The oracle itself against torch.nn.functional.cross_entropy (values and gradients)."""
    x = torch.randn(23, 50, dtype=torch.float64, device=device, requires_grad=True)
    t = _targets(23, 50, device, 0.3, ignore_index)
    x2 = x.detach().clone().requires_grad_()
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    ours, theirs = CE.cross_entropy_ref(x, t, **kw), TF.cross_entropy(x2, t, **kw)
    torch.testing.assert_close(ours, theirs)
    g = torch.randn(ours.shape, dtype=torch.float64, device=device)
    ours.backward(g)
    theirs.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_triton_matches_torch_exactly_enough(reduction, device):
    """fp32 logits: the kernel against torch's own cross_entropy (what users compare with)."""
    x = torch.randn(31, 513, device=device, requires_grad=True)
    t = _targets(31, 513, device)
    x2 = x.detach().clone().requires_grad_()
    with fuseformer.use_backend("triton"):
        ours = F.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
    theirs = TF.cross_entropy(x2, t, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    g = torch.randn(ours.shape, device=device)
    ours.backward(g)
    theirs.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_all_ignored_gives_zero(reduction, device):
    x = torch.randn(6, 100, device=device, requires_grad=True)
    t = torch.full((6,), -100, device=device)
    with fuseformer.use_backend("triton"):
        loss = F.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_cross_entropy_nan_inf_like_torch(device):
    x = torch.randn(5, 300, device=device)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    x[3, :260] = float("-inf")  # a masked vocabulary; the first block is all -inf
    t = torch.tensor([0, 1, 2, 280, 4], device=device)
    with fuseformer.use_backend("triton"):
        ours = F.cross_entropy(x, t, reduction="none")
    theirs = TF.cross_entropy(x, t, reduction="none")
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    torch.testing.assert_close(ours, theirs, equal_nan=True)


def test_cross_entropy_empty(device):
    x = torch.randn(0, 10, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        loss = F.cross_entropy(x, torch.zeros(0, dtype=torch.long, device=device))
    loss.backward()
    assert loss.item() == 0 and x.grad.shape == (0, 10)


def test_cross_entropy_float64_runs_on_reference(device):
    x = torch.randn(4, 9, dtype=torch.float64, device=device)
    t = torch.randint(0, 9, (4,), device=device)
    torch.testing.assert_close(F.cross_entropy(x, t), TF.cross_entropy(x, t))


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (F.cross_entropy, dict(logits=torch.randn(3, 8), target=torch.randn(3)), "target has dtype float32"),
        (F.cross_entropy, dict(logits=torch.randn(3, 8), target=torch.zeros(4, dtype=torch.long)), "target has shape"),
        (F.cross_entropy, dict(logits=torch.randn(3), target=torch.zeros(3, dtype=torch.long)), "logits must have 2"),
        (
            F.cross_entropy,
            dict(logits=torch.randn(3, 8), target=torch.zeros(3, dtype=torch.long), reduction="avg"),
            "reduction must be",
        ),  # fmt: skip
        (
            F.cross_entropy,
            dict(logits=torch.randn(3, 8), target=torch.zeros(3, dtype=torch.long), label_smoothing=2.0),
            "label_smoothing must be",
        ),  # fmt: skip
        (
            F.cross_entropy,
            dict(logits=torch.randn(3, 8), target=torch.zeros(3, dtype=torch.long), z_loss=-1.0),
            "z_loss must be",
        ),  # fmt: skip
        (
            F.cross_entropy,
            dict(logits=torch.randn(3, 8), target=torch.zeros(3, dtype=torch.long), softcap=float("nan")),
            "softcap must be",
        ),  # fmt: skip
    ],
)
def test_bad_input(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(**kwargs)


def test_custom_ops_pass_opcheck(device):
    x = torch.randn(6, 50, device=device, requires_grad=True)
    t = _targets(6, 50, device)
    with fuseformer.use_backend("triton"):
        for cap in (0.0, 1.5):
            _, lse = CE._ce_fwd_op(x.detach(), t, -100, 0.1, 0.0, cap)
            torch.library.opcheck(CE._ce_fwd_op, (x, t, -100, 0.1, 0.0, cap))
            dloss = torch.randn(6, device=device)
            torch.library.opcheck(CE._ce_bwd_op, (dloss, x.detach(), t, lse, -100, 0.1, 0.0, cap))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_large_vocab_blocks(reduction, device):
    """V >= 32768 takes the 8192-wide steps (5 of them here, the last partial)."""
    _check_ce(3, 40000, torch.float16, device, reduction, label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("v", [50257, 128256, 4099])
def test_cross_entropy_gpu(v, dtype, reduction):
    _check_ce(2048, v, dtype, "cuda", reduction, label_smoothing=0.1 if v == 4099 else 0.0)
