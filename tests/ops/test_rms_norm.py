"""rms_norm: the Triton kernels against the fp64 reference (DESIGN.md §3), bad input, compile."""

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.testing import assert_close

CPU_SHAPES = [(1, 1), (3, 123), (37, 769), (5, 5125), (2, 3, 64), (4, 20000)]
GPU_SHAPES = [(1, 1), (37, 769), (4096, 1024), (8192, 4096), (1000, 5125), (64, 65536), (3, 70001)]


def _nan_gapped(shape, dtype, device):
    """A random tensor of ``shape`` viewed out of a wider one whose gap columns hold NaN."""
    base = torch.full((*shape[:-1], shape[-1] + 5), float("nan"), dtype=dtype, device=device)
    base[..., : shape[-1]] = torch.randn(shape, dtype=dtype, device=device)
    return base[..., : shape[-1]]


def _check(shape, dtype, device, *, residual, weight=True, noncontig=False, eps=1e-6):
    n = shape[-1]

    def make(s):
        return _nan_gapped(s, dtype, device) if noncontig else torch.randn(s, dtype=dtype, device=device)

    x = make(shape)
    r = make(shape) if residual else None
    w = (1 + 0.5 * torch.randn(n, dtype=dtype, device=device)) if weight else None
    leaves = [t for t in (x, w, r) if t is not None]

    def run(fn, cast, upcast=None):
        args = [t.detach().to(cast).requires_grad_() for t in leaves]
        xs, ws = args[0], (args[1] if weight else None)
        rs = args[-1] if residual else None
        kw = {} if upcast is None else {"upcast": upcast}
        out = fn(xs, ws, eps, rs, **kw) if kw else fn(xs, ws, eps=eps, residual=rs)
        outs = list(out) if residual else [out]
        return outs, args

    with fuseformer.use_backend("triton"):
        outs, args = run(F.rms_norm, dtype)
    refs, ref_args = run(F.rms_norm_ref, torch.float64, upcast=True)
    bases, base_args = run(F.rms_norm_ref, dtype, upcast=False)
    names = ["y", "h"]
    for name, o, rf, b in zip(names, outs, refs, bases):
        assert o.dtype == dtype
        assert_close(name, o, rf, b)

    grads_out = [torch.randn(o.shape, dtype=dtype, device=device) for o in outs]
    for res in (outs, refs, bases):
        torch.autograd.backward(res, [g.to(res[0].dtype) for g in grads_out])
    grad_names = ["dx", "dw", "dr"] if weight else ["dx", "dr"]
    for name, a, rf, b in zip(grad_names, args, ref_args, base_args):
        assert_close(name, a.grad, rf.grad, b.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(shape, dtype, residual, device):
    _check(shape, dtype, device, residual=residual)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_noncontiguous_with_nan_gaps(residual, device):
    _check((7, 300), torch.float32, device, residual=residual, noncontig=True)


def test_rms_norm_without_weight(device):
    _check((9, 129), torch.float16, device, residual=True, weight=False)


def test_rms_norm_empty_rows(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        y = F.rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 64) and torch.equal(w.grad, torch.zeros_like(w))


def test_rms_norm_nan_inf_propagate_like_reference(device):
    x = torch.randn(4, 257, device=device)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    w = torch.randn(257, device=device)
    with fuseformer.use_backend("triton"):
        y = F.rms_norm(x, w)
    ref = F.rms_norm_ref(x.double(), w.double())
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert_close("y", y, ref, F.rms_norm_ref(x, w, upcast=False))


def test_rms_norm_reference_backend_is_used_when_forced(device):
    x, w = torch.randn(3, 10, device=device), torch.randn(10, device=device)
    with fuseformer.use_backend("reference"):
        torch.testing.assert_close(F.rms_norm(x, w), F.rms_norm_ref(x, w))


def test_rms_norm_float64_runs_on_reference(device):
    x, w = torch.randn(3, 10, dtype=torch.float64, device=device), torch.randn(10, dtype=torch.float64, device=device)
    torch.testing.assert_close(F.rms_norm(x, w), F.rms_norm_ref(x, w))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.randint(0, 5, (3, 8)), weight=torch.randn(8)), "x has dtype int64"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(7)), r"weight has shape \(7,\)"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), residual=torch.randn(3, 9)), "residual has shape"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), residual=torch.randn(3, 8).half()), "residual has dtype"),
        (dict(x=torch.randn(3, 8), weight="w"), "weight must be a torch.Tensor"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), eps=-1.0), "eps must be"),
    ],
)
def test_rms_norm_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.rms_norm(**kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a second device")
def test_rms_norm_device_mismatch():
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        F.rms_norm(torch.randn(3, 8, device="cuda"), torch.randn(8))


def test_rms_norm_compiles_fullgraph(device, compile_backend):
    x = torch.randn(6, 96, device=device, requires_grad=True)
    r = torch.randn(6, 96, device=device)
    w = torch.randn(96, device=device, requires_grad=True)

    def fn(x, r, w):
        y, h = F.rms_norm(x, w, residual=r)
        return F.rms_norm(y * 2, w) + h

    with fuseformer.use_backend("triton"):
        eager = fn(x, r, w)
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(x, r, w)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_gpu(shape, dtype, residual):
    _check(shape, dtype, "cuda", residual=residual)


def test_rms_norm_empty_hidden_with_zero_eps(device):
    x = torch.randn(3, 0, device=device)
    with fuseformer.use_backend("triton"):
        y = F.rms_norm(x, None, eps=0.0)
    assert y.shape == (3, 0)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_custom_ops_pass_opcheck(residual, device):
    """Schema, fake tensors, autograd registration and AOT dispatch of the registered ops."""
    from fuseformer.ops.rms_norm import _rms_norm_bwd_op, _rms_norm_fwd_op

    x = torch.randn(5, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    r = torch.randn(5, 40, device=device, requires_grad=True) if residual else None
    _, h, rstd = _rms_norm_fwd_op(x.detach(), w.detach(), None if r is None else r.detach(), 1e-6)
    xn = h if residual else x.detach()
    dh = torch.randn(5, 40, device=device) if residual else None
    with fuseformer.use_backend("triton"):
        torch.library.opcheck(_rms_norm_fwd_op, (x, w, r, 1e-6))
        torch.library.opcheck(_rms_norm_bwd_op, (torch.randn(5, 40, device=device), xn, w.detach(), rstd, dh))
