"""swiglu / geglu: the Triton kernels against the fp64 reference (DESIGN.md §3), strided and packed
inputs, NaN/Inf, empty, bad input, compile."""

import pytest
import torch
import torch.nn.functional as TF

import fuseformer
import fuseformer.ops as F
from fuseformer.ops import activations as A
from fuseformer.testing import assert_close

CPU_SHAPES = [(1, 1), (3, 123), (37, 769), (5, 5125), (2, 3, 64)]
GPU_SHAPES = [(16384, 14336), (4096, 11008), (1000, 5125), (3, 70001), (8, 512, 1376), (1, 1)]
# (public op, its kwargs, the reference's kwargs): one case per kernel activation.
VARIANTS = {
    "silu": (F.swiglu, {}, F.swiglu_ref),
    "gelu_tanh": (F.geglu, {"approximate": "tanh"}, F.geglu_ref),
    "gelu": (F.geglu, {"approximate": "none"}, F.geglu_ref),
}


def _randn(shape, dtype, device, scale=1.0, gapped=False):
    """A random tensor; with ``gapped``, viewed out of a wider one whose gap columns hold NaN."""
    values = (scale * torch.randn(shape, device=device)).to(dtype)
    if not gapped:
        return values
    base = torch.full((*shape[:-1], shape[-1] + 5), float("nan"), dtype=dtype, device=device)
    base[..., : shape[-1]] = values
    return base[..., : shape[-1]]


def _inputs(shape, dtype, device, layout):
    """gate, up in ``layout``: "contiguous", "nan_gapped" or "packed" (the halves of one (..., 2I)).

    Gate is scaled by 3 so that both tails and the bend of the activation are exercised.
    """
    if layout == "packed":
        gate, up = _randn((*shape[:-1], 2 * shape[-1]), dtype, device, scale=2.0).chunk(2, dim=-1)
        return gate, up
    gapped = layout == "nan_gapped"
    return _randn(shape, dtype, device, 3.0, gapped), _randn(shape, dtype, device, 1.0, gapped)


def _check(activation, shape, dtype, device, layout="contiguous"):
    op, kwargs, ref_fn = VARIANTS[activation]
    gate, up = _inputs(shape, dtype, device, layout)
    if layout != "contiguous":  # strided views; for nan_gapped, a kernel reading a gap yields NaN
        assert not gate.is_contiguous() and not up.is_contiguous()
        assert layout == "packed" or torch.isnan(gate._base).any()

    def run(fn, cast, **kw):
        args = [t.detach().to(cast).requires_grad_() for t in (gate, up)]
        return fn(*args, **kwargs, **kw), args

    with fuseformer.use_backend("triton"):
        out, args = run(op, dtype)
    ref, ref_args = run(ref_fn, torch.float64, upcast=True)
    base, base_args = run(ref_fn, dtype, upcast=False)
    assert out.dtype == dtype and out.shape == gate.shape and out.is_contiguous()
    assert_close("y", out, ref, base)

    dy = torch.randn(out.shape, dtype=dtype, device=device)
    for res in (out, ref, base):
        res.backward(dy.to(res.dtype))
    for name, a, rf, b in zip(("dgate", "dup"), args, ref_args, base_args):
        assert a.grad.dtype == dtype
        assert_close(name, a.grad, rf.grad, b.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_matches_reference(activation, shape, dtype, device):
    _check(activation, shape, dtype, device)


def _check_packed(activation, shape, dtype, device):
    """The packed call op(gate_up) (up=None) against the reference on its halves; its gradient is
    one tensor, produced by the op itself (no split and concatenation in the backward)."""
    op, kwargs, ref_fn = VARIANTS[activation]
    gu = _randn((*shape[:-1], 2 * shape[-1]), dtype, device, scale=2.0)

    def run(fn, cast, packed, **kw):
        x = gu.detach().to(cast).requires_grad_()
        y = fn(x, **kwargs) if packed else fn(*x.chunk(2, dim=-1), **kwargs, **kw)
        return y, x

    with fuseformer.use_backend("triton"):
        out, x = run(op, dtype, True)
    ref, ref_x = run(ref_fn, torch.float64, False, upcast=True)
    base, base_x = run(ref_fn, dtype, False, upcast=False)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1]) and out.is_contiguous()
    assert_close("y", out, ref, base)
    nodes, stack = [], [out.grad_fn]
    while stack:  # the backward graph from y to the leaf: the op's node feeds the leaf directly
        node = stack.pop()
        nodes.append(type(node).__name__)
        stack += [f for f, _ in node.next_functions if f is not None]
    assert "_GLUPackedFunctionBackward" in nodes and not any(n.startswith(("Split", "Chunk", "Cat")) for n in nodes)
    dy = torch.randn(out.shape, dtype=dtype, device=device)
    for res in (out, ref, base):
        res.backward(dy.to(res.dtype))
    assert x.grad.dtype == dtype and x.grad.shape == gu.shape
    assert_close("dgate_up", x.grad, ref_x.grad, base_x.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES + [(0, 8), (3, 0)])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_packed_matches_reference(activation, shape, dtype, device):
    _check_packed(activation, shape, dtype, device)


