"""FP8 inference, applied to a model from outside (STYLE.md §4): the model files stay plain.

What becomes FP8 (weights e4m3 with a scale per output channel, activations quantized per token as they
go, :mod:`fuseformer.layers.fp8`), in every decoder layer:

- ``self_attn.qkv_proj`` and ``self_attn.o_proj`` (:class:`Fp8Linear`);
- ``mlp`` (:class:`Fp8GatedMLP`: gate-up GEMM with act * mul and the quantization in its epilogue, then
  the down GEMM);
- the norms whose output feeds those linears directly (:class:`Fp8RMSNorm`: the norm and the
  quantization in one kernel), ``FP8_NORMS`` per architecture: a Llama-family layer's input and
  post-attention norms; Gemma2's input and pre-feedforward norms (its post-attention and
  post-feedforward norms feed residual adds, not linears, and stay).

What stays in the model's dtype: the embeddings, the final norm, the LM head, q/k norms (Qwen3), the
rotary tables, attention itself and the residual stream.

FP8 checkpoints (what vLLM reads), from ``quantization_config`` in config.json (``checkpoint_scheme``):

- ``quant_method: "fp8"`` (Hugging Face / vLLM): e4m3 weights with a per-tensor ``weight_scale`` (or
  ``weight_scale_inv``: in these formats both multiply, ``w = q * scale``); ``activation_scheme``
  ``"dynamic"``. ``"static"`` (calibrated per-tensor input scales) is refused: re-export it dynamic.
  ``weight_block_size`` (DeepSeek's 128x128 blocks) is refused, naming the field.
- ``quant_method: "compressed-tensors"`` (llm-compressor): ``config_groups`` whose ``weights`` are
  ``{num_bits: 8, type: float, strategy: tensor | channel}`` and ``input_activations`` dynamic (or
  null: weight-only checkpoints run with dynamic per-token activations here too); ``weight_scale``
  (1,) or (N, 1). Static input activations, group or block weight strategies, integers and
  sparsity are refused, naming the field.

Which of our modules are FP8 is read from the tensors themselves (their dtype in the headers): a
packed module (q/k/v, gate/up/down) is FP8 when all its parts are e4m3; a module the checkpoint
leaves in bf16 (its ``ignore`` / ``ignored_layers``) stays bf16, and FP8 parts of a module that is
not all FP8 are dequantized at load. Per-tensor scales become per-channel ones by broadcasting each
part's scale over its rows of the packed weight: q, k and v of different scales stay exact (no
requantization to a shared max scale, as vLLM does).

KV-cache scales, when the checkpoint has them (``self_attn.k_scale``/``v_scale``, the older
``self_attn.kv_scale``, compressed-tensors' ``k_proj.output_scale``/``v_proj.output_scale``), go to
each attention module's fp32 scalar buffers ``k_scale``, ``v_scale`` (1.0 when absent; not in the state
dict), for an FP8 KV cache.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fuseformer.ops as F
from fuseformer.layers.fp8 import FP8_DTYPE, Fp8GatedMLP, Fp8Linear, Fp8RMSNorm
from fuseformer.models.config import ModelConfig

QUANTIZATIONS = (None, "fp8")  # LLM(quantization=...)'s values
CHECKPOINT_FORMATS = ("fp8", "compressed-tensors")  # quantization_config.quant_method values read

# Per architecture: each norm made an Fp8RMSNorm -> the module it feeds (the norm is converted only when
# that module is FP8). An architecture missing here cannot be quantized (a new one says how here).
_LLAMA_NORMS = {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp"}
FP8_NORMS: dict[str, dict[str, str]] = {
    "LlamaForCausalLM": _LLAMA_NORMS,
    "MistralForCausalLM": _LLAMA_NORMS,
    "Qwen2ForCausalLM": _LLAMA_NORMS,
    "Qwen3ForCausalLM": _LLAMA_NORMS,
    "GemmaForCausalLM": _LLAMA_NORMS,
    # post_attention_layernorm and post_feedforward_layernorm normalize a sublayer's output before the
    # residual add: their outputs feed no linear.
    "Gemma2ForCausalLM": {"input_layernorm": "self_attn.qkv_proj", "pre_feedforward_layernorm": "mlp"},
}
FP8_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj")  # in each decoder layer
FP8_MLP = "mlp"

# Checkpoint tensor names of FP8 formats -> ours (suffix rewrites), and those that carry nothing used.
_RENAMES = ((".weight_scale_inv", ".weight_scale"),)
_FP8_IGNORED = (".input_scale", ".q_scale", ".prob_scale")
# KV-cache scale names -> which of the attention's scales they give.
_KV_SCALES = {
    "self_attn.k_scale": ("k_scale",),
    "self_attn.v_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
    "self_attn.k_proj.output_scale": ("k_scale",),
    "self_attn.v_proj.output_scale": ("v_scale",),
}
_KV_SCALE = re.compile(r"^(model\.layers\.\d+\.)(" + "|".join(re.escape(k) for k in _KV_SCALES) + r")$")


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """An FP8 checkpoint's ``quantization_config``, checked: ``method`` is its ``quant_method``
    ("fp8" or "compressed-tensors"); ``weight_only`` when it quantizes no activations (run here with
    dynamic per-token activations all the same)."""

    method: str
    weight_only: bool = False


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what}")


def checkpoint_scheme(hf: dict[str, Any], where: str = "config.json") -> Fp8Scheme | None:
    """The FP8 scheme of a config.json dict's ``quantization_config`` (None when it has none).

    ValueError naming the field for what is not read: an unknown ``quant_method``, static activation
    scales, block-wise weight scales (``weight_block_size``, compressed-tensors' ``block`` strategy),
    integer or non-8-bit weights, sparsity."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _refuse(where, f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_scheme(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    raise _refuse(
        where,
        f"quantization_config.quant_method {method!r} is not supported; the FP8 checkpoints read are "
        f"quant_method {' and '.join(map(repr, CHECKPOINT_FORMATS))}",
    )


