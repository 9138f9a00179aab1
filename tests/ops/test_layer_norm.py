"""layer_norm: the Triton kernels against the fp64 reference (DESIGN.md §3), bad input, compile."""

import importlib

import pytest
import torch
import torch.nn.functional as TF

import fuseformer
import fuseformer.ops as F
from fuseformer.ops.layer_norm import layer_norm_fwd
from fuseformer.testing import assert_close

# (4, 20000) takes the chunked forward (> 16384) and backward (> 8192); (17, 8200) the single-pass
# forward and the chunked backward with more rows than the interpreter's 16 persistent programs.
CPU_SHAPES = [(1, 1), (3, 123), (37, 769), (5, 5125), (2, 3, 64), (4, 20000)]
GPU_SHAPES = [(1, 1), (37, 769), (4096, 1024), (8192, 4096), (1000, 5125), (64, 65536), (3, 70001)]


def _nan_gapped(shape, dtype, device):
    """A random tensor of ``shape`` viewed out of a wider one whose gap columns hold NaN."""
    base = torch.full((*shape[:-1], shape[-1] + 5), float("nan"), dtype=dtype, device=device)
    base[..., : shape[-1]] = torch.randn(shape, dtype=dtype, device=device)
    return base[..., : shape[-1]]


def _check(shape, dtype, device, *, residual, weight=True, bias=True, noncontig=False, eps=1e-5, offset=0.0):
    """Outputs (y, and h when fused) and every gradient against the fp64 reference (§3).

    ``offset`` shifts x by a constant: a large mean over a small spread is where a variance taken
    as E[x^2] - E[x]^2 cancels, so it catches a kernel computing it that way.
    """
    n = shape[-1]

    def make(s):
        t = _nan_gapped(s, dtype, device) if noncontig else torch.randn(s, dtype=dtype, device=device)
        return t + offset if offset else t

    x = make(shape)
    r = (
        (_nan_gapped(shape, dtype, device) if noncontig else torch.randn(shape, dtype=dtype, device=device))
        if residual
        else None
    )
    w = (1 + 0.5 * torch.randn(n, dtype=dtype, device=device)) if weight else None
    b = 0.5 * torch.randn(n, dtype=dtype, device=device) if bias else None
    leaves = {"x": x, "w": w, "b": b, "r": r}
    leaves = {k: v for k, v in leaves.items() if v is not None}

    def run(fn, cast, upcast=None):
        args = {k: t.detach().to(cast).requires_grad_() for k, t in leaves.items()}
        kw = dict(bias=args.get("b"), eps=eps, residual=args.get("r"))
        if upcast is not None:
            kw["upcast"] = upcast
        out = fn(args["x"], args.get("w"), **kw)
        outs = list(out) if residual else [out]
        return outs, args

    with fuseformer.use_backend("triton"):
        outs, args = run(F.layer_norm, dtype)
    refs, ref_args = run(F.layer_norm_ref, torch.float64, upcast=True)
    bases, base_args = run(F.layer_norm_ref, dtype, upcast=False)
    for name, o, rf, bs in zip(["y", "h"], outs, refs, bases):
        assert o.dtype == dtype and o.shape == shape
        assert_close(name, o, rf, bs)

    grads_out = [torch.randn(o.shape, dtype=dtype, device=device) for o in outs]
    for res in (outs, refs, bases):
        torch.autograd.backward(res, [g.to(res[0].dtype) for g in grads_out])
    for k in leaves:
        assert args[k].grad.dtype == leaves[k].dtype
        assert_close(f"d{k}", args[k].grad, ref_args[k].grad, base_args[k].grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_matches_reference(shape, dtype, residual, device):
    _check(shape, dtype, device, residual=residual)


@pytest.mark.parametrize("weight, bias", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("shape", [(9, 129), (2, 20000)])
def test_layer_norm_affine_variants(shape, weight, bias, device):
    _check(shape, torch.float16, device, residual=True, weight=weight, bias=bias)


@pytest.mark.parametrize("shape", [(37, 769), (4, 20000)])
def test_layer_norm_bfloat16(shape, device):
    # No tl.dot here, so the interpreter's bf16 problem (DESIGN.md §3) does not apply.
    _check(shape, torch.bfloat16, device, residual=True)


def test_layer_norm_float32_params_with_half_input(device):
    # Mixed precision: fp16 activations, fp32 parameters. y comes in x's dtype, dw/db in theirs.
    x = torch.randn(6, 200, dtype=torch.float16, device=device, requires_grad=True)
    w = (1 + 0.5 * torch.randn(200, device=device)).requires_grad_()
    b = torch.randn(200, device=device, requires_grad=True)
    dy = torch.randn(6, 200, dtype=torch.float16, device=device)
    with fuseformer.use_backend("triton"):
        y = F.layer_norm(x, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    assert y.dtype == torch.float16 and [g.dtype for g in grads] == [torch.float16, torch.float32, torch.float32]
    results = []
    for cast, upcast in ((torch.float64, True), (None, False)):
        args = [t.detach().to(cast or t.dtype).requires_grad_() for t in (x, w, b)]
        yr = F.layer_norm_ref(*args, upcast=upcast)
        results.append((yr, torch.autograd.grad(yr, args, dy.to(yr.dtype))))
    (y_ref, g_ref), (y_base, g_base) = results
    assert_close("y", y, y_ref, y_base)
    for name, g, gr, gb in zip(["dx", "dw", "db"], grads, g_ref, g_base):
        assert_close(name, g, gr, gb)


def test_layer_norm_chunked_backward_many_rows(device):
    _check((17, 8200), torch.float32, device, residual=False)


@pytest.mark.parametrize("shape", [(6, 300), (2, 20000)])
def test_layer_norm_large_mean_small_spread(shape, device):
    _check(shape, torch.float32, device, residual=False, offset=1000.0)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(7, 300), (2, 20000)])
def test_layer_norm_noncontiguous_with_nan_gaps(shape, residual, device):
    _check(shape, torch.float32, device, residual=residual, noncontig=True)


def test_layer_norm_transposed_3d_input(device):
    # (S, B, N) viewed as (B, S, N): rows cannot be collapsed without a copy.
    x = torch.randn(5, 3, 64, device=device).transpose(0, 1)
    r = torch.randn(5, 3, 64, device=device).transpose(0, 1)
    w, b = torch.randn(64, device=device), torch.randn(64, device=device)
    with fuseformer.use_backend("triton"):
        y, h = F.layer_norm(x, w, b, residual=r)
    y_ref, h_ref = F.layer_norm_ref(x.double(), w.double(), b.double(), residual=r.double())
    y_base, h_base = F.layer_norm_ref(x, w, b, residual=r, upcast=False)
    assert y.shape == h.shape == (3, 5, 64)
    assert_close("y", y, y_ref, y_base)
    assert_close("h", h, h_ref, h_base)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight, bias", [(True, True), (False, False), (True, False)])
def test_layer_norm_reference_matches_torch_layer_norm(weight, bias, residual, device):
    x = torch.randn(5, 77, dtype=torch.float64, device=device) * 3 + 2
    r = torch.randn_like(x) if residual else None
    w = torch.randn(77, dtype=torch.float64, device=device) if weight else None
    b = torch.randn(77, dtype=torch.float64, device=device) if bias else None
    out = F.layer_norm_ref(x, w, b, eps=1e-3, residual=r)
    h = x + r if residual else x
    expected = TF.layer_norm(h, (77,), w, b, eps=1e-3)
    if residual:
        torch.testing.assert_close(out[1], h, rtol=0, atol=0)
        out = out[0]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(8, 500), (3, 20000)])
