"""Test setup. Without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1),
which must be set before Triton is first imported, so it happens here, before fuseformer loads."""

import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fuseformer  # noqa: E402  (after TRITON_INTERPRET is settled)
from fuseformer.ops._utils import poison_outputs  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: correctness at real sizes on a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on the CPU")
    config.addinivalue_line("markers", "on_device: takes the device fixture (given on a CUDA host only)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        # Tests taking the ``device`` fixture run on the GPU there, but ``-m gpu`` runs skip them:
        # ``-m "gpu or on_device"`` takes both (scripts/gpu_check.sh's ordered stage, MARK=...).
        for item in items:
            if "device" in getattr(item, "fixturenames", ()):
                item.add_marker("on_device")
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_poison(request):
    """A fresh seed per test case (from its id, so reruns repeat) and NaN-poisoned kernel outputs."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    with poison_outputs():
        yield


@pytest.fixture
def compile_backend():
    """torch.compile backend for the fullgraph tests: inductor on a GPU; aot_eager on the CPU (it
    traces the same graph with autograd, without minutes of C++ compilation per test)."""
    return "inductor" if HAS_CUDA else "aot_eager"


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def host_reads(monkeypatch):
    """The sizes of the tensors read to the host with ``Tensor.tolist`` (a sync each on a GPU) while
    the test runs, in order."""
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(t):
        reads.append(t.numel())
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    return reads


__all__ = ["fuseformer", "HAS_CUDA"]