def _fp8_scheme(qc: dict[str, Any], where: str) -> Fp8Scheme:
    if qc.get("weight_block_size") is not None:
        raise _refuse(
            where,
            f"quantization_config.weight_block_size {qc['weight_block_size']!r}: block-wise FP8 weight scales "
            "(DeepSeek's 128x128) are not supported; only per-tensor or per-channel scales",
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme == "static":
        raise _refuse(
            where,
            'quantization_config.activation_scheme "static" (calibrated per-tensor input scales) is not '
            'supported; FP8 here quantizes activations per token at run time ("dynamic"): use a dynamic '
            "checkpoint, or the bf16 one with quantization='fp8'",
        )
    if scheme != "dynamic":
        raise _refuse(where, f"quantization_config.activation_scheme must be 'dynamic', got {scheme!r}")
    return Fp8Scheme("fp8")


def _compressed_tensors_scheme(qc: dict[str, Any], where: str) -> Fp8Scheme:
    if qc.get("sparsity_config"):
        raise _refuse(
            where, "quantization_config.sparsity_config: sparse compressed-tensors checkpoints are not supported"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, "quantization_config.config_groups must be a non-empty object (compressed-tensors)")
    weight_only = []
    for name, group in groups.items():
        at = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise _refuse(where, f"{at} must be an object")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise _refuse(where, f"{at}.weights must be an object (only weight-quantized checkpoints are read)")
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise _refuse(
                where,
                f"{at}.weights is {w.get('num_bits')}-bit {w.get('type')}: only FP8 (num_bits 8, type float) is "
                "supported",
            )
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel"):
            raise _refuse(
                where,
                f"{at}.weights.strategy {strategy!r} is not supported (block_structure "
                f"{w.get('block_structure')!r}): only 'tensor' and 'channel' weight scales",
            )
        if w.get("dynamic"):
            raise _refuse(where, f"{at}.weights.dynamic true is not supported: the weights must be stored quantized")
        act = group.get("input_activations")
        weight_only.append(act is None)
        if act is None:
            continue
        if not isinstance(act, dict):
            raise _refuse(where, f"{at}.input_activations must be an object or null")
        if act.get("num_bits") != 8 or act.get("type") != "float":
            raise _refuse(where, f"{at}.input_activations must be FP8 (num_bits 8, type float)")
        if not act.get("dynamic"):
            raise _refuse(
                where,
                f"{at}.input_activations.dynamic false (static, calibrated input scales) is not supported; "
                "FP8 here quantizes activations per token at run time: use a dynamic checkpoint",
            )
    return Fp8Scheme("compressed-tensors", weight_only=all(weight_only))


def read_scheme(config_path: Path) -> Fp8Scheme | None:
    """``checkpoint_scheme`` of the config.json at ``config_path`` (errors name the file)."""
    return checkpoint_scheme(json.loads(config_path.read_text()), str(config_path))


def wants_fp8(quantization: str | None, scheme: Fp8Scheme | None, who: str = "load_model") -> bool:
    """Whether the model runs in FP8: ``quantization="fp8"``, or None with an FP8 checkpoint (its
    quantization is used, as vLLM does). ValueError for other values."""
    if quantization not in QUANTIZATIONS:
        accepted = ", ".join(map(repr, QUANTIZATIONS))
        raise ValueError(f"{who}: quantization must be one of {accepted}, got {quantization!r}")
    return quantization == "fp8" or scheme is not None


# --------------------------------------------------------------------------------------------------
# Converting a model's modules
# --------------------------------------------------------------------------------------------------
def _plan(config: ModelConfig) -> dict[str, str]:
    plan = FP8_NORMS.get(config.architecture)
    if plan is None:
        raise ValueError(f"quantize_model_fp8: no FP8 plan for architecture {config.architecture!r} (FP8_NORMS)")
    return plan


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    setattr(_get(root, ".".join(parents)) if parents else root, last, module)


def _empty_linear(linear: nn.Linear) -> Fp8Linear:
    w = linear.weight
    return Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, dtype=w.dtype, device=w.device)


