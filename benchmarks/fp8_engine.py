"""FP8 inference against bf16 (issue 31), Llama-3-8B shape, random weights, one process, JSON to $OUT/fp8_engine.json.

Three engines over the same weights, one after the other (the model is quantized in place between the
first and the second): bf16; ``quantization="fp8"``; ``quantization="fp8", kv_cache_dtype="fp8"``.
Each runs, with the defaults otherwise (CUDA graphs, async scheduling):

- batch1: one 128-token prompt, 256 new tokens (greedy, EOS ignored): output tok/s, TPOT, and the
  decode step's weight bytes over its time as TB/s;
- fixed: 256 prompts x 256 tokens, 256 new tokens each: output tok/s;
- prefill: one 4,096-token prompt, 1 new token: time to first token and prefill tok/s.

Each case runs once to warm up (other prompts of the same shapes), then is timed.

    OUT=/tmp/out python benchmarks/fp8_engine.py [batch1,fixed,prefill] [bf16,fp8,fp8kv]
"""

import gc
import json
import os
import random
import sys
import time

import torch

from fuseformer import LLM, SamplingParams
from fuseformer.bench.engine import SHAPES, build_models

CASES = {"batch1": (1, 128, 256), "fixed": (256, 256, 256), "prefill": (1, 4096, 1)}


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: parameters and buffers (FP8 weights and scales are buffers), but the
    input embedding's (a lookup) unless the LM head shares it."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    embed, head = model.model.embed_tokens.weight, getattr(model.lm_head, "weight", None)
    return total - (0 if head is embed else embed.numel() * embed.element_size())


def run_case(llm: LLM, name: str, vocab: int) -> dict:
    n, length, out = CASES[name]
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    llm.generate(prompts_of(n, length, vocab, seed=1), params, use_tqdm=False)  # warm-up, other tokens
    prompts = prompts_of(n, length, vocab, seed=2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    rec = dict(case=name, requests=n, prompt_len=length, output_len=out, seconds=seconds, output_tok_s=tokens / seconds,
               mean_ttft_ms=1e3 * sum(ttft) / len(ttft))  # fmt: skip
    if out > 1:
        tpot = [
            (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) for o in outs
        ]
        rec["mean_tpot_ms"] = 1e3 * sum(tpot) / len(tpot)
    else:
        rec["prefill_tok_s"] = length * n / seconds
    return rec


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
    out_path = os.path.join(os.environ.get("OUT", "."), "fp8_engine.json")
    from fuseformer.bench._timing import copy_ceiling_tb_s

    copy = copy_ceiling_tb_s("cuda")
    hf, ours = build_models(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    vocab = ours.config.vocab_size
    max_len = max(length + out for _, length, out in CASES.values())
    records = []
    engines = {"bf16": ("bf16", {}), "fp8": ("fp8", dict(quantization="fp8")),
               "fp8kv": ("fp8 + fp8 KV cache", dict(quantization="fp8", kv_cache_dtype="fp8"))}  # fmt: skip
    chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else list(engines)
    for label, kwargs in (engines[e] for e in chosen):
        try:
            llm = LLM(ours, device="cuda", max_model_len=max_len, **kwargs)
        except Exception as exc:
            records.append(dict(engine=label, error=f"{type(exc).__name__}: {exc}"[:400]))
            continue
        nbytes = weight_bytes(llm.model)
        for name in names:
            try:
                rec = dict(engine=label, **run_case(llm, name, vocab), kv_blocks=llm.core.runner.num_blocks)
                if name == "batch1":
                    rec["weight_gb"] = nbytes / 1e9
                    rec["decode_tb_s"] = nbytes / (rec["mean_tpot_ms"] * 1e-3) / 1e12
                    rec["decode_pct_copy"] = 100 * rec["decode_tb_s"] / copy
            except Exception as exc:
                rec = dict(engine=label, case=name, error=f"{type(exc).__name__}: {exc}"[:400])
            records.append(rec)
            print(json.dumps(rec), flush=True)
            json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           copy_tb_s=copy, records=records), open(out_path, "w"), indent=1)  # fmt: skip
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["case"]: r for r in records if r.get("engine") == "bf16" and "error" not in r}
    for r in records:
        if "error" not in r and r["engine"] != "bf16" and r["case"] in base:
            key = "prefill_tok_s" if r["case"] == "prefill" else "output_tok_s"
            print(f"{r['engine']:<20} {r['case']:<8} {r[key]:>10.0f} = {r[key] / base[r['case']][key]:.2f}x bf16")


if __name__ == "__main__":
    main()
