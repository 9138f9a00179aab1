"""Load a model of the registry from a local Hugging Face directory (nothing is downloaded).

The mapping from checkpoint names to our parameters is data (STYLE.md §5): ``PACKED_MODULES`` says
which checkpoint modules are packed, in order, into one of ours (q/k/v -> qkv_proj, gate/up ->
gate_up_proj), ``IGNORED_SUFFIXES`` lists tensors that carry nothing we use. One generic loader reads
it: every checkpoint tensor maps to (parameter, row range), its shape is checked, and every row of
every parameter must be written exactly once.

FP8 (``quantization="fp8"``, or a checkpoint whose config.json has an FP8 ``quantization_config``): the
model is built with the FP8 modules of models/quantization.py (their e4m3 ``weight`` and fp32
``weight_scale`` buffers are targets like parameters, packed the same way), and each tensor is read
by its kind: e4m3 into e4m3 (its scale broadcast over its rows), bf16/fp32 into e4m3 quantized per row
as it is read (a bf16 checkpoint quantized at load, one tensor at a time), e4m3 into a bf16 parameter
dequantized with its scale (a module the checkpoint has only partly in FP8).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from fuseformer.models import quantization as Q
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


def loadable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint fills: the parameters (a tied lm_head.weight once, as the embedding) and
    the persistent buffers (FP8 modules' ``weight`` and ``weight_scale``), by name."""
    out = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def checkpoint_targets(model: torch.nn.Module, config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint name -> (our parameter or buffer name, first row, row count); row count -1 = the whole
    tensor. Packed parameters (and an FP8 module's packed ``weight_scale`` rows) take their parts' rows."""
    rows = shard_rows(config)
    targets = {}
    for name in loadable_tensors(model):
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


def empty_model(
    config: ModelConfig, dtype: torch.dtype, device, convert: Callable[[nn.Module], object] | None = None
) -> nn.Module:
    """Our model for ``config`` (the registry's class for its architecture), built on the meta device
    and cast there, then allocated (not initialized) once, in ``dtype``, on ``device``; tied
    embeddings tied. Its values are garbage until loaded. ``convert`` changes the meta model's modules
    in place before the allocation (the FP8 structure)."""
    with torch.device("meta"):
        model = build_model(config).to(dtype)
        if convert is not None:
            convert(model)
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


class _Header(NamedTuple):
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F8_E4M3", ...


def _read_headers(files: dict[Path, list[str] | None]) -> dict[str, _Header]:
    """Every tensor's file, shape and dtype, from the safetensors headers alone."""
    headers: dict[str, _Header] = {}
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
                sl = f.get_slice(name)
                headers[name] = _Header(file, tuple(sl.get_shape()), sl.get_dtype())
    return headers


def _fp8_plan(
    path: Path, config: ModelConfig, headers: dict[str, _Header], scheme: Q.Fp8Scheme | None, fp8: bool
) -> Callable[[str], bool] | None:
    """Which of our modules are FP8 (None: none): with an FP8 checkpoint, those whose weights it stores all
    in e4m3; with a plain one and ``quantization="fp8"``, all. FP8 tensors need the checkpoint's
    ``quantization_config``; e5m2 weights are refused."""
    fp8_tensors = {n for n, h in headers.items() if h.dtype.startswith("F8_")}
    for name in sorted(fp8_tensors):
        if headers[name].dtype != "F8_E4M3":
            raise ValueError(f"load_model: {path} tensor {name} is {headers[name].dtype}; FP8 weights must be e4m3")
        if scheme is None:
            raise ValueError(
                f"load_model: {path} tensor {name} is FP8 (e4m3) but {path / 'config.json'} has no "
                "quantization_config saying how to read it"
            )
    if not fp8:
        return None
    if scheme is None:
        return lambda name: True
    modules = Q.fp8_modules(config, fp8_tensors, PACKED_MODULES)
    return modules.__contains__


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    strict: bool = True,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model of the HF directory ``path`` and load its safetensors weights.

    Args:
        path: directory with config.json and model.safetensors, or model.safetensors.index.json and
            its shards.
        dtype: float32, float16 or bfloat16; default the checkpoint's (config ``dtype``/``torch_dtype``),
            else float32. With FP8, the dtype of what is not FP8 and of the FP8 layers' outputs.
        device: where the parameters live.
        strict: raise on checkpoint tensors the model has no place for (else ignore them). Missing
            tensors always raise.
        quantization: None or "fp8". "fp8" with a bf16/fp32 checkpoint quantizes it as it loads (the
            weights of models/quantization.py's FP8 layers, per output channel, one tensor at a time).
            An FP8 checkpoint (config.json's ``quantization_config``: "fp8" or "compressed-tensors")
            loads in FP8 with None too: the checkpoint's quantization is used, as vLLM does.

    Returns:
        (model in eval mode, its ModelConfig). With ``tie_word_embeddings`` set and a distinct
        ``lm_head.weight`` in the checkpoint, the model is untied and the config says so (a warning
        tells); a tied checkpoint that holds only ``lm_head.weight`` loads it as the embedding. Each
        attention module has fp32 scalar buffers ``k_scale``/``v_scale``: the checkpoint's KV-cache
        scales, else 1.0.

    Every checkpoint tensor's name and shape are checked from the file headers before the model's
    memory is allocated, so a config.json whose sizes do not match its weights fails at once.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"load_model: {path} is not a directory")
    config = ModelConfig.from_file(path / "config.json")
    scheme = Q.read_scheme(path / "config.json")
    fp8 = Q.wants_fp8(quantization, scheme)
    dtype = dtype if dtype is not None else (config.torch_dtype or torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"load_model: dtype must be one of float32, float16, bfloat16, got {dtype}")
    files = _checkpoint_files(path)

    # Pass 1, headers only: where each tensor goes, its shape checked against the meta model.
    headers = _read_headers(files)
    is_fp8 = _fp8_plan(path, config, headers, scheme, fp8)

    def convert(model: nn.Module) -> None:
        if is_fp8 is not None:
            Q.convert_fp8(model, config, quantize=False, is_fp8=is_fp8)

    with torch.device("meta"):
        meta = build_model(config)
        convert(meta)
    params = loadable_tensors(meta)
    targets = checkpoint_targets(meta, config)
    plan: dict[str, tuple[Path, str]] = {}  # checkpoint name (ours) -> (file, name in the file)
    kv_plan: dict[tuple[str, str], tuple[Path, str]] = {}  # (attention module, k_scale | v_scale) -> tensor
    dequant_scales: dict[str, tuple[Path, str]] = {}  # e4m3 weight kept in dtype -> its scale tensor
    unexpected: list[str] = []
    lm_head: tuple[Path, str] | None = None  # a tied model's lm_head.weight, if the checkpoint has one
    for raw, (file, shape, _) in headers.items():
        if raw.endswith(IGNORED_SUFFIXES):
            continue
        kv = Q.kv_scale_target(raw)
        if kv is not None:
            if len(shape) > 1 or (shape and shape[0] != 1):
                raise ValueError(f"load_model: {file} tensor {raw} has shape {shape}; expected a scalar KV-cache scale")
            for which in kv[1]:
                kv_plan[(kv[0], which)] = (file, raw)
            continue
        name = Q.canonical_name(raw) if scheme is not None else raw
        if name is None:
            continue
        tied_head = config.tie_word_embeddings and name == _LM_HEAD
        if name not in targets and not tied_head:
            if scheme is not None and name.endswith(".weight_scale"):
                dequant_scales[name.removesuffix("_scale")] = (file, raw)
            else:
                unexpected.append(f"{raw} (in {file.name})")
            continue
        param_name, _, n = targets[_EMBED if tied_head else name]
        param = params[param_name]
        rows = param.shape[0] if n < 0 else n
        if param_name.endswith(".weight_scale"):
            Q.check_scale_shape(shape, rows, f"load_model: {file} tensor {raw}")
        else:
            expected = tuple(param.shape) if n < 0 else (n, *param.shape[1:])
            if shape != expected:
                raise ValueError(f"load_model: {file} tensor {raw} has shape {shape}; expected {expected}")
        if tied_head:
            lm_head = (file, raw)
        else:
            plan[name] = (file, raw)
    if config.tie_word_embeddings and _EMBED not in plan and lm_head is not None:
        plan[_EMBED] = lm_head  # only the head is stored: the embedding is the same tensor (transformers)

    # FP8 pairs: an e4m3 weight kept in dtype needs its scale; a weight quantized at load makes its own.
    scales: dict[str, tuple[Path, str]] = {}  # e4m3 weight kept in dtype -> its scale tensor
    made: set[str] = set()  # scales of the weights quantized at load
    for name, (file, raw) in plan.items():
        fp8_tensor, fp8_target = Q.is_fp8_dtype(headers[raw].dtype), Q.is_fp8_dtype(params[targets[name][0]].dtype)
        if fp8_tensor and not fp8_target:
            scale = dequant_scales.pop(name, None)
            if scale is None:
                raise ValueError(
                    f"load_model: {file} tensor {raw} is FP8 (e4m3) but the checkpoint has no scale for it"
                )
            Q.check_scale_shape(headers[scale[1]].shape, headers[raw].shape[0], f"load_model: tensor {scale[1]}")
            scales[name] = scale
        elif fp8_target and not fp8_tensor:
            made.add(name.removesuffix("weight") + "weight_scale")
    unexpected += [f"{raw} (in {file.name})" for file, raw in dequant_scales.values()]
    given = sorted(made & set(plan))
    if given:
        raise ValueError(f"load_model: {path} has scales {given[:5]} for weights that are not FP8")
    plan_or_made = set(plan) | made
    missing = sorted(set(targets) - plan_or_made)
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
    model = empty_model(config, dtype, device, convert)
    params = loadable_tensors(model)
    targets = checkpoint_targets(model, config)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for target, (file, name) in plan.items():
        by_file.setdefault(file, []).append((target, name))
    with torch.no_grad():
        for file, entries in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for target, name in entries:
                    _copy(f, target, name, targets, params, scales, dtype, device)
        Q.attach_kv_scales(model)
        for (attn, which), (file, name) in kv_plan.items():
            model.get_buffer(f"{attn}.{which}").fill_(_read_tensor(file, name).float().reshape(()))
    return model.eval(), config


def _copy(f, target: str, name: str, targets, params, scales, dtype: torch.dtype, device) -> None:
    """Copy the checkpoint tensor ``name`` (open file ``f``) into the rows of our tensor for ``target``, by
    its kind (the module doc); ``scales``: the scale tensors of e4m3 weights kept in ``dtype``."""
    param_name, start, n = targets[target]
    param = params[param_name]
    dest = param.data if n < 0 else param.data[start : start + n]
    tensor = f.get_tensor(name)
    if param_name.endswith(".weight_scale"):
        dest.copy_(Q.scale_rows(tensor, dest.shape[0], f"load_model: tensor {name}"))
    elif Q.is_fp8_dtype(dest.dtype):
        if Q.is_fp8_dtype(tensor.dtype):
            dest.copy_(tensor)
        else:  # a bf16/fp32 weight quantized per row as it loads; its scale rows with it
            q, s = Q.quantize_rows(tensor, device, dtype)
            dest.copy_(q)
            scale = params[param_name + "_scale"].data
            (scale if n < 0 else scale[start : start + n]).copy_(s)
    elif Q.is_fp8_dtype(tensor.dtype):
        file, scale_name = scales[target]
        dest.copy_(Q.dequantize_rows(tensor, _read_tensor(file, scale_name), dtype, f"load_model: tensor {scale_name}"))
    else:
        dest.copy_(tensor)
