"""``OptimizeReport``: what ``optimize`` replaced, how far each replacement is from the float64
reference against its tolerance, what it kept, reverted or left, and why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fuseformer.fusion.base import Skipped


@dataclass(eq=False, kw_only=True)
class Replacement:
    """One replacement and its verdict.

    max_error / tolerance: of the module's output against the float64 reference (DESIGN.md §3:
        tolerance = 2 x the original module's own error in the model's dtype + a floor); None when
        not verified. Kind "fp8": against the float64 model computing with the FP8 layers' dequantized
        weights, tolerance = 2 x the error of PyTorch's simulation of the same per-token e4m3
        activation rounding + the floor (``fusion/verify.py``).
    grad_error / grad_tolerance: the same for the gradients of ``params`` (the worst parameter), when
        training.
    status: "kept", "reverted" (over tolerance; kind "fp8" also when its weights are not the e4m3
        rounding of the originals) or "unverified" (``verify=False``).
    """

    path: str
    kind: str
    original: str
    replacement: str
    status: str = "unverified"
    max_error: float | None = None
    tolerance: float | None = None
    grad_error: float | None = None
    grad_tolerance: float | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "original": self.original,
            "replacement": self.replacement,
            "status": self.status,
            "max_error": self.max_error,
            "tolerance": self.tolerance,
            "grad_error": self.grad_error,
            "grad_tolerance": self.grad_tolerance,
            "note": self.note,
        }


@dataclass(eq=False)
class OptimizeReport:
    """The result of :func:`fuseformer.optimize`. ``print(report)`` shows a table;
    :meth:`to_dict` gives the same as plain data; :meth:`revert` restores the original modules."""

    model_name: str
    training: bool
    verified: bool
    fp8: bool = False
    # ||out - ref|| / ||ref|| of the model's final output against the float64 copy of the original
    # (unquantized): of the optimized model, and of the original in its own dtype. Set when verified,
    # for inference; with fp8 this is what FP8 cost.
    output_error: float | None = None
    baseline_output_error: float | None = None
    replacements: list[Replacement] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    # Set by optimize: undoes every kept replacement and any restructuring, in reverse order.
    _revert: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def kept(self) -> list[Replacement]:
        return [r for r in self.replacements if r.status != "reverted"]

    @property
    def reverted(self) -> list[Replacement]:
        return [r for r in self.replacements if r.status == "reverted"]

    def counts(self) -> dict[str, int]:
        """Kept replacements per kind: {"norm": 5, "mlp": 2, ...}."""
        out: dict[str, int] = {}
        for r in self.kept:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def revert(self) -> None:
        """Put back every original module of the model this report came from (idempotent)."""
        if self._revert is not None:
            self._revert()
            self._revert = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "training": self.training,
            "verified": self.verified,
            "fp8": self.fp8,
            "output_error": self.output_error,
            "baseline_output_error": self.baseline_output_error,
            "counts": self.counts(),
            "replacements": [r.to_dict() for r in self.replacements],
            "skipped": [s.to_dict() for s in self.skipped],
        }

    def __str__(self) -> str:
        mode = ("training" if self.training else "inference") + (", fp8" if self.fp8 else "")
        lines = [
            f"fuseformer.optimize({self.model_name}, {mode}): {len(self.kept)} kept, {len(self.reverted)} reverted"
        ]
        if not self.replacements and not self.skipped:
            lines.append("nothing to fuse: the model is unchanged")
        if self.replacements:
            rows = [("path", "kind", "original -> replacement", "max error", "tolerance", "status")]
            for r in self.replacements:
                err = _num(r.max_error) if r.grad_error is None else f"{_num(r.max_error)} / grad {_num(r.grad_error)}"
                tol = (
                    _num(r.tolerance) if r.grad_tolerance is None else f"{_num(r.tolerance)} / {_num(r.grad_tolerance)}"
                )
                rows.append((r.path or "(model)", r.kind, f"{r.original} -> {r.replacement}", err, tol, r.status))
            widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
            for i, row in enumerate(rows):
                lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
                if i == 0:
                    lines.append("  ".join("-" * w for w in widths))
        if self.output_error is not None:
            lines.append(
                f"final output vs the float64 model: relative error {_num(self.output_error)} "
                f"(the original model's: {_num(self.baseline_output_error)})"
            )
        if self.skipped:
            lines.append("left as it is:")
            lines.extend(f"  {s.path or '(model)'} [{s.kind}]: {s.reason}" for s in self.skipped)
        return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"
