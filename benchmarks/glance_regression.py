"""Issue 27's no-regression check: the op figures of BENCHMARKS.md's glance table, timed for two copies
of the package in one device call, each in its own processes (alternating, so drift hits both alike).

The old copy is the package before issue 27's work (commit fc8d9e1), exported into an ignored folder
that the device call carries:

    mkdir -p .glance-old && git archive fc8d9e1 fuseformer ':!fuseformer/assets' | tar -x -C .glance-old
    python benchmarks/glance_regression.py --old .glance-old --out $OUT/glance.json [--rounds 2] [--cases rms_norm,...]

Each case goes through the public ops only (``fuseformer.ops``; their signatures are the same in both),
timed by ``triton.testing.do_bench`` medians on random inputs. The result: each case's median ms for
old and new over the rounds, new / old, and the cases more than 2% slower (the issue's bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cases():
    """name -> a function returning (fn to time, extra dict) for the glance table's op rows."""
    import torch

    import fuseformer.ops as F

    dev, bf16 = "cuda", torch.bfloat16

    def rand(*shape, grad=False, dtype=bf16):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad)

    def backward(fwd, inputs):
        out = fwd()
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(o) for o in outs]
        return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)

    def rms(rows, cols, bwd=False, residual=False):
        def make():
            x, w = rand(rows, cols, grad=bwd), rand(cols, grad=bwd)
            r = rand(rows, cols) if residual else None
            fwd = lambda: F.rms_norm(x, w, 1e-6, residual=r)  # noqa: E731
            return backward(fwd, (x, w)) if bwd else fwd

        return make

    def swiglu(bwd=False):
        def make():
            g, u = rand(16384, 14336, grad=bwd), rand(16384, 14336, grad=bwd)
            fwd = lambda: F.swiglu(g, u)  # noqa: E731
            return backward(fwd, (g, u)) if bwd else fwd

        return make

    def rotary():
        q, k = rand(8, 4096, 32, 128), rand(8, 4096, 8, 128)
        angles = torch.rand(4096, 64, device=dev) * 6.28
        cos, sin = angles.cos(), angles.sin()
        return lambda: (F.apply_rotary(q, cos, sin), F.apply_rotary(k, cos, sin))

    def attn_fwd(batch, seq, causal):
        def make():
            q, k, v = (rand(batch, seq, 32, 128) for _ in range(3))
            return lambda: F.flash_attention(q, k, v, causal=causal)

        return make

    def attn_bwd():
        q, k, v = (rand(4, 4096, 32, 128, grad=True) for _ in range(3))
        return backward(lambda: F.flash_attention(q, k, v, causal=True), (q, k, v))

    def mlp(tokens):
        def make():
            x = rand(tokens, 4096)
            w_gate_up, w_down = rand(2 * 14336, 4096) * 0.02, rand(4096, 14336) * 0.02
            return lambda: F.fused_mlp(x, w_gate_up, w_down)

        return make

    def flce():
        h = rand(8192, 4096, grad=True)
        w = (rand(128256, 4096) * 0.02).requires_grad_(True)
        t = torch.randint(0, 128256, (8192,), device=dev)

        def step():
            F.fused_linear_cross_entropy(h, w, t).backward()
            h.grad = w.grad = None

        return step

    cases = {
        "rms_norm fwd 32768x4096": rms(32768, 4096),
        "rms_norm bwd 32768x4096": rms(32768, 4096, bwd=True),
        "add + rms_norm fwd 32768x4096": rms(32768, 4096, residual=True),
        "rms_norm fwd 4096x1024": rms(4096, 1024),
        "rms_norm bwd 4096x1024": rms(4096, 1024, bwd=True),
        "swiglu fwd 16384x14336": swiglu(),
        "swiglu bwd 16384x14336": swiglu(bwd=True),
        "apply_rotary q,k B8 S4096 H32/8 D128": rotary,
        "flash_attention fwd hd128 causal B4 S4096": attn_fwd(4, 4096, True),
        "flash_attention fwd hd128 full B1 S16384": attn_fwd(1, 16384, False),
        "flash_attention bwd hd128 causal B4 S4096": attn_bwd,
        "fused_mlp fwd T8192 H4096 I14336": mlp(8192),
        "fused_linear_cross_entropy fwd+bwd 8192 x 4096, V 128256": flce,
    }
    cases.update({f"fused_mlp decode T{t}": mlp(t) for t in (1, 8, 32, 64)})
    return cases


