"""The generate subcommand: complete one prompt, streaming the text as it is generated.

``add_generate_parser(subparsers)`` adds it to the ``fuseformer`` command; ``run_generate`` runs it
(exit code 0; 2 for bad arguments; 1 when the model cannot be loaded). ``python -m
fuseformer.engine.cli generate ...`` runs it alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# The model used when --model is not given: the built-in one shipped in the package
# (fuseformer/assets/builtin, trained by `fuseformer train --preset builtin`); None if it is absent.
BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "builtin"
DEFAULT_MODEL: str | None = str(BUILTIN_MODEL_DIR) if (BUILTIN_MODEL_DIR / "config.json").is_file() else None

_DTYPES = ("auto", "float32", "float16", "bfloat16")


def default_threads() -> int | None:
    """CPU threads ``generate`` gives torch by default: None (torch's choice) when OMP_NUM_THREADS
    is set; else 1 on a machine of up to 2 cores, half the cores up to 4 beyond.

    Why not torch's default (one per physical core): on a loaded 2-core machine, ``fuseformer
    generate "def fibonacci(n):"`` (the built-in model, 256 tokens) took 62-252 s with 2 threads
    against 6-27 s with 1 (load 2.4-10, 2026-12-03; README "CPU threads"). A thread that the OS
    deschedules stalls every parallel region its peers wait in; a model this small gains little
    from a second thread even when the machine is idle."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    cores = torch.get_num_threads()  # torch's default: the physical cores it may use
    return 1 if cores <= 2 else min(4, cores // 2)


def add_generate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``generate`` to a ``fuseformer`` subcommand set."""
    p = subparsers.add_parser(
        "generate",
        help="complete a prompt with a local model, streaming the text",
        description=(
            "Complete PROMPT with a local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3; "
            "nothing is downloaded) and stream the text to stdout. A loading line and a summary "
            "(tokens, time, tokens/s) go to stderr."
        ),
    )
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory: config.json, *.safetensors, tokenizer.json (default: the built-in model)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens at most (default: 256)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature, 0 is greedy (default: the model's generation_config.json, else 1)",
    )
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default: the model's, else 1)"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="keep the k most likely tokens, -1 all (default: the model's, else -1)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling: same seed, same text (default: 0)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template (default: off)"
    )
    p.add_argument(
        "--dtype", default="auto", choices=_DTYPES, help="the weights' dtype (default: auto, the checkpoint's)"
    )
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 on a machine of up to 2 cores, else half the cores up to 4; "
        "torch's own choice when OMP_NUM_THREADS is set). More threads than idle cores slow generation down "
        "many times over",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps as CUDA graphs captured at start (default: on with a CUDA device, as vLLM's); "
        "--no-cuda-graphs runs them eagerly",
    )
    add_enforce_eager(p)
    add_quantization(p)
    p.add_argument("--quiet", action="store_true", help="no loading line and no summary on stderr (default: off)")
    p.set_defaults(func=run_generate)
    return p


def add_enforce_eager(p: argparse.ArgumentParser) -> None:
    """--enforce-eager, shared by ``generate`` and ``serve``."""
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs and no scheduling ahead, unless asked for by their own flags (vLLM's name; "
        "without it both are on with a CUDA device) (default: off)",
    )


def add_quantization(p: argparse.ArgumentParser) -> None:
    """--quantization and --kv-cache-dtype, shared by ``generate`` and ``serve`` (vLLM's names)."""
    p.add_argument(
        "--quantization",
        default=None,
        choices=("fp8",),
        help="fp8: FP8 (e4m3) weights with per-channel scales and per-token activations in the decoder layers' "
        "linear layers and MLPs (embeddings, LM head and attention stay in --dtype); a bf16 checkpoint is "
        "quantized as it loads (default: none, or the checkpoint's own when its config.json has an FP8 "
        "quantization_config)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="the KV cache's dtype: auto is the model's; fp8 (or fp8_e4m3) stores K and V in e4m3 with each "
        "layer's scales from the checkpoint (else 1.0): twice the tokens in the same memory (default: auto)",
    )


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
    import torch

    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            return model, f"--device must be cpu, cuda or cuda:N, got {args.device!r}"
        if device.type == "cuda" and not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU"
            return model, f"--device {args.device}: no CUDA device is available ({why}); use --device cpu"
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            return model, f"--device {args.device}: there are {torch.cuda.device_count()} CUDA device(s)"
    if args.enforce_eager and args.cuda_graphs:
        return model, "--enforce-eager and --cuda-graphs contradict each other; pass one"
    if args.cuda_graphs:
        if not torch.cuda.is_available() or (args.device is not None and not args.device.startswith("cuda")):
            return model, "--cuda-graphs needs a CUDA device"
    return model, None


def _error(message: str, code: int) -> int:
    print(f"fuseformer generate: error: {message}", file=sys.stderr)
    return code


def _log(args: argparse.Namespace, message: str) -> None:
    if not args.quiet:
        print(f"fuseformer generate: {message}", file=sys.stderr, flush=True)


def run_generate(args: argparse.Namespace) -> int:
    """Run ``fuseformer generate``; returns the exit code."""
    model, error = check_model_args(args)
    if error is not None:
        return _error(error, 2)
    if args.threads is not None and args.threads < 1:
        return _error(f"--threads must be at least 1, got {args.threads}", 2)

    import torch

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

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads if args.threads is not None else (default_threads() if device == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    where = f"{device}, {torch.get_num_threads()} CPU thread(s)" if device == "cpu" else device
    _log(args, f"loading {model} ({where}) ...")
    start = time.perf_counter()
    try:
        llm = LLM(
            model,
            dtype=args.dtype,
            device=device,
            seed=0 if args.seed is None else args.seed,
            cuda_graphs=args.cuda_graphs,
            enforce_eager=args.enforce_eager,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    except (FileNotFoundError, ValueError) as exc:
        return _error(str(exc), 1)
    if llm.tokenizer is None:
        return _error(f"--model {model} has no tokenizer.json", 2)
    _log(args, f"loaded {_describe_weights(llm.model)} in {time.perf_counter() - start:.1f} s")

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
    except ValueError as exc:  # the chat template's failures included (ChatTemplateError)
        return _error(str(exc), 2)

    start, first, num_tokens, finish = time.perf_counter(), None, 0, None
    try:
        while llm.has_unfinished_requests():
            for out in llm.step():
                for c in out.outputs:
                    num_tokens += len(c.token_ids)
                    finish = c.finish_reason or finish
                    if first is None and c.token_ids:
                        first = time.perf_counter()
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
    seconds = time.perf_counter() - start
    ttft = f", first token after {first - start:.2f} s" if first is not None else ""
    _log(
        args,
        f"{num_tokens} tokens in {seconds:.1f} s ({num_tokens / max(seconds, 1e-9):.1f} tok/s{ttft}; "
        f"finished: {finish})",
    )
    return 0


def _describe_weights(model) -> str:
    """The loaded line's weights: "11.7M parameters (float32)", or with FP8 layers "11.7M parameters
    (bfloat16; 9.4M in fp8)" (the FP8 weights are buffers, counted too)."""
    import torch

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    params = sum(p.numel() for p in model.parameters())
    fp8 = sum(b.numel() for b in model.buffers() if b.dtype == torch.float8_e4m3fn)
    if not fp8:
        return f"{params / 1e6:.1f}M parameters ({dtype})"
    return f"{(params + fp8) / 1e6:.1f}M parameters ({dtype}; {fp8 / 1e6:.1f}M in fp8)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuseformer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
