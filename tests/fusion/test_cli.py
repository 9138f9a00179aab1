"""``fuseformer validate`` and ``fuseformer profile`` on a tiny Hugging Face directory made here."""

import json

import pytest
import torch

from fuseformer import fusion
from fuseformer.cli import main
from fuseformer.fusion.base import Candidate, PassResult

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_validate_passes_and_writes_json(llama_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["validate", str(llama_dir), "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "greedy generation, 16 tokens: same" in text and "kept" in text
    data = json.loads(out.read_text())
    assert data["generation"]["same"] and data["report"]["counts"]
    assert all(r["status"] == "kept" for r in data["report"]["replacements"])


def test_validate_exits_1_when_a_replacement_is_over_tolerance(llama_dir, monkeypatch, capsys):
    def find(model, training, kinds, args, kwargs):
        head = model.lm_head
        original_forward = head.forward

        def apply():
            head.forward = lambda x: original_forward(x) * 1.5

        def undo():
            head.__dict__.pop("forward", None)

        c = Candidate(path="lm_head", kind="loss", original="Linear", replacement="wrong", apply=apply, undo=undo)
        return PassResult(name="stub", candidates=[c])

    monkeypatch.setattr(fusion, "_find", find)
    assert main(["validate", str(llama_dir), "--device", "cpu"]) == 1
    assert "reverted" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["validate", "/nonexistent-dir"], "no config.json"),
        (["validate", "{dir}", "--device", "tpu"], "--device must be cpu or cuda"),
        (["validate", "{dir}", "--device", "cpu", "--include", "norms"], "include has unknown kind"),
        (["profile", "{dir}", "--seq", "0"], "--batch and --seq must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(llama_dir, capsys, argv, message):
    argv = [a.format(dir=llama_dir) for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_profile_writes_table_json_and_png(llama_dir, tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", str(llama_dir), "--device", "cpu", "--seq", "16", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "before CPU ms" in text
    data = json.loads((out / "profile.json").read_text())
    kinds = {r["kind"] for r in data["rows"]}
    assert {"mlp", "attention", "norm", "total"} <= kinds
    assert all(r["before_ms"] >= 0 and r["after_ms"] >= 0 for r in data["rows"])
    pytest.importorskip("matplotlib")
    assert (out / "profile.png").stat().st_size > 1000
