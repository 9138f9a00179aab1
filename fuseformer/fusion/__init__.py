"""Automatic fusion of the models users already have: ``fuseformer.optimize(model)``.

Known Hugging Face architectures go through ``fusion/hf.py`` (and ``hf_classic.py`` for GPT-2, BERT,
RoBERTa), which use transformers' own extension points; any other module through the torch.fx
pattern pass of ``fusion/fx.py``. Every replacement is made on the one model instance given,
checked against a float64 copy (``fusion/verify.py``), and reverted when over tolerance.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fuseformer.fusion.base import KINDS, Candidate, PassResult, Skipped
from fuseformer.fusion.report import OptimizeReport, Replacement

__all__ = ["KINDS", "OptimizeReport", "Replacement", "Skipped", "optimize", "revert"]

# The report of each optimized model, so that a second optimize is a no-op and revert(model)
# finds what to undo. Weak: it keeps no model alive, and a deep copy of an optimized model is
# not taken for the original.
_REPORTS: weakref.WeakKeyDictionary[nn.Module, OptimizeReport] = weakref.WeakKeyDictionary()


def optimize(
    model: nn.Module,
    *,
    training: bool | None = None,
    verify: bool = True,
    sample_inputs: Any = None,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
) -> OptimizeReport:
    """Replace the fusable parts of ``model`` with fuseformer's fused ops, in place, on this
    instance only (no class and nothing process-wide is patched), and check each replacement.

    Args:
        model: any ``nn.Module``; Hugging Face models of known architectures (Llama, Mistral, Qwen2,
            Qwen3, Gemma 1-3, Phi-3, GPT-2, BERT, RoBERTa) use transformers' extension points,
            anything else a torch.fx pattern pass.
        training: replace for training too (gradients verified; the causal-LM loss becomes the
            fused linear cross-entropy). None: ``model.training``.
        verify: run the original model, a float64 copy and the fused model on ``sample_inputs``;
            any replacement whose output (or gradient) is over the DESIGN.md §3 tolerance is
            reverted and reported.
        sample_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments for
            ``model(...)``. None: built from the model's config (token ids, 2 x 16) or its first
            layer's width.
        include, exclude: kinds of replacement to make or to leave: ``"norm"``, ``"mlp"``,
            ``"attention"``, ``"loss"``.

    Returns an :class:`OptimizeReport` (print it for a table). Calling ``optimize`` again on the same
    model changes nothing and returns the first report; ``report.revert()`` or
    :func:`fuseformer.revert` restores the original modules.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(verify, bool):
        raise TypeError(f"optimize: verify must be a bool, got {verify!r}")
    if training is not None and not isinstance(training, bool):
        raise TypeError(f"optimize: training must be a bool or None, got {training!r}")
    kinds = _kinds(include, exclude)
    if model in _REPORTS:
        return _REPORTS[model]
    training = model.training if training is None else training

    from fuseformer.fusion import verify as V

    given = sample_inputs is not None
    if given:
        args, kwargs = V.normalize_inputs(sample_inputs)
    elif verify:
        args, kwargs = V.build_inputs(model, training)
    else:
        args, kwargs = (), {}

    if given:
        # Bad input fails here, before anything is touched.
        try:
            with torch.no_grad():
                V.run(model, args, kwargs, (), training=False)
        except Exception as e:
            raise ValueError(
                f"optimize: sample_inputs do not run through {type(model).__name__}: {type(e).__name__}: {e}"
            ) from e

    result = _find(model, training, kinds, args, kwargs)
    report = OptimizeReport(model_name=type(model).__name__, training=training, verified=verify)
    report.skipped = list(result.skipped)
    cands = list(result.candidates)
    records = {
        id(c): Replacement(path=c.path, kind=c.kind, original=c.original, replacement=c.replacement, note=c.note)
        for c in cands
    }
    report.replacements = [records[id(c)] for c in cands]

    applied: list[Candidate] = []

    def undo_all() -> None:
        for c in reversed(applied):
            c.undo()
        applied.clear()
        if result.restore is not None:
            result.restore()
        _REPORTS.pop(model, None)

    try:
        if verify and cands:
            # Gradients are matched by parameter object: replacements share the original
            # parameters, though they may hold them under other module paths.
            names = {id(p): n for n, p in model.named_parameters()}
            base = V.run(model, args, kwargs, cands, training, names)
            ref_model = V.reference_copy(model)
            ref_dtype = next(ref_model.parameters()).dtype
            ref_args, ref_kwargs = V.cast_inputs(args, kwargs, ref_dtype)
            ref = V.run(ref_model, ref_args, ref_kwargs, cands, training)
            del ref_model
        for c in cands:
            c.apply()
            applied.append(c)
        if verify and cands:
            live = list(cands)
            while live:
                fused = V.run(model, args, kwargs, live, training, names)
                verdicts = {id(c): V.judge(c, fused, base, ref, training) for c in live}
                for c in live:
                    v, r = verdicts[id(c)], records[id(c)]
                    r.max_error, r.tolerance = v.max_error, v.tolerance
                    r.grad_error, r.grad_tolerance = v.grad_error, v.grad_tolerance
                    r.status = "kept" if v.passed else "reverted"
                    r.note = c.note if not v.note else f"{c.note}; {v.note}" if c.note else v.note
                culprit = _culprit(live, verdicts, list(fused.outputs))
                if culprit is None:
                    break
                culprit.undo()
                applied.remove(culprit)
                live.remove(culprit)
                records[id(culprit)].status = "reverted"
    except Exception:
        undo_all()
        raise

    if not applied and result.restore is not None:
        result.restore()
    elif applied:
        report._revert = undo_all
        _REPORTS[model] = report
    return report


