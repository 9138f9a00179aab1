"""Verification: the model as it was, a float64 copy of it, and the fused model run the same sample
inputs; every replaced module's output (and, when training, the gradients of its parameters) is
compared with the DESIGN.md §3 criterion through forward hooks.

For a module output ``out`` of the fused model, ``base`` of the original model in its own dtype and
``ref`` of the float64 copy, the replacement passes when
``max|out - ref| <= 2 * max|base - ref| + floor(dtype) * max(1, max|ref|)``
(``fuseformer.testing.tolerance``). The original model's own error sets the bar, so a model in bf16
is held to what bf16 PyTorch achieves, and errors that build up through the layers count on both
sides alike.

FP8 replacements (kind ``"fp8"``, ``optimize(model, fp8=True)``) cannot meet that bar: rounding each
activation to e4m3 (3 mantissa bits) costs far more than bf16 does. They are judged after every other
replacement has been (which keeps its §3 verdict, taken without FP8), with the same formula on two
other runs:

- ``ref``: the float64 copy whose FP8-replaced weights are the FP8 layers' own dequantized weights
  (``Fp8Linear.dequantized_weight()``, :attr:`Candidate.weights`), so the weight rounding, a choice
  made once and seen in full here, is not counted, and only what the FP8 layers do to the activations
  is judged;
- ``base`` (:func:`fp8_baseline`): the original model, its own modules in its own dtype, computing with
  those same dequantized weights (``torch.func.functional_call``; the model is not touched) and with
  the input of every linear an FP8 layer replaces rounded to e4m3 per token in PyTorch
  (``quantize_fp8_ref``, then times its scale). That is PyTorch's own error for the FP8 computation,
  the baseline of §3's "kernel error <= 2 x PyTorch's error", and it owes nothing to the FP8 modules'
  code, so a mistake there (a scale, the gate/up order, the activation) shows.

So an FP8 layer passes when its output is within 2x (plus the floor) of what per-token e4m3 rounding
of its inputs costs in PyTorch, against the exact computation with the same FP8 weights. Its weights
are checked first (:func:`fp8_weight_error`): each must be the e4m3 rounding of the original
parameter, element by element (at most 2^-4 of it, e4m3's half ulp, plus e4m3's subnormal step at
the tensor's scale); a layer whose weights are not is reverted before anything runs.
``Fp8GatedMLP`` quantizes its intermediate activation per 128-column group, finer than the per-token
rounding the baseline applies there, so it is held to the per-token bar. What FP8 costs as a whole
is recorded apart: :func:`rel_error` of the model's final output against the unquantized float64
copy (``OptimizeReport.output_error``), next to the original model's own (``baseline_output_error``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fuseformer.ops as F
from fuseformer.fusion.base import Candidate
from fuseformer.ops.quant_fp8 import FP8_MAX
from fuseformer.testing import FLOOR, max_err, tolerance

# The float64 copy doubles or quadruples the model's memory; past this many parameters the
# reference is float32 instead (still 2-4x the precision of the bf16/fp16 models that large).
FLOAT64_MAX_PARAMS = 3_000_000_000
SAMPLE_BATCH, SAMPLE_SEQ = 2, 16
# With fp8=True: 2 x 48 = 96 tokens, past the 64 (mlp_decode.DECODE_MAX_T) up to which the FP8 layers on
# CUDA leave activations unquantized (weight-only decode path), so the default sample judges the W8A8
# path, where the activation rounding is.
FP8_SAMPLE_SEQ = 48


@dataclass(eq=False)
class Run:
    """One run of a model on the sample inputs: the compared output of each path, and the
    parameters' gradients by name (training only)."""

    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    final: torch.Tensor | None = None  # the model's own output tensor (``first_tensor``)


def normalize_inputs(sample_inputs: Any) -> tuple[tuple, dict]:
    """``sample_inputs`` as (args, kwargs): a tensor is one positional argument, a tuple or list the
    positional arguments, a mapping (a dict, a tokenizer's BatchEncoding) the keyword arguments."""
    if isinstance(sample_inputs, torch.Tensor):
        return (sample_inputs,), {}
    if isinstance(sample_inputs, Mapping):
        if not all(isinstance(k, str) for k in sample_inputs):
            raise TypeError("optimize: sample_inputs as a mapping must have str keys (keyword arguments)")
        return (), dict(sample_inputs)
    if isinstance(sample_inputs, (tuple, list)):
        return tuple(sample_inputs), {}
    raise TypeError(
        "optimize: sample_inputs must be a tensor, a tuple/list of positional arguments or a dict of "
        f"keyword arguments, got {type(sample_inputs).__name__}"
    )


