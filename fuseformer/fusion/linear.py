"""The ``"linear"`` kind of ``optimize``: a CPU float32 model's ``nn.Linear`` layers as
``fuseformer.layers.Linear``, whose forward is ``cpu_linear`` (ops/_cpu_linear.py): at a decode step's
few rows (<= 4) and out_features >= in_features it computes the same product as ``(W @ x^T)^T``, which
MKL streams ~2x faster than ``F.linear``'s gemv; any other call is ``F.linear`` as before.

It runs after the structural pass (``fusion/hf.py``, ``hf_classic.py`` or ``fx.py``) and the FP8 pass, so
it serves any module, and adds its candidates to their result. What it leaves (docs/optimize.md,
"linear"):

- every linear of a model that is not float32 on the CPU: on a GPU, or in bf16/fp16, ``cpu_linear`` is
  ``F.linear``, so there is nothing to gain; one Skipped entry for the whole model says so;
- a linear that is not exactly ``torch.nn.Linear`` (a subclass: ours, FP8 layers, quantized or
  parametrized linears), or whose weight or bias is not a plain contiguous float32 CPU Parameter;
- a linear that another candidate stops calling as a module (not reported: it is replaced anyway): those
  of an MLP the ``"mlp"`` kind fuses (``fused_mlp`` reads their weights; its CPU path already uses
  ``cpu_linear``), those an ``"fp8"`` candidate replaces, and the LM head a ``"loss"`` candidate folds into
  ``fused_linear_cross_entropy``;
- a linear whose ``forward`` is set on the instance (a hook library's wrapper), which a class change
  would not reach.
"""

from __future__ import annotations

import torch
from torch import nn

from fuseformer.fusion.base import Candidate, PassResult, Skipped
from fuseformer.layers.linear import Linear

# Kinds whose candidate at ``path`` replaces the linears inside that module with something that reads
# their weights (HF "mlp": fused_mlp on the packed gate/up weight; "fp8": FP8 layers). An FX "mlp"
# candidate's path is its parameter-free slot, which holds no linear: the traced code still calls them.
_TAKES_LINEARS_UNDER_PATH = ("mlp", "fp8")


def add_candidates(model: nn.Module, result: PassResult) -> None:
    """Add a ``"linear"`` candidate for each ``nn.Linear`` of ``model`` that the other candidates in
    ``result`` leave called as a module, or a Skipped entry saying why there are none. Nothing is
    changed until a candidate's ``apply`` runs."""
    floats = [p for p in model.parameters() if p.is_floating_point()]
    other = next((p for p in floats if p.dtype != torch.float32 or p.device.type != "cpu"), None)
    if other is not None:
        result.skipped.append(
            Skipped(
                path="",
                kind="linear",
                reason=f"parameters in {other.dtype} on {other.device}: the faster decode product of "
                "layers.Linear is for float32 on the CPU (elsewhere it is F.linear)",
            )
        )
        return
    taken = _taken(model, result.candidates)
    for path, m in model.named_modules():
        if type(m) is not nn.Linear or id(m) in taken:
            continue
        reason = _why_not(m)
        if reason is not None:
            result.skipped.append(Skipped(path=path, kind="linear", reason=reason))
        else:
            result.candidates.append(_candidate(path, m))


def _taken(model: nn.Module, candidates: list[Candidate]) -> set[int]:
    """ids of the linears that ``candidates`` stop calling as modules (module docstring)."""
    taken: set[int] = set()
    for c in candidates:
        if c.kind in _TAKES_LINEARS_UNDER_PATH:
            taken.update(id(m) for m in model.get_submodule(c.path).modules() if isinstance(m, nn.Linear))
        elif c.kind == "loss" and c.params is not None:
            # ``params`` names the head's weight (HF: "lm_head.weight", or the embedding's when tied) or
            # the head module (FX: "lm_head"): match the linears by their weight Parameter.
            prefix = c.params
            heads = {
                id(p)
                for n, p in model.named_parameters(remove_duplicate=False)
                if n == prefix or n.startswith(prefix + ".")
            }
            taken.update(id(m) for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in heads)
    return taken


def _why_not(m: nn.Linear) -> str | None:
    for name in ("weight", "bias"):
        p = getattr(m, name)
        if p is None and name == "bias":
            continue
        if type(p) is not nn.Parameter or p.dtype != torch.float32 or p.device.type != "cpu":
            return f"{name} is not a float32 CPU Parameter ({type(p).__name__}, {getattr(p, 'dtype', None)})"
    if not m.weight.is_contiguous():
        return "weight is not contiguous (the fast form needs a row-major (out, in) weight)"
    if "forward" in m.__dict__:
        return "its forward is set on the instance (a hook library's wrapper?), which a class change would not reach"
    return None


def _candidate(path: str, m: nn.Linear) -> Candidate:
    # The swap sets this instance's __class__ to layers.Linear, an nn.Linear subclass that only overrides
    # forward (no state of its own), and undo sets it back. Rather than a new module in the parent's slot:
    # the module stays the very object it was, so everything holding it keeps it (a module registered
    # at two paths, the user's references, the FX pass's traced code, other candidates that swap their
    # own slots), with its parameters, hooks, state-dict keys and isinstance(m, nn.Linear); apply and undo
    # touch nothing but this instance, so they commute with every other candidate's.
    original = type(m)

    def apply() -> None:
        if type(m) is original:
            m.__class__ = Linear

    def undo() -> None:
        if type(m) is Linear:
            m.__class__ = original

    return Candidate(
        path=path,
        kind="linear",
        original=f"Linear {m.in_features}->{m.out_features}",
        replacement="fuseformer Linear (cpu_linear)",
        apply=apply,
        undo=undo,
        note="this instance's class set to layers.Linear: (W @ x^T)^T at <= 4 rows when out >= in, else F.linear",
    )
