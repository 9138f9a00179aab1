"""The FP8 pass of ``optimize(model, fp8=True)``: the linear layers that become FP8, for inference.

It runs after the structural pass (``fusion/hf.py``, ``hf_classic.py`` or ``fx.py``) and adds candidates of
kind ``"fp8"`` to that pass's result. Each replaces one module on its parent, on this instance only, by
its :mod:`fuseformer.layers.fp8` form (e4m3 weight with an fp32 scale per output channel, activations
quantized per token as they come); ``undo`` puts the original module object back. What is replaced
(docs/optimize.md, "FP8"):

- Hugging Face models: every ``nn.Linear`` (and GPT-2's ``Conv1D``, whose (in, out) weight is
  transposed once) inside the transformer blocks, i.e. the ModuleLists of layers of one class
  (attention q/k/v/o or packed qkv, MLP gate/up/down, BERT's query/key/value/dense), as
  :class:`Fp8Linear`. A gated MLP that the ``"mlp"`` kind fuses (its ``fused_mlp`` reads the packed
  gate/up weight) becomes one :class:`Fp8GatedMLP` instead, which keeps that fusion in FP8: one gate-up
  GEMM with act * up and the quantization in its epilogue, then the down GEMM; the ``"mlp"`` candidate
  for it is dropped.
- Any other module: every ``nn.Linear`` except an LM head (a linear whose weight is an embedding's, or
  whose output width is an embedding's vocabulary).

Left as they are, reported as skipped: the LM head (as ``LLM(quantization="fp8")`` keeps it: the logits
are what decoding reads), embeddings (lookups, no GEMM), linears outside the blocks of a Hugging Face
model (poolers, classifiers), linears whose in or out features are not multiples of 16 (the FP8 GEMMs'
alignment, cuBLASLt's for ``torch._scaled_mm``), weights that are not bf16/fp16/fp32 (the FP8 GEMMs write
those), and modules with forward hooks (offloading, adapters), which the replacement would not carry.
"""

from __future__ import annotations

import torch
from torch import nn

from fuseformer.fusion.base import Candidate, PassResult, Skipped
from fuseformer.layers.fp8 import Fp8GatedMLP, Fp8Linear

# K and N of an FP8 GEMM: multiples of 16 (cuBLASLt's FP8 rule, which torch._scaled_mm enforces).
MULTIPLE = 16
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the FP8 GEMMs' output dtypes
HEAD_REASON = (
    "the LM head stays in the model's dtype, as LLM(quantization='fp8') keeps it: the logits are what decoding reads"
)


def add_candidates(model: nn.Module, result: PassResult) -> None:
    """Add the FP8 replacements of ``model`` to ``result`` (the structural pass's), and what is left and
    why to ``result.skipped``. Nothing is changed until a candidate's ``apply`` runs."""
    names = {id(p): n for n, p in model.named_parameters()}
    blocks = _blocks(model)
    heads = _heads(model, generic=blocks is None)
    taken: set[int] = set()  # linears an FP8 MLP (or an MLP fusion that reads the weights) covers
    fp8_paths: set[str] = set()  # the linears made FP8
    for c in list(result.candidates):
        if c.kind == "mlp":
            _take_over_mlp(model, c, names, result, taken)
    for path, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            result.skipped.append(Skipped(path=path, kind="fp8", reason="an embedding is a table lookup, not a GEMM"))
            continue
        if not _is_linear(m) or id(m) in taken:
            continue
        if id(m) in heads:
            result.skipped.append(Skipped(path=path, kind="fp8", reason=heads[id(m)]))
        elif blocks is not None and not any(path.startswith(b + ".") for b in blocks):
            result.skipped.append(Skipped(path=path, kind="fp8", reason="outside the transformer blocks"))
        elif (reason := _why_not(m)) is not None:
            result.skipped.append(Skipped(path=path, kind="fp8", reason=reason))
        else:
            result.candidates.append(_linear_candidate(model, path, m, names))
            fp8_paths.add(path)
    _drop_plain_mlps(result, fp8_paths)


