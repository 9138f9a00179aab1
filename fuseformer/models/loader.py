"""Load a model of the registry from a local Hugging Face directory (nothing is downloaded).

The mapping from checkpoint names to our parameters is data (STYLE.md §5): ``PACKED_MODULES`` says
which checkpoint modules are packed, in order, into one of ours (q/k/v -> qkv_proj, gate/up ->
gate_up_proj), ``IGNORED_SUFFIXES`` lists tensors that carry nothing we use. One generic loader reads
it: every checkpoint tensor maps to (parameter, row range), its shape is checked, and every row of
every parameter must be written exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from fuseformer.models.config import ModelConfig
from fuseformer.models.registry import build_model

# Our packed module -> the checkpoint modules stacked along dim 0 of its weight (and bias), in order.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Checkpoint tensors that are not parameters of ours (old checkpoints saved the rotary buffer).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


def shard_rows(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Rows each checkpoint module takes in its packed parameter, per packed module."""
    d = config.head_dim
    return {
        "qkv_proj": (config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d),
        "gate_up_proj": (config.intermediate_size, config.intermediate_size),
    }


def checkpoint_targets(model: torch.nn.Module, config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint name -> (our parameter name, first row, row count); row count -1 = the whole tensor."""
    rows = shard_rows(config)
    targets = {}
    for name, _ in model.named_parameters():  # tied lm_head.weight is listed once, as the embedding
        parts = name.split(".")
        packed = next((i for i, p in enumerate(parts) if p in PACKED_MODULES), None)
        if packed is None:
            targets[name] = (name, 0, -1)
            continue
        start = 0
        for sub, n in zip(PACKED_MODULES[parts[packed]], rows[parts[packed]]):
            targets[".".join([*parts[:packed], sub, *parts[packed + 1 :]])] = (name, start, n)
            start += n
    return targets


def _checkpoint_files(path: Path) -> dict[Path, list[str] | None]:
    """Safetensors files of the checkpoint -> the tensor names the index assigns them (None: all)."""
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"load_model: {index} is malformed ({type(exc).__name__}: {exc})") from exc
        files: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(path / file, []).append(name)
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"load_model: {file} (listed in {index}) does not exist")
        return files
    single = path / _SINGLE
    if single.is_file():
        return {single: None}
    raise FileNotFoundError(f"load_model: {path} holds neither {_SINGLE} nor {_INDEX}")


def empty_model(config: ModelConfig, dtype: torch.dtype, device) -> nn.Module:
    """Our model for ``config`` (the registry's class for its architecture), built on the meta device
    and cast there, then allocated (not initialized) once, in ``dtype``, on ``device``; tied
    embeddings tied. Its values are garbage until loaded."""
    with torch.device("meta"):
        model = build_model(config).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


def _untie_if_distinct(
    config: ModelConfig, path: Path, plan: dict[str, tuple[Path, str]], lm_head: tuple[Path, str] | None
) -> ModelConfig:
    """The config to build when config.json ties the embeddings and the checkpoint has an
    ``lm_head.weight`` too. As transformers does: equal to the embedding (``.bin`` conversions
    store both), it is the same tensor and stays tied; different, the two are kept apart, with a
    warning, and the returned config says untied. Never is a checkpoint tensor dropped."""
    if not config.tie_word_embeddings or lm_head is None or _EMBED not in plan:
        return config
    if torch.equal(_read_tensor(*plan[_EMBED]), _read_tensor(*lm_head)):
        return config
    warnings.warn(
        f"load_model: {path / 'config.json'} sets tie_word_embeddings, but the checkpoint's lm_head.weight "
        f"differs from {_EMBED}: both are kept, untied (as transformers does); set tie_word_embeddings to "
        "false in config.json to silence this",
        stacklevel=3,
    )
    return dataclasses.replace(config, tie_word_embeddings=False)


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    strict: bool = True,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model of the HF directory ``path`` and load its safetensors weights.

    Args:
        path: directory with config.json and model.safetensors, or model.safetensors.index.json and
            its shards.
        dtype: float32, float16 or bfloat16; default the checkpoint's (config ``dtype``/``torch_dtype``),
            else float32.
        device: where the parameters live.
        strict: raise on checkpoint tensors the model has no place for (else ignore them). Missing
            tensors always raise.

    Returns:
        (model in eval mode, its ModelConfig). With ``tie_word_embeddings`` set and a distinct
        ``lm_head.weight`` in the checkpoint, the model is untied and the config says so (a warning
        tells); a tied checkpoint that holds only ``lm_head.weight`` loads it as the embedding.

    Every checkpoint tensor's name and shape are checked from the file headers before the model's
    memory is allocated, so a config.json whose sizes do not match its weights fails at once.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"load_model: {path} is not a directory")
    config = ModelConfig.from_file(path / "config.json")
    dtype = dtype if dtype is not None else (config.torch_dtype or torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"load_model: dtype must be one of float32, float16, bfloat16, got {dtype}")
    files = _checkpoint_files(path)

    # Pass 1, headers only: where each tensor goes, its shape checked against the meta model.
    with torch.device("meta"):
        meta = build_model(config)
    params = dict(meta.named_parameters())
    targets = checkpoint_targets(meta, config)
    plan: dict[str, tuple[Path, str]] = {}  # checkpoint name -> (file, name)
    unexpected: list[str] = []
    lm_head: tuple[Path, str] | None = None  # a tied model's lm_head.weight, if the checkpoint has one
    for file, listed in files.items():
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise ValueError(f"load_model: cannot read {file}: {exc}") from exc
        with handle as f:
            names = list(f.keys())
            if listed is not None:
                absent = sorted(set(listed) - set(names))
                if absent:
                    raise ValueError(f"load_model: {file} lacks {absent[:5]}, which the index assigns to it")
            for name in names:
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                tied_head = config.tie_word_embeddings and name == _LM_HEAD
                if name not in targets and not tied_head:
                    unexpected.append(f"{name} (in {file.name})")
                    continue
                param_name, _, n = targets[_EMBED if tied_head else name]
                param = params[param_name]
                expected = tuple(param.shape) if n < 0 else (n, *param.shape[1:])
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected:
                    raise ValueError(f"load_model: {file} tensor {name} has shape {shape}; expected {expected}")
                if tied_head:
                    lm_head = (file, name)
                else:
                    plan[name] = (file, name)
    if config.tie_word_embeddings and _EMBED not in plan and lm_head is not None:
        plan[_EMBED] = lm_head  # only the head is stored: the embedding is the same tensor (transformers)
    missing = sorted(set(targets) - set(plan))
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ValueError(f"load_model: {path} is missing tensors {missing[:10]}{more}")
    if unexpected and strict:
        more = f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""
        raise ValueError(f"load_model: {path} has tensors the model does not use: {unexpected[:10]}{more}")
    config = _untie_if_distinct(config, path, plan, lm_head)
    if not config.tie_word_embeddings and lm_head is not None:
        plan[_LM_HEAD] = lm_head

    # Pass 2: allocate once and copy every tensor into its rows.
    model = empty_model(config, dtype, device)
    params = dict(model.named_parameters())
    targets = checkpoint_targets(model, config)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for target, (file, name) in plan.items():
        by_file.setdefault(file, []).append((target, name))
    for file, entries in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for target, name in entries:
                param_name, start, n = targets[target]
                param = params[param_name]
                dest = param.data if n < 0 else param.data[start : start + n]
                with torch.no_grad():
                    dest.copy_(f.get_tensor(name))
    return model.eval(), config
