"""The native autograd node (csrc/native.cpp, runtime/native.py) and rms_norm's plans for it.

On a CPU there is no driver to launch with, so the tests give the node a fake ``cuLaunchKernel`` (a
ctypes callback): it reads the launch's parameters the way the GPU would (pointers, int32/int64,
fp32, in Triton's order) and runs the same Triton kernel on them under the interpreter. What is
checked is everything but the driver: the plan's slots, argument order and kinds, outputs, saved
tensors, gradients, the held workspace, both backward forms, and the fallbacks to the Python backward.
The GPU tests check the real launches against the Python path.
"""

import ctypes
import importlib
import os
import subprocess
import sys

import pytest
import torch

from fuseformer.runtime import native

rn = importlib.import_module("fuseformer.ops.rms_norm")

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(native._cxx() is None, reason="no C++ compiler to build the native module")

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_uint] * 7,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)
_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


class FakeDriver:
    """compiled_launch's stand-in (a recipe per launch: the kernel, its config and what each parameter
    is) and cuLaunchKernel's (decodes the parameters and runs the recipe's kernel)."""

    def __init__(self):
        self.recipes = []
        self.errors = []
        self.capturing = False
        self.launch_cb = _LAUNCH(self._launch)
        self.capturing_cb = _CAPTURING(self._is_capturing)

    def compiled_launch(self, kernel, grid, config, tensors, ints, floats=()):
        kinds = [(native.POINTER, t.dtype) for _, t in tensors]
        kinds += [(native.INT32 if -(2**31) <= v < 2**31 else native.INT64, None) for v in ints]
        kinds += [(native.FLOAT32, None)] * len(floats)
        self.recipes.append((kernel, config, kinds, len(tensors), len(ints)))
        args = [(native.POINTER, s) for s, _ in tensors]
        args += [(k, v) for (k, _), v in zip(kinds[len(tensors) :], ints)]
        args += [(native.FLOAT32, f) for f in floats]
        return (len(self.recipes), (tuple(grid) + (1, 1))[:3], 128, 0, args)

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        try:
            kernel, config, kinds, n_ptr, n_int = self.recipes[function - 1]
            values = []
            for i, (kind, dtype) in enumerate(kinds):
                address = params[i]
                if kind == native.POINTER:
                    ptr = ctypes.c_uint64.from_address(address).value
                    size = torch.empty(0, dtype=dtype).element_size()
                    values.append(torch.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=dtype))
                elif kind == native.INT32:
                    values.append(ctypes.c_int32.from_address(address).value)
                elif kind == native.INT64:
                    values.append(ctypes.c_int64.from_address(address).value)
                else:
                    values.append(ctypes.c_float.from_address(address).value)
            # Triton's two scratch pointers follow, null.
            assert ctypes.c_uint64.from_address(params[len(kinds)]).value == 0
            kernel[(gx, gy, gz)](*values, **config.kwargs)
            return 0
        except Exception as exc:  # an exception cannot cross the C callback: report a launch failure
            self.errors.append(exc)
            return 999

    def _is_capturing(self, stream, status):
        status[0] = 1 if self.capturing else 0
        return 0


@pytest.fixture(scope="module")
def mod():
    was = native.enabled()
    native.set_enabled(True)
    m = native.module(wait=True)
    assert m is not None, native.status()
    yield m
    native.set_enabled(was)


