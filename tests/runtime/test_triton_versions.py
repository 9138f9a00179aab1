"""The Triton-version gates: the direct launch (runtime/launch.py) only on the Triton whose launch path it
re-implements (3.6.x), the Gluon kernels (ops/_gluon.py) only where Triton's Gluon is the API they were
written for; elsewhere ``kernel[grid]`` and the Triton kernels, which must compute the same.

CI runs these under the oldest and the newest supported Triton (.ci/run), so each branch of each gate
is pinned on both, with the detected version faked where the installed one does not reach it. (The launch
path's own mechanics: tests/runtime/test_launch.py.)"""

import inspect
import subprocess
import sys
import types

import pytest
import torch
import triton

import fuseformer.ops as F
from fuseformer.ops import _gluon
from fuseformer.ops import activations as A
from fuseformer.ops import attention as attn_mod
from fuseformer.ops import mlp as mlp_mod
from fuseformer.runtime import launch
from fuseformer.testing import assert_close

HAS_CUDA = torch.cuda.is_available()
FORMAT = launch._LAUNCH_ARGS_FORMAT


# --------------------------------------------------------------------------------------------
# Direct launch
# --------------------------------------------------------------------------------------------
def test_direct_launch_layout_only_on_triton_3_6():
    assert launch.launch_layout_problem("3.6.0", False, FORMAT) is None
    assert launch.launch_layout_problem("3.6.1", False, FORMAT) is None
    for version in ("3.5.1", "3.7.0", "3.8.0", "3.9.0", "4.0.0", "3.60.0"):
        problem = launch.launch_layout_problem(version, False, FORMAT)
        assert problem is not None and version in problem and "3.6.x" in problem
    assert "interpreter" in launch.launch_layout_problem("3.6.0", True, FORMAT)
    assert "C launcher" in launch.launch_layout_problem("3.6.0", False, None)  # a 3.6 build with another driver
    assert "C launcher" in launch.launch_layout_problem("3.6.0", False, "iiiKKOOOO")


def _pretend(monkeypatch, version, interpret=False, cuda=True):
    """Make the installed Triton look like ``version`` (its interpreter off, 3.6's launcher format
    there) on a machine with CUDA, as far as the launch decision reads them."""
    from triton import knobs
    from triton.backends.nvidia import driver

    monkeypatch.setattr(launch, "_triton_version", lambda: version)
    monkeypatch.setattr(knobs.runtime, "interpret", interpret)
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", FORMAT, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


def test_launch_path_is_direct_on_triton_3_6_with_cuda(monkeypatch):
    _pretend(monkeypatch, "3.6.0")
    path, why = launch.launch_path()
    assert path == "direct" and "3.6.0" in why
    assert launch.triton_launch_layout_known()
    with launch.fast_launch(False):
        assert launch.launch_path() == (
            "kernel[grid]",
            "the direct launch is turned off (fast_launch(False))",
        )


@pytest.mark.parametrize("version", ["3.7.0", "3.8.0", "3.9.0", "3.5.1"])
def test_launch_path_is_kernel_grid_on_other_tritons(monkeypatch, version):
    _pretend(monkeypatch, version)
    path, why = launch.launch_path()
    assert path == "kernel[grid]" and version in why
    assert not launch.triton_launch_layout_known()
    # A Launcher decides at its first launch: never the direct path on this Triton.
    assert launch.Launcher(A._glu_fwd_kernel)._decide() is False


def test_launch_path_without_cuda_or_under_the_interpreter(monkeypatch):
    _pretend(monkeypatch, "3.6.0", cuda=False)
    assert launch.launch_path() == ("kernel[grid]", "no CUDA device")
    _pretend(monkeypatch, "3.6.0", interpret=True)
    path, why = launch.launch_path()
    assert path == "kernel[grid]" and "interpreter" in why


def test_launch_path_of_this_process():
    """What the installed Triton gets (the function ``fuseformer info`` reads)."""
    path, why = launch.launch_path()
    assert path in ("direct", "kernel[grid]") and why
    if path == "direct":
        assert triton.__version__.startswith(launch.DIRECT_LAUNCH_TRITON) and HAS_CUDA
    if not triton.__version__.startswith(launch.DIRECT_LAUNCH_TRITON):
        assert path == "kernel[grid]" and triton.__version__ in why


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors through the interpreter")
def test_kernel_grid_fallback_computes_under_the_interpreter(monkeypatch):
    """On a Triton the direct launch was not written for, every launch is kernel[grid] (a miss each)
    and the op's result is the reference's."""
    monkeypatch.setattr(launch, "_triton_version", lambda: "3.9.0")
    launcher = launch.Launcher(A._glu_fwd_kernel)
    monkeypatch.setattr(A, "_fwd_launcher", launcher)
    for m, n in ((37, 123), (37, 123), (1, 769)):
        gate, up = torch.randn(m, n), torch.randn(m, n)
        ref, base = A.swiglu_ref(gate.double(), up.double()), A.swiglu_ref(gate, up, upcast=False)
        assert_close("swiglu", F.swiglu(gate, up), ref, base)
    assert launcher.misses == 3 and launcher._direct is False


# --------------------------------------------------------------------------------------------
# Gluon
# --------------------------------------------------------------------------------------------
def _fake_gluon(**overrides):
    """Gluon modules whose calls have Triton 3.6's parameters (``_gluon._SIGNATURES``), with
    ``overrides`` ("module.name": signature string, or None to leave it out) on top."""
    modules = {m: types.SimpleNamespace() for m in ("gl", "gluon", "tma", "mbarrier", "hopper")}
    for module, name, params in _gluon._SIGNATURES:
        key = f"{module}.{name}"
        sig = overrides.get(key, "(" + ", ".join([*params, "_semantic=None"]) + ")")
        if sig is None:
            continue
        ns: dict = {}
        exec(f"def {name}{sig}: pass", ns)
        setattr(modules[module], name, ns[name])
    return modules


