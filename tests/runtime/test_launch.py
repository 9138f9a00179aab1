"""runtime/launch.py, the one launch path of the ops' kernels: the specialization key of the direct launch's
cache against Triton's own, the per-key fallback to ``kernel[grid]``, and the process-wide switch.
(Which Triton releases take the direct path: tests/runtime/test_triton_versions.py.)"""

import types

import pytest
import torch

from fuseformer.ops import _utils
from fuseformer.runtime import launch


def test_ops_utils_re_exports_the_launch_path():
    """The ops import the launch path from _utils: the same objects as runtime/launch.py's."""
    for name in ("LaunchConfig", "Launcher", "fast_launch", "launch_config", "spec_key"):
        assert getattr(_utils, name) is getattr(launch, name)


def test_launch_config_is_one_object_per_value():
    assert launch.launch_config(BLOCK=64, num_warps=4) is launch.launch_config(BLOCK=64, num_warps=4)
    assert launch.launch_config(BLOCK=64) is not launch.launch_config(BLOCK=128)


def test_fast_launch_switch_is_scoped():
    before = launch.fast_launch_enabled()
    with launch.fast_launch(False):
        assert not launch.fast_launch_enabled()
        assert launch.launch_path() == (
            "kernel[grid]",
            "the direct launch is turned off (fast_launch(False))",
        )
        with launch.fast_launch(True):
            assert launch.fast_launch_enabled()
        assert not launch.fast_launch_enabled()
    assert launch.fast_launch_enabled() == before


def test_spec_key_determines_triton_specialization():
    """Equal spec_key entries mean equal Triton specializations (the direct launch's cache is
    keyed on spec_key): checked against Triton's own native_specialize_impl, per argument."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend

    def triton_spec(arg):
        return libtriton.native_specialize_impl(BaseBackend, arg, False, True, True)

    ints = [0, 1, 2, 15, 16, 17, 31, 32, 33, 48, 1023, 1024, 1025, 4096, 70001, 2**31 - 16, 2**31 - 1]
    ints += [2**31, 2**31 + 1, 2**31 + 16, 2**32, 2**40 + 3, 2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16]
    ints += [-1, -15, -16, -17, -(2**31), -(2**31) - 1, -(2**31) - 16, -(2**63)]
    seen: dict = {}
    for v in ints:
        _, key = launch.spec_key((), (v,))
        assert seen.setdefault(("int", key), triton_spec(v)) == triton_spec(v), v
    buf = torch.zeros(256, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int64):
        size = dtype.itemsize
        for offset in range(0, 64, size):  # every alignment the dtype allows
            t = buf[offset : offset + 8 * size].view(dtype)
            ptrs, key = launch.spec_key((t,), ())
            assert ptrs == [t.data_ptr()]
            assert seen.setdefault(("ptr", key), triton_spec(t)) == triton_spec(t), (dtype, offset)
    # Keys of different kinds never collide (a pointer key holds a dtype; an int key does not).
    assert len({k for kind, k in seen}) == len(seen)
    # Several pointers, aligned or not in every combination: equal keys, equal specializations of each.
    views = [buf[offset : offset + 32].view(torch.float16) for offset in (0, 2, 16, 30)]
    pairs: dict = {}
    for a in views:
        for b in views:
            _, key = launch.spec_key((a, b), (16, 17))
            assert pairs.setdefault(key, (triton_spec(a), triton_spec(b))) == (triton_spec(a), triton_spec(b))
    assert len(pairs) > 2
    assert launch.spec_key((), [1, 16, 2**31])[1] == launch.spec_key((), (1, 16, 2**31))[1]  # ints as a list (rotary's)


def test_one_unhandled_config_keeps_the_direct_path_for_the_others(monkeypatch):
    """A compiled form the direct path cannot launch (e.g. one autotune candidate that needs scratch
    memory) sends that key through kernel[grid] for good and leaves the kernel's other configs on the
    direct path: before, one such launch turned the launcher off for the rest of the process, a leak
    between GPU tests (the every-candidate sweep, then the direct-launch checks)."""
    direct_calls, grid_calls = [], []

    class FakeKernel:
        pre_run_hooks: list = []

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                grid_calls.append(kwargs["BLOCK"])
                return kwargs["BLOCK"]  # the "compiled kernel": which config it was

            return run

    def fake_c_launch(*args):
        direct_calls.append(args[-1])  # the last constexpr: BLOCK

    runtime = types.SimpleNamespace(debug=False, launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(
        launch,
        "_triton_knobs",
        types.SimpleNamespace(runtime=runtime, compilation=types.SimpleNamespace(instrumentation_mode="")),
    )
    monkeypatch.setattr(launch, "_cuda_get_device", lambda: -1)  # a CPU tensor's get_device()
    monkeypatch.setattr(launch, "_cuda_current_stream", lambda device: 0)
    monkeypatch.setattr(launch.Launcher, "_decide", lambda self: True)
    # BLOCK=64 compiles to a form the direct path handles; BLOCK=128 to one it does not.
    monkeypatch.setattr(
        launch.Launcher,
        "_entry",
        lambda self, compiled, config, *n: (
            None if compiled == 128 else (fake_c_launch, None, None, False, False, (compiled,))
        ),
    )
    launcher = launch.Launcher(FakeKernel())
    small, large = launch.launch_config(BLOCK=64), launch.launch_config(BLOCK=128)
    x = torch.zeros(4)
    with launch.fast_launch(True):
        for config in (small, large, small, large, small):
            launcher((1,), config, [x], [4])
    assert grid_calls == [64, 128, 128]  # each config's first launch, and every unhandled one
    assert direct_calls == [64, 64]  # the handled config stayed direct after the unhandled one
    assert launcher.misses == 3
