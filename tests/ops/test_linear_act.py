"""linear_act: the GEMM with bias and activation in its epilogue, against the fp64 reference (DESIGN.md §3),
output and every gradient; both weight layouts (nn.Linear's and Conv1D's transpose view), both load
paths, odd shapes, strided x with NaN gaps, NaN, bad input, compile, opcheck. bf16 and the real sizes run
in the gpu-marked tests."""

import importlib

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.ops.activations import _act_ref
from fuseformer.testing import assert_close

M = importlib.import_module("fuseformer.ops.linear_act")  # the module (F.linear_act is the function)


def _weight(n, k, dtype, device, layout="nk"):
    w = torch.randn(n, k, device=device) / k**0.5
    if layout == "kn":  # transformers' Conv1D keeps (in, out): the op gets its transpose view
        return w.T.contiguous().to(dtype).T
    return w.to(dtype)


def _x(lead, k, dtype, device, gapped=False, gap=5):
    x = torch.randn(*lead, k, device=device).to(dtype)
    if not gapped:
        return x
    base = torch.full((*lead, k + gap), float("nan"), dtype=dtype, device=device)
    base[..., :k] = x
    return base[..., :k]


def _check(lead, k, n, dtype, device, activation="gelu", bias=True, layout="nk", gapped=False, backward=True,
           config=None):  # fmt: skip
    x = _x(lead, k, dtype, device, gapped)
    w = _weight(n, k, dtype, device, layout)
    b = torch.randn(n, device=device).to(dtype) if bias else None

    def run(fn, cast, **kw):
        # Leaves in ``cast``; the weight keeps its layout (a transpose view of a (K, N) leaf for "kn").
        xs = x.detach().to(cast).requires_grad_(backward)
        leaf = (w.T if layout == "kn" else w).detach().to(cast).requires_grad_(backward)
        ws = leaf.T if layout == "kn" else leaf
        bs = b.detach().to(cast).requires_grad_(backward) if bias else None
        return fn(xs, ws, bs, activation, **kw), [t for t in (xs, leaf, bs) if t is not None]

    if config is not None:  # the launcher with an explicit config: the kernel's own output
        y, pre = M.linear_act_fwd(x.reshape(-1, k), w, b, activation, True, config)
        z = torch.nn.functional.linear(x.reshape(-1, k).double(), w.double(), None if b is None else b.double())
        z_base = torch.nn.functional.linear(x.reshape(-1, k), w, b)
        assert_close("pre", pre, z, z_base)
        assert_close("y", y, _act_ref(z, activation), _act_ref(z_base, activation))
    with fuseformer.use_backend("triton"):
        out, args = run(F.linear_act, dtype)
    ref, ref_args = run(M.linear_act_ref, torch.float64, upcast=True)
    base, base_args = run(M.linear_act_ref, dtype, upcast=False)
    assert out.dtype == dtype and out.shape == (*lead, n)
    assert_close("out", out, ref, base)
    if not backward:
        return
    g = torch.randn(out.shape, device=device).to(dtype)
    for o in (out, ref, base):
        o.backward(g.to(o.dtype))
    for name, a, r, bb in zip(["dx", "dweight", "dbias"], args, ref_args, base_args):
        assert_close(name, a.grad, r.grad, bb.grad)


CPU_CASES = [((1,), 40, 88), ((7,), 40, 88), ((2, 17), 96, 200), ((37,), 33, 50)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead, k, n", CPU_CASES)
def test_linear_act_matches_reference(lead, k, n, dtype, device):
    _check(lead, k, n, dtype, device)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_linear_act_activations_and_layouts(activation, layout, device):
    _check((9,), 40, 72, torch.float16, device, activation, layout=layout)


def test_linear_act_without_bias(device):
    _check((13,), 48, 40, torch.float32, device, bias=False)


DESC = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2, USE_DESC=True)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("path", ["pointers", "descriptors", "persistent"])
def test_linear_act_kernel_paths(path, layout, device):
    """Each load path (the persistent tile loop: fewer programs than tiles, each walking several) and
    weight layout with an explicit config (T, K, N not multiples of the blocks, several row groups of the
    grouped order); the saved pre-activation too."""
    cfg = dict(DESC, USE_DESC=path != "pointers", PERSISTENT=path == "persistent")
    # N 104: rows of 16-byte multiples in both layouts (descriptors apply), not a multiple of BLOCK_N.
    _check((50,), 72, 104, torch.float16, device, layout=layout, config=cfg, backward=False)


def test_linear_act_noncontiguous_x_with_nan_gaps(device):
    _check((11,), 40, 64, torch.float32, device, gapped=True)


