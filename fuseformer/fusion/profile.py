"""Where a model's time goes, before and after ``fuseformer.optimize``: GPU time per module kind
(torch.profiler over ``record_function`` ranges opened by forward hooks), with the achieved
TFLOP/s of the linear layers and GB/s of the rest against the ceilings measured in the same run.

``profile_model(model, inputs, training=...)`` returns the records; ``plot`` draws the two bars
(before, after) stacked by module kind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Module kinds the time is grouped by, from the class name of the modules directly under a layer.
_KIND_WORDS = (
    ("attention", ("attention", "attn")),
    ("mlp", ("mlp", "feedforward", "intermediate", "output")),
    ("norm", ("norm",)),
    ("embedding", ("embed",)),
    ("lm_head", ("lm_head",)),
)


def module_kind(name: str, module: nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1].lower()
    cls = type(module).__name__.lower()
    for kind, words in _KIND_WORDS:
        if any(w in leaf for w in words) or any(w in cls for w in words if kind != "mlp"):
            return kind
    return None


def _profiled_modules(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """(name, kind, module) for the outermost modules of each kind (not their children)."""
    out, taken = [], []
    for name, m in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in taken):
            continue
        kind = module_kind(name, m)
        if kind is not None:
            out.append((name, kind, m))
            taken.append(name)
    return out


def _time_by_kind(model: nn.Module, step: Callable[[], Any], device: str) -> dict[str, float]:
    """Milliseconds per module kind (GPU time on CUDA, CPU time elsewhere) of one ``step()``,
    plus "total" and "other" (outside every profiled module)."""
    handles = []
    ranges: dict[int, Any] = {}
    for _, kind, m in _profiled_modules(model):

        def pre(mod, args, kind=kind):
            r = torch.profiler.record_function(f"ff:{kind}")
            r.__enter__()
            ranges.setdefault(id(mod), []).append(r)

        def post(mod, args, out):
            ranges[id(mod)].pop().__exit__(None, None, None)

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    cuda = device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    try:
        step()  # warm up
        if cuda:
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    times: dict[str, float] = {}
    total = 0.0
    for e in prof.key_averages():
        t = (e.device_time_total if cuda else e.cpu_time_total) / 1e3
        if e.key.startswith("ff:"):
            times[e.key[3:]] = times.get(e.key[3:], 0.0) + t
    if cuda:
        total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    else:
        total = max((e.cpu_time_total for e in prof.key_averages()), default=0.0) / 1e3
    times["other"] = max(0.0, total - sum(times.values()))
    times["total"] = total
    return times


def _work(model: nn.Module, tokens: int) -> dict[str, dict[str, float]]:
    """Per kind: FLOPs of its linear layers (2 x weight elements x tokens) and bytes of its
    parameters plus one read and one write of its (tokens, width) activations."""
    out: dict[str, dict[str, float]] = {}
    for _, kind, m in _profiled_modules(model):
        w = out.setdefault(kind, {"flops": 0.0, "bytes": 0.0})
        for sub in m.modules():
            if isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D":
                w["flops"] += 2.0 * sub.weight.numel() * tokens
        params = list(m.parameters())
        width = params[0].shape[-1] if params else 0
        elt = params[0].element_size() if params else 2
        w["bytes"] += sum(p.numel() * p.element_size() for p in params) + 2.0 * tokens * width * elt
    return out


def profile_model(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    training: bool = False,
    optimize_kwargs: dict | None = None,
) -> dict[str, Any]:
    """Profile ``model`` on ``inputs`` (keyword arguments), optimize it (in place), profile it again.

    Returns {"before": {kind: ms}, "after": {kind: ms}, "work": ..., "ceilings": ..., "report": ...};
    each kind's achieved TFLOP/s (linear layers) and GB/s, and the percent of the ceilings on CUDA.
    """
    import fuseformer

    device = str(next(model.parameters()).device)
    tokens = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).numel()

    def stepper(m: nn.Module) -> Callable[[], Any]:
        def step():
            if training:
                m.zero_grad(set_to_none=True)
                out = m(**inputs)
                loss = out["loss"] if "labels" in inputs else out[0].float().mean()
                loss.backward()
            else:
                with torch.no_grad():
                    m(**inputs)

        return step

    model.train(training)
    before = _time_by_kind(model, stepper(model), device)
    work = _work(model, tokens)  # of the original modules
    report = fuseformer.optimize(model, training=training, **(optimize_kwargs or {}))
    after = _time_by_kind(model, stepper(model), device)
    ceilings: dict[str, float] = {}
    if device.startswith("cuda"):
        from fuseformer.bench._timing import copy_ceiling_tb_s, gemm_ceiling_tflop_s

        ceilings = {"copy_tb_s": copy_ceiling_tb_s(), "gemm_tflop_s": gemm_ceiling_tflop_s()}
    rows = []
    for kind in sorted(set(before) | set(after), key=lambda k: -before.get(k, 0.0)):
        row: dict[str, Any] = {"kind": kind, "before_ms": before.get(kind, 0.0), "after_ms": after.get(kind, 0.0)}
        w = work.get(kind)
        for side in ("before", "after"):
            ms = row[f"{side}_ms"]
            if w and ms > 0:
                row[f"{side}_tflop_s"] = w["flops"] / (ms * 1e-3) / 1e12
                row[f"{side}_gb_s"] = w["bytes"] / (ms * 1e-3) / 1e9
                if ceilings:
                    row[f"{side}_pct_gemm"] = 100 * row[f"{side}_tflop_s"] / ceilings["gemm_tflop_s"]
                    row[f"{side}_pct_copy"] = 100 * row[f"{side}_gb_s"] / (1e3 * ceilings["copy_tb_s"])
        rows.append(row)
    return {"device": device, "tokens": tokens, "training": training, "rows": rows, "ceilings": ceilings,
            "report": report.to_dict()}  # fmt: skip


def format_rows(result: dict[str, Any]) -> str:
    unit = "GPU ms" if result["device"].startswith("cuda") else "CPU ms"
    head = f"{'kind':<10} {'before ' + unit:>14} {'after ' + unit:>14} {'speedup':>8}  achieved after"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        speed = r["before_ms"] / r["after_ms"] if r["after_ms"] > 0 else float("nan")
        extra = ""
        if "after_tflop_s" in r and r["after_tflop_s"] > 0.5:
            extra = f"{r['after_tflop_s']:.1f} TFLOP/s"
            extra += f" ({r['after_pct_gemm']:.0f}% of GEMM)" if "after_pct_gemm" in r else ""
        elif "after_gb_s" in r:
            extra = f"{r['after_gb_s']:.1f} GB/s"
            extra += f" ({r['after_pct_copy']:.0f}% of copy)" if "after_pct_copy" in r else ""
        lines.append(f"{r['kind']:<10} {r['before_ms']:>14.3f} {r['after_ms']:>14.3f} {speed:>8.2f}  {extra}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> bool:
    """A stacked bar chart (before, after) of the time per kind; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rows"] if r["kind"] != "total"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for side_i, side in enumerate(("before", "after")):
        bottom = 0.0
        for i, r in enumerate(rows):
            v = r[f"{side}_ms"]
            ax.bar(side_i, v, bottom=bottom, color=f"C{i}", label=r["kind"] if side_i == 0 else None)
            bottom += v
    ax.set_xticks([0, 1], ["original", "fuseformer.optimize"])
    ax.set_ylabel("GPU ms" if result["device"].startswith("cuda") else "CPU ms")
    ax.set_title(f"where the time goes ({result['tokens']} tokens, {'training' if result['training'] else 'forward'})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
