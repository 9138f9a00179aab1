"""The fusion pass for Hugging Face decoder LMs of known architectures, instance by instance.

Architectures (by ``config.model_type`` and module structure, never by importing a model class, so
that any transformers 5.x works): llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3.
gpt2 / bert / roberta go to ``fusion/hf_classic.py``. What each candidate replaces (docs/optimize.md):

- norm: every ``*RMSNorm`` module becomes a ``fuseformer.layers.RMSNorm`` sharing its Parameter
  (``offset=1`` for Gemma's ``x * (1 + w)``), set on its parent module. The norm that follows a
  residual add (``post_attention_layernorm`` in Llama/Qwen/Mistral/Phi-3, ``pre_feedforward_layernorm``
  in Gemma 2/3) is instead fused with that add: the decoder layer gets an instance-bound ``forward``
  (the class's code, with ``h = x + a; norm(h)`` as one ``rms_norm(a, w, residual=x)``); its path is
  the decoder layer. The layer object stays the same GradientCheckpointingLayer, so gradient
  checkpointing still wraps it.
- mlp: the MLP gets an instance-bound ``forward``. Without gradients (inference) it runs
  ``fused_mlp`` on a packed (2I, H) gate/up weight: Phi-3's own ``gate_up_proj``, or for the others
  one new storage into which ``gate_proj.weight`` and ``up_proj.weight`` become ``.data`` views (no
  extra memory, state-dict names unchanged). With gradients: ``swiglu`` / ``geglu`` between the
  existing linears, so the gradients reach the original parameters (Phi-3: ``fused_mlp`` itself,
  whose weight is the parameter).
- attention: the module gets its own shallow copy of the config naming the ``"fuseformer"``
  attention function (``fusion/hf_attention.py``); masks, cache and ``generate`` stay transformers'.
- loss (training only): the causal LM gets an instance-bound ``forward`` that, when ``labels`` are
  given as a keyword, runs the base model and ``fused_linear_cross_entropy`` on the last hidden
  states, so full logits never exist; it returns ``logits=None``. Without labels, or with labels and
  a ``logits_to_keep`` (transformers then takes the loss of the kept logits), it is the class's
  forward.

Every ``apply`` / ``undo`` touches this instance only; ``undo`` puts back the same objects.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as tnf
from torch import nn

import fuseformer.ops as F
from fuseformer.fusion import hf_attention
from fuseformer.fusion.base import Candidate, PassResult, Skipped
from fuseformer.layers.norms import RMSNorm

CLASSIC = frozenset({"gpt2", "bert", "roberta"})
# model_type -> (the norm fused with the residual add before it, the norm on the attention
# output, the norm on the MLP output); None where the layer has none.
LAYOUTS: dict[str, tuple[str, str | None, str | None]] = {
    "llama": ("post_attention_layernorm", None, None),
    "mistral": ("post_attention_layernorm", None, None),
    "qwen2": ("post_attention_layernorm", None, None),
    "qwen3": ("post_attention_layernorm", None, None),
    "phi3": ("post_attention_layernorm", None, None),
    "gemma": ("post_attention_layernorm", None, None),
    "gemma2": ("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
    "gemma3_text": ("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
}
_ATTR = "_fuseformer"  # instance __dict__ key holding what a bound forward needs (deepcopy-safe)


def find_candidates(model: nn.Module, *, training: bool, kinds: frozenset[str]) -> PassResult | None:
    """The replacements this pass can make on ``model``, or None when it is not a Hugging Face
    model of an architecture this file (or ``hf_classic.py``) knows."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    model_type = getattr(model.config, "model_type", None)
    if model_type in CLASSIC:
        from fuseformer.fusion import hf_classic

        return hf_classic.find_candidates(model, training=training, kinds=kinds)
    if model_type not in LAYOUTS:
        return None
    stack = _decoder_stack(model)
    if stack is None:
        return None
    prefix, layers = stack
    result = PassResult(name="hf")
    gemma = model_type.startswith("gemma")
    if "norm" in kinds:
        fused = _norm_candidates(model, prefix, layers, model_type, gemma, result)
        _module_norm_candidates(model, fused, gemma, result)
    if "mlp" in kinds:
        for i, layer in enumerate(layers):
            _mlp_candidate(f"{prefix}.{i}.mlp", layer.mlp, training, result)
    if "attention" in kinds:
        _attention_candidates(model, prefix, layers, training, result)
    if "loss" in kinds:
        _loss_candidate(model, training, result)
    return result


def _decoder_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The first ModuleList of decoder layers (each with ``self_attn`` and ``mlp``) and its path."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(hasattr(c, "self_attn") and hasattr(c, "mlp") for c in m):
            return name, m
    return None