def test_gluon_gate_takes_triton_3_6_gluon():
    assert _gluon.api_problem("3.6.0", _fake_gluon()) is None


@pytest.mark.parametrize("version", ["3.5.1", "3.7.0", "3.8.0", "3.9.0"])
def test_gluon_gate_off_on_other_tritons(version):
    problem = _gluon.api_problem(version, _fake_gluon())
    assert problem is not None and version in problem


@pytest.mark.parametrize(
    "override, named",
    [
        # Triton 3.9: the old TMA names became shims over async_load / async_store.
        ({"tma.async_copy_global_to_shared": "(*args, _semantic=None, **kwargs)"}, "async_copy_global_to_shared"),
        ({"tma.async_copy_shared_to_global": "(*args, _semantic=None, **kwargs)"}, "async_copy_shared_to_global"),
        ({"mbarrier.expect": "(mbarrier, bytes_per_cta=None, pred=True, _semantic=None)"}, "expect"),
        ({"gl.warp_specialize": "(functions_and_args, worker_num_warps, _semantic=None)"}, "warp_specialize"),
        ({"tma.async_copy_global_to_shared": "(coord, tensor_desc, barrier, result, pred=True)"}, "async_copy"),
        ({"hopper.warpgroup_mma": None}, "warpgroup_mma"),
    ],
)
def test_gluon_gate_detects_another_api_on_3_6(override, named):
    """Import-time feature detection: a 3.6-numbered Triton whose Gluon calls take other parameters
    (or lack one) keeps the Gluon kernels off."""
    problem = _gluon.api_problem("3.6.0", _fake_gluon(**override))
    assert problem is not None and named in problem


def test_gluon_gate_of_this_triton():
    assert _gluon.HAVE_GLUON == (_gluon.UNAVAILABLE is None)
    if not triton.__version__.startswith(_gluon.GLUON_TRITON):
        assert not _gluon.HAVE_GLUON and triton.__version__ in _gluon.UNAVAILABLE
        assert _gluon.gl is None and _gluon.tma is None  # nothing of another Gluon API is reachable
    if not _gluon.HAVE_GLUON:
        assert not _gluon.runs_on("cuda")
        from fuseformer.ops import attention_hopper, mlp_hopper

        assert not hasattr(attention_hopper, "_attention_fwd_kernel") and not hasattr(mlp_hopper, "_gate_up_kernel")


def test_gate_decisions_at_import_under_a_faked_triton_version():
    """A fresh process that sees Triton 3.9.0: Gluon off, kernel[grid], and the ops still import."""
    script = (
        "import triton; triton.__version__ = '3.9.0'\n"
        "from fuseformer.ops import _gluon\nfrom fuseformer.runtime import launch\n"
        "import fuseformer.ops\n"
        "print(_gluon.HAVE_GLUON, launch.launch_path()[0], launch.triton_launch_layout_known())\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "kernel[grid]", "False"]


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors through the interpreter")
def test_triton_kernels_take_gluon_shapes_with_the_gate_off(monkeypatch):
    """With the Gluon gate off, attention and the fused MLP at shapes the Gluon kernels take on an H200
    (batched hd 64, S 128; gate-up with H % 64 == 0, I % 128 == 0) run the Triton kernels under the
    interpreter and match the reference."""
    monkeypatch.setattr(_gluon, "HAVE_GLUON", False)
    monkeypatch.setattr(attn_mod, "_GLUON_FWD", True)
    monkeypatch.setattr(mlp_mod, "_GLUON_GATE_UP", True)
    monkeypatch.setattr(mlp_mod, "_GLUON_MIN_TOKENS", 1)
    assert not _gluon.runs_on("cuda")
    q, k, v = (torch.randn(1, 128, 2, 64, dtype=torch.float16) for _ in range(3))
    ref = F.flash_attention_ref(q.double(), k.double(), v.double(), causal=True)
    base = F.flash_attention_ref(q, k, v, causal=True, upcast=False)
    assert_close("flash_attention", F.flash_attention(q, k, v, causal=True), ref, base)
    x, wgu, wd = (torch.randn(*shape, dtype=torch.float16) * 0.3 for shape in ((16, 64), (256, 64), (64, 128)))
    ref = F.fused_mlp_ref(x.double(), wgu.double(), wd.double())
    assert_close("fused_mlp", F.fused_mlp(x, wgu, wd), ref, F.fused_mlp_ref(x, wgu, wd, upcast=False))


def test_signatures_table_names_real_parameters_on_3_6():
    """Where the installed Triton is 3.6 with Gluon, every parameter the table names is one its Gluon
    declares (so the detection reads this Triton, not a table gone stale)."""
    if not _gluon.HAVE_GLUON:
        pytest.skip(f"Gluon kernels off here: {_gluon.UNAVAILABLE}")
    hopper = sys.modules["triton.experimental.gluon.language.nvidia.hopper"]
    modules = {"gl": _gluon.gl, "gluon": _gluon.gluon, "tma": _gluon.tma, "mbarrier": _gluon.mbarrier, "hopper": hopper}
    for module, name, params in _gluon._SIGNATURES:
        fn = getattr(modules[module], name)
        if params:
            assert set(params) <= set(inspect.signature(fn).parameters), (module, name)
