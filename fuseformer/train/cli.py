"""The train subcommand: a TrainConfig from a preset, a config file (.json/.toml) and flags.

``add_train_parser(subparsers)`` adds it to the ``fuseformer`` command; ``run_train`` runs it.
The parser's description (``_DESCRIPTION``) is what ``fuseformer train --help`` shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from fuseformer.train.config import TrainConfig, read_config_file

_DESCRIPTION = """\
Train a causal LM (Llama, Mistral, Qwen2 or Qwen3 architecture) on text files.

The run is described by a preset, a config file and flags; later ones override earlier ones:
--preset < --config < flags. Every config field is also a flag (--micro-batch-size 8,
--activation-checkpointing every:2, --data a.txt dir/).

  fine-tune    --model DIR: a Hugging Face model directory (its tokenizer is used)
  from scratch a config file whose [model] table gives the architecture and sizes
               (architecture, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
               num_attention_heads, num_key_value_heads), with --tokenizer DIR;
               docs/training.md has a complete small config file
  a recipe     --preset builtin (the built-in model: tokenizer and model trained on the
               standard library's .py files)

Example: fuseformer train --config run.toml --data my_corpus/ --out-dir runs/tiny --export tiny-model

Under torchrun, pass --distributed ddp or fsdp. Metrics go to OUT_DIR/metrics.jsonl, the loss
curve to OUT_DIR/loss.png (with matplotlib), checkpoints to OUT_DIR/checkpoints/.
"""

# Each TrainConfig field's flag help; "(default: ...)" is added from the field's default.
_HELP = {
    "model": "a Hugging Face model directory to fine-tune (to train from scratch, give a [model] table in --config)",
    "data": "text files and folders to train on (folders are searched for --data-suffixes)",
    "tokenizer": "directory with tokenizer.json (+ tokenizer_config.json naming the EOS token); "
    "needed from scratch, else the model directory's",
    "data_suffixes": "file suffixes read from data folders",
    "data_exclude": "folder names skipped in data folders",
    "cache_dir": "where the tokenized data is cached; none means OUT_DIR/data_cache",
    "seq_len": "tokens per packed row",
    "micro_batch_size": "rows per forward/backward",
    "grad_accum_steps": "micro-batches per optimizer step",
    "lr": "peak learning rate (after warmup)",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "optimizer steps of linear warmup",
    "max_steps": "optimizer steps of the run",
    "weight_decay": "AdamW weight decay (matrices only)",
    "betas": "AdamW betas",
    "eps": "AdamW epsilon",
    "grad_clip": "max global gradient norm, 0 for no clipping",
    "precision": "auto (bf16 on CUDA, fp32 on a CPU, where bf16 runs ~10x slower), bf16, fp16 or fp32",
    "fp8": "float8 GEMMs (e4m3, rowwise scales, through torchao) for the decoder layers' linear layers; "
    "needs torchao and an SM 8.9+ GPU (Ada, Hopper) or a CPU",
    "activation_checkpointing": "off, all, every:K or all-but:K (recompute layers in backward to save memory)",
    "eval_every": "evaluate every N optimizer steps and at the end; 0 never",
    "eval_split": "fraction of the documents held out for evaluation, 0 for none",
    "eval_batches": "micro-batches per rank per evaluation",
    "save_every": "write a checkpoint every N optimizer steps and at the end; 0 never",
    "keep_checkpoints": "checkpoints kept on disk (the newest)",
    "resume": "continue from OUT_DIR/checkpoints when one is there",
    "out_dir": "folder of the run: metrics, loss curve, checkpoints",
    "seed": "seed of the initialization, data order and sampling",
    "init_std": "standard deviation of the random initialization (from scratch)",
    "distributed": "none, ddp or fsdp (under torchrun)",
    "log_every": "print a progress line every N optimizer steps; 0 never",
    "progress": "show a progress bar",
    "device": "auto (this rank's CUDA GPU when available, else cpu), cuda or cpu",
}

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


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value) or "none"
    return "none" if value is None else str(value)


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand (one flag per TrainConfig field) to ``subparsers``."""
    p = subparsers.add_parser(
        "train",
        help="train a causal LM (config file, preset or flags; torchrun for DDP/FSDP2)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="a .json or .toml file of config fields (default: none)")
    p.add_argument("--preset", help="a named recipe: builtin (default: none)")
    p.add_argument(
        "--export",
        help="after training, write the final model here as a bf16 Hugging Face directory (default: none)",
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "none; required unless --config or --preset gives it" if f.name == "model" else _default_text(default)
        help_text = f"{_HELP.get(f.name, f.name.replace('_', ' '))} (default: {shown})"
        if f.name in _LISTS:
            p.add_argument(flag, dest=f.name, nargs="+", type=_LISTS[f.name], default=None, help=help_text)
        elif f.name == "model":
            p.add_argument(flag, dest=f.name, metavar="DIR", help=help_text)
        elif isinstance(default, bool):
            p.add_argument(flag, dest=f.name, type=_bool, default=None, metavar="{true,false}", help=help_text)
        elif isinstance(default, int):
            p.add_argument(flag, dest=f.name, type=int, default=None, help=help_text)
        elif isinstance(default, float):
            p.add_argument(flag, dest=f.name, type=float, default=None, help=help_text)
        else:
            p.add_argument(flag, dest=f.name, type=_none_or_str, default=None, help=help_text)
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


def run_train(args: argparse.Namespace) -> int:
    """Run ``fuseformer train``; returns the exit status (2 for a configuration or data error)."""
    from fuseformer.train.trainer import train

    try:
        config = config_from_args(args)
        result = train(config, export=getattr(args, "export", None))
    except (ValueError, FileNotFoundError) as exc:
        print(f"fuseformer train: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    last = f"{result.losses[-1]:.4f}" if result.losses else "-"
    print(f"fuseformer train: step {result.final_step}, last loss {last}, skipped (fp16) steps {result.skipped_steps}")
    if result.eval_losses:
        step, loss = max(result.eval_losses.items())
        print(f"fuseformer train: eval loss {loss:.4f} at step {step}")
    curve = f"curve in {result.curve}" if result.curve is not None else "no loss curve (matplotlib is not installed)"
    print(f"fuseformer train: metrics in {Path(config.out_dir) / 'metrics.jsonl'}, {curve}")
    if result.export is not None:
        print(f"fuseformer train: exported {result.export}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fuseformer.train.cli ...``: ``fuseformer train`` alone (the same flags)."""
    parser = argparse.ArgumentParser(prog="fuseformer")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
