"""TrainConfig: validation names the field; dict/JSON/TOML round trips; presets."""

import json

import pytest
import torch

from fuseformer.models.config import ModelConfig
from fuseformer.models.llama import LlamaForCausalLM
from fuseformer.train import TrainConfig
from fuseformer.train.presets import BUILTIN_MODEL, PRESETS


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("seq_len", 0, "seq_len must be an int >= 1"),
        ("micro_batch_size", 1.5, "micro_batch_size"),
        ("grad_accum_steps", True, "grad_accum_steps"),
        ("warmup_steps", -1, "warmup_steps"),
        ("lr", 0.0, "lr must be > 0"),
        ("lr", float("nan"), "lr must be a finite"),
        ("min_lr", 1.0, "min_lr 1.0 is above lr"),
        ("betas", (0.9, 1.0), "betas"),
        ("eval_split", 1.0, "eval_split"),
        ("precision", "fp8", "precision must be one of"),
        ("distributed", "tp", "distributed must be one of"),
        ("activation_checkpointing", "every:0", "activation_checkpointing"),
        ("activation_checkpointing", "some", "activation_checkpointing"),
        ("activation_checkpointing", "all-but:-1", "all-but:k"),
        ("activation_checkpointing", "all-but:", "activation_checkpointing"),
        ("data_suffixes", ("py",), "data_suffixes"),
        ("model", 3, "model must be a ModelConfig or a path"),
    ],
)
def test_bad_fields_name_the_field(model_config, field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"model": model_config(), field: value})


def test_checkpoint_modes(model_config):
    plans = {"off": (0, 0), "all": (1, 0), "every:3": (3, 0), "all-but:2": (1, 2), "all-but:0": (1, 0)}
    for mode, plan in plans.items():
        assert TrainConfig(model=model_config(), activation_checkpointing=mode).checkpoint_plan() == plan


def test_round_trips(tmp_path, model_config):
    cfg = TrainConfig(model=model_config(torch_dtype=torch.bfloat16), data=("a", "b"), betas=(0.8, 0.9), seq_len=64)
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert TrainConfig.from_file(path) == cfg
    toml = tmp_path / "c.toml"
    toml.write_text('model = "some/hf/dir"\ndata = ["x"]\nprecision = "fp16"\nbetas = [0.9, 0.99]\n')
    t = TrainConfig.from_file(toml)
    assert t.model == "some/hf/dir" and t.data == ("x",) and t.betas == (0.9, 0.99) and t.precision == "fp16"
    hf = TrainConfig.from_dict({"model": {"architectures": ["LlamaForCausalLM"], **_hf_fields()}})
    assert hf.model.hidden_size == 32
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['sequence_length'\]"):
        TrainConfig.from_dict({"model": "x", "sequence_length": 3})
    with pytest.raises(ValueError, match="model is required"):
        TrainConfig.from_dict({})
    bad = tmp_path / "bad.toml"
    bad.write_text("seq_len = = 3")
    with pytest.raises(ValueError, match="cannot parse"):
        TrainConfig.from_file(bad)
    with pytest.raises(ValueError, match="must end in .json or .toml"):
        TrainConfig.from_file(tmp_path / "c.json").__class__.from_file(_touch(tmp_path / "c.yaml"))


def _touch(path):
    path.write_text("")
    return path


def _hf_fields():
    return dict(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)


def test_builtin_preset():
    """The built-in model's bf16 weights fit the issue's 25 MB; the preset is a valid config."""
    m = BUILTIN_MODEL
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(m).parameters())  # tied embedding counted once
    assert 2 * params <= 25e6
    assert m.num_key_value_heads < m.num_attention_heads  # GQA
    cfg = TrainConfig(**PRESETS["builtin"], data=("x",), tokenizer="t")
    assert cfg.precision == "auto" and cfg.seq_len <= m.max_position_embeddings


def test_config_file_in_docs_is_complete_and_valid(tmp_path):
    """docs/training.md's small config file reads as a TrainConfig from scratch (a [model] table)
    with the parameter count the text gives."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "tiny.toml").write_text(toml)
    cfg = TrainConfig.from_file(tmp_path / "tiny.toml")
    assert isinstance(cfg.model, ModelConfig) and cfg.tokenizer and cfg.data
    assert cfg.seq_len <= cfg.model.max_position_embeddings
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(cfg.model).parameters())
    assert f"{params / 1e6:.1f}M parameters" in doc
