"""rms_norm: the Triton kernels against the fp64 reference (DESIGN.md §3), bad input, compile."""

import importlib

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.testing import assert_close

rms_norm_fwd = importlib.import_module("fuseformer.ops.rms_norm").rms_norm_fwd

# (3, 3001): the fused add + norm's default at rows of 2049..4096 is the two-loop RELOAD form.
CPU_SHAPES = [(1, 1), (3, 123), (37, 769), (3, 3001), (5, 5125), (2, 3, 64), (4, 20000)]
GPU_SHAPES = [(1, 1), (37, 769), (4096, 1024), (8192, 4096), (1000, 5125), (64, 65536), (3, 70001)]


def _nan_gapped(shape, dtype, device):
    """A random tensor of ``shape`` viewed out of a wider one whose gap columns hold NaN."""
    base = torch.full((*shape[:-1], shape[-1] + 5), float("nan"), dtype=dtype, device=device)
    base[..., : shape[-1]] = torch.randn(shape, dtype=dtype, device=device)
    return base[..., : shape[-1]]


def _check(shape, dtype, device, *, residual, weight=True, noncontig=False, eps=1e-6, offset=0.0):
    n = shape[-1]

    def make(s):
        return _nan_gapped(s, dtype, device) if noncontig else torch.randn(s, dtype=dtype, device=device)

    x = make(shape)
    r = make(shape) if residual else None
    w = (1 - offset + 0.5 * torch.randn(n, dtype=dtype, device=device)) if weight else None  # scale ~1
    leaves = [t for t in (x, w, r) if t is not None]

    def run(fn, cast, upcast=None):
        args = [t.detach().to(cast).requires_grad_() for t in leaves]
        xs, ws = args[0], (args[1] if weight else None)
        rs = args[-1] if residual else None
        kw = {} if upcast is None else {"upcast": upcast}
        out = fn(xs, ws, eps, rs, offset=offset, **kw) if kw else fn(xs, ws, eps=eps, residual=rs, offset=offset)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 123), (5, 5125), (4, 20000)])  # one pass; chunked fwd; chunked bwd
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_offset_matches_reference(shape, dtype, residual, device):
    """Gemma's scale (1 + w): forward and gradients (dw is offset-free, dx sees 1 + w)."""
    _check(shape, dtype, device, residual=residual, offset=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_offset_is_hf_gemma_rms_norm(dtype, device):
    """offset=1 computes what HF GemmaRMSNorm computes: (1 + w) in fp32 times the fp32 normalized
    row, then one cast (so in fp16 the two agree to the last rounding, not only within §3)."""
    modeling_gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    theirs = modeling_gemma.GemmaRMSNorm(200, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        theirs.weight.copy_(0.3 * torch.randn(200))
    x = torch.randn(7, 200, dtype=dtype, device=device)
    with fuseformer.use_backend("triton"):
        y = F.rms_norm(x, theirs.weight, 1e-6, offset=1.0)
    expected = theirs(x)
    assert y.dtype == expected.dtype == dtype
    torch.testing.assert_close(y, expected, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)
    ref = F.rms_norm_ref(x.double(), theirs.weight.double(), 1e-6, offset=1.0)
    assert_close("y", y, ref, F.rms_norm_ref(x, theirs.weight, 1e-6, upcast=False, offset=1.0))


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
        (dict(x=torch.randn(3, 8), weight=torch.randn(7).double()), r"weight has shape \(7,\); expected \(8,\)"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8).int()), "weight has dtype int32"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), residual="r"), "residual must be a torch.Tensor"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), residual=torch.randn(2, 3, 8)), r"\(the shape of x\)"),
        (dict(x=torch.tensor(1.0), weight=None), "x must have at least 1 dim"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), eps=-1.0), "eps must be"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), offset="1"), "offset must be a finite float"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(8), offset=float("nan")), "offset must be a finite float"),
        (dict(x=torch.randn(3, 8), weight=None, offset=1.0), "offset 1.0 needs a weight"),
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
        return F.rms_norm(y * 2, w, offset=1.0) + h  # the offset is a float of the op's schema

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
        torch.library.opcheck(_rms_norm_fwd_op, (x, w, r, 1e-6, 1.0))  # Gemma's offset
        torch.library.opcheck(_rms_norm_bwd_op, (torch.randn(5, 40, device=device), xn, w.detach(), rstd, dh, 1.0))


