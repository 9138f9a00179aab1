"""bench/tune.py: the tuning drivers of ``fuseformer bench --tune``: off the GPU their bookkeeping, on it
a quick run. (The ops' candidates themselves: tests/runtime/test_op_configs.py.)"""

import pytest
import torch

from fuseformer.bench import tune
from fuseformer.ops import _attention_common as ATT_CFG
from fuseformer.runtime import autotune


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEFORMER_CACHE_DIR", str(tmp_path))
    autotune.clear_memory()
    yield tmp_path
    autotune.clear_memory()


def test_every_tuned_kernel_has_a_driver():
    assert set(tune.TUNERS) == {"rms_norm_fwd", "rms_norm_bwd", "mlp_gate_up", "attention_fwd", "attention_bwd"}
    assert all(callable(fn) for fn in tune.TUNERS.values())


def test_tune_all_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("runs the real sweep on a GPU")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        tune.tune_all()


def test_tune_all_rejects_unknown_kernels(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="unknown names"):
        tune.tune_all(kernels=["no_such_kernel"])


def test_tune_all_keeps_going_past_a_failing_driver(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken(quick):
        raise RuntimeError("out of resources")

    monkeypatch.setitem(tune.TUNERS, "rms_norm_fwd", broken)
    monkeypatch.setitem(tune.TUNERS, "rms_norm_bwd", lambda quick: [dict(kernel="rms_norm_bwd", key="k", ms=1.0)])
    records = tune.tune_all(kernels=["rms_norm_fwd", "rms_norm_bwd"])
    assert {r["kernel"] for r in records} == {"rms_norm_fwd", "rms_norm_bwd"}
    assert "out of resources" in next(r for r in records if r["kernel"] == "rms_norm_fwd")["error"]


def test_drivers_store_what_they_time(monkeypatch):
    """The drivers hand the candidates to autotune.tune with the one timing helper (bench_ms) and force
    (a stored config is re-measured)."""
    calls = []

    def fake_tune(kernel, configs, bench_fn, key, *, timer, device=None, force=False):
        calls.append((kernel, key, timer, force))
        return list(configs)[0]

    monkeypatch.setattr(autotune, "tune", fake_tune)
    assert tune._tune("rms_norm_fwd", [dict(a=1)], lambda c: lambda: None, "N1024") == dict(a=1)
    assert calls == [("rms_norm_fwd", "N1024", tune.bench_ms, True)]


@pytest.mark.gpu
def test_tune_all_quick_fills_the_cache(cache_dir):
    """The two rms_norm drivers only (all of them take ~4 min: `fuseformer bench --tune` runs those)."""
    records = tune.tune_all(quick=True, kernels=["rms_norm_fwd", "rms_norm_bwd"])
    assert records and not [r for r in records if "error" in r], records
    assert {r["kernel"] for r in records} == {"rms_norm_fwd", "rms_norm_bwd"}
    assert autotune.cache_path("rms_norm_fwd", autotune.gpu_name()).exists()


@pytest.mark.gpu
def test_attention_drivers_run_the_triton_kernels_with_the_candidates(cache_dir, monkeypatch):
    """One case per attention driver: each candidate reaches the Triton kernel through the launchers'
    ``config=`` arguments, and the chosen configs are stored."""
    monkeypatch.setattr(tune, "ATTENTION_CASES", ((128, 4096, True),))
    records = tune.tune_attention_fwd(quick=True) + tune.tune_attention_bwd(quick=True)
    assert records and not [r for r in records if "error" in r], records
    for kind in ("fwd", "bwd_dkdv", "bwd_dq"):
        assert autotune.lookup(ATT_CFG.KERNELS[kind], ATT_CFG.config_key(128, True, torch.bfloat16))[1] == "cache"
