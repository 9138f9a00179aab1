"""Tiny random Hugging Face checkpoints, made in the test session with transformers' save_pretrained
(nothing is downloaded): one per architecture and feature the models must cover."""

import functools
import math

import pytest
import torch
import transformers

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)

# name -> (HF config class, its arguments)
CHECKPOINTS = {
    # GQA 4/2, untied, Llama-3 rope scaling (original context 16, so most frequencies are scaled).
    "llama3": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=2, rope_scaling={**_LLAMA3, "original_max_position_embeddings": 16}),
    ),
    # MHA, tied embeddings, linear rope scaling.
    "llama_linear_tied": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    # Dynamic NTK: max_position_embeddings 12, so sequences past 12 tokens rescale the base.
    "llama_dynamic": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=1, max_position_embeddings=12, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    ),
    # Sliding window of 5 in every layer.
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=5)),
    # q/k/v bias, tied embeddings, sliding window (4) in layer 1 only.
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            rope_theta=1000.0,
        ),
    ),
    # q/k norm, head_dim 32 != hidden / heads, untied.
    "qwen3": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Offset norms, GeGLU in the tanh form (the legacy "gelu" is erf in transformers 5.17, tanh since:
    # test_registry covers our reading of it), scaled embeddings, MQA, tied.
    "gemma": (transformers.GemmaConfig, dict(num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh")),
    # Gemma2: 3 layers, sliding window 4 in layers 0 and 2; query_pre_attn_scalar 24 != head_dim; both
    # soft-caps low enough to bite (random scores reach ~4, logits ~15); GQA 4/2, untied.
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            tie_word_embeddings=False,
        ),
    ),
}
_MODEL_CLASSES = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
    transformers.GemmaConfig: transformers.GemmaForCausalLM,
    transformers.Gemma2Config: transformers.Gemma2ForCausalLM,
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (biases and norm weights too, so that none is a silent no-op), scaled
    so activations and logits are O(1)-O(10): greedy choices are then decisive. Gemma's norms scale
    by 1 + weight, so theirs are drawn around 0."""
    gen = torch.Generator().manual_seed(seed)
    one = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(one + 0.3 * r)
            elif p.dim() == 1:  # biases
                p.copy_(0.5 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r * (2.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1]))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """make(name, sharded=False) -> (directory, the HF model in fp32, eval mode)."""

    @functools.cache
    def make(name: str, sharded: bool = False):
        config_cls, kwargs = CHECKPOINTS[name]
        # Eager attention: the math itself. transformers 5.17 (the GPU host's) let Gemma2 take SDPA, which
        # drops the attention soft-cap, so HF's own logits there were not Gemma2's (5.25 refuses SDPA).
        config = config_cls(**(_BASE | kwargs), attn_implementation="eager")
        torch.manual_seed(1234)
        model = _MODEL_CLASSES[config_cls](config).eval()
        _randomize(model, seed=len(name))
        path = tmp_path_factory.mktemp(f"{name}_sharded" if sharded else name)
        model.save_pretrained(path, max_shard_size="40KB" if sharded else "5GB")
        return path, model

    return make