# --------------------------------------------------------------------------------------------
# Host-overhead paths: the no-grad launcher, unused outputs, the dw reduction, the direct launch
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_no_grad_matches_reference(residual, device):
    """The inference path (no rstd buffer, STORE_RSTD=False) against the fp64 reference."""
    x = torch.randn(2, 5, 300, device=device)
    r = torch.randn(2, 5, 300, device=device) if residual else None
    w = torch.randn(300, device=device)
    with torch.no_grad(), fuseformer.use_backend("triton"):
        out = F.rms_norm(x, w, residual=r)
    refs = F.rms_norm_ref(x.double(), w.double(), residual=None if r is None else r.double())
    bases = F.rms_norm_ref(x, w, residual=r, upcast=False)
    for name, o, rf, b in zip(["y", "h"], *(v if residual else [v] for v in (out, refs, bases))):
        assert o.shape == x.shape
        assert_close(name, o, rf, b)


@pytest.mark.parametrize("use", ["y", "h"])
def test_rms_norm_residual_backward_with_one_output_unused(use, device):
    """The eager Function leaves unused output gradients as None (no zero fill): the backward must
    handle dy None (only h used) and dh None (only y used)."""
    x, r = (torch.randn(6, 130, device=device, requires_grad=True) for _ in range(2))
    w = torch.randn(130, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        y, h = F.rms_norm(x, w, residual=r)
    (y if use == "y" else h).square().sum().backward()
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    yd, hd = F.rms_norm_ref(xd, wd, residual=rd)
    (yd if use == "y" else hd).square().sum().backward()
    torch.testing.assert_close(x.grad, xd.grad.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r.grad, rd.grad.float(), rtol=1e-4, atol=1e-4)
    # Only h used: the reference leaves w without a gradient; ours is zero (dy taken as zeros).
    w_ref = wd.grad.float() if wd.grad is not None else torch.zeros_like(w)
    torch.testing.assert_close(w.grad, w_ref, rtol=1e-4, atol=1e-4)


def test_rms_norm_backward_with_an_undefined_output_gradient(device):
    """Without the residual the eager Function leaves autograd to materialize y's gradient: a
    consumer that returns None for it gives x and w zero gradients (as the residual form's dy None)."""

    class _DropFirst(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, z):
            return y.sum() * 0 + z.sum()

        @staticmethod
        def backward(ctx, g):
            return None, g.expand(3)

    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    z = torch.randn(3, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        y = F.rms_norm(x, w)
    dx, dw, dz = torch.autograd.grad(_DropFirst.apply(y, z), (x, w, z))
    assert torch.equal(dx, torch.zeros_like(x)) and torch.equal(dw, torch.zeros_like(w))
    assert torch.equal(dz, torch.ones_like(z))


def test_rms_norm_dw_reduction_over_many_partials(device):
    """dw from more partial rows than one step of the reduction kernel takes (N 5000: BLOCK_P 64;
    one row a program in the backward, so M 100 gives 100 partial rows)."""
    from fuseformer.ops.rms_norm import rms_norm_bwd, rms_norm_fwd
    from fuseformer.ops.rms_norm_bwd import _dw_plan

    m, n = 100, 5000
    assert _dw_plan(n)[0].kwargs["BLOCK_P"] < m
    x, dy = torch.randn(m, n, device=device), torch.randn(m, n, device=device)
    w = torch.randn(n, device=device)
    _, _, rstd = rms_norm_fwd(x, w, None, 1e-6)
    # Enough programs per SM for one program a row (CPU stand-in: 4 "SMs"); the two-launch form.
    dx, dw = rms_norm_bwd(dy, x, w, rstd, None, programs_per_sm=512, fused_dw=False)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    F.rms_norm_ref(xd, wd).backward(dy.double())
    torch.testing.assert_close(dx, xd.grad.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw, wd.grad.float(), rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------------------------
# The single-launch backward (dw summed in the backward kernel's tail, FUSED_DW)
# --------------------------------------------------------------------------------------------
def _spy_launches(monkeypatch):
    """Record each backward launch: True for the single-launch form, False for the two-launch
    backward kernel, "dw" for the dw reduction kernel."""
    import importlib

    rn = importlib.import_module("fuseformer.ops.rms_norm_bwd")
    launches = []

    def spy(real, tag=None):
        def launch(grid, cfg, *args):
            launches.append(tag or cfg.kwargs.get("FUSED_DW", False))
            return real(grid, cfg, *args)

        return launch

    monkeypatch.setattr(rn, "_bwd_launcher", spy(rn._bwd_launcher))
    monkeypatch.setattr(rn, "_dw_launcher", spy(rn._dw_launcher, "dw"))
    return rn, launches


def _bwd_inputs(m, n, dtype, device, residual):
    """Inputs of rms_norm_bwd (x being the normalized input h) and the fp64 and in-dtype references."""
    from fuseformer.ops.rms_norm import rms_norm_fwd

    x, dy = torch.randn(m, n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
    w = 1 + 0.5 * torch.randn(n, dtype=dtype, device=device)
    dh = torch.randn(m, n, dtype=dtype, device=device) if residual else None
    _, _, rstd = rms_norm_fwd(x, w, None, 1e-6)

    def grads(cast, upcast):
        xs, ws = x.to(cast).requires_grad_(), w.to(cast).requires_grad_()
        y = F.rms_norm_ref(xs, ws, 1e-6, upcast=upcast)
        dx, dw = torch.autograd.grad(y, (xs, ws), dy.to(cast))
        return (dx + dh.to(cast) if residual else dx), dw

    return (dy, x, w, rstd, dh), grads(torch.float64, True), grads(dtype, False)


# (M, N, programs per SM) and the P partial rows they give with the CPU stand-in of 4 "SMs": 1 (one
# program, one group), 5 (8-row blocks: groups of 3, the last of 2), 53 (one row a program at N > 4096:
# 7 groups of 8, the last of 5), and 3 programs of chunked rows.
_FUSED_SHAPES = [(1, 300, None), (37, 769, None), (53, 4100, 64), (3, 20000, None)]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, per_sm", _FUSED_SHAPES)
def test_rms_norm_single_launch_backward(m, n, per_sm, dtype, residual, device, monkeypatch):
    """dx and dw of the single-launch form against the fp64 reference (DESIGN.md §3), in one launch;
    a second call right after gives bitwise the same (the counters are back at zero, the summation
    order is fixed); the two-launch form agrees."""
    rn, launches = _spy_launches(monkeypatch)
    args, refs, bases = _bwd_inputs(m, n, dtype, device, residual)
    dx, dw = rn.rms_norm_bwd(*args, programs_per_sm=per_sm, fused_dw=True)
    assert launches == [True]
    block_m = rn._bwd_plan(n, residual, True, dtype, args[1].get_device())[2]
    assert (m + block_m - 1) // block_m == {1: 1, 37: 5, 53: 53, 3: 3}[m]  # P (below 4 x per SM)
    for name, got, ref, base in zip(["dx", "dw"], (dx, dw), refs, bases):
        assert got.dtype == dtype
        assert_close(name, got, ref, base)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    counters, _ = rn._workspaces[(args[1].get_device(), stream)]
    assert not counters.any()
    dx2, dw2 = rn.rms_norm_bwd(*args, programs_per_sm=per_sm, fused_dw=True)
    assert torch.equal(dx2, dx) and torch.equal(dw2, dw)
    dx3, dw3 = rn.rms_norm_bwd(*args, programs_per_sm=per_sm, fused_dw=False)
    assert launches == [True, True, False, "dw"]
    assert torch.equal(dx3, dx)
    assert_close("dw", dw3, refs[1], bases[1])


def test_rms_norm_single_launch_rule(device):
    """The launch plan's rule: small problems with one-pass rows take one launch; large ones, long
    rows and no-weight calls do not (the last have no dw: one launch anyway)."""
    import importlib

    rn = importlib.import_module("fuseformer.ops.rms_norm_bwd")
    assert rn._fused_dw_rows(4096, 1024, 264) == 17  # the small-rows goal shape: P 264, groups of 17
    assert rn._fused_dw_rows(4096, 2048, 264) == 17
    assert rn._fused_dw_rows(4096, 4096, 264) == 0  # the tail would read 33 rows of 4096
    assert rn._fused_dw_rows(32768, 4096, 264) == 0  # 2^27 elements: GPU-bound, two launches
    assert rn._fused_dw_rows(2048, 8192, 264) == 0  # the tail would read 33 rows of 8192
    assert [rn._fused_dw_group(p) for p in (1, 2, 4, 5, 9, 10, 528)] == [1, 2, 2, 3, 3, 4, 23]
    index = torch.empty(0, device=device).get_device()
    assert rn._bwd_plan(1024, False, True, torch.bfloat16, index)[4]
    assert not rn._bwd_plan(20000, False, True, torch.bfloat16, index)[4]  # chunked rows
    assert not rn._bwd_plan(1024, False, False, torch.bfloat16, index)[4]  # no weight


def test_rms_norm_backward_takes_the_rules_launch_for_every_m(device, monkeypatch):
    """The single-launch decision is ``_fused_dw_rows``'s for every M: around the grid filling up
    and around the element limit. Launches are recorded, not run."""
    import importlib

    rn = importlib.import_module("fuseformer.ops.rms_norm_bwd")
    launches = []
    monkeypatch.setattr(
        rn, "_bwd_launcher", lambda grid, cfg, tensors, ints, floats=(): launches.append((grid, cfg, ints[-1]))
    )
    monkeypatch.setattr(rn, "_dw_launcher", lambda *args: None)
    n = 1024
    w = torch.ones(n, device=device)
    index = w.get_device()
    cfg, fused_cfg, block_m, max_programs, fused_max = rn._bwd_plan(n, False, True, torch.float32, index)
    assert fused_max and rn._fused_dw_rows(1, n, fused_max)
    rows = rn._FUSED_DW_MAX_ELEMENTS // n  # the most rows the single launch takes
    full = block_m * fused_max  # the first M whose row blocks fill the grid
    for m in (1, full - block_m, full - 1, full, full + 1, rows, rows + 1):
        x = torch.empty(m, n, device=device)
        launches.clear()
        rn.rms_norm_bwd(x, x, w, torch.empty(m, device=device))
        programs = min((m + block_m - 1) // block_m, fused_max)
        expected = rn._fused_dw_rows(m, n, programs)
        if expected:
            assert launches == [((programs,), fused_cfg, expected)], m
        else:
            assert launches == [((min((m + block_m - 1) // block_m, max_programs),), cfg, 0)], m


def test_new_empty_is_a_kernel_output_in_the_tensors_dtype_and_device(device, monkeypatch):
    """``new_empty`` (the launchers' allocation for outputs shaped like an input): contiguous, of
    the tensor's dtype (or the one given) and device, a plain tensor without grad (also from a
    Parameter), and NaN-filled while outputs are poisoned (the tests' default)."""
    from fuseformer.ops import _utils

    x = torch.randn(3, 6, dtype=torch.float16, device=device, requires_grad=True)[:, :5]
    w = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16, device=device))
    for poison in (True, False):
        monkeypatch.setattr(_utils, "_POISON", poison)
        for t, sizes, dtype in ((x, (7, 5), None), (w, (5,), None), (x, (0, 5), None), (x, (7,), torch.float32)):
            out = _utils.new_empty(t, *sizes, dtype=dtype)
            assert out.shape == sizes and out.dtype == (dtype or t.dtype) and out.device == t.device
            assert out.is_contiguous() and type(out) is torch.Tensor and not out.requires_grad
            if poison:
                assert out.isnan().all()


def test_autograd_function_node_calls_backward_directly(device):
    """The eager Function's graph node runs our backward itself (no per-call lookup in
    BackwardCFunction.apply), and gradients through it are those of the reference."""
    import importlib

    rn = importlib.import_module("fuseformer.ops.rms_norm")
    x = torch.randn(4, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        y = F.rms_norm(x, w)
    assert type(y.grad_fn) is rn._RMSNormFunction._backward_cls
    assert rn._RMSNormFunction._backward_cls.apply is rn._RMSNormFunction.backward
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    dxr, dwr = torch.autograd.grad(F.rms_norm_ref(xd, wd), (xd, wd), dy.double())
    torch.testing.assert_close(dx, dxr.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw, dwr.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_public_backward_takes_one_launch(residual, device, monkeypatch):
    """Through the public op (eager autograd.Function), a small call's backward launches the
    backward kernel alone, and its gradients are those of the two-launch form."""
    rn, launches = _spy_launches(monkeypatch)
    x, r = (torch.randn(29, 257, device=device, requires_grad=True) for _ in range(2))
    w = torch.randn(257, device=device, requires_grad=True)
    dy = torch.randn(29, 257, device=device)
    with fuseformer.use_backend("triton"):
        y, h = F.rms_norm(x, w, residual=r) if residual else (F.rms_norm(x, w), None)
        grads = torch.autograd.grad([y, h] if residual else [y], (x, w), [dy, dy] if residual else [dy])
    assert launches == [True]
    launches.clear()
    _, _, rstd = rms_norm_fwd(x.detach(), w.detach(), r.detach() if residual else None, 1e-6)
    xn = (x + r).detach() if residual else x.detach()
    dx, dw = rn.rms_norm_bwd(dy, xn, w.detach(), rstd, dy if residual else None, fused_dw=False)
    torch.testing.assert_close(grads[0], dx, rtol=0, atol=0)
    assert launches == [False, "dw"]
    torch.testing.assert_close(grads[1], dw, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_rms_norm_single_launch_under_graph_capture_and_streams(monkeypatch):
    """While a CUDA graph is captured the backward takes the two-launch form (the per-stream
    scratch stays out of graphs); a side stream gets its own scratch; results match eager."""
    rn, launches = _spy_launches(monkeypatch)
    args, refs, bases = _bwd_inputs(4096, 1024, torch.bfloat16, "cuda", False)
    rn.rms_norm_bwd(*args, fused_dw=False)  # compiles the two-launch kernels before the capture
    launches.clear()
    dx, dw = rn.rms_norm_bwd(*args)
    assert launches == [True]
    assert_close("dx", dx, refs[0], bases[0])
    assert_close("dw", dw, refs[1], bases[1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dx_side, dw_side = rn.rms_norm_bwd(*args)
        key = (torch.cuda.current_device(), side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    assert key in rn._workspaces
    assert torch.equal(dx_side, dx) and torch.equal(dw_side, dw)
    graph = torch.cuda.CUDAGraph()
    launches.clear()
    with torch.cuda.graph(graph):
        dx_g, dw_g = rn.rms_norm_bwd(*args)
    assert launches == [False, "dw"]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dx_g, dx)
    assert_close("dw", dw_g, refs[1], bases[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fast_launch_matches_normal_launch(dtype, residual):
    """The direct launch path gives bitwise the outputs and gradients of kernel[grid](...), and is
    taken: across shapes, a second dtype, misaligned (offset) and row-strided views."""
    from fuseformer.ops._utils import fast_launch
    from fuseformer.testing import skip_unless_direct_launch_triton

    skip_unless_direct_launch_triton()
    from fuseformer.ops.rms_norm import _fwd_launcher
    from fuseformer.ops.rms_norm_bwd import _bwd_launcher, _dw_launcher

    launchers = (_fwd_launcher, _bwd_launcher, _dw_launcher)

    def views(m, n):
        base = torch.randn(m * (n + 3) + 8, dtype=dtype, device="cuda")
        yield base[: m * n].view(m, n)  # contiguous, aligned
        yield base[1 : 1 + m * n].view(m, n)  # pointer off 16-byte alignment
        yield base[: m * (n + 3)].view(m, n + 3)[:, :n]  # row stride n + 3

    def run(x, r, w, dy):
        # detach(): the same storage and strides (a clone would be a fresh, aligned tensor).
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        rs = r.detach().requires_grad_() if r is not None else None
        out = F.rms_norm(xs, ws, residual=rs)
        outs = list(out) if residual else [out]
        torch.autograd.backward(outs, [dy] * len(outs))
        with torch.no_grad():
            inference = F.rms_norm(x, w, residual=r)
        grads = [xs.grad, ws.grad] + ([rs.grad] if residual else [])
        return [o.detach() for o in outs] + grads + (list(inference) if residual else [inference])

    for m, n in [(1, 1), (37, 769), (4096, 1024), (3, 70001)]:
        w = 1 + 0.5 * torch.randn(n, dtype=dtype, device="cuda")
        for x, r in zip(views(m, n), views(m, n)):
            r = r if residual else None
            dy = torch.randn(m, n, dtype=dtype, device="cuda")
            with fast_launch(False):
                expected = run(x, r, w, dy)
            with fast_launch(True):
                run(x, r, w, dy)  # first launch of each key: compiles, fills the cache
                misses = [la.misses for la in launchers]
                got = run(x, r, w, dy)
                assert [la.misses for la in launchers] == misses, "direct path not taken"
            for e, g in zip(expected, got):
                assert torch.equal(e, g) or (torch.isnan(e).any() and torch.equal(e.isnan(), g.isnan()))
    torch.cuda.synchronize()


def test_rms_norm_reload_forward_matches_two_pass(device):
    """The two-pass forward's RELOAD variant (x and r re-read in pass 2, h stored there; the fused
    default at rows of 2049..4096) gives the two-pass outputs; y may differ by h's rounding (RELOAD
    normalizes h unrounded)."""
    import importlib

    rn = importlib.import_module("fuseformer.ops.rms_norm")
    m, n = 5, 200
    x, r = (torch.randn(m, n, dtype=torch.float16, device=device) for _ in range(2))
    w = torch.randn(n, dtype=torch.float16, device=device)
    cfg = dict(BLOCK_M=2, BLOCK_N=64, SINGLE_PASS=False, num_warps=4)
    with fuseformer.use_backend("triton"):
        y0, h0, s0 = rn.rms_norm_fwd(x, w, r, 1e-6, config=cfg)
        y1, h1, s1 = rn.rms_norm_fwd(x, w, r, 1e-6, config=dict(cfg, RELOAD=True))
    torch.testing.assert_close(h1, h0, rtol=0, atol=0)
    torch.testing.assert_close(s1, s0, rtol=0, atol=0)
    torch.testing.assert_close(y1, y0, rtol=2e-3, atol=2e-3)


# The CPU path (what the reference backend runs on fp32 CPU tensors unless the reference is forced):
# torch's fused rms_norm, outputs and gradients against the fp64 reference.
@pytest.mark.parametrize("shape", [(1, 576), (3, 123), (2, 3, 64)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight, offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
def test_rms_norm_cpu_path_matches_reference(shape, residual, weight, offset, monkeypatch):
    rn = importlib.import_module("fuseformer.ops.rms_norm")
    monkeypatch.setattr(rn, "choose_backend", lambda *args: "reference")  # as on a CPU-only install
    calls = []
    real = rn.rms_norm_ref
    monkeypatch.setattr(rn, "rms_norm_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    n = shape[-1]
    leaves = [
        torch.randn(shape),
        (1 - offset + 0.5 * torch.randn(n)) if weight else None,
        torch.randn(shape) if residual else None,
    ]

    def run(fn, cast, **kw):
        args = [t.detach().to(cast).requires_grad_() if t is not None else None for t in leaves]
        out = fn(args[0], args[1], 1e-6, args[2], offset=offset, **kw)
        return (list(out) if residual else [out]), [a for a in args if a is not None]

    outs, args = run(F.rms_norm, torch.float32)
    assert calls == []  # the CPU path, not the reference
    refs, ref_args = run(F.rms_norm_ref, torch.float64)
    bases, base_args = run(F.rms_norm_ref, torch.float32, upcast=False)
    for name, o, rf, b in zip(["y", "h"], outs, refs, bases):
        assert o.dtype == torch.float32
        assert_close(name, o, rf, b)
    grads = [torch.randn(o.shape) for o in outs]
    for res in (outs, refs, bases):
        torch.autograd.backward(res, [g.to(res[0].dtype) for g in grads])
    for a, rf, b in zip(args, ref_args, base_args):
        assert_close("grad", a.grad, rf.grad, b.grad)
    with fuseformer.use_backend("reference"):  # forced: the reference itself
        forced = F.rms_norm(leaves[0], leaves[1], 1e-6, leaves[2], offset=offset)
    assert calls == [1]
    with torch.no_grad():  # the in-place form of the CPU path, bitwise the reference's
        fast = F.rms_norm(leaves[0], leaves[1], 1e-6, leaves[2], offset=offset)
    torch.testing.assert_close(fast, forced, rtol=0, atol=0)
