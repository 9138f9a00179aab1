"""The fusion pass for the classic Hugging Face Transformers: GPT-2, BERT, RoBERTa (and MiniLM-style
small BERTs, bare ``BertModel`` as sentence-transformers loads it, and the task heads on top).

``fusion/hf.py`` sends ``config.model_type`` in {"gpt2", "bert", "roberta"} here. Detection is by
module structure (child names, types, forward signatures), never by importing a model class, so
that any transformers 5.x works (5.17 names the cache ``past_key_values``, 5.25 ``cache``). What each
candidate replaces (docs/optimize.md, "GPT-2, BERT, RoBERTa"):

- norm, post-LN add (BERT/RoBERTa ``*SelfOutput`` / ``*Output``: ``LayerNorm(dropout(dense(h)) + x)``):
  the module gets an instance-bound ``forward`` running ``layer_norm(dropout(dense(h)), w, b,
  residual=x)``, the add inside the kernel. Path: that module.
- norm, GPT-2 block (``ln_2(attn_out + residual)``): the block gets an instance-bound ``forward`` with
  that add fused into ``ln_2``; the sum comes back as the residual stream for the MLP's add. The block
  stays the same GradientCheckpointingLayer object. Path: the block. Blocks with cross-attention
  keep theirs.
- norm, every other ``nn.LayerNorm`` (GPT-2 ``ln_1``/``ln_f``, embeddings, MLM heads): a
  ``fuseformer.layers.LayerNorm`` sharing its Parameters, set on its parent.
- mlp (inference): with GELU's tanh form (GPT-2's gelu_new), the up projection and its GELU (GPT-2
  ``GPT2MLP``: ``act(c_fc(h))``, then ``c_proj`` and dropout as before; a ``*Intermediate`` with that
  activation) as one cuBLASLt GEMM with bias + GELU in its epilogue (``torch._addmm_activation``: run 139,
  H100, GPT-2 shape T 16384 142.5 us against 194.6 for GEMM + GELU) on CUDA fp16/bf16; elsewhere the
  module's own ops. The module gets an instance-bound ``forward``. Path: that module. Erf GELU (BERT,
  RoBERTa) and other activations are left, with the reason: a Triton GEMM with the GELU in its epilogue
  was measured no faster than cuBLAS + GELU (runs 138-139), and cuBLASLt's epilogue has only the tanh form.
- attention: the attention module gets its own shallow copy of the config naming a registered
  transformers attention function. GPT-2 (causal) uses ``"fuseformer"`` (``fusion/hf_attention.py``);
  BERT/RoBERTa encoders (bidirectional) use ``"fuseformer_encoder"`` (:func:`encoder_attention`,
  here). The model keeps building its own masks for its own implementation; the function reads them.
- loss (training, ``GPT2LMHeadModel`` only): ``fusion/hf.py``'s fused linear cross-entropy forward.

Every ``apply`` / ``undo`` touches this instance only; ``undo`` puts back the same objects. State-dict
names never change (bound forwards add no parameters; the LayerNorm twin names its own ``weight``
and ``bias``).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as tnf
from torch import nn

import fuseformer.ops as F
from fuseformer.fusion import hf_attention
from fuseformer.fusion.base import Candidate, PassResult, Skipped
from fuseformer.fusion.hf import _ATTR, _del_bound_forward, _loss_candidate, _set_bound_forward
from fuseformer.layers.norms import LayerNorm

MODEL_TYPES = frozenset({"gpt2", "bert", "roberta"})
ENCODER_NAME = "fuseformer_encoder"
MAX_HEAD_DIM = hf_attention.MAX_HEAD_DIM

_registered = False


def find_candidates(model: nn.Module, *, training: bool, kinds: frozenset[str]) -> PassResult:
    """The replacements this pass can make on a GPT-2, BERT or RoBERTa model (any head on top).

    Nothing is changed until a candidate's ``apply`` runs. A model of another ``model_type``, or one
    whose modules are not laid out as expected, gets a result with only ``skipped`` entries."""
    result = PassResult(name="hf_classic")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        result.skipped.append(
            Skipped(path="", kind="norm", reason=f"model_type {model_type!r} is not gpt2/bert/roberta")
        )
        return result
    gpt2 = model_type == "gpt2"
    fused: set[int] = set()  # the LayerNorms fused with their residual add
    if "norm" in kinds:
        if gpt2:
            _gpt2_block_candidates(model, fused, result)
        else:
            _post_ln_candidates(model, fused, result)
        _layer_norm_candidates(model, fused, result)
    if "mlp" in kinds:
        _mlp_candidates(model, gpt2, training, result)
    if "attention" in kinds:
        _attention_candidates(model, gpt2, training, result)
    if "loss" in kinds:
        if gpt2 and hasattr(model, "lm_head") and not hasattr(model, "multiple_choice_head"):
            _loss_candidate(model, training, result)
        else:
            result.skipped.append(Skipped(path="", kind="loss", reason=f"{type(model).__name__} is not a causal LM"))
    return result


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------
def _is_layer_norm(m: object) -> bool:
    return isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1


def _params_of(cls: type) -> list[str]:
    """The names of ``cls.forward``'s positional parameters after ``self`` (through decorators)."""
    try:
        sig = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in sig.parameters.values() if p.kind in kinds][1:]


