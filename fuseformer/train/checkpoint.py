"""Checkpoints: a Hugging Face model directory plus the trainer's state, written atomically.

The functions here take plain state (state dicts, a ModelConfig, a :class:`RunState`), not a
Trainer: ``Trainer.save_checkpoint`` / ``Trainer.load_checkpoint`` gather and restore it.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from fuseformer.models.config import ModelConfig
from fuseformer.models.loader import PACKED_MODULES, load_model, shard_rows
from fuseformer.train import distributed as D

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_STATE = "trainer_state.pt"
_LATEST = "latest"


# --------------------------------------------------------------------------------------------
# The model as a Hugging Face directory
# --------------------------------------------------------------------------------------------
def hf_config(config: ModelConfig, dtype: torch.dtype = torch.float32, **extra: Any) -> dict[str, Any]:
    """config.json for ``config`` (``ModelConfig.to_hf``, by the registry's writer of its architecture),
    weights in ``dtype``; ``ModelConfig.from_hf`` of it gives ``config`` back."""
    return config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")} | extra


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


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the Python, NumPy, torch and CUDA generators from a checkpoint's ``rng``."""
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


@dataclass(kw_only=True, slots=True)
class RunState:
    """What a checkpoint keeps of a run besides the weights, as plain values and state dicts: the
    trainer gathers it (``Trainer.save_checkpoint``) and restores it (``Trainer.load_checkpoint``)."""

    step: int
    skipped_steps: int
    tokens_seen: int
    optimizer: dict[str, Any]  # the whole (unsharded) optimizer state
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None  # fp16's GradScaler, else None
    data: dict[str, Any]  # the sampler's position


def save_checkpoint(
    out_dir: str | Path,
    model_state: dict[str, torch.Tensor],
    model_config: ModelConfig,
    run: RunState,
    *,
    dist: D.DistInfo,
    train_config: dict[str, Any],
    keep_checkpoints: int,
    tokenizer_dir: str | Path | None = None,
) -> Path | None:
    """Write ``<out_dir>/checkpoints/step_<run.step>``: the model (``model_state``, our parameter
    names, of ``model_config``) as a Hugging Face directory, ``run`` and the RNG states in
    trainer_state.pt, ``train_config`` as train_config.json; then point ``latest`` at it and keep
    the newest ``keep_checkpoints``. Every rank calls it (rank 0 writes; a barrier after). Returns
    its path on rank 0, else None."""
    path = None
    if dist.is_main:
        root = checkpoint_root(out_dir)
        name = f"step_{run.step:07d}"
        tmp = root / f".tmp_{name}"
        for stale in root.glob(".tmp_step_*"):  # left by a run killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        save_model(model_state, model_config, tmp, dtype=torch.float32, tokenizer_dir=tokenizer_dir)
        state = {
            "step": run.step,
            "skipped_steps": run.skipped_steps,
            "tokens_seen": run.tokens_seen,
            "optimizer": run.optimizer,
            "scheduler": run.scheduler,
            "scaler": run.scaler,
            "data": run.data,
            "rng": _rng_state(),
            "world_size": dist.world_size,
        }
        torch.save(state, tmp / _STATE)
        (tmp / "train_config.json").write_text(json.dumps(train_config, indent=2, default=str))
        path = root / name
        if path.exists():  # the same step written by an earlier, resumed run
            shutil.rmtree(path)
        os.replace(tmp, path)
        pointer_tmp = root / f".{_LATEST}.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, root / _LATEST)
        done = sorted(p for p in root.glob("step_*") if p != path)
        for old in done[: max(0, len(done) - (keep_checkpoints - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier(dist)
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


@dataclass(kw_only=True, slots=True)
class LoadedCheckpoint:
    """A checkpoint as read from disk (:func:`read_checkpoint`), nothing restored yet."""

    model_state: dict[str, torch.Tensor]  # our parameter names, fp32 on the CPU
    run: RunState
    rng: dict[str, Any]  # for :func:`set_rng_state`
    world_size: int  # of the run that wrote it


def read_checkpoint(path: str | Path, model_config: ModelConfig) -> LoadedCheckpoint:
    """Read every file of the checkpoint at ``path`` and check that its model is ``model_config``'s
    shape (ValueError naming the differing fields otherwise). A checkpoint whose files cannot be read
    raises CheckpointReadError, before the caller has restored anything."""
    path = Path(path)
    if not (path / _STATE).is_file():
        raise ValueError(f"load_checkpoint: {path} is not a trainer checkpoint (no {_STATE})")
    config, lm_state, state = _read_checkpoint(path)
    check_same_shape(config, model_config, str(path))
    run = RunState(
        step=state["step"],
        skipped_steps=state["skipped_steps"],
        tokens_seen=state["tokens_seen"],
        optimizer=state["optimizer"],
        scheduler=state["scheduler"],
        scaler=state["scaler"],
        data=state["data"],
    )
    return LoadedCheckpoint(model_state=lm_state, run=run, rng=state["rng"], world_size=state["world_size"])


def resume_latest(out_dir: str | Path, restore: Callable[[Path], None], *, warn: bool = True) -> Path | None:
    """Restore (``restore(path)``, which reads with :func:`read_checkpoint`) from the newest checkpoint
    of the run in ``out_dir`` that reads; returns its path, or None when the run has none. A newest
    checkpoint that is unreadable (a truncated trainer_state.pt) is passed over, with a warning when
    ``warn``, for the next older one; when none reads, the newest one's error is raised (starting
    again from step 0 would overwrite the run)."""
    root = checkpoint_root(out_dir)
    latest = latest_checkpoint(out_dir)
    if latest is None:
        return None
    older = sorted((p for p in root.glob("step_*") if (p / _STATE).is_file() and p != latest), reverse=True)
    first_error: CheckpointReadError | None = None
    for path in [latest, *older]:
        try:
            restore(path)
        except CheckpointReadError as exc:
            first_error = first_error or exc
            if warn:
                warnings.warn(f"resume: {exc}; trying an older checkpoint", stacklevel=2)
            continue
        if first_error is not None and warn:
            warnings.warn(f"resume: resumed from the older {path}, not {latest}", stacklevel=2)
        return path
    raise first_error
