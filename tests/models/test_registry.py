"""The model registry: every entry parses transformers' own config of a tiny model, builds and runs,
and writes a config.json that parses back to the same ModelConfig; unsupported architectures are
named with the supported ones; Gemma's config fields (defaults, null soft-caps, the legacy "gelu");
and nothing outside fuseformer/models imports a model class by name (STYLE.md §17)."""

import ast
from pathlib import Path

import pytest
import torch
import transformers

from fuseformer.models import registry
from fuseformer.models.attention_metadata import AttentionMetadata
from fuseformer.models.config import ModelConfig

_TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)
# Per architecture, what makes the tiny config exercise its features (windows, bias, head_dim).
_EXTRA = {
    "MistralForCausalLM": dict(sliding_window=3),
    "Qwen2ForCausalLM": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "Qwen3ForCausalLM": dict(head_dim=16),
    "GemmaForCausalLM": dict(head_dim=8, num_key_value_heads=1),
    "Gemma2ForCausalLM": dict(head_dim=8, sliding_window=3),
}
PACKAGE = Path(__file__).resolve().parents[2] / "fuseformer"


def _hf_dict(architecture: str, **extra) -> dict:
    """config.json of a tiny model as transformers writes it (its defaults filled in)."""
    entry = registry.ARCHITECTURES[architecture]
    hf = transformers.AutoConfig.for_model(entry.model_type, **(_TINY | _EXTRA.get(architecture, {}) | extra))
    hf.architectures = [architecture]
    return hf.to_dict()


@pytest.mark.parametrize("architecture", registry.supported_architectures())
def test_every_entry_parses_builds_runs_and_round_trips(architecture):
    config = ModelConfig.from_hf(_hf_dict(architecture))
    assert config.architecture == architecture
    model = registry.build_model(config)
    assert isinstance(model, registry.model_class(config)) and model.config is config
    with torch.no_grad():
        hidden = model(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), AttentionMetadata.varlen([3, 2]))
        logits = model.compute_logits(hidden, torch.tensor([2, 4]))
    assert hidden.shape == (5, 32) and logits.shape == (2, 64) and torch.isfinite(logits).all()
    written = config.to_hf()
    assert written["architectures"] == [architecture]
    assert written["model_type"] == registry.ARCHITECTURES[architecture].model_type
    assert ModelConfig.from_hf(written) == config
    # transformers reads what we write as the same model (its defaults do not change the meaning).
    theirs = transformers.AutoConfig.for_model(**written).to_dict() | {"architectures": [architecture]}
    assert ModelConfig.from_hf(theirs) == config


def test_unsupported_architecture_names_it_and_lists_the_supported_ones():
    hf = _hf_dict("LlamaForCausalLM") | {"architectures": ["Phi3ForCausalLM"]}
    with pytest.raises(ValueError, match="architecture 'Phi3ForCausalLM' is not supported") as info:
        ModelConfig.from_hf(hf)
    for name in registry.supported_architectures():
        assert name in str(info.value)
    with pytest.raises(ValueError, match=r"model_class: architecture 'Phi3ForCausalLM' .*Gemma2ForCausalLM"):
        registry.check_architecture("Phi3ForCausalLM", "model_class")
    with pytest.raises(ValueError, match="architecture 'Phi3ForCausalLM' is not supported"):
        ModelConfig(architecture="Phi3ForCausalLM", **_TINY)


def test_gemma_defaults_are_transformers_defaults():
    """Absent fields take GemmaConfig's / Gemma2Config's defaults, and so mean what they mean there."""
    sizes = _TINY
    gemma = ModelConfig.from_hf({"architectures": ["GemmaForCausalLM"], **sizes})
    gemma2 = ModelConfig.from_hf({"architectures": ["Gemma2ForCausalLM"], **sizes})
    theirs, theirs2 = transformers.GemmaConfig(**sizes), transformers.Gemma2Config(**sizes)
    for ours, hf in ((gemma, theirs), (gemma2, theirs2)):
        assert ours.head_dim == hf.head_dim == 256
        assert ours.tie_word_embeddings and hf.tie_word_embeddings
        assert ours.max_position_embeddings == hf.max_position_embeddings == 8192
        assert ours.hidden_act == "gelu_tanh"
    assert gemma.query_pre_attn_scalar is None  # Gemma (1) scales by head_dim**-0.5
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping, gemma.sliding_window) == (None,) * 3
    assert gemma.layer_types == ("full_attention",) * 2
    assert gemma2.query_pre_attn_scalar == theirs2.query_pre_attn_scalar == 256
    assert gemma2.attn_logit_softcapping == theirs2.attn_logit_softcapping == 50.0
    assert gemma2.final_logit_softcapping == theirs2.final_logit_softcapping == 30.0
    assert gemma2.sliding_window == theirs2.sliding_window == 4096
    assert gemma2.layer_types == tuple(theirs2.layer_types) == ("sliding_attention", "full_attention")
    assert (gemma2.window(0), gemma2.window(1)) == (4096, -1)


