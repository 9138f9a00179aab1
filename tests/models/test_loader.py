"""load_model: packing, tied embeddings, dtypes, sharded checkpoints, and errors that name the file and
tensor (missing or malformed files, missing, unexpected or wrongly shaped tensors)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fuseformer.models.loader import load_model


@pytest.fixture
def llama_dir(hf_checkpoint, tmp_path):
    """A private copy of the llama3 checkpoint that a test may break."""
    src, hf = hf_checkpoint("llama3")
    return shutil.copytree(src, tmp_path / "ckpt"), hf


def _rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_packed_weights_and_tied_embeddings(name, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    hf_sd = hf.state_dict()
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        ours = model.model.layers[i]
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            qkv = torch.cat([hf_sd[f"{pre}self_attn.{p}_proj.{kind}"] for p in "qkv"])
            assert torch.equal(getattr(ours.self_attn.qkv_proj, kind), qkv)
        gate_up = torch.cat([hf_sd[f"{pre}mlp.gate_proj.weight"], hf_sd[f"{pre}mlp.up_proj.weight"]])
        assert torch.equal(ours.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(ours.input_layernorm.weight, hf_sd[f"{pre}input_layernorm.weight"])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, hf_sd["lm_head.weight"])
    assert not model.training


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(dtype, hf_checkpoint):
    path, hf = hf_checkpoint("qwen2")
    model, _ = load_model(path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after the cast
    assert torch.equal(model.model.norm.weight, hf.model.norm.weight.to(dtype))


def test_checkpoint_dtype_is_the_default(llama_dir):
    path, _ = llama_dir
    _rewrite(path, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    model, cfg = load_model(path)
    assert cfg.torch_dtype == torch.bfloat16 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert load_model(path, dtype=torch.float32)[0].model.embed_tokens.weight.dtype == torch.float32


def test_rotary_buffer_in_old_checkpoints_is_ignored(llama_dir):
    path, _ = llama_dir
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(path)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json does not exist"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_model(tmp_path / "nowhere")


def test_malformed_config(llama_dir):
    path, _ = llama_dir
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model(path)


def test_no_weights(llama_dir):
    path, _ = llama_dir
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_model(path)


def test_corrupt_safetensors_names_the_file(llama_dir):
    path, _ = llama_dir
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors"):
        load_model(path)


def test_missing_tensor_is_named(llama_dir):
    path, _ = llama_dir
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.self_attn\.k_proj\.weight'\]"):
        load_model(path)


def test_wrong_shape_names_file_and_tensor(llama_dir):
    path, _ = llama_dir
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}))
    match = r"model\.safetensors tensor model\.layers\.0\.mlp\.up_proj\.weight has shape \(95, 64\); expected \(96,"
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_unexpected_tensor(llama_dir):
    path, _ = llama_dir
    _rewrite(path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    match = r"does not use: \['model\.layers\.0\.extra\.weight \(in model\.safetensors\)'\]"
    with pytest.raises(ValueError, match=match):
        load_model(path)
    load_model(path, strict=False)


def test_sharded_index_errors(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("qwen3", sharded=True)
    path = shutil.copytree(src, tmp_path / "ckpt")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2

    # An index naming a shard that is not there.
    broken = {**index, "weight_map": {**index["weight_map"], "model.norm.weight": "model-99-of-99.safetensors"}}
    index_file.write_text(json.dumps(broken))
    match = r"model-99-of-99\.safetensors \(listed in .*index\.json\) does not exist"
    with pytest.raises(FileNotFoundError, match=match):
        load_model(path)

    # An index assigning a tensor to the wrong shard.
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    wrong = {**index, "weight_map": {**index["weight_map"], name: shards[1]}}
    index_file.write_text(json.dumps(wrong))
    with pytest.raises(ValueError, match=rf"{shards[1]} lacks \['{name}'\]"):
        load_model(path)

    index_file.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is malformed"):
        load_model(path)


def _set_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


def test_string_for_a_bool_is_refused_naming_file_and_field(llama_dir):
    """``"tie_word_embeddings": "false"`` was truthy: the model was tied and the checkpoint's
    lm_head.weight dropped. transformers refuses the type; so do we, naming config.json and the field."""
    path, _ = llama_dir
    _set_config(path, tie_word_embeddings="false")
    match = rf"{path / 'config.json'}: .*tie_word_embeddings must be true or false, got 'false'"
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_tied_config_with_distinct_lm_head_keeps_it(llama_dir):
    """tie_word_embeddings true but the checkpoint's lm_head.weight differs from the embedding: as
    transformers does, both are kept untied, with a warning; no tensor is dropped."""
    path, hf = llama_dir
    _set_config(path, tie_word_embeddings=True)
    with pytest.warns(UserWarning, match="lm_head.weight differs from model.embed_tokens.weight"):
        model, config = load_model(path)
    assert not config.tie_word_embeddings
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_tied_config_with_equal_lm_head_or_only_the_head(hf_checkpoint, tmp_path):
    """A tied checkpoint that also stores lm_head.weight (equal: .bin conversions) stays tied without
    a warning; one that stores only lm_head.weight loads it as the embedding."""
    import warnings

    src, hf = hf_checkpoint("qwen2")  # tied; save_pretrained stores the embedding only
    path = shutil.copytree(src, tmp_path / "ckpt")
    embed = hf.model.embed_tokens.weight
    _rewrite(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, config = load_model(path)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight

    _rewrite(path, lambda t: t.pop("model.embed_tokens.weight"))
    model, config = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight and torch.equal(model.lm_head.weight, embed)


def test_sizes_are_checked_before_allocating(llama_dir):
    """A config.json whose sizes do not match its weights fails from the headers, before memory for
    the model it describes is allocated (intermediate_size 2**30 would need ~1.5 TiB here)."""
    path, _ = llama_dir
    _set_config(path, intermediate_size=2**30)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d\.mlp\.\w+\.weight has shape"):
        load_model(path)