def _bound_forward_candidate(
    path: str, module: nn.Module, kind: str, forward, state: dict, *, original: str, replacement: str, note: str
) -> Candidate:
    """A candidate that binds ``forward`` (with its ``state``) to ``module`` alone, and unbinds it."""

    def apply():
        if "forward" not in module.__dict__:
            _set_bound_forward(module, forward, dict(state))

    def undo():
        _del_bound_forward(module)

    return Candidate(path=path, kind=kind, original=original, replacement=replacement, apply=apply, undo=undo,
                     note=note)  # fmt: skip


def _add_layer_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual) in one kernel. Mixed dtypes (autocast: a bf16 GEMM
    output added to an fp32 stream) are promoted first, as the ``+`` they replace would."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return F.layer_norm(x.to(dtype), norm.weight, norm.bias, eps=norm.eps, residual=residual.to(dtype))


def _post_ln_forward(self, hidden_states, input_tensor):
    """BERT/RoBERTa ``*SelfOutput`` / ``*Output``: LayerNorm(dropout(dense(h)) + input_tensor)."""
    h = self.dropout(self.dense(hidden_states))
    return _add_layer_norm(h, input_tensor, self.LayerNorm)[0]


def _post_ln_candidates(model: nn.Module, fused: set[int], result: PassResult) -> None:
    for path, m in model.named_modules():
        if not type(m).__name__.endswith("Output") or not _is_layer_norm(getattr(m, "LayerNorm", None)):
            continue
        if not (
            isinstance(getattr(m, "dense", None), nn.Linear) and isinstance(getattr(m, "dropout", None), nn.Dropout)
        ):
            continue
        if _params_of(type(m)) != ["hidden_states", "input_tensor"]:
            result.skipped.append(
                Skipped(path=path, kind="norm", reason=f"{type(m).__name__}.forward has an unknown signature")
            )
            continue
        fused.add(id(m.LayerNorm))
        result.candidates.append(
            _bound_forward_candidate(
                path, m, "norm", _post_ln_forward, {},
                original=f"{type(m).__name__} residual add + LayerNorm",
                replacement="fuseformer layer_norm (+ residual add)",
                note="LayerNorm(dropout(dense(h)) + x) with the add in the kernel",
            )
        )  # fmt: skip


def _gpt2_block_forward(self, hidden_states, *args, **kwargs):
    """GPT2Block's forward with ``ln_2(attn_out + residual)`` as one fused add + LayerNorm.

    Arguments are matched to the class's own parameter names (positional as GPT2Model passes them,
    the cache named as this transformers names it) and passed on to ``self.attn`` as the class's
    forward passes them. With cross-attention inputs, or arguments it does not recognize, the
    class's forward runs."""
    names, cache = self.__dict__[_ATTR]["params"], self.__dict__[_ATTR]["cache"]
    if len(args) > len(names) - 1:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    kw = dict(zip(names[1:], args))
    if kw.keys() & kwargs.keys():
        return type(self).forward(self, hidden_states, *args, **kwargs)
    kw.update(kwargs)
    if cache != "past_key_values" and "past_key_values" in kw and cache not in kw:
        kw[cache] = kw.pop("past_key_values")  # the deprecated name the class's decorator renames
    if kw.pop("encoder_hidden_states", None) is not None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    kw.pop("encoder_attention_mask", None)
    kw.pop("hidden_states", None)
    residual = hidden_states
    attn_output = self.attn(self.ln_1(hidden_states), **kw)[0]
    h, residual = _add_layer_norm(attn_output, residual, self.ln_2)
    return residual + self.mlp(h)


