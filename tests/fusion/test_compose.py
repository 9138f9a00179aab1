"""optimize composes with what users wrap around a model: DDP and FSDP2 after optimize train as the
original does (2 gloo processes on the CPU); ``save_pretrained`` writes the original names;
``torch.compile`` runs an optimized model without a graph break at our ops."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fuseformer

WORKER = Path(__file__).with_name("dist_worker.py")
pytest.importorskip("transformers")


def _run(tmp_path, mode, plain=False):
    out = tmp_path / f"{mode}{'-plain' if plain else ''}.pt"
    if mode == "none":
        cmd = [sys.executable, str(WORKER)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    cmd += ["--mode", mode, "--out", str(out)] + (["--plain"] if plain else [])
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", FUSEFORMER_BACKEND="reference")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ddp_and_fsdp_after_optimize_train_as_the_original(tmp_path, mode):
    plain = _run(tmp_path, "none", plain=True)
    got = _run(tmp_path, mode)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(plain["losses"]), rtol=1e-4, atol=1e-5)
    assert got["state"].keys() == plain["state"].keys()
    for name, value in plain["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def _tiny():
    spec = __import__("importlib.util").util.spec_from_file_location("_fusion_dist_worker", WORKER)
    module = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_llama()


def test_save_pretrained_keeps_the_original_names(tmp_path):
    from safetensors.torch import load_file

    model = _tiny()
    names = set(model.state_dict())
    fuseformer.optimize(model)
    assert set(model.state_dict()) == names
    model.save_pretrained(tmp_path)
    saved = set(load_file(tmp_path / "model.safetensors"))
    want = {n for n in names if n != "lm_head.weight" or not model.config.tie_word_embeddings}
    assert saved == want


def test_compile_has_no_graph_break_at_our_ops():
    model = _tiny().eval()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = fuseformer.optimize(model)
    assert report.counts()
    explain = torch._dynamo.explain(model)(input_ids=ids)
    reasons = " ".join(str(b.reason) for b in explain.break_reasons)
    assert "fuseformer" not in reasons, reasons
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