def build_inputs(model: nn.Module, training: bool, seq: int = SAMPLE_SEQ) -> tuple[tuple, dict]:
    """Sample inputs made from the model itself, (SAMPLE_BATCH, ``seq``): token ids for a Hugging Face
    model or a model that starts with an embedding (plus labels for a causal LM when training), else a
    float tensor of the first layer's width. ValueError when neither tells the input."""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0 and getattr(model, "main_input_name", "input_ids") == "input_ids":
        max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if isinstance(max_pos, int) and max_pos > 0:
            seq = min(seq, max_pos)
        ids = torch.randint(0, vocab, (SAMPLE_BATCH, seq), generator=gen).to(device)
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if training and _is_causal_lm(model):
            kwargs["labels"] = ids.clone()
        return (), kwargs
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return (torch.randint(0, m.num_embeddings, (SAMPLE_BATCH, seq), generator=gen).to(device),), {}
        width = m.in_features if isinstance(m, nn.Linear) else None
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and len(m.normalized_shape) == 1:
            width = m.normalized_shape[0]
        if width:
            dtype = param.dtype if param is not None and param.dtype.is_floating_point else torch.float32
            x = torch.randn(SAMPLE_BATCH, seq, width, generator=gen).to(device=device, dtype=dtype)
            return (x,), {}
    raise ValueError(
        f"optimize: cannot tell what {type(model).__name__} takes as input; pass sample_inputs "
        "(a tensor, a tuple of arguments or a dict of keyword arguments)"
    )


