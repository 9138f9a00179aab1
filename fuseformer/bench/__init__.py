"""Benchmarks: our kernels side by side with the peers a user would pick, in one process and run.

``run_suites(["ops", "attention"], out_dir)`` prints a table per suite and writes
``<suite>.json`` (records plus the environment and the two ceilings) and PNG plots to ``out_dir``.
``fuseformer bench --tune`` runs the tuning drivers of ``bench/tune.py`` first. Config sweeps and one-off
investigations are the lab's, outside the package: ``benchmarks/sweeps.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform


def environment() -> dict:
    import torch
    import triton

    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton.__version__,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )
    for pkg in ("transformers", "liger_kernel"):
        try:
            from importlib.metadata import version

            env[pkg] = version(pkg.replace("_", "-"))
        except Exception:
            env[pkg] = None
    return env


def run_suites(suites: list[str], out_dir: str = "bench-results", quick: bool = False) -> int:
    import torch

    from fuseformer.bench._timing import copy_ceiling_tb_s, gemm_ceiling_tflop_s

    if not torch.cuda.is_available():
        print("fuseformer bench: needs a CUDA GPU (the figures are GPU timings); none is available")
        return 2
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    env["copy_ceiling_tb_s"] = copy_ceiling_tb_s()
    env["gemm_ceiling_tflop_s"] = gemm_ceiling_tflop_s()
    print(
        f"{env['gpu']}: copy {env['copy_ceiling_tb_s']:.2f} TB/s, bf16 GEMM {env['gemm_ceiling_tflop_s']:.0f} TFLOP/s"
    )
    for suite in suites:
        if suite == "ops":
            from fuseformer.bench.ops import bench_ops, format_table, plot_ops

            records = bench_ops(quick)
            print(format_table(records))
            plot_ops(records, os.path.join(out_dir, "ops.png"))
        elif suite == "attention":
            from fuseformer.bench.attention import bench_attention

            records = bench_attention(quick)
            for r in records:
                print(json.dumps(r))
        elif suite == "mlp_ce":
            from fuseformer.bench.mlp_ce import bench_mlp_ce

            records = bench_mlp_ce(quick)
            for r in records:
                print(json.dumps(r))
        elif suite == "engine":
            from fuseformer.bench.engine import bench_engine, format_table

            records = bench_engine(quick)
            print(format_table(records))
        elif suite == "serve":
            from fuseformer.bench.serve import bench_serve, format_table

            records = bench_serve(quick)
            print(format_table(records))
        elif suite == "optimize":
            from fuseformer.bench.optimize import bench_optimize, format_table

            records = bench_optimize(quick)
            print(format_table(records))
        elif suite == "train":
            from fuseformer.train.bench import bench_train

            records = bench_train(quick)
            for r in records:
                print(json.dumps(r))
        else:
            print(f"fuseformer bench: unknown suite {suite!r} (ops, attention, mlp_ce, engine, serve, train, optimize)")
            return 2
        with open(os.path.join(out_dir, f"{suite}.json"), "w") as f:
            json.dump(dict(env=env, records=records), f, indent=1)
    return 0
