"""Where an engine step's time goes at the Llama-3-8B shape (random weights), on a CUDA GPU.

Runs 256 requests x (256 prompt, 64 output) once to warm up, then profiles a decode-heavy batch
(all prompts prefilled first, then 32 decode steps) with torch.profiler, and prints: wall time per
decode step, GPU-busy time per step, and the kernels that take the GPU time.

    python scripts/profile_engine.py [OUT_DIR]
"""

import json
import sys
import time

import torch

from fuseformer.bench.engine import SHAPES, build_models
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams


def main(out: str = ".", shape: dict = SHAPES["llama3-8b"], device: str = "cuda", **llm_kwargs) -> None:
    hf, ours = build_models(shape, device, torch.bfloat16 if device == "cuda" else torch.float32)
    del hf
    llm = LLM(ours, device=device, max_model_len=512, **llm_kwargs)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (256, 256), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (JIT compiles)

    for p in prompts:
        llm.add_request(None, p, params)
    # until every prompt is prefilled (and partly decoded): then the steps below are pure decode
    steps = 0
    while llm.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in llm.scheduler.running):
        llm.step()
        steps += 1
    print(f"prefill done after {steps} steps", flush=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(8):
        llm.step()
    sync()
    plain = (time.perf_counter() - t0) / 8
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(16):
            llm.step()
        sync()
        wall = (time.perf_counter() - t0) / 16
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / 16
    table = events.table(sort_by="self_device_time_total", row_limit=25)
    print(table)
    summary = dict(
        decode_step_ms_unprofiled=1e3 * plain,
        decode_step_ms_profiled=1e3 * wall,
        gpu_busy_ms_per_step=gpu_us / 1e3,
        running=len(llm.scheduler.running),
    )
    print(json.dumps(summary, indent=1))
    with open(f"{out}/engine-profile.txt", "w") as f:
        f.write(table + "\n" + json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:2])
