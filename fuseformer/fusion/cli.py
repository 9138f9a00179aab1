"""``fuseformer validate MODEL_DIR`` and ``fuseformer profile MODEL_DIR``: a local Hugging Face model
through ``fuseformer.optimize``, checked layer by layer and by greedy generation, or timed per
module kind before and after. ``--fp8`` passes ``fp8=True`` (inference); ``validate --fp8`` then reports
greedy tokens that differ from the original's without failing on them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="a local Hugging Face model directory (config.json and weights)")
    p.add_argument("--training", action="store_true", help="optimize for training: gradients compared too")
    p.add_argument(
        "--dtype", default="auto", choices=_DTYPES,
        help="weights' dtype (default auto: the checkpoint's on CUDA, float32 on the CPU)",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--include",
        default=None,
        help="comma-separated kinds to fuse: norm,mlp,attention,loss,linear,fp8 (default all)",
    )
    p.add_argument("--exclude", default=None, help="comma-separated kinds to leave as they are (default none)")
    p.add_argument(
        "--fp8", action="store_true",
        help="inference: the transformer blocks' linear layers in FP8 (e4m3 weights, per-token activations)",
    )  # fmt: skip


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add ``validate`` and ``profile`` to a ``fuseformer`` subcommand set."""
    p = subparsers.add_parser(
        "validate",
        help="optimize a local HF model, print the per-layer comparison, compare greedy generation",
        description="Load MODEL_DIR with transformers, run fuseformer.optimize on it, print each replacement's "
        "error against its tolerance, and compare greedy generation with the original model. Exit code 1 when "
        "a replacement is over tolerance or the generations differ (with --fp8, differing tokens are reported, not "
        "failed), 2 for bad arguments.",
    )
    _common(p)
    p.add_argument("--prompt", default=None, help="prompt for the generation check (default: 8 fixed token ids)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens compared (default 16)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.set_defaults(func=run_validate)

    p = subparsers.add_parser(
        "profile",
        help="time per module kind of a local HF model before and after optimize (table, JSON, PNG)",
        description="Time MODEL_DIR's forward (or forward + backward with --training) per module kind with "
        "torch.profiler, before and after fuseformer.optimize, with the achieved TFLOP/s or GB/s (and percent "
        "of the copy and GEMM ceilings measured in the same run on CUDA).",
    )
    _common(p)
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    p.add_argument("--out", default="profile-results", help="folder for profile.json and profile.png")
    p.set_defaults(func=run_profile)


def _error(msg: str) -> int:
    print(f"fuseformer: error: {msg}", file=sys.stderr)
    return 2


def _load(args: argparse.Namespace):
    """(model, tokenizer or None, device) from the arguments; raises ValueError for bad ones."""
    import torch

    path = Path(args.model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{args.model_dir} is not a Hugging Face model directory (no config.json)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA GPU")
    if args.dtype == "auto":
        dtype = "auto" if device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    try:
        import transformers
    except ImportError:
        raise ValueError("validate and profile need transformers: pip install transformers") from None
    config = transformers.AutoConfig.from_pretrained(path)
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = auto.from_pretrained(path, dtype=dtype).to(device)
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        except Exception:
            tokenizer = None
    return model, tokenizer, device, causal


def _kinds(value: str | None) -> list[str] | None:
    return None if value is None else [k.strip() for k in value.split(",") if k.strip()]


def run_validate(args: argparse.Namespace) -> int:
    import copy
    import json

    import torch

    import fuseformer

    try:
        model, tokenizer, device, causal = _load(args)
        original = copy.deepcopy(model) if causal else None
        report = fuseformer.optimize(
            model, training=args.training, include=_kinds(args.include), exclude=_kinds(args.exclude), fp8=args.fp8
        )
    except (ValueError, TypeError, OSError) as e:
        return _error(str(e))
    print(report)
    failed = bool(report.reverted)
    gen = None
    if causal:
        if args.prompt is not None and tokenizer is not None:
            ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
        else:
            vocab = model.config.vocab_size
            ids = torch.arange(1, 9, device=device).remainder(vocab).unsqueeze(0)
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)
        model.eval()
        original.eval()
        with torch.no_grad():
            want = original.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, ids.shape[1] :].tolist()
            got = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, ids.shape[1] :].tolist()
        gen = {"original": want, "optimized": got, "same": want == got}
        print(f"greedy generation, {len(want)} tokens: {'same' if want == got else 'DIFFERENT'}")
        if want != got:
            first = next(i for i, (a, b) in enumerate(zip(want + [None], got + [None])) if a != b)
            print(
                f"  first difference at token {first}: "
                f"original {want[first : first + 4]}, optimized {got[first : first + 4]}"
            )
            # FP8 changes the numbers on purpose: greedy tokens may part ways after a near tie, which
            # is reported, not failed (each layer is held to the FP8 criterion above).
            failed = failed or not args.fp8
    if failed and report.reverted:
        print(f"{len(report.reverted)} replacement(s) over tolerance (reverted)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": report.to_dict(), "generation": gen}, f, indent=1)
    return 1 if failed else 0


def run_profile(args: argparse.Namespace) -> int:
    import os

    import torch

    from fuseformer.fusion import profile

    if args.batch <= 0 or args.seq <= 0:
        return _error("--batch and --seq must be positive")
    try:
        model, _, device, causal = _load(args)
        kinds = dict(include=_kinds(args.include), exclude=_kinds(args.exclude), fp8=args.fp8)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (args.batch, args.seq), device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if args.training and causal:
            inputs["labels"] = ids
        result = profile.profile_model(model, inputs, training=args.training, optimize_kwargs=kinds)
    except (ValueError, TypeError, OSError) as e:
        return _error(str(e))
    print(profile.format_rows(result))
    os.makedirs(args.out, exist_ok=True)
    profile.write_json(result, os.path.join(args.out, "profile.json"))
    png = os.path.join(args.out, "profile.png")
    wrote = profile.plot(result, png)
    print(
        f"wrote {os.path.join(args.out, 'profile.json')}"
        + (f" and {png}" if wrote else " (no PNG: matplotlib missing)")
    )
    return 0