@pytest.fixture
def fake(mod, monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(native, "compiled_launch", driver.compiled_launch)
    mod.set_driver_for_testing(ctypes.cast(driver.launch_cb, ctypes.c_void_p).value,
                               ctypes.cast(driver.capturing_cb, ctypes.c_void_p).value)  # fmt: skip
    yield driver
    mod.set_driver_for_testing(0, 0)
    assert not driver.errors, driver.errors


def _inputs(m, n, dtype, has_w, has_r):
    x = torch.randn(m, n, dtype=dtype, requires_grad=True)
    w = (torch.rand(n, dtype=dtype) + 0.5).requires_grad_() if has_w else None
    r = torch.randn(m, n, dtype=dtype, requires_grad=True) if has_r else None
    return x, w, r


def _check(mod, plan, x, w, r, eps, dy_fn=None, fallbacks=0):
    """Run the plan as a node; compare outputs and gradients with the fp32 reference. Returns the
    plan's launch count so far."""
    out = mod.apply(plan, x, w, r)
    assert len(out) == (2 if r is not None else 1)
    leaves = [t for t in (x, w, r) if t is not None]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    xr, wr, rr = next(it), (next(it) if w is not None else None), (next(it) if r is not None else None)
    ref = rn.rms_norm_ref(xr, wr, eps, rr)
    refs = ref if isinstance(ref, tuple) else (ref,)
    half = x.dtype == torch.float16
    for o, e in zip(out, refs):
        assert o.dtype == x.dtype and o.shape == x.shape
        torch.testing.assert_close(o.float(), e.detach(), **(dict(rtol=2e-2, atol=2e-2) if half else {}))
    grads_out = [torch.randn_like(o) for o in out]
    if dy_fn is not None:
        grads_out = [dy_fn(g) for g in grads_out]
    got = torch.autograd.grad(out, leaves, grads_out)
    want = torch.autograd.grad(refs, ref_leaves, [g.float() for g in grads_out])
    for g, e in zip(got, want):
        assert g.dtype == x.dtype
        torch.testing.assert_close(g.float(), e, **(dict(rtol=3e-2, atol=3e-2) if half else dict(rtol=1e-4, atol=1e-4)))
    launches, fell_back = mod.plan_counts(plan)
    assert fell_back == fallbacks
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("has_w,has_r", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("m,n", [(37, 769), (5, 64), (1, 8)])
def test_rms_norm_plan_matches_reference(mod, fake, m, n, dtype, has_w, has_r):
    """The plan's forward and backward (single-launch dw, the rule at these sizes) give what the
    reference gives, outputs and every gradient, and ran their launches (not the fallback)."""
    x, w, r = _inputs(m, n, dtype, has_w, has_r)
    plan = rn._native_plan(mod, x.detach(), w, r, 1e-6, -1, 0)
    launches = _check(mod, plan, x, w, r, 1e-6)
    assert launches == 2  # one forward launch, one backward launch


def test_rms_norm_plan_two_launch_backward(mod, fake, monkeypatch):
    """Where the rule sums dw in a second kernel (large problems), the plan does the same: partials as
    a backward output, then the dw reduction launch."""
    monkeypatch.setattr(rn, "_fused_dw_rows", lambda m, n, programs: 0)
    x, w, r = _inputs(70, 300, torch.float32, True, False)
    plan = rn._native_plan(mod, x.detach(), w, None, 1e-5, -1, 0)
    assert _check(mod, plan, x, w, r, 1e-5) == 3


def test_rms_norm_plan_gradients_of_any_layout(mod, fake):
    """A gradient that is not contiguous (an expanded one, as from y.sum()) or not 16-byte aligned is
    made so in C++ before the launch, with the right result."""
    x, w, _ = _inputs(9, 40, torch.float32, True, False)
    plan = rn._native_plan(mod, x.detach(), w, None, 1e-6, -1, 0)

    def unaligned(g):
        buf = torch.empty(g.numel() + 1, dtype=g.dtype)
        view = buf[1:].view_as(g)
        view.copy_(g)
        assert view.data_ptr() % 16
        return view

    _check(mod, plan, x, w, None, 1e-6, dy_fn=lambda g: g[:, :1].expand_as(g))
    _check(mod, plan, x, w, None, 1e-6, dy_fn=unaligned)


def test_rms_norm_plan_falls_back_while_capturing(mod, fake):
    """A backward whose stream is being captured runs the Python backward (the registered fallback),
    with the same gradients."""
    x, w, r = _inputs(12, 48, torch.float32, True, True)
    plan = rn._native_plan(mod, x.detach(), w, r, 1e-6, -1, 7)  # stream 7: a (fake) capturable one
    fake.capturing = True
    assert _check(mod, plan, x, w, r, 1e-6, fallbacks=1) == 1  # the forward's launch only


def test_plan_and_saved_tensors_are_checked(mod, fake):
    """Plans referring to slots that do not exist are refused (ValueError); an input modified in place
    after the forward fails the backward as torch's own ops do."""
    fb = rn._native_fallback(False, True)
    bad = [(1, (1, 1, 1), 128, 0, [(native.POINTER, 9)])]
    with pytest.raises(ValueError, match="slot"):
        mod.make_plan([], bad, [], [], [], [], [], [-1, -1, -1], [], fb, 0, torch.device("cpu"))
    x, w, _ = _inputs(4, 16, torch.float32, True, False)
    plan = rn._native_plan(mod, x.detach(), w, None, 1e-6, -1, 0)
    y = mod.apply(plan, x, w, None)[0]
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_plan_without_a_driver_raises(mod, fake):
    """Launching with no driver loaded is an error, not a crash."""
    x, w, _ = _inputs(4, 16, torch.float32, True, False)
    plan = rn._native_plan(mod, x.detach(), w, None, 1e-6, -1, 0)
    mod.set_driver_for_testing(0, 0)
    with pytest.raises(RuntimeError, match="no CUDA driver"):
        mod.apply(plan, x, w, None)


@pytest.mark.parametrize("value, expected", [(None, "True on"), ("0", "False off"), ("1", "True on")])
def test_native_is_on_by_default_and_FUSEFORMER_NATIVE_0_turns_it_off(value, expected):
    code = "import fuseformer.runtime.native as n; print(n.enabled(), n.status())"
    env = {k: v for k, v in os.environ.items() if k != "FUSEFORMER_NATIVE"}
    if value is not None:
        env["FUSEFORMER_NATIVE"] = value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith(expected), (out.stdout, out.stderr[-500:])


_OFFLINE = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
from fuseformer.runtime import native

rn = importlib.import_module("fuseformer.ops.rms_norm")

k = rn._rms_norm_fwd_kernel
names = [p.name for p in k.params]
# x, residual, weight, y, h, rstd; then 6 ints (the last, M, is 1: Triton makes it a constexpr); eps.
sig = {n: ("*fp16" if i < 5 else "*fp32") for i, n in enumerate(names[:6])}
ints = (64, 0, 64, 0, 1, 64)
for n, v in zip(names[6:12], ints):
    sig[n] = "constexpr" if v == 1 else "i32"
sig[names[12]] = "fp32"
cfg = rn._fwd_plan(64, False, True, True, torch.float16, "cpu")[0].kwargs
consts = {n: 1 for n, v in zip(names[6:12], ints) if v == 1}
for p in k.params[13:]:
    sig[p.name] = "constexpr"
    consts[p.name] = cfg.get(p.name, p.default)
opts = {o: cfg[o] for o in ("num_warps", "num_stages") if o in cfg}
compiled = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=opts)
fn, grid, block, shared, args = native.launch_of(compiled, k, (3,), [0, 0, 1, 3, 3, 4], ints, (1e-6,))
assert grid == (3, 1, 1) and block == 32 * compiled.metadata.num_warps, (grid, block)
want = [(0, 0), (0, 0), (0, 1), (0, 3), (0, 3), (0, 4), (1, 64), (1, 0), (1, 64), (1, 0), (1, 64), (3, 1e-6)]
assert args == want, args
print("ok")
"""


@pytest.mark.skipif(HAS_CUDA, reason="the GPU tests launch the real plans")
def test_launch_arguments_follow_the_compiled_signature_offline():
    """launch_of reads a kernel compiled for sm_90 (no GPU needed): pointer slots in order, an int
    Triton specialized to a constexpr (== 1) left out, i32 ints and the fp32 eps kept."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _OFFLINE], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(4096, 1024), (257, 4096), (3, 65536), (1, 128)])
@pytest.mark.parametrize("has_r", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_native_rms_norm_matches_python_path(m, n, has_r, dtype):
    """On the GPU, with the native node on: rms_norm's outputs and gradients are bit-equal to the Python
    path's (the same kernels with the same arguments), and the node's launches (not the fallback) ran.
    (1, 128): M == 1 is a constexpr of the compiled kernels, left out of the launch; (3, 65536): the
    two-launch backward; the others the single-launch one."""
    import fuseformer.ops as F

    was = native.enabled()
    native.set_enabled(True)
    try:
        assert native.module(wait=True) is not None and native.cuda_module() is not None, native.status()
        x0 = torch.randn(m, n, device="cuda", dtype=dtype)
        w0 = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        r0 = torch.randn(m, n, device="cuda", dtype=dtype) if has_r else None
        results = []
        for on in (False, True):
            native.set_enabled(on)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            r = r0.clone().requires_grad_() if has_r else None
            out = F.rms_norm(x, w, 1e-6, residual=r)
            outs = out if has_r else (out,)
            torch.manual_seed(0)
            gs = [torch.randn_like(o) for o in outs]
            leaves = [t for t in (x, w, r) if t is not None]
            results.append((outs, torch.autograd.grad(outs, leaves, gs)))
        for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
            assert torch.equal(a, b)
        plans = [p for k, p in rn._native_plans.items() if k[:2] == (m, n) and k[2] == dtype and k[4] == has_r]
        assert plans and plans[0], "no plan was built"
        launches, fallbacks = native.module().plan_counts(plans[0])
        assert launches >= 2 and fallbacks == 0
    finally:
        native.set_enabled(was)


_BUILD = r"""
import sys, warnings
from fuseformer.runtime import native
native.set_enabled(True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mod = native.module(wait=True)
print(mod is not None, native.status().split(" (")[0], len(caught))
"""


def _build_in(tmp_path, extra_env, n=1):
    env = {k: v for k, v in os.environ.items() if k != "FUSEFORMER_NATIVE"}
    env.update(FUSEFORMER_CACHE_DIR=str(tmp_path), **extra_env)
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]  # fmt: skip
    return [p.communicate(timeout=600) for p in procs]


def test_a_failed_build_warns_once_and_leaves_the_python_path(tmp_path):
    """A compiler that fails: module() is None, status says why, one RuntimeWarning, no crash."""
    ((out, err),) = _build_in(tmp_path, {"CXX": "false"})
    assert out.split()[:3] == ["False", "on,", "build"], (out, err[-500:])
    assert out.split()[-1] == "1"


@pytest.mark.slow
def test_two_processes_build_one_module(tmp_path):
    """Two processes starting at once with an empty cache: one compiles (the other waits on the lock),
    both load the same file, and no partial file is left behind."""
    results = _build_in(tmp_path, {}, n=2)
    for out, err in results:
        assert out.startswith("True on, built"), (out, err[-1000:])
    built = list((tmp_path / "native").rglob("*.so"))
    assert len(built) == 1 and not list((tmp_path / "native").rglob("*.tmp")), built


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter is on only without a GPU")
def test_no_native_launches_under_the_interpreter(mod):
    """Plans follow Triton 3.6's compiled-kernel parameter layout: under the interpreter (or another
    Triton) cuda_module() is None and ops keep their Python path."""
    from fuseformer.ops._utils import triton_launch_layout_known

    assert not triton_launch_layout_known()
    assert native.cuda_module() is None
