"""ModelConfig from Hugging Face config.json files: the four architectures, old and new formats,
validation errors naming the field, file errors naming the file."""

import json

import pytest
import torch

from fuseformer.models.config import ModelConfig


def _hf(path):
    return json.loads((path / "config.json").read_text())


def test_llama3_config(hf_checkpoint):
    path, _ = hf_checkpoint("llama3")
    c = ModelConfig.from_file(path)
    assert c.architecture == "LlamaForCausalLM"
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_theta == 10000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert c.rope_scaling["original_max_position_embeddings"] == 16 and c.rope_scaling["factor"] == 8.0
    assert not c.tie_word_embeddings and not c.attention_bias and not c.o_proj_bias and not c.qk_norm
    assert c.sliding_window is None and c.layer_types == ("full_attention",) * 2 and c.window(1) == -1
    assert c.torch_dtype == torch.float32


def test_qwen2_config(hf_checkpoint):
    c = ModelConfig.from_file(hf_checkpoint("qwen2")[0] / "config.json")
    assert c.architecture == "Qwen2ForCausalLM" and c.tie_word_embeddings
    assert c.attention_bias and not c.o_proj_bias  # Qwen2: q/k/v bias, none on o_proj
    assert c.rope_theta == 1000.0 and c.rope_scaling is None
    assert c.layer_types == ("full_attention", "sliding_attention") and (c.window(0), c.window(1)) == (-1, 4)


def test_qwen3_and_mistral_configs(hf_checkpoint):
    q3 = ModelConfig.from_file(hf_checkpoint("qwen3")[0])
    assert q3.qk_norm and q3.head_dim == 32 and q3.sliding_window is None
    mi = ModelConfig.from_file(hf_checkpoint("mistral")[0])
    assert mi.architecture == "MistralForCausalLM" and mi.sliding_window == 5 and mi.window(0) == mi.window(1) == 5


def test_old_format_and_defaults(hf_checkpoint):
    hf = _hf(hf_checkpoint("llama3")[0])
    del hf["rope_parameters"], hf["head_dim"]
    hf |= {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}, "torch_dtype": "bfloat16"}
    hf.pop("dtype", None)
    c = ModelConfig.from_hf(hf)
    assert c.rope_theta == 500000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert c.head_dim == 16 and c.torch_dtype == torch.bfloat16


def test_qwen2_old_config_without_layer_types(hf_checkpoint):
    hf = _hf(hf_checkpoint("qwen2")[0])
    del hf["layer_types"]
    hf |= {"num_hidden_layers": 3, "max_window_layers": 1}
    assert ModelConfig.from_hf(hf).layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    hf["use_sliding_window"] = False
    c = ModelConfig.from_hf(hf)
    assert c.sliding_window is None and c.layer_types == ("full_attention",) * 3


def test_unsupported_architecture_is_named(hf_checkpoint):
    hf = _hf(hf_checkpoint("llama3")[0]) | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        ModelConfig.from_hf(hf)


_GOOD = dict(
    architecture="LlamaForCausalLM",
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(architecture="BertModel"), "architecture 'BertModel'"),
        (dict(hidden_size=0), "hidden_size must be a positive int"),
        (dict(vocab_size=3.5), "vocab_size must be a positive int"),
        (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        (dict(hidden_size=66), "head_dim is not given and hidden_size 66"),
        (dict(head_dim=15), "head_dim must be a positive even int"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type 'yarn' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks low_freq_factor"),
        (dict(sliding_window=0), "sliding_window must be a positive int"),
        (dict(layer_types=("full_attention",)), "layer_types has 1 entries"),
        (dict(layer_types=("full_attention", "sliding_attention")), "sliding_window is None"),
        (dict(torch_dtype=torch.int8), "torch_dtype"),
    ],
)
def test_validation_names_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**_GOOD, **change})


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(dtype="int8"), "dtype 'int8'"),
        (dict(architectures=["LlamaForCausalLM", "MistralForCausalLM"]), "must name one architecture"),
    ],
)
def test_hf_fields_rejected(change, match, hf_checkpoint):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(_hf(hf_checkpoint("llama3")[0]) | change)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: .*must be a positive int"):
        ModelConfig.from_file(tmp_path)


def test_kv_cache_sizes():
    c = ModelConfig(**{**_GOOD, "head_dim": 32})
    assert c.kv_cache_shape(10, 16) == (10, 16, 2, 32)
    assert c.kv_cache_block_bytes(16, torch.bfloat16) == 2 * 2 * 16 * 2 * 32 * 2


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
        (dict(attention_bias="no"), "attention_bias must be true or false"),
        (dict(hidden_size="64"), "hidden_size must be an integer, got '64'"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a number"),
        (dict(rope_scaling="linear"), "rope_scaling must be an object"),
        (dict(hidden_size=2**40), r"hidden_size 1099511627776 is above the supported"),
        (dict(max_position_embeddings=2**62), "max_position_embeddings .* is above the supported"),
        (
            dict(rope_parameters={"rope_type": "linear", "factor": "x"}),
            "rope_scaling factor must be a positive number, got 'x'",
        ),
        (
            dict(rope_parameters={"rope_type": "linear", "factor": 0}),
            "rope_scaling factor must be a positive number, got 0",
        ),
        (
            dict(rope_parameters={"rope_type": "dynamic", "factor": -2}),
            "rope_scaling factor must be a positive number, got -2",
        ),
        (
            dict(rope_parameters={"rope_type": "linear", "factor": True}),
            "rope_scaling factor must be a positive number",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4}),
            "rope_scaling high_freq_factor 4 must be above low_freq_factor 4",
        ),
    ],
)
def test_config_json_types_and_ranges_name_file_and_field(change, match, hf_checkpoint, tmp_path):
    """config.json values of the wrong type or out of range: a ValueError naming the file and the
    field (as transformers' strict configs check types), never a traceback from later arithmetic
    or a silently wrong model (a string "false" is truthy; rope factor 0 divides by zero)."""
    (tmp_path / "config.json").write_text(json.dumps(_hf(hf_checkpoint("llama3")[0]) | change))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: ModelConfig: {match}"):
        ModelConfig.from_file(tmp_path)


def test_null_counts_as_absent(hf_checkpoint):
    hf = _hf(hf_checkpoint("llama3")[0]) | {"tie_word_embeddings": None, "rms_norm_eps": None, "head_dim": None}
    c = ModelConfig.from_hf(hf)
    assert c.tie_word_embeddings is False and c.rms_norm_eps == 1e-6 and c.head_dim == 16