def _gpt2_block_candidates(model: nn.Module, fused: set[int], result: PassResult) -> None:
    for path, m in model.named_modules():
        if not (isinstance(m, nn.ModuleList) and len(m) and all(hasattr(b, "attn") and hasattr(b, "mlp") for b in m)):
            continue
        for i, block in enumerate(m):
            bpath = f"{path}.{i}"
            names = _params_of(type(block))
            cache = "cache" if "cache" in names else "past_key_values"
            expected = {"hidden_states", cache, "attention_mask", "encoder_hidden_states", "use_cache"}
            if hasattr(block, "crossattention"):
                result.skipped.append(
                    Skipped(path=bpath, kind="norm", reason="block with cross-attention: ln_2's add is not fused")
                )
                continue
            if not (
                _is_layer_norm(getattr(block, "ln_1", None))
                and _is_layer_norm(getattr(block, "ln_2", None))
                and names[:1] == ["hidden_states"]
                and expected <= set(names)
            ):
                result.skipped.append(
                    Skipped(path=bpath, kind="norm", reason=f"{type(block).__name__} is not laid out as GPT2Block")
                )
                continue
            fused.add(id(block.ln_2))
            result.candidates.append(
                _bound_forward_candidate(
                    bpath, block, "norm", _gpt2_block_forward, {"params": names, "cache": cache},
                    original=f"{type(block).__name__} residual add + ln_2",
                    replacement="fuseformer layer_norm (+ residual add)",
                    note="ln_2(attn_out + residual) with the add in the kernel",
                )
            )  # fmt: skip
        return


def _layer_norm_candidates(model: nn.Module, fused: set[int], result: PassResult) -> None:
    for path, m in list(model.named_modules()):
        if not path or id(m) in fused or not isinstance(m, nn.LayerNorm):
            continue
        if not _is_layer_norm(m):
            result.skipped.append(
                Skipped(path=path, kind="norm", reason=f"normalized_shape {tuple(m.normalized_shape)}: one dim only")
            )
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        new = LayerNorm.from_module(m)

        def apply(parent=parent, name=name, new=new):
            setattr(parent, name, new)

        def undo(parent=parent, name=name, old=m):
            setattr(parent, name, old)

        result.candidates.append(
            Candidate(
                path=path,
                kind="norm",
                original="LayerNorm",
                replacement="fuseformer LayerNorm",
                apply=apply,
                undo=undo,
                note="shares the weight and bias Parameters",
            )
        )


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------
# transformers' activation modules (ACT2FN) computing GELU's tanh form: GPT-2's gelu_new, the fast form,
# PyTorch's tanh GELU. cuBLASLt's GELU epilogue computes exactly that form; models with erf GELU (BERT,
# RoBERTa), SiLU or others keep their MLP (see _mlp_candidates).
_TANH_GELU = frozenset({"NewGELUActivation", "FastGELUActivation", "PytorchGELUTanh", "GELUTanh"})
_NO_FUSED_FORM = (
    "{act}: no fused form faster than cuBLAS + the activation on Hopper (runs 138-139, H100, BERT-base T 16384: "
    "a Triton GEMM with bias + GELU in its epilogue 197.5-261 us against 193.8); cuBLASLt's epilogue computes "
    "only GELU's tanh form"
)


def _tanh_gelu(act: object) -> bool:
    return type(act).__name__ in _TANH_GELU or (isinstance(act, nn.GELU) and act.approximate == "tanh")


