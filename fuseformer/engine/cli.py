"""``fuseformer generate PROMPT --model DIR``: complete one prompt, streaming the text as it is generated.

``add_generate_parser(subparsers)`` adds the subcommand to the ``fuseformer`` command; ``run_generate``
runs it (exit code 0; 2 for bad arguments; 1 when the model cannot be loaded). ``python -m
fuseformer.engine.cli generate ...`` runs it alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The model used when --model is not given: the built-in one shipped in the package
# (fuseformer/assets/builtin, trained by `fuseformer train --preset builtin`); None if it is absent.
BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "builtin"
DEFAULT_MODEL: str | None = str(BUILTIN_MODEL_DIR) if (BUILTIN_MODEL_DIR / "config.json").is_file() else None

_DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_generate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``generate`` to a ``fuseformer`` subcommand set."""
    p = subparsers.add_parser("generate", help="complete a prompt with a local model, streaming the text")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory (config.json, safetensors, tokenizer); default: the built-in model",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens at most (default 256)")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: the model's, else 1)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (-1: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (same seed, same text)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="weights' dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs (CUDA only)")
    p.set_defaults(func=run_generate)
    return p


def check_model_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the model directory to load: --model, else the built-in one; the first error among the
    arguments ``generate`` and ``serve`` share: --model, --device, --cuda-graphs, or None)."""
    model = args.model or DEFAULT_MODEL
    if model is None:
        return None, "no --model given and no built-in model is installed"
    if not Path(model).is_dir():
        return model, f"--model {model} is not a directory"
    if args.device is not None and args.device.split(":")[0] not in ("cpu", "cuda"):
        return model, f"--device must be cpu or cuda, got {args.device!r}"
    if args.cuda_graphs:
        import torch

        if not torch.cuda.is_available() or (args.device is not None and not args.device.startswith("cuda")):
            return model, "--cuda-graphs needs a CUDA device"
    return model, None


def _error(message: str, code: int) -> int:
    print(f"fuseformer generate: error: {message}", file=sys.stderr)
    return code


def run_generate(args: argparse.Namespace) -> int:
    """Run ``fuseformer generate``; returns the exit code."""
    model, error = check_model_args(args)
    if error is not None:
        return _error(error, 2)

    from fuseformer.engine.llm import LLM
    from fuseformer.engine.sampling_params import SamplingParams

    overrides = {
        "max_tokens": 256 if args.max_tokens is None else args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        SamplingParams(**overrides)  # bad values fail now, before the model loads
    except (TypeError, ValueError) as exc:
        return _error(str(exc), 2)

    try:
        llm = LLM(
            model,
            dtype=args.dtype,
            device=args.device,
            seed=0 if args.seed is None else args.seed,
            cuda_graphs=args.cuda_graphs,
        )
    except (FileNotFoundError, ValueError) as exc:
        return _error(str(exc), 1)
    if llm.tokenizer is None:
        return _error(f"--model {model} has no tokenizer.json", 2)

    # The model's generation_config.json defaults, then what was given on the command line.
    defaults = llm.get_default_sampling_params()
    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    params = SamplingParams(**({f: getattr(defaults, f) for f in fields} | overrides))
    try:
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
        else:
            prompt = args.prompt
        request_id = llm.add_request(None, prompt, params)
    except ValueError as exc:
        return _error(str(exc), 2)

    try:
        while llm.has_unfinished_requests():
            for out in llm.step():
                for c in out.outputs:
                    if c.text:
                        sys.stdout.write(c.text)
                        sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    except KeyboardInterrupt:
        llm.abort(request_id)
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        llm.abort(request_id)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuseformer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
