"""ModelConfig: the fields of a Hugging Face ``config.json`` that our decoder models use.

One dataclass for every architecture of models/registry.py. ``from_hf`` reads the fields all of them
share, then the architecture's own through its parser (``llama_fields``, ``gemma_fields`` below, named
by the registry). It reads both the transformers 5.x format (``rope_parameters`` holding
``rope_theta``, ``layer_types``, ``dtype``) and the older one (top-level ``rope_theta``,
``rope_scaling``, ``torch_dtype``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fuseformer.layers.mlp import HF_ACTIVATIONS

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# Keys each rope type needs beyond rope_type itself.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Sizes above this are refused: every tensor index the kernels compute from them fits int32, and no
# real checkpoint comes near (Llama-3-405B: hidden 16384, vocab 128256, intermediate 53248).
_MAX_SIZE = 2**31 - 1
# config.json fields and their JSON type, checked before use as transformers' strict config
# dataclasses check them: a string "false" for a bool would be truthy, a string for a number
# would fail later in arithmetic. None (null) counts as absent.
_HF_TYPES = {
    "vocab_size": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "max_position_embeddings": int,
    "sliding_window": int,
    "max_window_layers": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "tie_word_embeddings": bool,
    "attention_bias": bool,
    "mlp_bias": bool,
    "use_sliding_window": bool,
    "use_bidirectional_attention": bool,
    "query_pre_attn_scalar": float,
    "attn_logit_softcapping": float,
    "final_logit_softcapping": float,
    "hidden_act": str,
    "hidden_activation": str,
    "rope_scaling": dict,
    "rope_parameters": dict,
    "layer_types": list,
}
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
_TYPE_NAMES[list] = "a list"
# The MLP's gate activations the kernels have: SwiGLU's silu, GeGLU's gelu (tanh or erf).
HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu")


def _is_type(value: Any, kind: type) -> bool:
    """``value`` has JSON type ``kind`` (bool is not an int here; an int is a float)."""
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_hf_types(hf: dict[str, Any]) -> None:
    for key, kind in _HF_TYPES.items():
        value = hf.get(key)
        if value is not None and not _is_type(value, kind):
            raise ValueError(f"ModelConfig: {key} must be {_TYPE_NAMES[kind]}, got {value!r}")


def _present(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` without its null values: null counts as absent, as for transformers' defaults."""
    return {k: v for k, v in hf.items() if v is not None}


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A decoder of one of the registry's architectures: Llama (1-3), Mistral, Qwen2, Qwen3, Gemma, Gemma2.

    ``rope_scaling`` is None for plain RoPE or a dict with ``rope_type`` in ROPE_TYPES and its keys
    (HF format). ``layer_types`` has one "full_attention" or "sliding_attention" per layer; the latter
    attend to the last ``sliding_window`` positions only. ``hidden_act`` is the kernel's name of the
    MLP's gate activation (HIDDEN_ACTS), not HF's.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: always)
    o_proj_bias: bool = False  # bias on o_proj (Llama/Qwen3 attention_bias covers it; Qwen2 has none)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)
    hidden_act: str = "silu"  # silu: SwiGLU MLP; gelu_tanh (Gemma) or gelu: GeGLU
    query_pre_attn_scalar: float | None = None  # softmax scale query_pre_attn_scalar**-0.5 (Gemma2); None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before softmax (Gemma2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma2)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default=())
    torch_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        # Here, not at the top: the registry imports the model files, which import this one.
        from fuseformer.models.registry import check_architecture

        check_architecture(self.architecture)
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig: {name} must be a positive int, got {value!r}")
            if value > _MAX_SIZE:
                raise ValueError(f"ModelConfig: {name} {value} is above the supported {_MAX_SIZE} (2**31 - 1)")
        for name in ("tie_word_embeddings", "attention_bias", "o_proj_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig: {name} must be a bool, got {getattr(self, name)!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"ModelConfig: head_dim is not given and hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not _is_type(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2 or self.head_dim > _MAX_SIZE:
            raise ValueError(f"ModelConfig: head_dim must be a positive even int (rotary pairs), got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not (_is_type(self.rms_norm_eps, float) and 0 <= self.rms_norm_eps < math.inf):
            raise ValueError(f"ModelConfig: rms_norm_eps must be a non-negative float, got {self.rms_norm_eps!r}")
        if not (_is_type(self.rope_theta, float) and self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"ModelConfig: rope_theta must be a positive float, got {self.rope_theta!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig: hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (_is_type(value, float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"ModelConfig: {name} must be a positive number or None, got {value!r}")
        self._check_rope_scaling()
        if self.sliding_window is not None and (not _is_type(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig: sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = (kind,) * self.num_hidden_layers
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"ModelConfig: layer_types has {len(self.layer_types)} entries; expected num_hidden_layers "
                f"{self.num_hidden_layers}"
            )
        for kind in self.layer_types:
            if kind not in ("full_attention", "sliding_attention"):
                raise ValueError(f"ModelConfig: layer_types entry {kind!r} is not full_attention or sliding_attention")
            if kind == "sliding_attention" and self.sliding_window is None:
                raise ValueError("ModelConfig: layer_types has sliding_attention but sliding_window is None")
        if self.torch_dtype is not None and self.torch_dtype not in _DTYPES.values():
            raise ValueError(f"ModelConfig: torch_dtype must be float32, float16 or bfloat16, got {self.torch_dtype}")

    def _check_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        if not isinstance(rs, dict):
            raise ValueError(f"ModelConfig: rope_scaling must be a dict or None, got {type(rs).__name__}")
        rope_type = rs.get("rope_type", rs.get("type"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"ModelConfig: rope_scaling rope_type {rope_type!r} is not supported; expected one of {ROPE_TYPES}"
            )
        missing = [k for k in _ROPE_KEYS[rope_type] if rs.get(k) is None]
        if missing:
            raise ValueError(f"ModelConfig: rope_scaling of type {rope_type!r} lacks {', '.join(missing)}")
        for key in _ROPE_KEYS[rope_type]:
            # factor 0 or below divides by zero or flips the frequencies; transformers warns under 1.
            value = rs[key]
            if not (_is_type(value, float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"ModelConfig: rope_scaling {key} must be a positive number, got {value!r}")
        if rope_type == "llama3" and rs["high_freq_factor"] <= rs["low_freq_factor"]:
            raise ValueError(
                f"ModelConfig: rope_scaling high_freq_factor {rs['high_freq_factor']!r} must be above "
                f"low_freq_factor {rs['low_freq_factor']!r}"
            )
        partial = rs.get("partial_rotary_factor", 1.0)
        if not _is_type(partial, float):
            raise ValueError(f"ModelConfig: rope_scaling partial_rotary_factor must be a number, got {partial!r}")
        if partial != 1.0:
            raise ValueError("ModelConfig: rope_scaling partial_rotary_factor != 1 is not supported")
        self.rope_scaling = {**rs, "rope_type": rope_type}
        self.rope_scaling.pop("type", None)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) cache: (num_blocks, block_size, num_key_value_heads, head_dim)."""
        return (num_blocks, block_size, self.num_key_value_heads, self.head_dim)

    def kv_cache_block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one KV block takes over all layers, K and V, in the caches' ``dtype`` (the model's, or
        torch.float8_e4m3fn for an FP8 KV cache: 1 byte an element, half a bf16 block): what the block
        pool divides memory by."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * block_size * self.num_key_value_heads * self.head_dim * item

    def window(self, layer: int) -> int:
        """The attention window of ``layer``: -1 for full attention, else sliding_window."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else -1

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face config.json: the fields every architecture shares
        here, then the architecture's own by its parser in the registry (which may override these)."""
        from fuseformer.models.registry import config_parser  # see __post_init__

        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"ModelConfig: config.json must name one architecture, got architectures={archs!r}")
        arch = archs[0]
        parse = config_parser(arch)  # a ValueError naming arch and the supported ones
        _check_hf_types(hf)
        raw, hf = hf, _present(hf)
        if hf.get("mlp_bias", False):
            raise ValueError("ModelConfig: mlp_bias=true is not supported")
        if hf.get("use_bidirectional_attention", False):
            raise ValueError("ModelConfig: use_bidirectional_attention=true is not supported (causal decoders only)")

        # RoPE: 5.x keeps theta and the scaling in rope_parameters; older configs use rope_theta and
        # rope_scaling. rope_type "default" means no scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        dtype_name = hf.get("dtype", hf.get("torch_dtype"))
        if dtype_name is not None and dtype_name not in _DTYPES:
            raise ValueError(f"ModelConfig: dtype {dtype_name!r} is not one of {tuple(_DTYPES)}")
        bias = bool(hf.get("attention_bias", False))
        shared = dict(
            architecture=arch,
            vocab_size=hf.get("vocab_size"),
            hidden_size=hf.get("hidden_size"),
            intermediate_size=hf.get("intermediate_size"),
            num_hidden_layers=hf.get("num_hidden_layers"),
            num_attention_heads=hf.get("num_attention_heads"),
            num_key_value_heads=hf.get("num_key_value_heads") or hf.get("num_attention_heads"),
            head_dim=hf.get("head_dim"),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings") or False,
            attention_bias=bias,
            o_proj_bias=bias,
            torch_dtype=_DTYPES[dtype_name] if dtype_name is not None else None,
        )
        return cls(**shared | parse(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a config.json (or the directory holding one); errors name the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"ModelConfig: {path} does not exist")
        try:
            hf = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"ModelConfig: {path} is not valid JSON: {exc}") from exc
        if not isinstance(hf, dict):
            raise ValueError(f"ModelConfig: {path} must hold a JSON object, got {type(hf).__name__}")
        try:
            return cls.from_hf(hf)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict of this config (``from_hf`` of it gives it back): the shared fields,
        then the architecture's own by its writer in the registry, and its HF ``model_type``."""
        from fuseformer.models.registry import config_writer, hf_model_type  # see __post_init__

        shared = {
            "architectures": [self.architecture],
            "model_type": hf_model_type(self.architecture),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
        }
        if self.torch_dtype is not None:
            shared["torch_dtype"] = str(self.torch_dtype).removeprefix("torch.")
        return shared | config_writer(self.architecture)(self)


# --------------------------------------------------------------------------------------------
# Parsers of each architecture's own fields (the registry names one per architecture). Each takes
# the config.json dict, types checked, nulls kept (where null differs from absent, the parser says),
# and returns ModelConfig fields, overriding the shared ones from_hf read.
# --------------------------------------------------------------------------------------------
def llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama, Mistral, Qwen2, Qwen3: a SwiGLU MLP; their bias, q/k norm and sliding-window rules."""
    arch, hf = hf["architectures"][0], _present(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"ModelConfig: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    # Sliding windows: Mistral uses sliding_window in every layer when it is set; Qwen2/Qwen3 only
    # with use_sliding_window, in the layers HF's layer_types (or max_window_layers) marks.
    window = hf.get("sliding_window")
    layer_types: tuple[str, ...] = ()
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = window if hf.get("use_sliding_window", False) else None
        if window is not None:
            n, first = hf["num_hidden_layers"], hf.get("max_window_layers", hf["num_hidden_layers"])
            default = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
            layer_types = tuple(hf.get("layer_types") or default)
    elif arch == "LlamaForCausalLM":
        window = None
    fields: dict[str, Any] = dict(sliding_window=window, layer_types=layer_types, qk_norm=arch == "Qwen3ForCausalLM")
    if arch == "Qwen2ForCausalLM":  # bias on q/k/v always, never on o_proj
        fields |= dict(attention_bias=True, o_proj_bias=False)
    return fields


def gemma_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma and Gemma2 (transformers 5.25's GemmaConfig, Gemma2Config and their modeling files).

    Both: a GeGLU MLP (Gemma ``hidden_act``, whose legacy "gelu" transformers reads as the tanh form;
    Gemma2 ``hidden_activation``), HF's defaults where a field is absent (head_dim 256, tied
    embeddings, 8192 positions). Gemma2: softmax scale ``query_pre_attn_scalar**-0.5`` (default 256),
    attention and final logit soft-capping (defaults 50 and 30; null turns one off), a sliding window
    (default 4096) in the layers ``layer_types`` marks, by default the even ones (0, 2, ...).
    """
    arch, raw, hf = hf["architectures"][0], hf, _present(hf)
    gemma2 = arch == "Gemma2ForCausalLM"
    name = hf.get("hidden_activation", "gelu_pytorch_tanh") if gemma2 else hf.get("hidden_act", "gelu_pytorch_tanh")
    if not gemma2 and name == "gelu":
        name = "gelu_pytorch_tanh"  # as GemmaConfig.__post_init__ does
    if HF_ACTIVATIONS.get(name, "silu") == "silu":
        key = "hidden_activation" if gemma2 else "hidden_act"
        raise ValueError(f"ModelConfig: {key} {name!r} is not supported for {arch} (a gelu form)")
    fields: dict[str, Any] = dict(
        hidden_act=HF_ACTIVATIONS[name],
        head_dim=hf.get("head_dim", 256),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
    )
    if not gemma2:
        return fields | dict(sliding_window=None, layer_types=())
    window = raw.get("sliding_window", 4096)
    if window is None:  # transformers' sliding-window mask raises on it too
        raise ValueError("ModelConfig: sliding_window must be set for Gemma2ForCausalLM (it has sliding layers)")
    n = hf.get("num_hidden_layers")
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)] if _is_type(n, int) else ()
    return fields | dict(
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=raw.get("attn_logit_softcapping", 50.0),
        final_logit_softcapping=raw.get("final_logit_softcapping", 30.0),
        sliding_window=window,
        layer_types=tuple(hf.get("layer_types") or default),
    )


# --------------------------------------------------------------------------------------------
# Writers: each architecture's own config.json fields of a ModelConfig, the parsers' inverses
# (ModelConfig.to_hf; the trainer's checkpoints write config.json with them).
# --------------------------------------------------------------------------------------------
def llama_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """Inverse of :func:`llama_fields`."""
    arch = config.architecture
    if config.hidden_act != "silu":
        raise ValueError(f"ModelConfig.to_hf: {arch} has a silu MLP in config.json, not {config.hidden_act!r}")
    if arch != "Qwen2ForCausalLM" and config.attention_bias != config.o_proj_bias:
        raise ValueError(f"ModelConfig.to_hf: {arch} cannot have attention_bias != o_proj_bias in config.json")
    out: dict[str, Any] = {"hidden_act": "silu"}
    if arch == "MistralForCausalLM":
        out["sliding_window"] = config.sliding_window
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        out["use_sliding_window"] = config.sliding_window is not None
        out["sliding_window"] = config.sliding_window
        out["layer_types"] = list(config.layer_types)
        out["max_window_layers"] = config.num_hidden_layers
    return out


# Kernel activation -> the HF name Gemma's config.json gives it. Gemma (1) reads "gelu" as the tanh
# form, so its config cannot say erf gelu.
_GEMMA_ACTIVATIONS = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def gemma_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """Inverse of :func:`gemma_fields`."""
    arch = config.architecture
    if config.hidden_act not in _GEMMA_ACTIVATIONS or (arch == "GemmaForCausalLM" and config.hidden_act == "gelu"):
        raise ValueError(f"ModelConfig.to_hf: {arch}'s config.json cannot say hidden_act {config.hidden_act!r}")
    if config.attention_bias != config.o_proj_bias:
        raise ValueError(f"ModelConfig.to_hf: {arch} cannot have attention_bias != o_proj_bias in config.json")
    if arch == "GemmaForCausalLM":
        return {"hidden_act": _GEMMA_ACTIVATIONS[config.hidden_act]}
    if config.sliding_window is None:  # the parser refuses it, as transformers' mask does
        raise ValueError(f"ModelConfig.to_hf: {arch}'s config.json needs a sliding_window")
    return {
        "hidden_activation": _GEMMA_ACTIVATIONS[config.hidden_act],
        # None (the head_dim scale) is written as head_dim: absent, Gemma2's default is 256.
        "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
    }
