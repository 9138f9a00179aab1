"""Automatic fusion of the models users already have: ``fuseformer.optimize(model)``.

Known Hugging Face architectures go through ``fusion/hf.py`` (and ``hf_classic.py`` for GPT-2, BERT,
RoBERTa), which use transformers' own extension points; any other module through the torch.fx
pattern pass of ``fusion/fx.py``. With ``fp8=True``, ``fusion/fp8.py`` then adds the FP8 linear layers
(inference); last, ``fusion/linear.py`` gives a float32 CPU model's remaining linears the CPU's faster
decode product. Every replacement is made on the one model instance given, checked against a float64 copy
(``fusion/verify.py``; FP8 ones by their own criterion there), and reverted when over tolerance.
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
    fp8: bool = False,
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
            reverted and reported. FP8 replacements have their own criterion (below).
        sample_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments for
            ``model(...)``. None: built from the model's config (token ids, 2 x 16; 2 x 48 with
            ``fp8``) or its first layer's width.
        include, exclude: kinds of replacement to make or to leave: ``"norm"``, ``"mlp"``,
            ``"attention"``, ``"loss"``, ``"linear"``, ``"fp8"`` (made only with ``fp8=True``).
            ``"linear"``: on a model whose parameters are float32 on the CPU, each ``torch.nn.Linear``
            (exactly that class) that no other replacement covers becomes a ``fuseformer.layers.Linear``
            (the same object, its class set on this instance), whose decode steps (<= 4 rows) take the
            CPU's faster form of the same product (``ops/_cpu_linear.py``): faster HF ``generate`` on a
            CPU. Elsewhere none is made (one "left as it is" line says why).
        fp8: inference only. The linear layers of the transformer blocks (any other module: every
            ``nn.Linear`` but an LM head) become FP8 (``fuseformer.layers.fp8``: e4m3 weights with a
            scale per output channel, activations quantized per token), as replacements of kind
            ``"fp8"``; an MLP the ``"mlp"`` kind fuses becomes one ``Fp8GatedMLP``. The LM head,
            embeddings and layers whose in/out features are not multiples of 16 stay, reported as
            skipped. Each FP8 layer is verified against the float64 model computing with its own
            dequantized weights, within 2x of PyTorch's simulation of the same per-token e4m3
            activation rounding (``fusion/verify.py``); ``report.output_error`` is the final
            output's relative error against the unquantized float64 model. Fast on Hopper GPUs
            (H100, H200); the CPU runs the reference math.

    Returns an :class:`OptimizeReport` (print it for a table). Calling ``optimize`` again on the same
    model changes nothing and returns the first report (ValueError if ``fp8`` differs from the first
    call's: revert first); ``report.revert()`` or :func:`fuseformer.revert` restores the original
    modules.

    Raises:
        TypeError: ``model``, ``verify``, ``training`` or ``fp8`` of the wrong type.
        ValueError: unknown kinds; ``fp8=True`` when training (FP8 training is ``TrainConfig(fp8=True)``);
            ``sample_inputs`` that do not run through the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(verify, bool):
        raise TypeError(f"optimize: verify must be a bool, got {verify!r}")
    if training is not None and not isinstance(training, bool):
        raise TypeError(f"optimize: training must be a bool or None, got {training!r}")
    if not isinstance(fp8, bool):
        raise TypeError(f"optimize: fp8 must be a bool, got {fp8!r}")
    kinds = _kinds(include, exclude, fp8)
    if fp8 and (training or (training is None and model.training)):
        why = "training=True" if training else "training=None and the model is in train mode (model.training)"
        raise ValueError(
            f"optimize: fp8=True is for inference only, but {why}; call model.eval() or pass training=False. "
            "To train in FP8 use TrainConfig(fp8=True) (float8 training through torchao)"
        )
    training = model.training if training is None else training
    if model in _REPORTS:
        report = _REPORTS[model]
        if report.fp8 != fp8:
            raise ValueError(
                f"optimize: this model was already optimized with fp8={report.fp8}; call fuseformer.revert(model) "
                f"before optimizing it with fp8={fp8}"
            )
        return report

    from fuseformer.fusion import verify as V

    given = sample_inputs is not None
    if given:
        args, kwargs = V.normalize_inputs(sample_inputs)
    elif verify:
        args, kwargs = V.build_inputs(model, training, V.FP8_SAMPLE_SEQ if fp8 else V.SAMPLE_SEQ)
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
    if fp8 and "fp8" in kinds:
        from fuseformer.fusion import fp8 as fp8_pass

        fp8_pass.add_candidates(model, result)
    if "linear" in kinds:  # last: it leaves the linears that any candidate above replaces or reads
        from fuseformer.fusion import linear as linear_pass

        linear_pass.add_candidates(model, result)
    report = OptimizeReport(model_name=type(model).__name__, training=training, verified=verify, fp8=fp8)
    report.skipped = list(result.skipped)
    cands = list(result.candidates)
    records = {
        id(c): Replacement(path=c.path, kind=c.kind, original=c.original, replacement=c.replacement, note=c.note)
        for c in cands
    }
    report.replacements = [records[id(c)] for c in cands]
    # FP8 replacements are applied and judged after the others, against their own reference (verify.py).
    plain = [c for c in cands if c.kind != "fp8"]
    fp8_cands = [c for c in cands if c.kind == "fp8"]

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
            for c in list(fp8_cands):
                why = V.fp8_weight_error(model, c)
                if why is not None:  # never applied: its weights are wrong, whatever its outputs
                    records[id(c)].status, records[id(c)].note = "reverted", f"{c.note}; {why}"
                    fp8_cands.remove(c)
            if fp8_cands:
                base_fp8 = V.fp8_baseline(model, args, kwargs, fp8_cands)
                V.use_fp8_weights(ref_model, fp8_cands)
                ref_fp8 = V.run(ref_model, ref_args, ref_kwargs, fp8_cands, False)
            del ref_model
        for c in plain:
            c.apply()
            applied.append(c)
        if verify and plain:
            _verify(model, args, kwargs, plain, base, ref, training, names, records, applied)
        for c in fp8_cands:
            c.apply()
            applied.append(c)
        if verify and fp8_cands:
            _verify(model, args, kwargs, fp8_cands, base_fp8, ref_fp8, False, names, records, applied)
        if verify and cands and not training:
            final = V.run(model, args, kwargs, (), False)
            report.output_error = V.rel_error(final.final, ref.final)
            report.baseline_output_error = V.rel_error(base.final, ref.final)
    except Exception:
        undo_all()
        raise

    if not applied and result.restore is not None:
        result.restore()
    elif applied:
        report._revert = undo_all
        _REPORTS[model] = report
    return report


def _verify(model, args, kwargs, live, base, ref, training, names, records, applied) -> None:
    """Judge the applied candidates ``live`` against ``base`` and ``ref`` (verify.judge), recording each
    verdict, and undo the culprit (``_culprit``) until every one left passes."""
    from fuseformer.fusion import verify as V

    live = list(live)
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


def _kinds(include: Iterable[str] | None, exclude: Iterable[str] | None, fp8: bool = False) -> frozenset[str]:
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
    if "fp8" in inc and include is not None and not fp8:
        raise ValueError("optimize: include names 'fp8' but fp8 is False; pass fp8=True for FP8 linear layers")
    return inc - parse("exclude", exclude)


def _find(model: nn.Module, training: bool, kinds: frozenset[str], args: tuple, kwargs: dict) -> PassResult:
    """The HF pass for architectures it knows, else the FX pass."""
    from fuseformer.fusion import hf

    result = hf.find_candidates(model, training=training, kinds=kinds)
    if result is not None:
        return result
    from fuseformer.fusion import fx

    return fx.find_candidates(model, training=training, kinds=kinds, sample_args=args, sample_kwargs=kwargs)
