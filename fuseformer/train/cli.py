"""``fuseformer train``: a TrainConfig from a preset, a config file (.json/.toml) and flags.

Later sources override earlier ones: ``--preset`` < ``--config`` < flags. Every TrainConfig field is
a flag (``--micro-batch-size 8``, ``--activation-checkpointing every:2``, ``--data a.txt dir/``).
Under ``torchrun`` pass ``--distributed ddp`` or ``fsdp``.

cli.py hooks it in with ``add_train_parser(subparsers)``; the parser's ``func`` is ``run_train``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from fuseformer.train.config import TrainConfig, read_config_file

# Fields that take several values, and their element type.
_LISTS = {"data": str, "data_suffixes": str, "data_exclude": str, "betas": float}
_SKIP = ("extra",)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _none_or_str(text: str) -> str | None:
    return None if text.lower() == "none" else text


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand (one flag per TrainConfig field) to ``subparsers``."""
    p = subparsers.add_parser(
        "train",
        help="train a causal LM (config file, preset or flags; torchrun for DDP/FSDP2)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="a .json or .toml file with TrainConfig fields")
    p.add_argument("--preset", help="a named recipe from fuseformer/train/presets.py (e.g. builtin)")
    p.add_argument("--export", help="after training, write the final model here as a bf16 Hugging Face directory")
    for f in dataclasses.fields(TrainConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in _LISTS:
            p.add_argument(flag, dest=f.name, nargs="+", type=_LISTS[f.name], default=None)
        elif f.name == "model":
            p.add_argument(flag, dest=f.name, help="a Hugging Face model directory to fine-tune")
        elif isinstance(default, bool):
            p.add_argument(flag, dest=f.name, type=_bool, default=None, metavar="{true,false}")
        elif isinstance(default, int):
            p.add_argument(flag, dest=f.name, type=int, default=None, help=f"default {default}")
        elif isinstance(default, float):
            p.add_argument(flag, dest=f.name, type=float, default=None, help=f"default {default}")
        else:
            p.add_argument(flag, dest=f.name, type=_none_or_str, default=None, help=f"default {default}")
    p.set_defaults(func=run_train)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Merge preset, config file and flags into a TrainConfig."""
    from fuseformer.train.presets import prepare_preset

    flags: dict[str, Any] = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if f.name not in _SKIP and getattr(args, f.name, None) is not None
    }
    file_data = read_config_file(args.config) if getattr(args, "config", None) else {}
    data: dict[str, Any] = {}
    if getattr(args, "preset", None):
        out_dir = flags.get("out_dir", file_data.get("out_dir"))
        data.update(prepare_preset(args.preset, out_dir))
    data.update(file_data)
    data.update(flags)
    return TrainConfig.from_dict(data)


def export_model(checkpoint: str | Path, out: str | Path) -> Path:
    """A trainer checkpoint's model (+ tokenizer files) as a bf16 Hugging Face directory."""
    import torch

    from fuseformer.models.loader import load_model
    from fuseformer.train.checkpoint import save_model

    lm, config = load_model(checkpoint, dtype=torch.float32)
    return save_model(lm.state_dict(), config, out, dtype=torch.bfloat16, tokenizer_dir=checkpoint)


def run_train(args: argparse.Namespace) -> int:
    """Run ``fuseformer train``; returns the exit status (2 for a configuration or data error)."""
    from fuseformer.train.checkpoint import latest_checkpoint
    from fuseformer.train.trainer import train

    try:
        config = config_from_args(args)
        result = train(config)
    except ValueError as exc:
        print(f"fuseformer train: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    last = f"{result.losses[-1]:.4f}" if result.losses else "-"
    print(f"fuseformer train: step {result.final_step}, last loss {last}, skipped (fp16) steps {result.skipped_steps}")
    if result.eval_losses:
        step, loss = max(result.eval_losses.items())
        print(f"fuseformer train: eval loss {loss:.4f} at step {step}")
    print(f"fuseformer train: metrics in {Path(config.out_dir) / 'metrics.jsonl'}, curve in {config.out_dir}/loss.png")
    if getattr(args, "export", None):
        ckpt = latest_checkpoint(config.out_dir)
        if ckpt is None:
            print("fuseformer train: --export needs a checkpoint; set --save-every", file=sys.stderr)
            return 2
        print(f"fuseformer train: exported {export_model(ckpt, args.export)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fuseformer.train.cli ...`` (the same flags), until cli.py hooks the subcommand in."""
    parser = argparse.ArgumentParser(prog="fuseformer")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
