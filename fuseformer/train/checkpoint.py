"""Checkpoints: a Hugging Face model directory plus the trainer's state, written atomically.

    <out_dir>/checkpoints/step_000100/   config.json, model.safetensors (HF names: q/k/v and
                                         gate/up unpacked), tokenizer files, trainer_state.pt
                                         (optimizer, scheduler, scaler, RNG, data position, step)
    <out_dir>/checkpoints/latest         "step_000100"

A checkpoint is written under a temporary name and renamed when complete, and ``latest`` is
replaced after that, so a run killed mid-save leaves the previous checkpoint usable. The model
directory loads with ``fuseformer.models.loader.load_model`` (and transformers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file

from fuseformer.models.config import ModelConfig
from fuseformer.models.loader import PACKED_MODULES, load_model, shard_rows
from fuseformer.train import distributed as D

if TYPE_CHECKING:
    from fuseformer.train.trainer import Trainer

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_STATE = "trainer_state.pt"
_LATEST = "latest"
_PREFIX = "lm."  # the trainer's module holds the model as .lm


# --------------------------------------------------------------------------------------------
# The model as a Hugging Face directory
# --------------------------------------------------------------------------------------------
def hf_config(config: ModelConfig, dtype: torch.dtype = torch.float32, **extra: Any) -> dict[str, Any]:
    """config.json for ``config``; ``ModelConfig.from_hf`` of it gives ``config`` back."""
    arch = config.architecture
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM") and (
        config.attention_bias != config.o_proj_bias
    ):
        raise ValueError(f"hf_config: {arch} cannot have attention_bias != o_proj_bias in config.json")
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch == "MistralForCausalLM":
        out["sliding_window"] = config.sliding_window
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        out["use_sliding_window"] = config.sliding_window is not None
        out["sliding_window"] = config.sliding_window
        out["layer_types"] = list(config.layer_types)
        out["max_window_layers"] = config.num_hidden_layers
    return out | extra


def hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> the checkpoint's: packed qkv_proj / gate_up_proj split back into
    q/k/v_proj and gate/up_proj (the loader's PACKED_MODULES table read backwards)."""
    rows = shard_rows(config)
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the same tensor as the embedding; HF keeps one
        parts = name.split(".")
        packed = next((i for i, p in enumerate(parts) if p in PACKED_MODULES), None)
        if packed is None:
            out[name] = tensor.contiguous()
            continue
        for sub, piece in zip(PACKED_MODULES[parts[packed]], tensor.split(rows[parts[packed]], dim=0)):
            out[".".join([*parts[:packed], sub, *parts[packed + 1 :]])] = piece.contiguous()
    return out


def save_model(
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    path: str | Path,
    dtype: torch.dtype | None = None,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write the model state (our names) as a Hugging Face directory: config.json,
    model.safetensors (in ``dtype``, default the state's), and the tokenizer files found in
    ``tokenizer_dir``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(state, config)
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(path / "model.safetensors", 0o644)  # safetensors writes 0600; the directory is meant to be shared
    (path / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=2))
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        if tokenizer_dir.is_file():
            tokenizer_dir = tokenizer_dir.parent
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, path / name)
    return path


def check_same_shape(config: ModelConfig, expected: ModelConfig, where: str) -> None:
    """Clear error when a checkpoint's model differs from the run's."""
    diffs = [
        f"{f.name} {getattr(config, f.name)!r} (run: {getattr(expected, f.name)!r})"
        for f in dataclasses.fields(ModelConfig)
        if f.name != "torch_dtype" and getattr(config, f.name) != getattr(expected, f.name)
    ]
    if diffs:
        raise ValueError(f"checkpoint {where} is for another model: {'; '.join(diffs)}")


# --------------------------------------------------------------------------------------------
# Trainer checkpoints
# --------------------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = checkpoint_root(out_dir)
    pointer = root / _LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / _STATE).is_file():
            return candidate
    done = sorted(p for p in root.glob("step_*") if (p / _STATE).is_file())
    return done[-1] if done else None