def _drop_plain_mlps(result: PassResult, fp8_paths: set[str]) -> None:
    """A plain MLP's fusion (the up projection's weight into cuBLASLt's GELU epilogue: GPT-2's MLP, a
    tanh-GELU ``*Intermediate``) cannot read an FP8 weight: where that linear becomes FP8, the fusion is
    dropped and reported."""
    for c in list(result.candidates):
        if c.kind == "mlp":  # gated MLPs have no ``dense`` / ``c_fc`` child (they are taken over above)
            up = next((p for p in (f"{c.path}.dense", f"{c.path}.c_fc") if p in fp8_paths), None)
            if up is not None:
                result.candidates.remove(c)
                result.skipped.append(Skipped(path=c.path, kind="mlp", reason=f"{up} is FP8 (fp8=True)"))


def _is_linear(m: nn.Module) -> bool:
    """An nn.Linear, or transformers' Conv1D (GPT-2: ``x @ W + b`` with W (in, out))."""
    return isinstance(m, nn.Linear) or (
        type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", torch.empty(0)).dim() == 2
    )


def _features(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear or Conv1D."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    return m.weight.shape[0], m.weight.shape[1]


def _why_not(m: nn.Module) -> str | None:
    """Why ``m`` (a linear) cannot be FP8 here, or None."""
    w = m.weight
    if w.dtype not in WEIGHT_DTYPES:
        return f"weight dtype {w.dtype}: the FP8 GEMMs write bfloat16, float16 or float32"
    if w.device.type == "meta":
        return "weight on the meta device"
    k, n = _features(m)
    if k % MULTIPLE or n % MULTIPLE:
        return f"in/out features {k}/{n} are not multiples of {MULTIPLE} (the FP8 GEMMs' alignment)"
    if m._forward_hooks or m._forward_pre_hooks:
        return "the module has forward hooks (offloading, adapters), which a replacement would not carry"
    return None


def _blocks(model: nn.Module) -> list[str] | None:
    """The paths of a Hugging Face model's transformer blocks (each outermost ModuleList of modules of one
    class that hold linear layers), or None for any other module (all of it is in scope)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    out: list[str] = []
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m) or any(path.startswith(b + ".") for b in out):
            continue
        if len({type(c) for c in m}) == 1 and all(any(_is_linear(s) for s in c.modules()) for c in m):
            out.append(path)
    return out


def _heads(model: nn.Module, generic: bool) -> dict[int, str]:
    """id -> reason for the LM heads: a Hugging Face model's output embeddings; in any module, a linear
    whose weight is an embedding's (tied) and, for modules that are not Hugging Face models, one whose
    output width is an embedding's vocabulary."""
    heads: dict[int, str] = {}
    get = getattr(model, "get_output_embeddings", None)
    head = None
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
    if isinstance(head, nn.Module):
        heads[id(head)] = HEAD_REASON
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    for m in model.modules():
        if not _is_linear(m) or id(m) in heads:
            continue
        if any(m.weight is e.weight for e in embeddings):
            heads[id(m)] = f"{HEAD_REASON} (its weight is an embedding's)"
        elif generic and any(_features(m)[1] == e.num_embeddings for e in embeddings):
            heads[id(m)] = f"{HEAD_REASON} (its output width is an embedding's vocabulary)"
    return heads


def _swap(model: nn.Module, path: str, old: nn.Module, new: nn.Module):
    """(apply, undo) setting ``new`` / ``old`` at ``path`` on its parent."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)

    def apply():
        setattr(parent, name, new)

    def undo():
        setattr(parent, name, old)

    return apply, undo


def _linear_candidate(model: nn.Module, path: str, m: nn.Module, names: dict[int, str]) -> Candidate:
    conv1d = not isinstance(m, nn.Linear)
    # Conv1D computes x @ W with W (K, N): the FP8 GEMM takes W^T (N, K), transposed once here.
    new = Fp8Linear.from_weight(m.weight.t().contiguous(), m.bias) if conv1d else Fp8Linear.from_linear(m)
    name = names[id(m.weight)]

    def weights() -> dict[str, torch.Tensor]:
        w = new.dequantized_weight(torch.float32)  # (N, K)
        return {name: w.t() if conv1d else w}

    apply, undo = _swap(model, path, m, new)
    k, n = _features(m)
    return Candidate(
        path=path,
        kind="fp8",
        original=f"{type(m).__name__} {k}->{n}",
        replacement="Fp8Linear",
        apply=apply,
        undo=undo,
        note="e4m3 weight per output channel, activations per token"
        + ("; Conv1D's (in, out) weight transposed" if conv1d else ""),
        weights=weights,
    )


def _gated_parts(mlp: nn.Module) -> tuple[list[nn.Linear], nn.Linear, str] | None:
    """A Hugging Face gated MLP's ([gate, up] or [gate_up], down, activation), or None when ``mlp`` is not
    one (an FX slot, an MLP of another shape)."""
    from fuseformer.fusion.hf import _activation

    act = _activation(getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None))
    down = getattr(mlp, "down_proj", None)
    if act is None or not isinstance(down, nn.Linear):
        return None
    if isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear):
        return [mlp.gate_up_proj], down, act
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if isinstance(gate, nn.Linear) and isinstance(up, nn.Linear):
        return [gate, up], down, act
    return None


def _take_over_mlp(model: nn.Module, c: Candidate, names: dict[int, str], result: PassResult, taken: set[int]):
    """An MLP the "mlp" kind fuses. Without biases that fusion runs ``fused_mlp`` on the weights
    themselves, which FP8 linears would not give it: the MLP becomes one Fp8GatedMLP (the fusion kept, in
    FP8) in place of the "mlp" candidate, or, when its linears cannot be FP8, stays with that candidate.
    With biases the fusion calls the linears as modules, so they become Fp8Linear each, below."""
    try:
        mlp = model.get_submodule(c.path)
    except AttributeError:
        return
    parts = _gated_parts(mlp)
    if parts is None:
        return
    gate_up, down, act = parts
    linears = [*gate_up, down]
    if any(m.bias is not None for m in linears):
        return
    taken.update(id(m) for m in linears)
    reason = next((r for r in map(_why_not, linears) if r is not None), None)
    if reason is not None:
        why = f"{reason}; the mlp fusion reads its weights, so its linears stay as they are"
        result.skipped.append(Skipped(path=c.path, kind="fp8", reason=why))
        return
    inter = down.in_features
    new = Fp8GatedMLP(down.out_features, inter, act, dtype=down.weight.dtype, device="meta")
    # Quantized per output channel: the packed (2I, H) rows are the gate's and the up's own, stacked.
    new.gate_up_proj = Fp8Linear.from_weight(torch.cat([m.weight.detach() for m in gate_up]))
    new.down_proj = Fp8Linear.from_linear(down)
    gate_up_names = [names[id(m.weight)] for m in gate_up]
    down_name = names[id(down.weight)]

    def weights() -> dict[str, torch.Tensor]:
        gu = new.gate_up_proj.dequantized_weight(torch.float32)  # (2I, H): rows [0, I) gate, [I, 2I) up
        out = {down_name: new.down_proj.dequantized_weight(torch.float32)}
        out.update(zip(gate_up_names, gu.split(gu.shape[0] // len(gate_up_names))))
        return out

    apply, undo = _swap(model, c.path, mlp, new)
    result.candidates.remove(c)
    result.candidates.append(
        Candidate(
            path=c.path,
            kind="fp8",
            original=type(mlp).__name__,
            replacement=f"Fp8GatedMLP ({act})",
            apply=apply,
            undo=undo,
            note="the mlp fusion in FP8: gate/up packed, act * up and its quantization in the gate-up GEMM",
            weights=weights,
        )
    )