def revert(model: nn.Module) -> bool:
    """Restore the modules ``optimize`` replaced in ``model``. Returns False when there was nothing
    to restore."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"revert: model must be a torch.nn.Module, got {type(model).__name__}")
    report = _REPORTS.get(model)
    if report is None:
        return False
    report.revert()
    return True


def _culprit(live: list[Candidate], verdicts: dict, order: list[str]) -> Candidate | None:
    """The one failing replacement to revert this round. An output depends only on the modules
    run before it, so the first output over tolerance (in execution order) is to blame for itself;
    a gradient depends on the modules run after it, so when every output passes, the last gradient
    over tolerance is. The others are judged again once it is reverted."""
    pos = {path: i for i, path in enumerate(order)}
    failed = [c for c in live if not verdicts[id(c)].passed]
    if not failed:
        return None
    out_failed = [c for c in failed if not _output_passed(verdicts[id(c)])]
    if out_failed:
        return min(out_failed, key=lambda c: pos.get(c.path, -1))
    return max(failed, key=lambda c: pos.get(c.path, len(order)))


def _output_passed(v) -> bool:
    return v.max_error is not None and v.max_error <= v.tolerance


def _kinds(include: Iterable[str] | None, exclude: Iterable[str] | None) -> frozenset[str]:
    def parse(name: str, value: Iterable[str] | None) -> frozenset[str]:
        if value is None:
            return frozenset()
        if isinstance(value, str):
            value = (value,)
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"optimize: {name} must be a list of kinds from {KINDS}, got {value!r}") from None
        for k in items:
            if k not in KINDS:
                raise ValueError(f"optimize: {name} has unknown kind {k!r}; kinds are {', '.join(KINDS)}")
        return frozenset(items)

    inc = parse("include", include) if include is not None else frozenset(KINDS)
    return inc - parse("exclude", exclude)


def _find(model: nn.Module, training: bool, kinds: frozenset[str], args: tuple, kwargs: dict) -> PassResult:
    """The HF pass for architectures it knows, else the FX pass."""
    from fuseformer.fusion import hf

    result = hf.find_candidates(model, training=training, kinds=kinds)
    if result is not None:
        return result
    from fuseformer.fusion import fx

    return fx.find_candidates(model, training=training, kinds=kinds, sample_args=args, sample_kwargs=kwargs)