def _set_bound_forward(module: nn.Module, fn, state: dict) -> None:
    module.__dict__[_ATTR] = state
    module.forward = types.MethodType(fn, module)


def _with_bound_forward(module: nn.Module, fn, state: dict, apply, undo):
    """(apply, undo) that also bind ``fn`` as ``module``'s forward (state under its own key)."""

    def apply_both():
        apply()
        module.__dict__["_fuseformer_rotary"] = state
        module.forward = types.MethodType(fn, module)

    def undo_both():
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_fuseformer_rotary", None)
        undo()

    return apply_both, undo_both


def _del_bound_forward(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)
    module.__dict__.pop(_ATTR, None)


def _eps(norm: nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------
def _is_rms_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(w, nn.Parameter)
        and w.dim() == 1
        and (hasattr(m, "variance_epsilon") or hasattr(m, "eps"))
    )


def _fused_layer_forward(self, hidden_states, *args, **kwargs):
    """A decoder layer's forward with the residual add fused into the norm after it. Keyword
    arguments go to ``self_attn`` as the class's forward passes them (whatever this transformers
    calls the cache); positional ones (nobody passes them) take the class's forward."""
    if args:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    fused_name, attn_norm, mlp_norm, offset = self.__dict__[_ATTR]["layout"]
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    kwargs.pop("hidden_states", None)
    a = self.self_attn(hidden_states=h, **kwargs)[0]
    if attn_norm is not None:
        a = getattr(self, attn_norm)(a)
    drop = getattr(self, "resid_attn_dropout", None)  # Phi-3
    if drop is not None:
        a = drop(a)
    norm = getattr(self, fused_name)
    w = norm.weight if not offset else offset + norm.weight.float()
    h, residual = F.rms_norm(a, w, eps=_eps(norm), residual=residual)
    m = self.mlp(h)
    if mlp_norm is not None:
        m = getattr(self, mlp_norm)(m)
    drop = getattr(self, "resid_mlp_dropout", None)
    if drop is not None:
        m = drop(m)
    return residual + m


def _norm_candidates(model, prefix, layers, model_type, gemma, result) -> set[int]:
    """One candidate per decoder layer fusing its residual add into the following norm; returns
    the ids of the norm modules so fused."""
    fused_name, attn_norm, mlp_norm = LAYOUTS[model_type]
    offset = 1.0 if gemma else 0.0
    done: set[int] = set()
    for i, layer in enumerate(layers):
        path = f"{prefix}.{i}"
        names = [n for n in ("input_layernorm", fused_name, attn_norm, mlp_norm) if n]
        if not all(_is_rms_norm(getattr(layer, n, None) or nn.Identity()) for n in names):
            result.skipped.append(Skipped(path=path, kind="norm", reason="decoder layer has not the expected norms"))
            continue
        done.add(id(getattr(layer, fused_name)))
        layout = (fused_name, attn_norm, mlp_norm, offset)

        def apply(layer=layer, layout=layout):
            if "forward" not in layer.__dict__:
                _set_bound_forward(layer, _fused_layer_forward, {"layout": layout})

        def undo(layer=layer):
            _del_bound_forward(layer)

        result.candidates.append(
            Candidate(
                path=path,
                kind="norm",
                original=f"{type(layer).__name__} residual add + {type(getattr(layer, fused_name)).__name__}",
                replacement="fuseformer rms_norm (+ residual add)",
                apply=apply,
                undo=undo,
                note=f"{fused_name} fused with the residual add before it" + (" (1 + w)" if gemma else ""),
            )
        )
    return done


def _module_norm_candidates(model, fused: set[int], gemma: bool, result) -> None:
    offset = 1.0 if gemma else 0.0
    for path, m in list(model.named_modules()):
        if not path or id(m) in fused or not _is_rms_norm(m):
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        new = RMSNorm.from_module(m, offset=offset)

        def apply(parent=parent, name=name, new=new):
            setattr(parent, name, new)

        def undo(parent=parent, name=name, old=m):
            setattr(parent, name, old)

        result.candidates.append(
            Candidate(
                path=path,
                kind="norm",
                original=type(m).__name__,
                replacement="fuseformer RMSNorm" + (" (1 + w)" if gemma else ""),
                apply=apply,
                undo=undo,
                note="shares the weight Parameter",
            )
        )


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------
def _activation(act: nn.Module | None) -> str | None:
    """fused_mlp's name for an ACT2FN module, or None when it is none of silu / gelu(tanh) / gelu."""
    name = type(act).__name__
    if "SiLU" in name or name == "SiLUActivation":
        return "silu"
    if "Tanh" in name or getattr(act, "approximate", None) == "tanh":
        return "gelu_tanh"
    if name in ("GELUActivation", "GELU") and getattr(act, "approximate", "none") == "none":
        return "gelu"
    return None