def test_layer_norm_matches_torch_layer_norm_fp32(shape, device):
    x = torch.randn(shape, device=device) * 2 + 1
    w, b = torch.randn(shape[-1], device=device), torch.randn(shape[-1], device=device)
    with fuseformer.use_backend("triton"):
        y = F.layer_norm(x, w, b, eps=1e-5)
    expected = TF.layer_norm(x, (shape[-1],), w, b, eps=1e-5)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [97, 20000])
def test_layer_norm_fwd_launcher_saves_mean_and_rstd(n, device):
    x = torch.randn(6, n, device=device) * 3 + 4
    r = torch.randn(6, n, device=device)
    y, h, mean, rstd = layer_norm_fwd(x, None, None, r, 1e-5)
    h64 = x.double() + r.double()
    var, mu = torch.var_mean(h64, dim=-1, unbiased=False)
    torch.testing.assert_close(h, (x + r))
    torch.testing.assert_close(mean.double(), mu, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (6,)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(0, 64), (3, 0)])
def test_layer_norm_empty(shape, residual, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    r = torch.randn(shape, device=device, requires_grad=True) if residual else None
    w = torch.randn(shape[-1], device=device, requires_grad=True)
    b = torch.randn(shape[-1], device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        out = F.layer_norm(x, w, b, eps=0.0, residual=r)
    y = out[0] if residual else out
    (y.sum() + (out[1].sum() if residual else 0)).backward()
    assert y.shape == shape and x.grad.shape == shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("n", [257, 20000])
def test_layer_norm_nan_inf_propagate_like_reference(n, device):
    x = torch.randn(4, n, device=device)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    w, b = torch.randn(n, device=device), torch.randn(n, device=device)
    with fuseformer.use_backend("triton"):
        y = F.layer_norm(x, w, b)
    ref = F.layer_norm_ref(x.double(), w.double(), b.double())
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all() and torch.isfinite(y[[0, 3]]).all()
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert_close("y", y, ref, F.layer_norm_ref(x, w, b, upcast=False))


def test_layer_norm_reference_backend_is_used_when_forced(device):
    x, w, b = torch.randn(3, 10, device=device), torch.randn(10, device=device), torch.randn(10, device=device)
    with fuseformer.use_backend("reference"):
        torch.testing.assert_close(F.layer_norm(x, w, b), F.layer_norm_ref(x, w, b))


def test_layer_norm_float64_runs_on_reference(device):
    x = torch.randn(3, 10, dtype=torch.float64, device=device)
    w, b = torch.randn(10, dtype=torch.float64, device=device), torch.randn(10, dtype=torch.float64, device=device)
    torch.testing.assert_close(F.layer_norm(x, w, b), TF.layer_norm(x, (10,), w, b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.randint(0, 5, (3, 8)), weight=torch.randn(8)), "x has dtype int64"),
        (dict(x=torch.tensor(1.0), weight=None), "x must have at least 1 dim"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(7)), r"weight has shape \(7,\)"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), bias=torch.randn(9)), r"bias has shape \(9,\)"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), bias=torch.randint(0, 3, (8,))), "bias has dtype int64"),
        (dict(x=torch.randn(3, 8), weight=None, bias="b"), "bias must be a torch.Tensor"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), residual=torch.randn(3, 9)), "residual has shape"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), residual=torch.randn(3, 8).half()), "residual has dtype"),
        (dict(x=torch.randn(3, 8), weight="w"), "weight must be a torch.Tensor"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), eps=-1.0), "eps must be"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), eps=float("nan")), "eps must be"),
    ],
)
def test_layer_norm_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.layer_norm(**kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a second device")
def test_layer_norm_device_mismatch():
    with pytest.raises(ValueError, match="bias is on cpu but x is on cuda"):
        F.layer_norm(torch.randn(3, 8, device="cuda"), None, torch.randn(8))


def test_layer_norm_compiles_fullgraph(device, compile_backend):
    x = torch.randn(6, 96, device=device, requires_grad=True)
    r = torch.randn(6, 96, device=device)
    w = torch.randn(96, device=device, requires_grad=True)
    b = torch.randn(96, device=device, requires_grad=True)

    def fn(x, r, w, b):
        y, h = F.layer_norm(x, w, b, residual=r)
        return F.layer_norm(y * 2, w) + F.layer_norm(h, None, b)

    g = torch.randn(6, 96, device=device)
    with fuseformer.use_backend("triton"):
        eager = fn(x, r, w, b)
        eager_grads = torch.autograd.grad(eager, (x, w, b), g)
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(x, r, w, b)
        compiled_grads = torch.autograd.grad(compiled, (x, w, b), g)
    torch.testing.assert_close(compiled, eager)
    for eager_grad, compiled_grad in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(compiled_grad, eager_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_gpu(shape, dtype, residual):
    _check(shape, dtype, "cuda", residual=residual)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight, bias", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("shape", [(4096, 4096), (64, 65536)])
def test_layer_norm_gpu_affine_variants(shape, weight, bias, dtype):
    _check(shape, dtype, "cuda", residual=True, weight=weight, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 4096), (16, 65536)])
