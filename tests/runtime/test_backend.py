"""runtime/backend.py, the one backend choice (DESIGN.md §2): the rule per device, forcing by
``use_backend`` (innermost wins) or FUSEFORMER_BACKEND, and forcing Triton where it cannot run raising."""

import pytest
import torch

from fuseformer.runtime import backend


def test_unsupported_inputs_take_the_reference_with_the_reason():
    choice = backend.natural_backend("cpu", supported=False, why_not="float64 runs on the reference")
    assert choice == backend.Choice("reference", "float64 runs on the reference")
    assert backend.choose_backend("op", torch.device("cpu"), supported=False) == "reference"


def test_cpu_tensors_follow_the_interpreter_switch(monkeypatch):
    monkeypatch.setattr(backend, "INTERPRET", True)
    assert backend.natural_backend("cpu").backend == "triton"
    monkeypatch.setattr(backend, "INTERPRET", False)
    choice = backend.natural_backend("cpu")
    assert choice.backend == "reference" and "TRITON_INTERPRET=1" in choice.reason
    assert backend.natural_backend("meta").backend == "reference"


def test_use_backend_nests_and_restores():
    assert backend.forced_backend() is None
    with backend.use_backend("reference"):
        assert backend.choose_backend("op", torch.device("cpu")) == "reference"
        with backend.use_backend("auto"):
            assert backend.forced_backend() is None
        assert backend.forced_backend() == "reference"
        assert backend.explain("cpu").reason.startswith("forced")
    assert backend.forced_backend() is None
    with pytest.raises(ValueError, match="use_backend: name must be one of"):
        with backend.use_backend("cuda"):
            pass


def test_forcing_triton_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(backend, "INTERPRET", False)
    monkeypatch.setattr(backend, "_natural_cache", {})
    with backend.use_backend("triton"):
        with pytest.raises(RuntimeError, match="rms_norm: the Triton backend was forced but cannot run"):
            backend.choose_backend("rms_norm", torch.device("cpu"))
        assert backend.explain("cpu").backend == "error"


def test_the_environment_forces_a_backend(monkeypatch):
    monkeypatch.setattr(backend, "_ENV_BACKEND", " Reference ")
    assert backend.forced_backend() == "reference"
    with backend.use_backend("auto"):  # use_backend("auto") clears use_backend's forcing only
        assert backend.forced_backend() == "reference"
    monkeypatch.setattr(backend, "_ENV_BACKEND", "auto")
    assert backend.forced_backend() is None
    monkeypatch.setattr(backend, "_ENV_BACKEND", "gpu")
    with pytest.raises(ValueError, match="FUSEFORMER_BACKEND: expected one of"):
        backend.forced_backend()