def test_linear_act_nan_propagates(device):
    x = torch.randn(5, 32, device=device)
    x[2, 3] = float("nan")
    w, b = _weight(48, 32, torch.float32, device), torch.randn(48, device=device)
    with fuseformer.use_backend("triton"):
        out = F.linear_act(x, w, b)
    ref = M.linear_act_ref(x, w, b)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out[2]).all()


def test_linear_act_empty_tokens_and_empty_k(device):
    x = torch.randn(0, 16, device=device, requires_grad=True)
    w = _weight(24, 16, torch.float32, device).requires_grad_()
    with fuseformer.use_backend("triton"):
        out = F.linear_act(x, w)
        out.sum().backward()
        assert out.shape == (0, 24) and torch.equal(w.grad, torch.zeros_like(w))
        b = torch.randn(8, device=device)
        y = F.linear_act(torch.randn(3, 0, device=device), torch.randn(8, 0, device=device), b)
    torch.testing.assert_close(y, torch.nn.functional.gelu(b).expand(3, 8))


def test_linear_act_no_grad_saves_nothing(device, monkeypatch):
    seen = []
    real = M.linear_act_fwd
    monkeypatch.setattr(M, "linear_act_fwd", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    x, w = torch.randn(3, 16, device=device), _weight(24, 16, torch.float32, device)
    with fuseformer.use_backend("triton"):
        F.linear_act(x, w)
        F.linear_act(x, w.requires_grad_())
    assert seen == [False, True]


def test_linear_act_cpu_default_is_eager_linear_then_act(monkeypatch):
    """On a CPU-only install (no interpreter) a CPU call is F.linear in x's dtype with the activation over it."""
    monkeypatch.setattr(M, "choose_backend", lambda *args: "reference")
    monkeypatch.setattr(M, "linear_act_ref", lambda *a, **k: pytest.fail("the reference ran"))
    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(F.linear_act(x, w, b, "gelu_tanh"), expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=[1.0], weight=torch.randn(4, 1)), "x must be"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(4, 7)), r"expected \(N, 8\)"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(4, 8), bias=torch.randn(5)), r"expected \(4,\)"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(4, 8), activation="relu"), "activation must be"),
        (dict(x=torch.randn(3, 8), weight=torch.randn(4, 8, dtype=torch.float16)), "weight"),
        (dict(x=torch.tensor(1.0), weight=torch.randn(4, 1)), "at least 1 dim"),
    ],
)
def test_linear_act_bad_input(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        F.linear_act(**kwargs)


def test_linear_act_compiles_fullgraph(device, compile_backend):
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    w = _weight(40, 32, torch.float32, device).requires_grad_()
    b = torch.randn(40, device=device, requires_grad=True)

    def fn(x, w, b):
        return F.linear_act(x, w, b) * 2

    with fuseformer.use_backend("triton"):
        eager = fn(x, w, b)
        eager_grads = torch.autograd.grad(eager.sum(), (x, w, b))
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(x, w, b)
        grads = torch.autograd.grad(compiled.sum(), (x, w, b))
    torch.testing.assert_close(compiled, eager)
    for a, e in zip(grads, eager_grads):
        torch.testing.assert_close(a, e)


def test_linear_act_custom_ops_pass_opcheck(device):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    w = _weight(24, 32, torch.float32, device).requires_grad_()
    b = torch.randn(24, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        torch.library.opcheck(M._fwd_op, (x, w, b, "gelu", True))
        _, pre = M._fwd_op(x.detach(), w.detach(), b.detach(), "gelu", True)
        dy = torch.randn(6, 24, device=device)
        torch.library.opcheck(M._bwd_op, (dy, x.detach(), w.detach(), pre, "gelu", True))


def test_linear_act_default_configs_fit():
    for t in (1, 7, 64, 65, 16384):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = M.default_config(t, dtype, on_gpu=True)
            assert set(cfg) == set(M.CONFIG_KEYS)
    assert M.candidate_configs(16384, torch.bfloat16)


GPU_CASES = [((16384,), 768, 3072), ((2, 1024), 768, 3072), ((7,), 768, 3072), ((257,), 200, 1000),
             ((3, 33), 96, 352)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead, k, n", GPU_CASES)
def test_linear_act_gpu(lead, k, n, dtype):
    _check(lead, k, n, dtype, "cuda", backward=lead[-1] <= 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_linear_act_gpu_conv1d_layout(activation):
    _check((4, 512), 768, 3072, torch.bfloat16, "cuda", activation, layout="kn")