def _empty_mlp(mlp: nn.Module) -> Fp8GatedMLP:
    w = mlp.down_proj.weight
    act = getattr(mlp, "act", None) or getattr(mlp, "activation", None) or "silu"
    return Fp8GatedMLP(mlp.down_proj.out_features, mlp.down_proj.in_features, act, dtype=w.dtype, device=w.device)


def convert_fp8(
    model: nn.Module, config: ModelConfig, *, quantize: bool = True, is_fp8: Callable[[str], bool] | None = None
) -> nn.Module:
    """Replace, in place, the modules of ``model`` that FP8 covers (the module doc) by their FP8 forms.

    quantize: True, quantize the loaded weights (``quantize_weight_fp8``, on their device); False, make
        empty FP8 modules of the same shapes, dtype and device (the loader fills them: on the meta
        device it builds the structure to load into).
    is_fp8: our module name ("model.layers.3.mlp") -> whether it becomes FP8; default all. A norm is
        converted when the module it feeds is.
    """
    plan = _plan(config)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for name in (*FP8_LINEARS, FP8_MLP):
            if is_fp8 is not None and not is_fp8(prefix + name):
                continue
            old = _get(layer, name)
            if name == FP8_MLP:
                new = Fp8GatedMLP.from_mlp(old) if quantize else _empty_mlp(old)
            else:
                new = Fp8Linear.from_linear(old) if quantize else _empty_linear(old)
            _set(layer, name, new)
        for norm, feeds in plan.items():
            fp8_norm = isinstance(_get(layer, norm), Fp8RMSNorm)
            if not fp8_norm and isinstance(_get(layer, feeds), (Fp8Linear, Fp8GatedMLP)):
                _set(layer, norm, Fp8RMSNorm.from_norm(_get(layer, norm)))
    attach_kv_scales(model)
    return model


def quantize_model_fp8(model: nn.Module, config: ModelConfig) -> nn.Module:
    """Convert a loaded model of the registry to FP8 in place (and return it): every decoder layer's
    qkv_proj, o_proj and MLP quantized per output channel, the norms that feed them fused with the
    activations' quantization (``FP8_NORMS``); the embeddings, the final norm and the LM head stay in
    the model's dtype. Attaches ``k_scale``/``v_scale`` (1.0) to each attention module that lacks them.
    Idempotent: modules already FP8 stay as they are."""
    with torch.no_grad():
        return convert_fp8(model, config, quantize=True, is_fp8=lambda name: not _is_fp8_module(model, name))


def _is_fp8_module(model: nn.Module, name: str) -> bool:
    return isinstance(_get(model, name), (Fp8Linear, Fp8GatedMLP))


def is_fp8_model(model: nn.Module) -> bool:
    """Whether any module of ``model`` is an FP8 linear or MLP."""
    return any(isinstance(m, (Fp8Linear, Fp8GatedMLP)) for m in model.modules())