def _gated(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if activation == "silu":
        return F.swiglu(gate, up)
    return F.geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


def _packed_ok(g: torch.Tensor, u: torch.Tensor, packed: torch.Tensor) -> bool:
    """gate/up weights are still the two halves of ``packed`` (a ``.to()``, ``load_state_dict``
    with assign=True, or a deepcopy breaks that; then the unpacked path runs)."""
    if torch.compiler.is_compiling():
        return True
    return (
        g.dtype == packed.dtype
        and g.device == packed.device
        and g.data_ptr() == packed.data_ptr()
        and u.data_ptr() == packed.data_ptr() + g.numel() * g.element_size()
    )


def _split_mlp_forward(self, x):
    """Llama-style MLP: down(act(gate(x)) * up(x)) with the activation and product fused; without
    gradients the gate-up GEMM and the activation are one ``fused_mlp`` on the packed weight."""
    state = self.__dict__[_ATTR]
    act, packed = state["activation"], state.get("packed")
    g, u = self.gate_proj.weight, self.up_proj.weight
    if packed is not None and not (torch.is_grad_enabled() and g.requires_grad) and _packed_ok(g, u, packed):
        return F.fused_mlp(x, packed, self.down_proj.weight, act)
    return self.down_proj(_gated(act, self.gate_proj(x), self.up_proj(x)))


def _packed_mlp_forward(self, x):
    """Phi-3 MLP: gate_up_proj is already packed ([gate; up]); fused_mlp carries its gradients."""
    act = self.__dict__[_ATTR]["activation"]
    if self.gate_up_proj.bias is not None or self.down_proj.bias is not None:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(_gated(act, gate, up))
    return F.fused_mlp(x, self.gate_up_proj.weight, self.down_proj.weight, act)


def _mlp_candidate(path: str, mlp: nn.Module, training: bool, result: PassResult) -> None:
    act_module = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    act = _activation(act_module)
    if act is None:
        result.skipped.append(Skipped(path=path, kind="mlp", reason=f"activation {type(act_module).__name__}"))
        return
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):

        def apply_packed(mlp=mlp, act=act):
            if "forward" not in mlp.__dict__:
                _set_bound_forward(mlp, _packed_mlp_forward, {"activation": act})

        def undo_packed(mlp=mlp):
            _del_bound_forward(mlp)

        result.candidates.append(
            Candidate(
                path=path,
                kind="mlp",
                original=type(mlp).__name__,
                replacement=f"fuseformer fused_mlp ({act})",
                apply=apply_packed,
                undo=undo_packed,
                note="gate_up_proj is already packed",
            )
        )
        return
    if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        result.skipped.append(Skipped(path=path, kind="mlp", reason="no gate_proj/up_proj/down_proj linears"))
        return
    pack = not training and mlp.gate_proj.bias is None and mlp.up_proj.bias is None and mlp.down_proj.bias is None

    def apply(mlp=mlp, act=act, pack=pack):
        if "forward" in mlp.__dict__:
            return
        state = {"activation": act}
        if pack:
            g, u = mlp.gate_proj.weight, mlp.up_proj.weight
            packed = torch.cat([g.data, u.data])  # (2I, H): rows [0, I) gate, [I, 2I) up
            g.data, u.data = packed[: g.shape[0]], packed[g.shape[0] :]
            state["packed"] = packed
        _set_bound_forward(mlp, _split_mlp_forward, state)

    def undo(mlp=mlp):
        state = mlp.__dict__.get(_ATTR)
        if state is None:
            return
        if state.get("packed") is not None:
            g, u = mlp.gate_proj.weight, mlp.up_proj.weight
            if _packed_ok(g, u, state["packed"]):  # give each weight its own storage back
                g.data, u.data = g.data.clone(), u.data.clone()
        _del_bound_forward(mlp)

    gated = "swiglu" if act == "silu" else "geglu"
    result.candidates.append(
        Candidate(
            path=path,
            kind="mlp",
            original=type(mlp).__name__,
            replacement=f"fuseformer fused_mlp ({act})" if pack else f"fuseformer {gated} between the linears",
            apply=apply,
            undo=undo,
            note=(
                f"gate/up packed in place (views of one (2I, H) storage); {gated} between the linears when "
                "gradients are needed"
                if pack
                else f"{gated} between the existing linears (gradients reach the original parameters)"
            ),
        )
    )


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
def _attention_candidates(model, prefix, layers, training, result) -> None:
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl == "flex_attention" or (isinstance(impl, str) and impl.startswith("paged")):
        result.skipped.append(
            Skipped(path=prefix, kind="attention", reason=f"model uses {impl!r} attention, whose masks we do not read")
        )
        return
    name = hf_attention.register()
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        path = f"{prefix}.{i}.self_attn"
        head_dim = getattr(attn, "head_dim", None)
        if head_dim is None or head_dim > hf_attention.MAX_HEAD_DIM:
            result.skipped.append(Skipped(path=path, kind="attention", reason=f"head dim {head_dim} is above 256"))
            continue
        dropout = getattr(attn, "attention_dropout", 0.0) or 0.0
        if training and dropout > 0:
            result.skipped.append(
                Skipped(path=path, kind="attention", reason=f"attention dropout {dropout} while training")
            )
            continue
        if not hasattr(attn, "config"):
            result.skipped.append(Skipped(path=path, kind="attention", reason="attention module has no config"))
            continue
        apply, undo = hf_attention.config_swap(attn, name)
        # RoPE fused too (the whole forward is ours), in training as well: its gradients pass against a
        # float64 copy on the GPU (run 141; the check, a lab script, is in commit 1dcf490), and it cut the Llama-1B
        # training step from 348 to 321 ms (HF's rotate_half ran three times a layer under checkpointing).
        rotary = hf_attention.rotary_state(attn)
        if rotary is not None:
            apply, undo = _with_bound_forward(attn, hf_attention.rotary_attention_forward, rotary, apply, undo)
        result.candidates.append(
            Candidate(
                path=path,
                kind="attention",
                original=f"{type(attn).__name__} ({impl})",
                replacement="fuseformer flash_attention" + (" + rotary" if rotary is not None else ""),
                apply=apply,
                undo=undo,
                note="transformers AttentionInterface 'fuseformer'; the model's own masks and cache",
            )
        )


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------
def _causal_lm_forward(self, *args, **kwargs):
    """A causal LM's forward whose loss is ``fused_linear_cross_entropy`` on the hidden states, as
    transformers' ForCausalLMLoss computes it from logits: labels shifted left (or ``shift_labels``),
    ignore_index -100, mean over the counted tokens, or sum / ``num_items_in_batch`` when given."""
    labels = kwargs.get("labels")
    keep = kwargs.get("logits_to_keep", 0)
    # Positional calls past input_ids, and labels with logits_to_keep (transformers then takes the
    # loss of the kept logits only), run the class's forward as they are.
    if labels is None or len(args) > 1 or not (isinstance(keep, int) and keep == 0):
        return type(self).forward(self, *args, **kwargs)
    kwargs = dict(kwargs)
    if args:
        kwargs["input_ids"] = args[0]
    kwargs.pop("labels")
    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    base = getattr(self, self.base_model_prefix)
    outputs = base(**kwargs, return_dict=True)
    hidden = outputs.last_hidden_state  # (B, S, H)
    head = self.get_output_embeddings()
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = tnf.pad(labels, (0, 1), value=-100)[..., 1:]
    num_items = kwargs.get("num_items_in_batch")
    loss = F.fused_linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels.to(hidden.device),
        bias=head.bias,
        ignore_index=-100,
        reduction="sum" if num_items is not None else "mean",
        out_dtype=torch.float32,  # as HF's loss on upcast logits: a bf16 loss of ~7 is good to ~0.03 only
        softcap=getattr(self.config, "final_logit_softcapping", None) or 0.0,  # Gemma 2's, inside the kernels
    )
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} - {"loss", "logits"}
    out = CausalLMOutputWithPast(loss=loss, logits=None, **{k: v for k, v in outputs.items() if k in fields})
    if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
        return out.to_tuple()
    return out


def _loss_candidate(model, training, result) -> None:
    if not training:
        result.skipped.append(Skipped(path="", kind="loss", reason="the loss is fused only when training"))
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(head, nn.Linear) or base is None or base is model:
        result.skipped.append(Skipped(path="", kind="loss", reason="not a causal LM with a linear lm_head"))
        return
    names = {id(p): n for n, p in model.named_parameters()}
    head_param = names.get(id(head.weight), "lm_head.weight")

    def apply(model=model):
        if "forward" not in model.__dict__:
            _set_bound_forward(model, _causal_lm_forward, {})

    def undo(model=model):
        _del_bound_forward(model)

    result.candidates.append(
        Candidate(
            path="",
            kind="loss",
            original=f"{head.__class__.__name__} lm_head + cross-entropy",
            replacement="fuseformer fused_linear_cross_entropy",
            apply=apply,
            undo=undo,
            params=head_param,
            select=lambda out: out.loss if not isinstance(out, tuple) else out[0],
            note="with labels: no full logits (logits=None)",
        )
    )
