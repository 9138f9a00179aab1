"""The fuseformer command: info, generate, serve, bench, train, validate and profile."""

from __future__ import annotations

import argparse
import platform
import sys


def _info(args: argparse.Namespace) -> int:
    import torch

    import fuseformer
    from fuseformer.ops import OPS
    from fuseformer.runtime import backend

    ok, triton_info = backend.triton_status()
    print(f"fuseformer {fuseformer.__version__}")
    print(f"python     {platform.python_version()} ({sys.executable})")
    print(f"torch      {torch.__version__}")
    print(f"triton     {triton_info}")
    devices = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(
                f"cuda:{i}     {p.name}, compute capability {p.major}.{p.minor}, "
                f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB"
            )
        devices.append("cuda")
    else:
        print("cuda       not available (ops run on the PyTorch reference, or interpreted)")
    print(
        f"TRITON_INTERPRET={'1' if backend.INTERPRET else '0'}  FUSEFORMER_BACKEND={backend.forced_backend() or 'auto'}"
    )
    from fuseformer.ops import _gluon
    from fuseformer.runtime.launch import launch_path

    # What runs here, not what could run elsewhere: Gluon needs an sm_90 GPU and Triton 3.6.x.
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    if not _gluon.ENABLED:
        gluon = "off (FUSEFORMER_GLUON=0)"
    elif not _gluon.HAVE_GLUON:
        gluon = f"off ({_gluon.UNAVAILABLE})"
    elif not hopper:
        gluon = "off (no sm_90 GPU here)"
    else:
        gluon = "on"
    print(f"gluon      {gluon} (on sm_90: flash_attention hd 64/128 batched; fused_mlp's gate-up from 512 tokens)")
    path, why = launch_path()
    print(f"launch     {path} ({why})")
    print()
    width = max(len(op) for op in OPS)
    for dev in devices:
        print(f"ops on {dev} tensors:")
        for op in OPS:
            choice = backend.explain(dev)
            print(f"  {op:<{width}}  {choice.backend:<9}  {choice.reason}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from fuseformer.bench import run_suites

    if args.tune:
        import torch

        if not torch.cuda.is_available():  # tune_all would raise; a user error is a line, not a traceback
            print(
                "fuseformer bench: error: --tune needs a CUDA GPU (it times kernels); none is available",
                file=sys.stderr,
            )
            return 2
        import json

        from fuseformer.bench.tune import tune_all

        for record in tune_all(quick=args.quick):
            print(json.dumps(record))
        if not args.suites:
            return 0
    return run_suites(args.suites or ["ops"], out_dir=args.out, quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fuseformer",
        description="fuseformer: fused Triton kernels for PyTorch Transformers, an inference engine and a trainer. "
        "Run 'fuseformer COMMAND --help' for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="device, versions, and which backend each op uses and why")
    p.set_defaults(func=_info)

    p = sub.add_parser("bench", help="benchmarks against peers on a GPU (table, JSON, PNG)")
    p.add_argument(
        "suites", nargs="*", default=[], help="suites: ops (default), attention, mlp_ce, engine, serve, train, optimize"
    )
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG (default: bench-results)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    p.add_argument("--tune", action="store_true", help="tune every kernel on this GPU first (fills the autotune cache)")
    p.set_defaults(func=_bench)

    from fuseformer.engine.cli import add_generate_parser
    from fuseformer.fusion.cli import add_parsers as add_fusion_parsers
    from fuseformer.serve.cli import add_serve_parser
    from fuseformer.train.cli import add_train_parser

    add_generate_parser(sub)
    add_serve_parser(sub)
    add_train_parser(sub)
    add_fusion_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
