"""CPU greedy decode: ``fuseformer.LLM`` against Hugging Face transformers' ``generate`` (issue 30 item 20).

Random-weight checkpoints of real small shapes (SmolLM-135M: Llama architecture; Qwen2-0.5B: qkv bias,
vocab 151936), written with transformers' ``save_pretrained`` into a temporary directory, so nothing is
downloaded. Each case runs one prompt of ``--prompt`` tokens to ``--new`` new tokens (greedy, EOS
ignored) in fp32 (``--dtype bfloat16``: bf16) on the CPU, with ``torch.set_num_threads(n)`` for each
``--threads``. The implementations alternate in the same process (``--reps`` times each, the order
rotated every rep: with two, swapped) so that load from other processes on a shared machine falls on all alike;
the figures are medians, and the ratio is ours / HF's tok/s (the median of the per-rep ratios is printed beside it).

``--optimize`` adds "HF + fuseformer.optimize": another HF model loaded the same way, then
``fuseformer.optimize(model, training=False)`` (verified as always), timed in the same rotation. Each
``--optimize`` argument is one such model: ``all`` (every kind) or kinds joined by ``+`` passed as
``include`` (``linear``, ``norm+attention``), to tell what each kind does on the CPU; ``--optimize``
alone means ``all``. Their records go under ``"optimize"``, with tok/s over HF's.

HF runs as users get it: ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` (``--dtype``) (SDPA attention,
the default dynamic cache), ``generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)``.
tok/s counts new tokens over the whole call (prefill included), as a user times ``generate``.

    python benchmarks/cpu_vs_transformers.py [--shapes smollm-135m qwen2-0.5b] [--threads 1 2]
        [--prompt 32] [--new 64] [--reps 5] [--optimize [all linear ...]] [--out cpu_vs_transformers.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

SHAPES = {
    "smollm-135m": dict(
        arch="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
    ),
    "qwen2-0.5b": dict(
        arch="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_checkpoint(shape: str, directory: Path) -> None:
    """A random-weight checkpoint of ``shape`` (fp32 safetensors) in ``directory``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    config = (LlamaConfig if arch == "llama" else Qwen2Config)(**spec, torch_dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)


def _time(fn) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t0, tokens


def _optimized_hf(directory: str, dtype: str, variant: str):
    """A fresh HF model of ``directory`` through ``fuseformer.optimize(training=False)``; ``variant`` is
    ``all`` or the ``include`` kinds joined by ``+``."""
    from transformers import AutoModelForCausalLM

    import fuseformer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    include = None if variant == "all" else variant.split("+")
    t0 = time.perf_counter()
    report = fuseformer.optimize(model, training=False, include=include)
    info = {
        "optimize": variant,
        "counts": report.counts(),
        "reverted": [f"{r.path} [{r.kind}]" for r in report.reverted],
        "skipped": [f"{s.path or '(model)'} [{s.kind}]: {s.reason}" for s in report.skipped],
        "optimize_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(info), flush=True)
    return model


def run_shape(
    shape: str,
    threads: list[int],
    prompt_len: int,
    new: int,
    reps: int,
    dtype: str = "float32",
    optimize: list[str] | None = None,
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from fuseformer import LLM, SamplingParams

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(shape, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype)).eval()
        optimized = {f"hf+opt[{v}]": _optimized_hf(tmp, dtype, v) for v in optimize or []}
        ours = LLM(tmp, dtype=dtype, device="cpu")
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, SHAPES[shape]["vocab_size"], (prompt_len,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        ids = torch.tensor([prompt])

        def run_hf(model=hf) -> list[int]:
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                )  # fmt: skip
            return out[0, prompt_len:].tolist()

        def run_ours() -> list[int]:
            return list(ours.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

        impls = {"hf": run_hf, "ours": run_ours}
        impls.update({name: (lambda m=m: run_hf(m)) for name, m in optimized.items()})
        names = list(impls)
        for n in threads:
            torch.set_num_threads(n)
            for fn in impls.values():  # warm-up (allocator, first-call paths)
                fn()
            times: dict[str, list[float]] = {name: [] for name in names}
            tokens: dict[str, list[int]] = {}
            for rep in range(reps):
                # Each rep starts one further along the list: every implementation takes every slot
                # alike (with two: hf, ours, then ours, hf).
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    dt, tokens[name] = _time(impls[name])
                    times[name].append(dt)
            hf_tps = new / statistics.median(times["hf"])
            our_tps = new / statistics.median(times["ours"])
            pair = statistics.median(h / o for h, o in zip(times["hf"], times["ours"], strict=True))
            same = sum(a == b for a, b in zip(tokens["hf"], tokens["ours"], strict=True))
            record = {
                "shape": shape,
                "threads": n,
                "dtype": dtype,
                "prompt": prompt_len,
                "new_tokens": new,
                "reps": reps,
                "hf_tok_s": round(hf_tps, 2),
                "ours_tok_s": round(our_tps, 2),
                "ratio": round(our_tps / hf_tps, 3),
                "ratio_pairwise_median": round(pair, 3),
                "hf_s": [round(t, 3) for t in times["hf"]],
                "ours_s": [round(t, 3) for t in times["ours"]],
                "same_tokens": f"{same}/{new}",
            }
            for name in optimized:
                tps = new / statistics.median(times[name])
                record.setdefault("optimize", {})[name] = {
                    "tok_s": round(tps, 2),
                    "vs_hf": round(tps / hf_tps, 3),
                    "vs_hf_pairwise_median": round(
                        statistics.median(h / o for h, o in zip(times["hf"], times[name], strict=True)), 3
                    ),
                    "ours_vs_it": round(our_tps / tps, 3),
                    "s": [round(t, 3) for t in times[name]],
                    "same_tokens_as_hf": f"{sum(a == b for a, b in zip(tokens['hf'], tokens[name], strict=True))}/{new}",
                }
            print(json.dumps(record), flush=True)
            results.append(record)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both models' dtype")
    p.add_argument(
        "--optimize", nargs="*", default=None, metavar="KINDS",
        help="also time HF + fuseformer.optimize: 'all' kinds (the default), or include kinds joined by '+', "
        "one model per argument (e.g. --optimize all linear norm+attention)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the records here as JSON")
    args = p.parse_args()
    import transformers

    meta = {
        "date": date.today().isoformat(),
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(json.dumps(meta), flush=True)
    records = []
    for shape in args.shapes:
        optimize = None if args.optimize is None else (args.optimize or ["all"])
        records += run_shape(shape, args.threads, args.prompt, args.new, args.reps, args.dtype, optimize)
    if args.out is not None:
        args.out.write_text(json.dumps({**meta, "results": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