def attach_kv_scales(model: nn.Module) -> nn.Module:
    """Give each decoder layer's attention fp32 scalar buffers ``k_scale`` and ``v_scale`` (1.0) where it
    has none (non-persistent: the state dict does not change); the loader fills them from a checkpoint's
    KV-cache scales. ``k = k_fp8 * k_scale`` in an FP8 KV cache, as vLLM's."""
    for layer in model.model.layers:
        attn = layer.self_attn
        device = next(attn.parameters(), torch.empty(0)).device
        for name in ("k_scale", "v_scale"):
            if getattr(attn, name, None) is None:
                attn.register_buffer(name, torch.ones((), dtype=torch.float32, device=device), persistent=False)
    return model


# --------------------------------------------------------------------------------------------------
# Loading: what the loader asks of an FP8 checkpoint's tensors
# --------------------------------------------------------------------------------------------------
def canonical_name(name: str) -> str | None:
    """An FP8 checkpoint's tensor name in our naming (``weight_scale_inv`` -> ``weight_scale``), or None
    for a tensor that carries nothing used here (input, query and probability scales)."""
    if name.endswith(_FP8_IGNORED):
        return None
    for old, new in _RENAMES:
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(our attention module's name, the scales it gives) for a KV-cache scale tensor's name, else None."""
    match = _KV_SCALE.match(name)
    if match is None:
        return None
    return match.group(1) + "self_attn", _KV_SCALES[match.group(2)]


def fp8_modules(config: ModelConfig, fp8_tensors: set[str], packed: dict[str, tuple[str, ...]]) -> set[str]:
    """Our modules ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp") whose checkpoint weights
    are all e4m3 (``fp8_tensors``: the checkpoint's weight names stored so). ``packed``: the loader's
    PACKED_MODULES."""
    out = set()
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for name in FP8_LINEARS:
            module, _, leaf = name.rpartition(".")
            parts = packed.get(leaf, (leaf,))
            if all(f"{prefix}{module}.{p}.weight" in fp8_tensors for p in parts):
                out.add(prefix + name)
        mlp = [f"{prefix}{FP8_MLP}.{p}.weight" for p in (*packed["gate_up_proj"], "down_proj")]
        if all(n in fp8_tensors for n in mlp):
            out.add(prefix + FP8_MLP)
    return out


def scale_rows(scale: torch.Tensor, rows: int, where: str) -> torch.Tensor:
    """A checkpoint weight scale as ``rows`` per-row fp32 scales: a per-tensor scale ((), (1,)) broadcast,
    a per-channel one ((rows,), (rows, 1)) as it is. ValueError for other shapes (block-wise scales)."""
    shape = tuple(scale.shape)
    if shape in ((), (1,), (1, 1)):
        return scale.reshape(1).float().expand(rows)
    if shape in ((rows,), (rows, 1)):
        return scale.reshape(rows).float()
    raise ValueError(
        f"{where} has shape {shape}; expected a per-tensor scale () or (1,), or per-channel ({rows},) or "
        f"({rows}, 1) (block-wise scales are not supported)"
    )


def check_scale_shape(shape: tuple[int, ...], rows: int, where: str) -> None:
    """``scale_rows``'s shape check, on a header's shape."""
    if shape not in ((), (1,), (1, 1), (rows,), (rows, 1)):
        scale_rows(torch.empty(shape, device="meta"), rows, where)


def quantize_rows(
    weight: torch.Tensor, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's bf16/fp32 weight rows (n, K) quantized per row on ``device`` after a cast to the
    model's ``dtype`` (what quantizing the loaded model gives): (q (n, K) e4m3, scale (n,) fp32)."""
    return F.quantize_weight_fp8(weight.to(device=device, dtype=dtype))


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """e4m3 weight rows (n, K) times their checkpoint scale, in fp32, then in ``dtype``."""
    return F.dequantize_fp8(q, scale_rows(scale, q.shape[0], where)[:, None], dtype=torch.float32).to(dtype)


def is_fp8_dtype(dtype: str | torch.dtype) -> bool:
    """A safetensors header dtype ("F8_E4M3") or torch dtype that is e4m3."""
    return dtype in ("F8_E4M3", FP8_DTYPE)