@pytest.mark.parametrize("layout", ["nan_gapped", "packed"])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_strided_inputs(activation, layout, device):
    _check(activation, (2, 7, 300), torch.float16, device, layout)


def test_glu_column_strided_input(device):
    """A transposed gate (column stride != 1) is copied, never read wrongly."""
    gate = torch.randn(96, 10, device=device).t()
    up = torch.randn(10, 96, device=device)
    with fuseformer.use_backend("triton"):
        y = F.swiglu(gate, up)
    assert_close("y", y, F.swiglu_ref(gate.double(), up.double()), F.swiglu_ref(gate, up, upcast=False))


@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_launchers_read_and_write_packed_halves_in_place(activation, device):
    """The fused MLP's use: gate/up are halves of one (M, 2I) tensor and the gradients go into the two
    halves of one (M, 2I) buffer, with no copy on either side."""
    m, i = 9, 200
    gu = torch.randn(m, 2 * i, device=device, dtype=torch.float16)
    gate, up = gu.chunk(2, dim=-1)
    y = A.glu_fwd(gate, up, activation)
    torch.testing.assert_close(y, A.glu_ref(gate, up, activation), rtol=2e-3, atol=2e-3)

    dy = torch.randn(m, i, device=device, dtype=torch.float16)
    dgu = torch.full((m, 2 * i), float("nan"), device=device, dtype=torch.float16)
    dgate, dup = dgu.chunk(2, dim=-1)
    out = A.glu_bwd(dy, gate, up, activation, dgate=dgate, dup=dup)
    assert out[0].data_ptr() == dgu.data_ptr() and out[1].data_ptr() == dgu[:, i:].data_ptr()
    g, u = (t.detach().double().requires_grad_() for t in (gate, up))
    A.glu_ref(g, u, activation).backward(dy.double())
    torch.testing.assert_close(dgu, torch.cat([g.grad, u.grad], -1).half(), rtol=2e-3, atol=2e-3)


def test_glu_config_override_matches_default(device):
    """``config=`` (tuning sweeps) launches the given tile: other tiles, same values; ``out=`` a
    row-strided buffer."""
    gate, up = _randn((5, 123), torch.float32, device, 3.0), _randn((5, 123), torch.float32, device)
    dy = _randn((5, 123), torch.float32, device)
    y0 = A.glu_fwd(gate, up, "silu")
    dg0, du0 = A.glu_bwd(dy, gate, up, "silu")
    for cfg in (dict(BLOCK_M=2, BLOCK_N=32, num_warps=2), dict(BLOCK_M=1, BLOCK_N=256, num_warps=4)):
        out = torch.full((5, 130), float("nan"), device=device)[:, :123]
        y = A.glu_fwd(gate, up, "silu", out=out, config=cfg)
        assert y.data_ptr() == out.data_ptr()
        torch.testing.assert_close(y, y0, rtol=0, atol=0)
        dg, du = A.glu_bwd(dy, gate, up, "silu", config=cfg)
        torch.testing.assert_close(dg, dg0, rtol=0, atol=0)
        torch.testing.assert_close(du, du0, rtol=0, atol=0)