def test_null_softcaps_turn_them_off():
    hf = _hf_dict("Gemma2ForCausalLM") | {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    config = ModelConfig.from_hf(hf)
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    model = registry.build_model(config)
    assert all(layer.self_attn.softcap == 0.0 for layer in model.model.layers)
    hidden = torch.randn(3, 32) * 10
    torch.testing.assert_close(model.compute_logits(hidden), model.lm_head(hidden))  # no final cap
    capped = registry.build_model(ModelConfig.from_hf(_hf_dict("Gemma2ForCausalLM", final_logit_softcapping=2.0)))
    capped.load_state_dict(model.state_dict())
    logits = capped.compute_logits(hidden)
    assert logits.abs().max() <= 2.0
    torch.testing.assert_close(logits, 2.0 * torch.tanh(model.lm_head(hidden) / 2.0))
    assert ModelConfig.from_hf(config.to_hf()) == config  # written as null, read as off


def test_gemma_activations():
    """Gemma's legacy hidden_act "gelu" is the tanh form (as GemmaConfig rewrites it); Gemma2's
    hidden_activation "gelu" is the exact one; a non-gelu activation is refused, naming the field."""
    gemma = _hf_dict("GemmaForCausalLM") | {"hidden_act": "gelu"}
    assert ModelConfig.from_hf(gemma).hidden_act == "gelu_tanh"
    assert transformers.GemmaConfig(**_TINY, hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"
    gemma2 = _hf_dict("Gemma2ForCausalLM") | {"hidden_activation": "gelu"}
    config = ModelConfig.from_hf(gemma2)
    assert config.hidden_act == "gelu" and ModelConfig.from_hf(config.to_hf()) == config
    assert registry.build_model(config).model.layers[0].mlp.act == "gelu"
    with pytest.raises(ValueError, match="hidden_act 'silu' is not supported for GemmaForCausalLM"):
        ModelConfig.from_hf(_hf_dict("GemmaForCausalLM") | {"hidden_act": "silu"})
    with pytest.raises(ValueError, match="hidden_activation 'relu' is not supported for Gemma2ForCausalLM"):
        ModelConfig.from_hf(gemma2 | {"hidden_activation": "relu"})
    exact = ModelConfig(architecture="GemmaForCausalLM", **_TINY, hidden_act="gelu")
    with pytest.raises(ValueError, match="GemmaForCausalLM's config.json cannot say hidden_act 'gelu'"):
        exact.to_hf()


def test_gemma2_layer_types_and_window():
    hf = _hf_dict("Gemma2ForCausalLM", num_hidden_layers=3) | {"layer_types": None}
    assert ModelConfig.from_hf(hf).layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    hf["layer_types"] = ["full_attention"] * 3
    assert ModelConfig.from_hf(hf).window(0) == -1
    with pytest.raises(ValueError, match="sliding_window must be set for Gemma2ForCausalLM"):
        ModelConfig.from_hf(hf | {"sliding_window": None})
    with pytest.raises(ValueError, match="query_pre_attn_scalar must be a number"):
        ModelConfig.from_hf(hf | {"query_pre_attn_scalar": "256"})


def test_nothing_outside_models_imports_a_model_file():
    """The loader, engine, trainer and tools build models through the registry (STYLE.md §17)."""
    model_files = {f"fuseformer.models.{p.stem}" for p in (PACKAGE / "models").glob("*.py")}
    model_files -= {
        f"fuseformer.models.{m}" for m in ("__init__", "registry", "config", "loader", "tokenizer", "quantization")
    }
    model_files -= {"fuseformer.models.attention_metadata"}
    assert {"fuseformer.models.llama", "fuseformer.models.gemma"} <= model_files
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent == PACKAGE / "models":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n in model_files for n in names):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not offenders, offenders