def test_layer_norm_gpu_large_mean_small_spread(shape):
    _check(shape, torch.float32, "cuda", residual=False, offset=1000.0)


@pytest.mark.gpu
def test_layer_norm_gpu_row_offsets_past_2_31():
    # 2^31 / 65536 = 32768 rows: the last rows' element offsets pass int32. Each row's y and dx
    # depend on that row alone, so the tail is checked against the reference run on the tail.
    x = torch.randn(32769, 65536, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(65536, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(32769, 65536, dtype=torch.bfloat16, device="cuda")
    y = F.layer_norm(x, w, None)
    (dx,) = torch.autograd.grad(y, x, dy)
    tails = []
    for cast, upcast in ((torch.float64, True), (torch.bfloat16, False)):
        xt = x.detach()[-2:].to(cast).requires_grad_()
        yt = F.layer_norm_ref(xt, w.to(cast), upcast=upcast)
        tails.append((yt, torch.autograd.grad(yt, xt, dy[-2:].to(cast))[0]))
    (y_ref, dx_ref), (y_base, dx_base) = tails
    assert_close("y[-2:]", y[-2:], y_ref, y_base)
    assert_close("dx[-2:]", dx[-2:], dx_ref, dx_base)


@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_custom_op_passes_opcheck(residual, device):
    """Schema, fake tensors, autograd registration and AOT dispatch of fuseformer::layer_norm_fwd."""
    from fuseformer.ops.layer_norm import _layer_norm_fwd_op

    x = torch.randn(5, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    b = torch.randn(40, device=device, requires_grad=True)
    r = torch.randn(5, 40, device=device, requires_grad=True) if residual else None
    with fuseformer.use_backend("triton"):
        torch.library.opcheck(_layer_norm_fwd_op, (x, w, b, r, 1e-5))


# The CPU path (what the reference backend runs on fp32 CPU tensors unless the reference is forced):
# torch's fused layer_norm after the residual add, outputs and gradients against the fp64 reference.
@pytest.mark.parametrize("shape", [(1, 768), (3, 123), (2, 3, 64)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight, bias", [(False, False), (True, False), (True, True)])
def test_layer_norm_cpu_path_matches_reference(shape, residual, weight, bias, monkeypatch):
    ln = importlib.import_module("fuseformer.ops.layer_norm")
    monkeypatch.setattr(ln, "choose_backend", lambda *args: "reference")  # as on a CPU-only install
    calls = []
    real = ln.layer_norm_ref
    monkeypatch.setattr(ln, "layer_norm_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    n = shape[-1]
    leaves = [
        torch.randn(shape),
        (1 + 0.5 * torch.randn(n)) if weight else None,
        torch.randn(n) if bias else None,
        torch.randn(shape) if residual else None,
    ]

    def run(fn, cast, **kw):
        args = [t.detach().to(cast).requires_grad_() if t is not None else None for t in leaves]
        out = fn(args[0], args[1], args[2], 1e-5, args[3], **kw)
        return (list(out) if residual else [out]), [a for a in args if a is not None]

    outs, args = run(F.layer_norm, torch.float32)
    assert calls == []  # the CPU path, not the reference
    refs, ref_args = run(F.layer_norm_ref, torch.float64)
    bases, base_args = run(F.layer_norm_ref, torch.float32, upcast=False)
    for name, o, rf, b in zip(["y", "h"], outs, refs, bases):
        assert o.dtype == torch.float32
        assert_close(name, o, rf, b)
    grads = [torch.randn(o.shape) for o in outs]
    for res in (outs, refs, bases):
        torch.autograd.backward(res, [g.to(res[0].dtype) for g in grads])
    for a, rf, b in zip(args, ref_args, base_args):
        assert_close("grad", a.grad, rf.grad, b.grad)
    with fuseformer.use_backend("reference"):  # forced: the reference itself
        F.layer_norm(leaves[0], leaves[1], leaves[2], 1e-5, leaves[3])
    assert calls == [1]