def test_glu_launch_plan_is_cached(monkeypatch, device):
    """The autotune lookup happens once per launch plan (forward and backward), never per call."""
    from fuseformer.runtime import autotune

    def fwd_bwd():
        gate, up = (_randn((3, 40), torch.float32, device).requires_grad_() for _ in range(2))
        with fuseformer.use_backend("triton"):
            y = F.swiglu(gate, up)
        y.sum().backward()
        return y, gate.grad, up.grad

    fwd_bwd()

    def no_lookup(*args, **kwargs):
        raise AssertionError("autotune.get_config called on a cached plan")

    monkeypatch.setattr(autotune, "get_config", no_lookup)
    fwd_bwd()


def test_glu_row_broadcast_grad(device):
    """An upstream gradient with row stride 0 (expanded) is read correctly."""
    gate = torch.randn(6, 50, device=device, requires_grad=True)
    up = torch.randn(6, 50, device=device, requires_grad=True)
    w = torch.randn(50, device=device)
    with fuseformer.use_backend("triton"):
        (F.swiglu(gate, up) * w).sum().backward()
    g, u = (t.detach().double().requires_grad_() for t in (gate, up))
    (F.swiglu_ref(g, u) * w.double()).sum().backward()
    torch.testing.assert_close(gate.grad.double(), g.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up.grad.double(), u.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (2, 0, 8)])