def save_checkpoint(trainer: Trainer) -> Path | None:
    """Write the trainer's checkpoint (every rank calls it; rank 0 writes). Returns its path on rank 0."""
    info = trainer.dist
    model_state = D.full_model_state(trainer.module, info)
    optim_state = D.full_optimizer_state(trainer.module, trainer.optimizer, info)
    path = None
    if info.is_main:
        root = checkpoint_root(trainer.config.out_dir)
        name = f"step_{trainer.step:07d}"
        tmp = root / f".tmp_{name}"
        for stale in root.glob(".tmp_step_*"):  # left by a run killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        lm_state = {k.removeprefix(_PREFIX): v for k, v in model_state.items()}
        save_model(lm_state, trainer.lm.config, tmp, dtype=torch.float32, tokenizer_dir=trainer.tokenizer_dir)
        state = {
            "step": trainer.step,
            "skipped_steps": trainer.skipped_steps,
            "tokens_seen": trainer.tokens_seen,
            "optimizer": optim_state,
            "scheduler": trainer.scheduler.state_dict(),
            "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
            "data": trainer.sampler.state_dict(),
            "rng": _rng_state(),
            "world_size": info.world_size,
        }
        torch.save(state, tmp / _STATE)
        (tmp / "train_config.json").write_text(json.dumps(trainer.config.to_dict(), indent=2, default=str))
        path = root / name
        if path.exists():  # the same step written by an earlier, resumed run
            shutil.rmtree(path)
        os.replace(tmp, path)
        pointer_tmp = root / f".{_LATEST}.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, root / _LATEST)
        done = sorted(p for p in root.glob("step_*") if p != path)
        for old in done[: max(0, len(done) - (trainer.config.keep_checkpoints - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier(info)
    return path


class CheckpointReadError(ValueError):
    """A checkpoint's files cannot be read (truncated, corrupt): an older one may still be."""


def _read_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(model config, model state, trainer state) of a checkpoint, all read before anything is
    restored; files that cannot be read raise CheckpointReadError naming the file."""
    try:
        config = ModelConfig.from_file(path / "config.json")
        lm, _ = load_model(path, dtype=torch.float32, device="cpu")
    except (ValueError, OSError) as exc:
        raise CheckpointReadError(f"checkpoint {path}: {exc}") from exc
    try:
        state = torch.load(path / _STATE, map_location="cpu", weights_only=True)
        missing = [k for k in ("step", "optimizer", "scheduler", "data", "rng", "world_size") if k not in state]
        if missing:
            raise KeyError(f"no {', '.join(missing)}")
    except Exception as exc:  # torch.load: RuntimeError, EOFError, UnpicklingError for a truncated file
        raise CheckpointReadError(f"checkpoint {path}: cannot read {_STATE}: {type(exc).__name__}: {exc}") from exc
    return config, lm.state_dict(), state


def resume_latest(trainer: Trainer) -> Path | None:
    """Restore the trainer from the newest checkpoint of its run that reads; returns its path, or
    None when the run has none. A newest checkpoint that is unreadable (a truncated trainer_state.pt)
    is passed over, with a warning, for the next older one; when none reads, the newest one's
    error is raised (starting again from step 0 would overwrite the run)."""
    root = checkpoint_root(trainer.config.out_dir)
    latest = latest_checkpoint(trainer.config.out_dir)
    if latest is None:
        return None
    older = sorted((p for p in root.glob("step_*") if (p / _STATE).is_file() and p != latest), reverse=True)
    first_error: CheckpointReadError | None = None
    for path in [latest, *older]:
        try:
            load_checkpoint(trainer, path)
        except CheckpointReadError as exc:
            first_error = first_error or exc
            if trainer.dist.is_main:
                warnings.warn(f"resume: {exc}; trying an older checkpoint", stacklevel=2)
            continue
        if first_error is not None and trainer.dist.is_main:
            warnings.warn(f"resume: resumed from the older {path}, not {latest}", stacklevel=2)
        return path
    raise first_error


def load_checkpoint(trainer: Trainer, path: str | Path) -> None:
    """Restore model, optimizer, scheduler, scaler, RNG and data position from ``path``. Every file is
    read first: a checkpoint that cannot be read (CheckpointReadError) leaves the trainer as it was."""
    path = Path(path)
    if not (path / _STATE).is_file():
        raise ValueError(f"load_checkpoint: {path} is not a trainer checkpoint (no {_STATE})")
    info = trainer.dist
    config, lm_state, state = _read_checkpoint(path)
    check_same_shape(config, trainer.lm.config, str(path))
    D.load_full_model_state(trainer.module, {_PREFIX + k: v for k, v in lm_state.items()}, info)
    D.load_full_optimizer_state(trainer.module, trainer.optimizer, state["optimizer"], info)
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler is not None and state["scaler"] is not None:
        trainer.scaler.load_state_dict(state["scaler"])
    if state["world_size"] != info.world_size and info.is_main:
        warnings.warn(
            f"load_checkpoint: saved with world size {state['world_size']}, resumed with {info.world_size}; "
            "the data order continues, but a step now holds other rows",
            stacklevel=2,
        )
    trainer.sampler.load_state_dict(state["data"])
    _set_rng_state(state["rng"])
    trainer.step = state["step"]
    trainer.skipped_steps = state["skipped_steps"]
    trainer.tokens_seen = state["tokens_seen"]
