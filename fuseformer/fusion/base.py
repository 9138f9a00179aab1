"""What a fusion pass hands to ``optimize``: candidates that can be applied and undone one by one.

A pass (``fusion/hf.py`` for known Hugging Face architectures, ``fusion/fx.py`` for any other
module) looks at one model instance and returns a :class:`PassResult`. Nothing it returns has
changed the model's numbers yet: ``optimize`` runs the model once as it is (and once as a float64
copy), then calls each candidate's ``apply``, runs it again, and calls ``undo`` on every candidate
whose output (or gradient) is over the DESIGN.md §3 tolerance.

A pass may restructure the model before it returns, as long as the restructured model computes
exactly what the original did (the FX pass swaps a traced GraphModule in for the module it traced);
``PassResult.restore`` puts the original structure back, and ``optimize`` calls it when every
candidate of that pass ends up reverted, or on ``revert``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# The kinds of replacement, as ``include``/``exclude`` name them. "linear" (a float32 CPU model's
# nn.Linear as layers.Linear, ``fusion/linear.py``) is made for any model, after the other kinds. "fp8"
# (linear layers with e4m3 weights, ``fusion/fp8.py``) is made only by ``optimize(model, fp8=True)``.
KINDS = ("norm", "mlp", "attention", "loss", "linear", "fp8")


@dataclass(eq=False, kw_only=True)
class Candidate:
    """One replacement a pass can make.

    path: dotted path (``model.get_submodule(path)``) of the module whose forward output verification
        compares, before and after ``apply`` (``""`` is the model itself). It must exist, with the
        same meaning, before and after ``apply``.
    kind: one of :data:`KINDS`.
    original, replacement: what is replaced by what, for the report ("LlamaRMSNorm",
        "fuseformer RMSNorm (+ residual add)").
    apply, undo: install the replacement on this instance only, and put back exactly what was
        there (the same module objects, the same parameters). Both idempotent.
    params: the prefix of the parameters (their names in ``model.named_parameters()``) whose
        gradients are compared when training; ``None`` means ``path``.
    select: picks the tensor to compare from the module's forward output; ``None`` means the output
        itself if it is a tensor, else its first tensor (a ModelOutput's ``loss`` when it has one is
        not chosen by default: a loss candidate passes ``select``).
    note: anything the report should say ("packed gate/up in place", "swiglu between the linears").
    weights: for a replacement that computes with other weight values than the parameters hold (kind
        "fp8": the e4m3 weights times their scales): parameter name (in ``model.named_parameters()``
        before any replacement) -> the value it computes with, in the parameter's layout; the modules
        holding those parameters are the linears whose inputs it quantizes. Verification builds its FP8
        reference and baseline from these (``fusion/verify.py``); ``None`` for the other kinds.
    """

    path: str
    kind: str
    original: str
    replacement: str
    apply: Callable[[], None]
    undo: Callable[[], None]
    params: str | None = None
    select: Callable[[Any], torch.Tensor | None] | None = None
    note: str = ""
    weights: Callable[[], dict[str, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Candidate: kind must be one of {KINDS}, got {self.kind!r}")


@dataclass(eq=False, kw_only=True)
class Skipped:
    """Something a pass saw and left as it is, and why (an unsupported head dim, an untraceable
    module, a structure it does not know)."""

    path: str
    kind: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "kind": self.kind, "reason": self.reason}


@dataclass(eq=False, kw_only=True)
class PassResult:
    """A pass's answer: what it can replace, what it left and why, and how to undo any
    restructuring it did while looking (``None``: it did none)."""

    name: str
    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    restore: Callable[[], None] | None = None