def test_glu_empty(shape, device):
    gate = torch.randn(shape, device=device, requires_grad=True)
    up = torch.randn(shape, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        y = F.geglu(gate, up)
    assert y.shape == shape
    y.sum().backward()
    assert gate.grad.shape == shape and up.grad.shape == shape


def _same_specials(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: both NaN, or the same infinity, or both finite."""
    both_nan = a.isnan() & b.isnan()
    same_inf = a.isinf() & b.isinf() & (a == b)
    return both_nan | same_inf | (a.isfinite() & b.isfinite())


@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_nan_inf_propagate_like_torch(activation, device):
    op, kwargs, ref_fn = VARIANTS[activation]
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, 30.0, -30.0, 1e30, -1e30]
    gate = torch.randn(4, 33, device=device)
    up = torch.randn(4, 33, device=device)
    gate[0, : len(specials)] = torch.tensor(specials)
    up[1, : len(specials)] = torch.tensor(specials)
    up[2, :3] = float("inf")
    gate[2, :3] = torch.tensor([0.0, -100.0, 2.0])  # act(gate) 0 (twice) and > 0 times inf
    with fuseformer.use_backend("triton"):
        args = [t.clone().requires_grad_() for t in (gate, up)]
        y = op(*args, **kwargs)
        dy = torch.randn_like(y)
        y.backward(dy)
    # Torch itself decides where NaN and Inf land: its fp32 eager formula (what users run), or, where
    # torch's own paths disagree (its vectorized CPU gelu(inf) is NaN on some machines and inf on
    # others, and inf in fp64), its fp64 result.
    torch_args = [t.clone().requires_grad_() for t in (gate, up)]
    act = TF.silu if activation == "silu" else lambda g: TF.gelu(g, **kwargs)
    expected = act(torch_args[0]) * torch_args[1]
    expected.backward(dy)
    ref_args = [t.double().requires_grad_() for t in (gate, up)]
    ref = ref_fn(*ref_args, **kwargs)
    ref.backward(dy.double())
    for name, o, e, r in [("y", y, expected, ref)] + [
        (n, a.grad, t.grad, rr.grad) for n, a, t, rr in zip(("dgate", "dup"), args, torch_args, ref_args)
    ]:
        like_fp32, like_fp64 = _same_specials(o, e), _same_specials(o.double(), r)
        agree = _same_specials(e.double(), r)
        assert bool((like_fp32 | (~agree & like_fp64)).all()), (name, o[~like_fp32], e[~like_fp32], r[~like_fp32])
        if name == "y":  # the cases above do produce both
            assert torch.isnan(o).any() and torch.isinf(o).any()
        finite = torch.isfinite(e) & torch.isfinite(r)
        assert_close(name, o[finite], r[finite], e[finite])


def test_glu_reference_backend_is_used_when_forced(device):
    gate, up = torch.randn(3, 10, device=device), torch.randn(3, 10, device=device)
    with fuseformer.use_backend("reference"):
        torch.testing.assert_close(F.swiglu(gate, up), TF.silu(gate) * up)
        torch.testing.assert_close(F.geglu(gate, up, "none"), TF.gelu(gate) * up)


def test_glu_float64_runs_on_reference(device):
    gate = torch.randn(3, 10, dtype=torch.float64, device=device)
    up = torch.randn(3, 10, dtype=torch.float64, device=device)
    torch.testing.assert_close(F.geglu(gate, up), TF.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(F.swiglu(gate, up), TF.silu(gate) * up)


def test_glu_refs_upcast():
    gate = torch.randn(3, 10, dtype=torch.float16)
    up = torch.randn(3, 10, dtype=torch.float16)
    for y in (F.swiglu_ref(gate, up), F.geglu_ref(gate, up, "none", upcast=False)):
        assert y.dtype == torch.float16
    expected = (TF.gelu(gate.float(), approximate="tanh") * up.float()).half()
    assert torch.equal(F.geglu_ref(gate, up), expected)


_BAD = [
    (F.swiglu, dict(gate=torch.randint(0, 5, (3, 8)), up=torch.randn(3, 8)), "gate has dtype int64"),
    (F.swiglu, dict(gate=torch.randn(3, 8), up=torch.randn(3, 9)), r"up has shape \(3, 9\)"),
    (F.swiglu, dict(gate=torch.randn(3, 8), up=torch.randn(3, 8).half()), "up has dtype float16"),
    (F.swiglu, dict(gate=torch.randn(3, 8), up=torch.randn(3, 8, device="meta")), "up is on meta but gate is on cpu"),
    (F.swiglu, dict(gate=torch.randn(()), up=torch.randn(())), "gate must have at least 1 dim"),
    (F.swiglu, dict(gate=torch.randn(3, 8), up=[1.0]), "up must be a torch.Tensor"),
    (F.geglu, dict(gate=torch.randn(3, 8), up=torch.randn(3, 8), approximate="erf"), "approximate must be"),
    (F.geglu, dict(gate=torch.randn(3, 8).half(), up=torch.randn(3, 8)), "up has dtype float32"),
    (F.swiglu, dict(gate=torch.randn(3, 7)), r"packed \[gate \| up\] tensor, its last dim even; got shape \(3, 7\)"),
    (F.geglu, dict(gate=torch.randn(())), "packed"),
    (F.swiglu, dict(gate=torch.randint(0, 5, (3, 8))), "gate has dtype int64"),
]


@pytest.mark.parametrize("op, kwargs, match", _BAD)
def test_glu_bad_input(op, kwargs, match):
    with pytest.raises(ValueError, match=match):
        op(**kwargs)


def test_glu_bad_approximate_in_reference():
    with pytest.raises(ValueError, match="approximate must be"):
        F.geglu_ref(torch.randn(2), torch.randn(2), approximate=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a second device")
def test_glu_device_mismatch():
    with pytest.raises(ValueError, match="up is on cpu but gate is on cuda"):
        F.swiglu(torch.randn(3, 8, device="cuda"), torch.randn(3, 8))


def test_glu_compiles_fullgraph(device, compile_backend):
    gu = torch.randn(2, 5, 128, device=device, requires_grad=True)

    def fn(gu):
        gate, up = gu.chunk(2, dim=-1)
        return F.swiglu(gate, up) + F.geglu(gate * 2, up, "none") + F.geglu(up, gate) + F.swiglu(gu * 0.5)

    with fuseformer.use_backend("triton"):
        eager = fn(gu)
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(gu)
        torch.testing.assert_close(compiled, eager)
        (g_eager,) = torch.autograd.grad(eager.sum(), gu)
        (g_compiled,) = torch.autograd.grad(compiled.sum(), gu)
    torch.testing.assert_close(g_compiled, g_eager)
    assert g_compiled.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_gpu(activation, shape, dtype):
    _check(activation, shape, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["packed", "nan_gapped"])
@pytest.mark.parametrize("shape", [(8192, 14336), (777, 5125)])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_gpu_strided(activation, shape, layout, dtype):
    _check(activation, shape, dtype, "cuda", layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16384, 8192), (777, 5125)])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_gpu_packed(activation, shape, dtype):
    _check_packed(activation, shape, dtype, "cuda")


@pytest.mark.gpu
def test_glu_gpu_int64_offsets():
    """Row offsets past 2^31 elements (a (2^31/I + 3, I) bf16 tensor, 4 GiB)."""
    i = 16384
    m = 2**31 // i + 3
    gate = torch.randn(m, i, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(m, i, device="cuda", dtype=torch.bfloat16)
    y = F.swiglu(gate, up)
    tail = slice(m - 4, m)
    assert_close("y", y[tail], F.swiglu_ref(gate[tail].double(), up[tail].double()),
                 F.swiglu_ref(gate[tail], up[tail], upcast=False))  # fmt: skip
    dgate, dup = A.glu_bwd(torch.ones_like(y), gate, up, "silu")
    for cast, upcast in ((torch.float64, True), (torch.bfloat16, False)):
        g, u = (t[tail].to(cast).requires_grad_() for t in (gate, up))
        F.swiglu_ref(g, u, upcast=upcast).sum().backward()
        if upcast:
            ref_dgate, ref_dup = g.grad, u.grad
    assert_close("dgate", dgate[tail], ref_dgate, g.grad)
    assert_close("dup", dup[tail], ref_dup, u.grad)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_glu_custom_op_passes_opcheck(activation, device):
    """Schema, fake tensors, autograd registration and AOT dispatch of fuseformer::glu_fwd."""
    from fuseformer.ops.activations import _glu_fwd_op

    g = torch.randn(5, 40, device=device, requires_grad=True)
    u = torch.randn(5, 40, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        torch.library.opcheck(_glu_fwd_op, (g, u, activation))


def test_glu_packed_custom_op_passes_opcheck(device):
    """The same for fuseformer::glu_packed_fwd (the packed [gate | up] form)."""
    from fuseformer.ops.activations import _glu_packed_fwd_op

    gu = torch.randn(5, 80, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        torch.library.opcheck(_glu_packed_fwd_op, (gu, "silu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", list(VARIANTS))
def test_glu_fast_launch_matches_normal_launch(activation, dtype):
    """The direct launch path gives bitwise the outputs and gradients of kernel[grid](...), and is
    taken: across shapes, the packed form, NaN-gapped row strides and a pointer off 16-byte alignment."""
    from fuseformer.ops._utils import fast_launch
    from fuseformer.testing import skip_unless_direct_launch_triton

    skip_unless_direct_launch_triton()

    op, kwargs, _ = VARIANTS[activation]
    launchers = (A._fwd_launcher, A._bwd_launcher)

    def cases(m, n):
        yield _inputs((m, n), dtype, "cuda", "contiguous")
        yield _inputs((m, n), dtype, "cuda", "nan_gapped")
        yield _randn((m, 2 * n), dtype, "cuda", 2.0), None  # packed [gate | up], up=None
        base = _randn((2 * m * n + 1,), dtype, "cuda", 2.0)
        yield base[1 : m * n + 1].view(m, n), base[m * n + 1 :].view(m, n)  # off 16-byte alignment

    def run(gate, up):
        # detach(): the same storage and strides (a clone would be a fresh, aligned tensor).
        args = [t.detach().requires_grad_() for t in (gate, up) if t is not None]
        y = op(*args, **kwargs) if up is not None else op(args[0], None, **kwargs)
        y.backward(y.detach() * 0.5 + 1)  # a gradient the same in both runs
        with torch.no_grad():
            inference = op(gate, up, **kwargs)
        return [y.detach(), inference] + [a.grad for a in args]

    for m, n in [(4096, 14336), (37, 769), (1, 1), (3, 70001)]:
        for gate, up in cases(m, n):
            with fast_launch(False):
                expected = run(gate, up)
            with fast_launch(True):
                run(gate, up)  # first launch of each key: compiles, fills the cache
                misses = [la.misses for la in launchers]
                got = run(gate, up)
                assert [la.misses for la in launchers] == misses, "direct path not taken"
            for e, g in zip(expected, got):
                assert torch.equal(e, g) or (torch.isnan(e).any() and torch.equal(e.isnan(), g.isnan()))
    torch.cuda.synchronize()