def _is_causal_lm(model: nn.Module) -> bool:
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def reference_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the model in float64 (float32 past :data:`FLOAT64_MAX_PARAMS` parameters)."""
    n = sum(p.numel() for p in model.parameters())
    dtype = torch.float64 if n <= FLOAT64_MAX_PARAMS else torch.float32
    return copy.deepcopy(model).to(dtype)


def fp8_weight_error(model: nn.Module, c: Candidate) -> str | None:
    """Why the weights ``c`` computes with (:attr:`Candidate.weights`) are not the e4m3 rounding of
    ``model``'s parameters of the same names, or None when they are: for each element
    ``|w8 - w| <= 2^-4 |w| (1 + 1e-3) + max|w| / 448 * 2^-10`` (round to nearest with 3 mantissa bits;
    the subnormal step at the largest per-channel scale)."""
    for name, w8 in (c.weights() if c.weights is not None else {}).items():
        w = model.get_parameter(name).detach().double()
        err = (w8.double().to(w.device) - w).abs()
        bound = w.abs() * (2.0**-4 * (1 + 1e-3)) + w.abs().max() / FP8_MAX * 2.0**-10
        if w8.shape != w.shape or not bool((err <= bound).all()):
            worst = (err - bound).max().item() if w8.shape == w.shape else float("inf")
            return f"FP8 weight for {name} is not the e4m3 rounding of the parameter (over the bound by {worst:.2e})"
    return None


def fp8_baseline(model: nn.Module, args: tuple, kwargs: dict, candidates: list[Candidate]) -> Run:
    """The FP8 candidates' baseline run (module doc): ``model`` with none of them applied, computing with
    their weights (:attr:`Candidate.weights`, cast to each parameter's dtype) and with the input of each
    module holding one of those weights rounded to e4m3 per token. ``model`` is left as it was."""
    weights: dict[str, torch.Tensor] = {}
    for c in candidates:
        for name, w in (c.weights() if c.weights is not None else {}).items():
            weights[name] = w.to(model.get_parameter(name).dtype)
    owners = {name.rpartition(".")[0] for name in weights}
    hooks = [model.get_submodule(path).register_forward_pre_hook(_round_input_fp8) for path in sorted(owners)]
    try:
        return run(model, args, kwargs, candidates, False, weights=weights)
    finally:
        for h in hooks:
            h.remove()


def _round_input_fp8(module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the first argument x (..., K) as e4m3 per token times its scale, in x's dtype."""
    x = args[0]
    q, scale = F.quantize_fp8_ref(x)  # (..., K) e4m3, (..., 1) fp32
    return ((q.float() * scale).to(x.dtype), *args[1:])


def use_fp8_weights(ref_model: nn.Module, candidates: Iterable[Candidate]) -> None:
    """Give the reference copy the weights the candidates compute with (:attr:`Candidate.weights`: the
    FP8 layers' dequantized weights), in place, in its dtype."""
    with torch.no_grad():
        for c in candidates:
            if c.weights is None:
                continue
            for name, w in c.weights().items():
                p = ref_model.get_parameter(name)
                p.copy_(w.to(device=p.device, dtype=p.dtype))


def rel_error(out: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    """``||out - ref|| / ||ref||`` (Frobenius, in float64) over the finite elements of ``ref``; None when
    either is missing or the shapes differ."""
    if out is None or ref is None or out.shape != ref.shape:
        return None
    o, r = out.detach().double(), ref.detach().double().to(out.device)
    finite = torch.isfinite(r)
    den = r[finite].norm().item()
    num = (o[finite] - r[finite]).norm().item()
    return num / den if den > 0 else num


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Floating-point tensors among the inputs cast to ``dtype`` (for the reference copy)."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        if isinstance(x, (tuple, list)):
            return type(x)(cast(v) for v in x)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x

    return cast(args), cast(kwargs)


def first_tensor(out: Any) -> torch.Tensor | None:
    """The tensor a module's output stands for: itself, a ModelOutput's ``logits`` or
    ``last_hidden_state``, else the first tensor found in it."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        for key in ("logits", "last_hidden_state"):
            if isinstance(out.get(key), torch.Tensor):
                return out[key]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for v in out:
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def run(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    candidates: Iterable[Candidate],
    training: bool,
    names: dict[int, str] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Run:
    """Run ``model`` once in eval mode (no dropout), recording each candidate's compared output
    (with ``weights``: those parameters' values instead of the model's, by name, for this call only);
    when ``training``, backpropagate a scalar (the output's ``loss`` when it has one, else the
    first output tensor against a fixed random probe) and record every parameter's gradient, by
    the name ``names`` gives its object (the names before any replacement moved it; default: its
    name in ``model``). The parameters' ``.grad`` and the modules' modes are left as they were."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for c in candidates:
        module = model.get_submodule(c.path)
        hooks.append(module.register_forward_hook(_recorder(outputs, c.path, c.select or first_tensor)))
    modes = [(m, m.training) for m in model.modules()]
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    grads: dict[str, torch.Tensor] = {}
    try:
        model.eval()
        with torch.set_grad_enabled(training):
            if weights:
                out = torch.func.functional_call(model, weights, args, kwargs, strict=False)
            else:
                out = model(*args, **kwargs)
            final = first_tensor(out)
            final = final.detach().clone() if isinstance(final, torch.Tensor) else None
            if training:
                for p in params:
                    p.grad = None
                _scalar(out).backward()
                if names is None:
                    names = {id(p): n for n, p in model.named_parameters()}
                grads = {names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None and id(p) in names}
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes:
            m.training = mode
        for p, g in zip(params, saved_grads):
            p.grad = g
    return Run(outputs, grads, final)


def _recorder(outputs: dict, path: str, select: Callable[[Any], torch.Tensor | None]):
    def hook(module, inputs, output):
        t = select(output)
        if isinstance(t, torch.Tensor):
            # The last call counts (a module run twice, e.g. under activation checkpointing).
            outputs[path] = t.detach().clone()

    return hook


def _scalar(out: Any) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else None
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.float().reshape(())
    t = first_tensor(out)
    if t is None or not t.is_floating_point():
        raise ValueError("optimize: with training=True the model's output must hold a floating-point tensor or a loss")
    probe = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.device)
    return (t.float() * probe).sum()


@dataclass(eq=False)
class Verdict:
    max_error: float | None
    tolerance: float | None
    grad_error: float | None
    grad_tolerance: float | None
    passed: bool
    note: str = ""


def _scalar_dtype(c: Candidate, base: Run, dtype: torch.dtype) -> torch.dtype:
    """The dtype whose floor judges a one-element output (a loss): that of the candidate's parameters'
    gradients (the model's compute dtype, bf16 for a bf16 model), else ``dtype``.

    A bf16 model's fp32 loss is one draw of the baseline's error, which can be small by chance: two
    outputs with the same error spread fail a 2x check on one draw ~30% of the time, (2/pi) atan(1/2).
    The GPU test's Llama reverted its loss at 1.3e-3 against 2 x 3.4e-4 (run 142) where every gradient,
    a tensor with a baseline of many draws, passed. So the scalar gets the floor of the precision it was
    computed from (8e-3 of the loss in bf16: its third digit) and its gradients keep the 2x check."""
    prefix = c.path if c.params is None else c.params
    for name, g in base.grads.items():
        if (not prefix or name == prefix or name.startswith(prefix + ".")) and g.dtype in FLOOR:
            return g.dtype if FLOOR[g.dtype] > FLOOR[dtype] else dtype
    return dtype


def judge(c: Candidate, fused: Run, base: Run, ref: Run, training: bool) -> Verdict:
    """The §3 verdict for one candidate: its output and, when training, its parameters' gradients."""
    if c.path not in fused.outputs or c.path not in base.outputs or c.path not in ref.outputs:
        return Verdict(None, None, None, None, True, "not reached by the sample inputs: unverified")
    out, base_out, ref_out = fused.outputs[c.path], base.outputs[c.path], ref.outputs[c.path]
    if out.shape != ref_out.shape:
        return Verdict(None, None, None, None, False, f"output shape {tuple(out.shape)} != {tuple(ref_out.shape)}")
    dtype = base_out.dtype if base_out.dtype in FLOOR else torch.float32
    if out.numel() == 1:
        dtype = _scalar_dtype(c, base, dtype)
    err, tol = max_err(out, ref_out), tolerance(ref_out, base_out, dtype)
    passed = err <= tol
    grad_err = grad_tol = None
    if training:
        prefix = c.path if c.params is None else c.params
        worst = None
        for name, g in fused.grads.items():
            if prefix and name != prefix and not name.startswith(prefix + "."):
                continue
            if name not in base.grads or name not in ref.grads:
                continue
            e, t = max_err(g, ref.grads[name]), tolerance(ref.grads[name], base.grads[name], dtype)
            if worst is None or e / t > worst[0] / worst[1]:
                worst = (e, t)
        if worst is not None:
            grad_err, grad_tol = worst
            passed = passed and grad_err <= grad_tol
    return Verdict(err, tol, grad_err, grad_tol, passed)
