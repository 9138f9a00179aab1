"""TrainConfig: one dataclass for a training run, validated in ``__post_init__`` (STYLE.md §6).

A run is described by data (a JSON or TOML file, a preset from train/presets.py, command-line flags);
``TrainConfig.from_dict`` builds it and ``to_dict`` writes it back (checkpoints keep a copy).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuseformer.models.config import ModelConfig

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DISTRIBUTED = ("none", "ddp", "fsdp")
DEFAULT_SUFFIXES = (".txt", ".md", ".py", ".rst")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """A training run of a causal LM on packed text.

    model: a ModelConfig (random init, normal(0, init_std)) or the path of a Hugging Face directory
        to fine-tune (its tokenizer is used unless ``tokenizer`` is given).
    data: text files and folders (searched recursively for ``data_suffixes``).
    tokenizer: directory with tokenizer.json (+ tokenizer_config.json naming the EOS token).
    seq_len: tokens per packed row; a step sees micro_batch_size * grad_accum_steps * world_size rows.
    activation_checkpointing: "off", "all", "every:k" (layers 0, k, 2k, ... recompute in backward),
        or "all-but:k" (every layer but the last k: those keep their activations, which the backward
        needs first and frees before the gradients have grown; k full layers of memory at the end
        of the forward for k layers' recompute saved).
    eval_split: fraction of the documents held out for the eval loss (0: no eval).
    precision: "auto" (bf16 autocast on CUDA, fp32 elsewhere: on a CPU bf16 ran ~10x slower than fp32),
        "bf16", "fp16" (dynamic loss scaling) or "fp32".
    save_every / eval_every / log_every: in optimizer steps; 0 = never. With save_every > 0 a final
        checkpoint is always written, and with eval_every > 0 a final evaluation runs.
    grad_clip: max global grad norm; 0 = no clipping.
    fp8: the decoder layers' linear layers run float8 GEMMs (e4m3, rowwise scales) through torchao's
        float8 training (train/fp8.py); master weights, optimizer, norms, attention and the LM-head
        loss as without it. Needs torchao, and a CUDA GPU of compute capability 8.9+ or a CPU.
    """

    model: ModelConfig | str
    data: tuple[str, ...] = ()
    tokenizer: str | None = None
    data_suffixes: tuple[str, ...] = DEFAULT_SUFFIXES
    data_exclude: tuple[str, ...] = ("site-packages", "dist-packages", "__pycache__")  # folder names skipped
    cache_dir: str | None = None  # tokenized cache; default <out_dir>/data_cache
    seq_len: int = 1024
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    max_steps: int = 1000
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "auto"
    fp8: bool = False
    activation_checkpointing: str = "off"
    eval_every: int = 0
    eval_split: float = 0.0
    eval_batches: int = 8  # micro-batches per rank per evaluation
    save_every: int = 0
    keep_checkpoints: int = 1  # finished checkpoints kept on disk (the newest ones)
    resume: bool = True  # continue from <out_dir>/checkpoints when one is there
    out_dir: str = "runs/train"
    seed: int = 0
    init_std: float = 0.02
    distributed: str = "none"
    log_every: int = 10
    progress: bool = True  # tqdm bar on rank 0
    device: str = "auto"  # "auto": cuda (this rank's GPU) when available, else cpu
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes copied into checkpoints

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig(**self.model) if "architecture" in self.model else ModelConfig.from_hf(self.model)
        if isinstance(self.model, Path):
            self.model = str(self.model)
        if not isinstance(self.model, (ModelConfig, str)):
            raise ValueError(f"TrainConfig: model must be a ModelConfig or a path, got {type(self.model).__name__}")
        if isinstance(self.data, (str, Path)):
            self.data = (str(self.data),)
        self.data = tuple(str(p) for p in self.data)
        if isinstance(self.data_suffixes, str):
            self.data_suffixes = (self.data_suffixes,)
        self.data_suffixes = tuple(self.data_suffixes)
        if isinstance(self.data_exclude, str):
            self.data_exclude = (self.data_exclude,)
        self.data_exclude = tuple(self.data_exclude)
        self.betas = tuple(float(b) for b in self.betas)
        for name in (
            "seq_len",
            "micro_batch_size",
            "grad_accum_steps",
            "max_steps",
            "eval_batches",
            "keep_checkpoints",
        ):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "eval_every", "save_every", "log_every", "seed"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "init_std", "eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"TrainConfig: {name} must be a finite float >= 0, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig: lr must be > 0, got {self.lr!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"TrainConfig: min_lr {self.min_lr} is above lr {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainConfig: betas must be two floats in [0, 1), got {self.betas!r}")
        if not (isinstance(self.eval_split, (int, float)) and 0 <= self.eval_split < 1):
            raise ValueError(f"TrainConfig: eval_split must be a fraction in [0, 1), got {self.eval_split!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig: precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.fp8, bool):
            raise ValueError(f"TrainConfig: fp8 must be true or false, got {self.fp8!r}")
        if self.distributed not in DISTRIBUTED:
            raise ValueError(f"TrainConfig: distributed must be one of {DISTRIBUTED}, got {self.distributed!r}")
        self.checkpoint_plan()  # validates activation_checkpointing
        for suffix in self.data_suffixes:
            if not isinstance(suffix, str) or not suffix.startswith("."):
                raise ValueError(f"TrainConfig: data_suffixes entries must start with '.', got {suffix!r}")

    def checkpoint_plan(self) -> tuple[int, int]:
        """Activation checkpointing as (stride, last layers left out): stride 0 = off, 1 = every layer,
        k = layers 0, k, 2k, ...; "all-but:k" is (1, k), "every:k" (k, 0), "all" (1, 0), "off" (0, 0)."""
        mode = self.activation_checkpointing
        if mode == "off":
            return 0, 0
        if mode == "all":
            return 1, 0
        kind, _, k = mode.partition(":") if isinstance(mode, str) else ("", "", "")
        if k.isdigit():
            if kind == "every" and int(k) >= 1:
                return int(k), 0
            if kind == "all-but":
                return 1, int(k)
        raise ValueError(
            "TrainConfig: activation_checkpointing must be 'off', 'all', 'every:k' (k >= 1) or 'all-but:k' "
            f"(k >= 0), got {mode!r}"
        )

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``from_dict`` of it gives an equal config."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ModelConfig):
                value = {k.name: getattr(value, k.name) for k in dataclasses.fields(value)}
                value["layer_types"] = list(value["layer_types"])
                value["torch_dtype"] = None if value["torch_dtype"] is None else str(value["torch_dtype"])[6:]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a dict (a config file's content); unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"TrainConfig: unknown field(s) {unknown}; known: {sorted(names)}")
        if "model" not in data:
            raise ValueError("TrainConfig: model is required (a model config table or a Hugging Face directory)")
        data = dict(data)
        model = data["model"]
        if isinstance(model, dict) and "torch_dtype" in model and isinstance(model["torch_dtype"], str):
            import torch

            model = {**model, "torch_dtype": getattr(torch, model["torch_dtype"])}
            data["model"] = model
        for key in ("data", "data_suffixes", "data_exclude", "betas"):
            if isinstance(data.get(key), list):
                data[key] = tuple(data[key])
        if isinstance(data.get("model"), dict) and isinstance(data["model"].get("layer_types"), list):
            data["model"] = {**data["model"], "layer_types": tuple(data["model"]["layer_types"])}
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        """Read a .json or .toml file holding the fields (``model`` a table or a directory path)."""
        return cls.from_dict(read_config_file(path))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The dict of a .json or .toml config file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"TrainConfig: config file {path} does not exist")
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError as exc:  # Python 3.10
                raise ValueError("TrainConfig: reading .toml needs Python 3.11 (tomllib); use .json") from exc
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
        else:
            raise ValueError(f"TrainConfig: config file {path} must end in .json or .toml")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"TrainConfig: cannot parse {path}: {exc}") from exc
    except Exception as exc:
        if type(exc).__name__ == "TOMLDecodeError":
            raise ValueError(f"TrainConfig: cannot parse {path}: {exc}") from exc
        raise
    if not isinstance(data, dict):
        raise ValueError(f"TrainConfig: {path} must hold an object/table, got {type(data).__name__}")
    return data


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"TrainConfig: {name} must be an int >= {minimum}, got {value!r}")
