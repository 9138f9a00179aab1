"""Where a batch-1 decode step's time goes (issue 28: 203 tok/s against the 240 goal, TPOT 4.84 ms against
~3.5 ms of weights at the copy ceiling). The Llama-3-8B shape with random bf16 weights through the public
``LLM`` with its defaults (CUDA graphs, async scheduling), one request of 128 prompt tokens: a timed run,
then the same run under torch.profiler (CUPTI reports the kernels a graph replays). Prints the kernels by
GPU time per decode step, the sum of all kernels a step against the step's wall time (the rest is the
device idle between kernels or waiting for the host), and each kernel's GB/s where its weight is known
from its time share (the GEMMs). JSON with ``--out``.

    python benchmarks/decode_step_profile.py [--tokens 128] [--out FILE] [--eager]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of the profiled run")
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (no graphs) as well")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from fuseformer.bench.engine import SHAPES, build_models, decode_bytes
    from fuseformer.engine.llm import LLM
    from fuseformer.engine.sampling_params import SamplingParams

    hf, model = build_models(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
    del hf
    gc.collect()
    weights = decode_bytes(model)
    prompt = [[(7 * i + 3) % model.config.vocab_size for i in range(128)]]
    results = []
    for eager in (False, True) if args.eager else (False,):
        llm = LLM(model, device="cuda", max_model_len=128 + args.tokens + 8, enforce_eager=eager)
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        m = out.metrics
        tpot_ms = 1e3 * (m.finished_time - m.first_token_time) / (args.tokens - 1)
        activity = (
            torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
        )
        with torch.profiler.profile(activities=[activity]) as prof:
            llm.generate(prompt, params, use_tqdm=False)
            torch.cuda.synchronize()
        steps = args.tokens - 1  # decode steps (the first token comes from the prefill)
        rows = []
        for e in prof.key_averages():
            if e.device_time_total <= 0:
                continue
            rows.append(dict(name=e.key[:110], per_step=e.count / steps, us_each=e.device_time_total / e.count,
                             us_per_step=e.device_time_total / steps))  # fmt: skip
        rows.sort(key=lambda r: -r["us_per_step"])
        kernel_ms = sum(r["us_per_step"] for r in rows) / 1e3
        rec = dict(
            enforce_eager=eager,
            tok_s=args.tokens / wall,
            tpot_ms=tpot_ms,
            weights_gb=weights / 1e9,
            weights_tb_s=weights / (tpot_ms * 1e-3) / 1e12,
            kernels_ms_per_step=kernel_ms,
            idle_ms_per_step=tpot_ms - kernel_ms,
            kernels=rows[:40],
            launches_per_step=sum(r["per_step"] for r in rows),
        )
        results.append(rec)
        print(f"# enforce_eager={eager}: {rec['tok_s']:.1f} tok/s, TPOT {tpot_ms:.3f} ms "
              f"({rec['weights_tb_s']:.2f} TB/s of {weights / 1e9:.2f} GB), kernels {kernel_ms:.3f} ms a step, "
              f"{rec['launches_per_step']:.0f} launches a step, the rest {tpot_ms - kernel_ms:.3f} ms")  # fmt: skip
        for r in rows[:28]:
            print(f"  {r['us_per_step']:8.1f} us/step {r['per_step']:6.1f}x {r['us_each']:8.2f} us  {r['name']}")
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), runs=results), indent=1))


if __name__ == "__main__":
    main()