def worker(names: list[str]) -> None:
    """Time ``names`` with the fuseformer on PYTHONPATH; one JSON line per case on stdout."""
    import torch
    import triton.testing

    import fuseformer

    cases = _cases()
    try:  # the old package's native autograd node (removed in issue 27): built before timing, as in steady use
        from fuseformer.runtime import native
    except ImportError:
        native = None
    if native is not None:
        native.module(wait=True)
        print(json.dumps(dict(native=native.status())), flush=True)
    for name in names:
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn = None
        try:
            fn = cases[name]()
            fn()  # compile outside the timing
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            row = dict(case=name, ms=ms, peak_gib=round(peak, 4), package=os.path.dirname(fuseformer.__file__))
        except Exception as exc:  # recorded, not fatal: the other cases still run
            row = dict(case=name, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        print(json.dumps(row), flush=True)
        del fn
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, help="a folder holding the old `fuseformer` package")
    p.add_argument("--new", type=Path, default=ROOT)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.cases.split("|"))
        return
    if args.old is None or not (args.old / "fuseformer" / "__init__.py").is_file():
        p.error("--old must be a folder holding the old fuseformer package (see the module's docstring)")
    sys.path.insert(0, str(ROOT))
    names = list(_cases()) if args.cases is None else args.cases.split(",")
    times: dict[str, dict[str, list[float]]] = {n: {"old": [], "new": []} for n in names}
    errors = []
    for r in range(args.rounds):
        order = [("old", args.old), ("new", args.new)]
        for tag, path in order if r % 2 == 0 else order[::-1]:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path.resolve()), os.environ.get("PYTHONPATH", "")]))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--cases", "|".join(names)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path)
            for line in done.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    if "native" in row:
                        print(f"{tag}: native autograd node: {row['native']}", flush=True)
                    elif "ms" in row and not row["package"].startswith(str(path.resolve())):
                        errors.append(dict(row, error=f"imported {row['package']}, not the {tag} copy"))
                    elif "ms" in row:
                        times[row["case"]][tag].append(row["ms"])
                    else:
                        errors.append(dict(row, package=tag))
            if done.returncode:
                errors.append(dict(package=tag, returncode=done.returncode, stderr=done.stderr[-2000:]))
        _report(times, errors, args.out, f"after round {r + 1} of {args.rounds}")


def _report(times: dict, errors: list, out: Path | None, when: str) -> None:
    """Each case's medians so far, new / old, the regressions; written to ``out`` (after every round, so a
    call cut short still has the rounds it finished)."""
    print(f"-- {when}", flush=True)
    rows = []
    for name, t in times.items():
        if t["old"] and t["new"]:
            old, new = statistics.median(t["old"]), statistics.median(t["new"])
            rows.append(dict(case=name, old_ms=old, new_ms=new, new_over_old=new / old, regressed=new > 1.02 * old))
            flag = "  REGRESSED" if new > 1.02 * old else ""
            print(f"{name:<58} old {old:9.4f} ms  new {new:9.4f} ms  new/old {new / old:6.3f}{flag}", flush=True)
    for e in errors:
        print("error:", json.dumps(e)[:600], flush=True)
    if out:
        out.write_text(json.dumps(dict(rows=rows, errors=errors, raw=times), indent=1))


if __name__ == "__main__":
    main()