def _epilogue_applies(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether cuBLASLt's bias + GELU epilogue takes the call: CUDA, fp16/bf16, nothing to differentiate
    (torch's ``_addmm_activation`` has no backward). On the CPU it computes erf GELU, another function."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))


def _gelu_linear(x: torch.Tensor, weight_kn: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ weight_kn + bias) in one cuBLASLt GEMM (bias and GELU in its epilogue)."""
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight_kn, use_gelu=True)
    return out.view(*x.shape[:-1], out.shape[-1])


def _intermediate_forward(self, hidden_states):
    """BERT/RoBERTa ``*Intermediate`` with a tanh-form GELU: one GEMM with bias + GELU in its epilogue
    where it applies (CUDA inference), else the module's own two ops."""
    dense = self.dense
    if _epilogue_applies(hidden_states, dense.weight, dense.bias):
        return _gelu_linear(hidden_states, dense.weight.T, dense.bias)
    return self.intermediate_act_fn(dense(hidden_states))


def _gpt2_mlp_forward(self, hidden_states):
    """GPT2MLP: dropout(c_proj(gelu_tanh(c_fc(h)))) with c_fc's GEMM, bias and GELU in one cuBLASLt call
    where it applies (CUDA inference; the Conv1D weight is already (in, out)), else the module's own ops."""
    c_fc = self.c_fc
    if _epilogue_applies(hidden_states, c_fc.weight, c_fc.bias):
        h = _gelu_linear(hidden_states, c_fc.weight, c_fc.bias)
    else:
        h = self.act(c_fc(hidden_states))
    return self.dropout(self.c_proj(h))


def _mlp_candidates(model: nn.Module, gpt2: bool, training: bool, result: PassResult) -> None:
    for path, m in model.named_modules():
        name = type(m).__name__
        if gpt2 and name.endswith("MLP") and hasattr(m, "c_fc"):
            act, linear, forward = getattr(m, "act", None), m.c_fc, _gpt2_mlp_forward
            ok = type(linear).__name__ == "Conv1D" and hasattr(m, "c_proj") and hasattr(m, "dropout")
        elif not gpt2 and name.endswith("Intermediate") and hasattr(m, "dense"):
            act, linear, forward = getattr(m, "intermediate_act_fn", None), m.dense, _intermediate_forward
            ok = isinstance(linear, nn.Linear)
        else:
            continue
        if not ok or _params_of(type(m)) != ["hidden_states"] or getattr(linear, "bias", None) is None:
            result.skipped.append(Skipped(path=path, kind="mlp", reason=f"{name} is not laid out as expected"))
            continue
        if not _tanh_gelu(act):
            result.skipped.append(Skipped(path=path, kind="mlp", reason=_NO_FUSED_FORM.format(act=type(act).__name__)))
            continue
        if training:
            reason = "training: cuBLASLt's GELU epilogue (torch._addmm_activation) has no backward"
            result.skipped.append(Skipped(path=path, kind="mlp", reason=reason))
            continue
        result.candidates.append(
            _bound_forward_candidate(
                path, m, "mlp", forward, {},
                original=f"{type(linear).__name__} + {type(act).__name__}",
                replacement="cuBLASLt GEMM with bias + GELU (tanh) epilogue",
                note="CUDA fp16/bf16 inference; elsewhere the module's own ops",
            )
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
def register() -> str:
    """Add ``"fuseformer_encoder"`` to transformers' attention registry; returns the name. One
    global registry entry, used only by attention modules whose config names it."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ENCODER_NAME, encoder_attention)
        _registered = True
    return ENCODER_NAME


def _attention_candidates(model: nn.Module, gpt2: bool, training: bool, result: PassResult) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "flex_attention" or (isinstance(impl, str) and impl.startswith("paged")):
        result.skipped.append(
            Skipped(path="", kind="attention", reason=f"model uses {impl!r} attention, whose masks we do not read")
        )
        return
    for path, m in model.named_modules():
        name = type(m).__name__
        if gpt2:
            if not (name.endswith("Attention") and hasattr(m, "c_attn") and hasattr(m, "head_dim")):
                continue
            head_dim, cross = m.head_dim, getattr(m, "is_cross_attention", False)
            dropout = getattr(getattr(m, "attn_dropout", None), "p", 0.0)
        else:
            if not (name.endswith("Attention") and all(hasattr(m, n) for n in ("query", "key", "value"))):
                continue
            head_dim, cross = getattr(m, "attention_head_size", None), "Cross" in name
            dropout = getattr(getattr(m, "dropout", None), "p", 0.0)
        if cross:
            result.skipped.append(Skipped(path=path, kind="attention", reason="cross-attention is left as it is"))
            continue
        if not isinstance(head_dim, int) or head_dim > MAX_HEAD_DIM:
            result.skipped.append(Skipped(path=path, kind="attention", reason=f"head dim {head_dim} is above 256"))
            continue
        if training and dropout > 0:
            result.skipped.append(
                Skipped(path=path, kind="attention", reason=f"attention dropout {dropout} while training")
            )
            continue
        if not hasattr(m, "config"):
            result.skipped.append(Skipped(path=path, kind="attention", reason="attention module has no config"))
            continue
        causal = bool(getattr(m, "is_causal", gpt2))
        fn = hf_attention.register() if causal else register()
        apply, undo = hf_attention.config_swap(m, fn)
        result.candidates.append(
            Candidate(
                path=path,
                kind="attention",
                original=f"{name} ({impl})",
                replacement="fuseformer flash_attention" + ("" if causal else " (bidirectional, varlen when padded)"),
                apply=apply,
                undo=undo,
                note=f"transformers AttentionInterface {fn!r}; the model's own masks{' and cache' if causal else ''}",
            )
        )


def _keep_of(mask: torch.Tensor, b: int, sq: int, sk: int) -> torch.Tensor | None:
    """The (B, Sk) bool keys every query sees, when ``mask`` is key padding and nothing else (the
    same row for every query and head); None for any other mask. A float mask must be additive 0 /
    "minus infinity" (<= finfo.min / 2): a bias of other values is not padding."""
    if mask.dim() == 2:  # flash-attention-2's form: (B, Sk), 1 = token
        return mask[:, -sk:].bool() if mask.shape[0] == b and mask.shape[1] >= sk else None
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[2] not in (1, sq) or mask.shape[3] < sk:
        return None
    m = mask[..., :sk]
    if m.dtype == torch.bool:
        valid = m
    else:
        valid = m == 0
        if not bool((valid | (m <= torch.finfo(m.dtype).min / 2)).all()):
            return None
    keep = valid[:, :1, :1, :]  # (B|1, 1, 1, Sk)
    if not torch.equal(valid, keep.expand_as(valid)):
        return None
    return keep[:, 0, 0, :].expand(b, sk)


def _encoder_plan(mask: torch.Tensor | None, b: int, sq: int, sk: int):
    """("full",) without padding, ("varlen", kv_idx, cu_k, max_k) with, None for a mask that is
    not key padding. Every layer of a forward gets the same mask tensor: it is read once."""
    if mask is None:
        return ("full",)
    key = ("encoder", b, sq, sk)
    plans = None if torch.compiler.is_compiling() else mask.__dict__.setdefault("_fuseformer_plans", {})
    if plans is not None and key in plans:
        return plans[key]
    keep = _keep_of(mask, b, sq, sk)
    if keep is None:
        plan = None
    elif bool(keep.all()):
        plan = ("full",)
    else:
        nk = keep.sum(1)
        cu_k = tnf.pad(nk.cumsum(0), (1, 0)).to(torch.int32)
        plan = ("varlen", keep.flatten().nonzero().squeeze(1), cu_k, int(nk.max()))
    if plans is not None:
        plans[key] = plan
    return plan


def _fallback(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """transformers' own sdpa attention, for what the kernel does not do (dropout while training,
    a mask that is not padding); a 2D padding mask becomes sdpa's (B, 1, 1, Sk) bool form."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = attention_mask[:, None, None, -key.shape[2] :].bool()
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
    )


def _sdpa_faster(query: torch.Tensor) -> bool:
    """Whether an unpadded batch runs faster on SDPA (its cuDNN kernel) than on ``flash_attention``: on
    CUDA at head dim <= 64 (run 137, H100, BERT-base's layer B 32 x S 512 x 12 heads: cuDNN 72.5 us,
    ours 91.4, its best config 88.0). Padded batches stay ours: packed varlen computes no padding, where
    SDPA with a mask takes its memory-efficient kernel (221 us unpadded)."""
    return query.is_cuda and query.shape[-1] <= 64


def encoder_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Bidirectional attention (BERT, RoBERTa) as a transformers attention function.

    query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D); ``attention_mask`` as the model built it: None
    (no padding), sdpa's (B, 1, Sq, Sk) bool, eager's additive float, or a (B, Sk) padding mask.
    Without padding: ``flash_attention`` on (B, S, H, D) views, or SDPA where its cuDNN kernel is the
    faster (:func:`_sdpa_faster`: CUDA, head dim <= 64). With padding: packed varlen, every
    query (pad positions included, so they get what transformers gives them: attention over the
    real tokens) against only the real keys. Returns (out (B, Sq, Hq, D), None)."""
    kwargs.pop("is_causal", None)
    b, hq, sq, d = query.shape
    sk, hkv = key.shape[2], key.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    if (
        (dropout and module.training)
        or d > MAX_HEAD_DIM
        or hq % hkv
        or query.numel() == 0
        or key.numel() == 0
        or (attention_mask is not None and not isinstance(attention_mask, torch.Tensor))
    ):
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    plan = _encoder_plan(attention_mask, b, sq, sk)
    if plan is None:
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if plan[0] == "full" and _sdpa_faster(query):
        return _fallback(module, query, key, value, None, dropout, scaling, kwargs)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D)
    if plan[0] == "full":
        return F.flash_attention(q, k, v, causal=False, softmax_scale=scale), None
    _, kv_idx, cu_k, max_k = plan
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    qp = q.reshape(b * sq, hq, d)  # (B * Sq, Hq, D): every query
    kp = k.reshape(b * sk, hkv, d).index_select(0, kv_idx)  # (Tk, Hkv, D): the real keys
    vp = v.reshape(b * sk, hkv, d).index_select(0, kv_idx)
    out = F.flash_attention(
        qp,
        kp,
        vp,
        causal=False,
        softmax_scale=scale,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=sq,
        max_seqlen_k=max_k,
    )
    return out.view(b, sq, hq, d), None
