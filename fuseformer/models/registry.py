"""The model registry: Hugging Face architecture name -> our model class and its config parser.

A new architecture is one model file and one line here (STYLE.md §17). The model class takes a
:class:`ModelConfig` and has the interface the engine and the loader use:

    forward(input_ids (T,), positions (T,), meta: AttentionMetadata) -> hidden (T, H)
    compute_logits(hidden (T, H), indices (N,) | None) -> logits (N, V)
    .config, .model.embed_tokens, .lm_head (tied when config.tie_word_embeddings)

and parameter names that are the checkpoint's, except the packed ones of the loader's
PACKED_MODULES. The parser (models/config.py) turns the architecture's own config.json fields into
ModelConfig fields; the writer turns them back (the config.json of the trainer's checkpoints).
Nothing else imports a model class by name: the loader, the engine and the trainer build models
through :func:`build_model`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from fuseformer.models.config import ModelConfig, gemma_fields, gemma_hf_fields, llama_fields, llama_hf_fields
from fuseformer.models.gemma import GemmaForCausalLM
from fuseformer.models.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class Architecture:
    """One registry entry: the model class, HF's ``model_type``, the parser of the architecture's own
    config.json fields and its inverse, the writer (both in models/config.py)."""

    model_class: type[nn.Module]
    model_type: str
    config_parser: Callable[[dict[str, Any]], dict[str, Any]]
    config_writer: Callable[[ModelConfig], dict[str, Any]]


# HF ``architectures[0]`` -> our implementation.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, "llama", llama_fields, llama_hf_fields),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, "mistral", llama_fields, llama_hf_fields),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, "qwen2", llama_fields, llama_hf_fields),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, "qwen3", llama_fields, llama_hf_fields),
    "GemmaForCausalLM": Architecture(GemmaForCausalLM, "gemma", gemma_fields, gemma_hf_fields),
    "Gemma2ForCausalLM": Architecture(GemmaForCausalLM, "gemma2", gemma_fields, gemma_hf_fields),
}


def supported_architectures() -> tuple[str, ...]:
    """The HF architecture names we implement, in registry order."""
    return tuple(ARCHITECTURES)


def _entry(architecture: str, who: str) -> Architecture:
    entry = ARCHITECTURES.get(architecture) if isinstance(architecture, str) else None
    if entry is None:
        raise ValueError(
            f"{who}: architecture {architecture!r} is not supported; expected one of {supported_architectures()}"
        )
    return entry


def check_architecture(architecture: str, who: str = "ModelConfig") -> None:
    """ValueError naming ``architecture`` and the supported ones unless the registry has it."""
    _entry(architecture, who)


def config_parser(architecture: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The parser of ``architecture``'s own config.json fields (see ModelConfig.from_hf)."""
    return _entry(architecture, "ModelConfig").config_parser


def config_writer(architecture: str) -> Callable[[ModelConfig], dict[str, Any]]:
    """The writer of ``architecture``'s own config.json fields (see ModelConfig.to_hf)."""
    return _entry(architecture, "ModelConfig.to_hf").config_writer


def hf_model_type(architecture: str) -> str:
    """Hugging Face's ``model_type`` of ``architecture`` ("llama", "gemma2", ...)."""
    return _entry(architecture, "ModelConfig.to_hf").model_type


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The model class implementing ``config.architecture``."""
    return _entry(config.architecture, "model_class").model_class


def build_model(config: ModelConfig) -> nn.Module:
    """A new model for ``config`` (parameters initialized on the current default device; build under
    ``torch.device("meta")`` to allocate nothing, as the loader does)."""
    return model_class(config)(config)
