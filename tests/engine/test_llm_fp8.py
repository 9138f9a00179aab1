"""LLM with FP8: ``quantization="fp8"`` on a plain checkpoint and on a built model, an FP8 checkpoint
loaded with its own quantization, ``kv_cache_dtype``, the arguments refused, and the ``generate`` and
``serve`` flags. The ops run their PyTorch references (tests/models/test_quantization.py says why; the
numerics of the FP8 model are checked there): here, that the engine runs what the model computes."""

import argparse
import os
import subprocess
import sys

import pytest
import torch

import fuseformer
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.layers.fp8 import Fp8GatedMLP, Fp8Linear
from fuseformer.models.loader import load_model
from fuseformer.models.quantization import is_fp8_model
from fuseformer.testing import packed_logits, save_tiny_tokenizer, tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
_KW = dict(num_kv_blocks=64, block_size=4, max_model_len=64)


@pytest.fixture(autouse=True)
def _reference_ops():
    with fuseformer.use_backend("reference"):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 (QKV bias, tied embeddings) saved as an HF directory with a tokenizer."""
    path = tmp_path_factory.mktemp("fp8_llm")
    save_tiny_tokenizer(path, ["Hello world, a tiny corpus for FP8.", "The quick brown fox."] * 3, "{{ x }}")
    model, config = tiny_llama(vocab_size=300)
    from safetensors.torch import save_file

    from fuseformer.models.loader import PACKED_MODULES, shard_rows

    tensors = {}
    rows = shard_rows(config)
    for name, p in model.state_dict().items():  # unpack q/k/v and gate/up as a checkpoint holds them
        packed = next((k for k in PACKED_MODULES if f".{k}." in name), None)
        if packed is None:
            tensors[name] = p.contiguous()
            continue
        for sub, part in zip(PACKED_MODULES[packed], p.split(rows[packed])):
            tensors[name.replace(packed, sub)] = part.contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    import json

    (path / "config.json").write_text(json.dumps(config.to_hf() | {"torch_dtype": "float32"}))
    return path


def _greedy_by_forward(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        (logits,) = packed_logits(model, [torch.tensor(ids)])
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :]


def test_quantization_fp8_loads_quantized_and_generates_what_the_model_computes(checkpoint):
    llm = LLM(checkpoint, quantization="fp8", device="cpu", **_KW)
    layer = llm.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp, Fp8GatedMLP)
    prompts = [[5, 17, 3, 99, 42], [7], [250, 1, 2, 3, 4, 5, 6, 7, 8]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    model, _ = load_model(checkpoint, quantization="fp8")
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _greedy_by_forward(model, prompt, 6), prompt
    (text,) = llm.generate("Hello world", GREEDY, use_tqdm=False)
    assert len(text.outputs[0].token_ids) == 6


def test_built_model_is_quantized_in_place(checkpoint):
    model, config = tiny_llama()
    llm = LLM(model, quantization="fp8", device="cpu", **_KW)
    assert llm.model is model and is_fp8_model(model)
    (out,) = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == _greedy_by_forward(model, [1, 2, 3], 6)
    # Already FP8 and quantization=None: it runs as it is.
    assert is_fp8_model(LLM(model, device="cpu", **_KW).model)


def test_kv_cache_dtype_fp8(checkpoint):
    llm = LLM(checkpoint, quantization="fp8", kv_cache_dtype="fp8", device="cpu", **_KW)
    assert llm.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    (out,) = llm.generate([[5, 17, 3, 99, 42]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    LLM(checkpoint, kv_cache_dtype="fp8_e4m3", device="cpu", **_KW)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quantization="awq"), r"LLM: quantization must be one of None, 'fp8', got 'awq'"),
        (dict(quantization="FP8"), r"quantization must be one of"),
        (dict(kv_cache_dtype="fp8_e5m2"), r"kv_cache_dtype.*fp8_e5m2 is not supported|fp8_e5m2' is not supported"),
        (dict(kv_cache_dtype="int8"), r"kv_cache_dtype must be one of"),
    ],
)
def test_bad_quantization_arguments(kwargs, match, checkpoint):
    with pytest.raises(ValueError, match=match):
        LLM(checkpoint, device="cpu", **_KW, **kwargs)


def test_generate_cli_quantization_fp8(checkpoint):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: the references
    cmd = [sys.executable, "-m", "fuseformer.engine.cli", "generate", "Hello world", "--model", str(checkpoint)]
    cmd += ["--max-tokens", "4", "--temperature", "0", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "M in fp8) in" in run.stderr.splitlines()[1]  # the loaded line counts the FP8 weights
    with fuseformer.use_backend("reference"):
        llm = LLM(checkpoint, quantization="fp8", kv_cache_dtype="fp8", device="cpu")
        (out,) = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert run.stdout == out.outputs[0].text + "\n"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_flags_and_defaults(command):
    from fuseformer.engine.cli import add_generate_parser
    from fuseformer.serve.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    (add_generate_parser if command == "generate" else add_serve_parser)(sub)
    head = ["generate", "hi"] if command == "generate" else ["serve"]
    args = parser.parse_args(head)
    assert args.quantization is None and args.kv_cache_dtype == "auto"
    args = parser.parse_args([*head, "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert args.quantization == "fp8" and args.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args([*head, "--quantization", "awq"])


def test_serve_passes_the_flags_to_llm(checkpoint, monkeypatch):
    from fuseformer.serve import cli

    seen = {}

    def fake_llm(model, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr("fuseformer.engine.llm.LLM", fake_llm)
    argv = ["serve", "--model", str(checkpoint), "--device", "cpu", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    assert cli.main(argv) == 1
    assert seen["quantization"] == "fp8" and seen["kv_cache_dtype"] == "fp8"
