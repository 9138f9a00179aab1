"""CPU greedy decode: ``fuseformer.LLM`` against Hugging Face transformers' ``generate`` (issue 30 item 20).

Random-weight checkpoints of real small shapes (SmolLM-135M: Llama architecture; Qwen2-0.5B: qkv bias,
vocab 151936), written with transformers' ``save_pretrained`` into a temporary directory, so nothing is
downloaded. Each case runs one prompt of ``--prompt`` tokens to ``--new`` new tokens (greedy, EOS
ignored) in fp32 (``--dtype bfloat16``: bf16) on the CPU, with ``torch.set_num_threads(n)`` for each
``--threads``. The two implementations alternate in the same process (``--reps`` times each, the
order swapped every rep) so that load from other processes on a shared machine falls on both alike;
the figures are medians, and the ratio is ours / HF's tok/s (the median of the per-rep ratios is printed beside it).

HF runs as users get it: ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` (``--dtype``) (SDPA attention,
the default dynamic cache), ``generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)``.
tok/s counts new tokens over the whole call (prefill included), as a user times ``generate``.

    python benchmarks/cpu_vs_transformers.py [--shapes smollm-135m qwen2-0.5b] [--threads 1 2]
        [--prompt 32] [--new 64] [--reps 5] [--out cpu_vs_transformers.json]
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


def run_shape(
    shape: str, threads: list[int], prompt_len: int, new: int, reps: int, dtype: str = "float32"
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from fuseformer import LLM, SamplingParams

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(shape, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype)).eval()
        ours = LLM(tmp, dtype=dtype, device="cpu")
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, SHAPES[shape]["vocab_size"], (prompt_len,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        ids = torch.tensor([prompt])

        def run_hf() -> list[int]:
            with torch.inference_mode():
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                )  # fmt: skip
            return out[0, prompt_len:].tolist()

        def run_ours() -> list[int]:
            return list(ours.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

        impls = {"hf": run_hf, "ours": run_ours}
        for n in threads:
            torch.set_num_threads(n)
            for fn in impls.values():  # warm-up (allocator, first-call paths)
                fn()
            times: dict[str, list[float]] = {"hf": [], "ours": []}
            tokens: dict[str, list[int]] = {}
            for rep in range(reps):
                order = ["hf", "ours"] if rep % 2 == 0 else ["ours", "hf"]
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
        records += run_shape(shape, args.threads, args.prompt, args.new, args.reps, args.dtype)
    if args.out is not None:
        args.out.write_text(json.dumps({**meta, "results": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
