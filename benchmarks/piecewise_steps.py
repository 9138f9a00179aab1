"""Steps that carry a prefill chunk beside decodes, eager against graph pieces (issue 28 item 2), on CUDA.

Llama-3-8B shape, bf16, random weights, the defaults of ``LLM`` (CUDA graphs, async scheduling). D
requests decode while a new request of P prompt tokens (max_tokens 1) arrives before every step, so
every timed step is a mixed step of D + P tokens. Wall time over ``--steps`` steps with the graph
pieces on, off (the runner's ``piecewise_graphs`` set aside: those steps eager, as before the pieces)
and on again, in one engine. JSON to $OUT/piecewise_steps.json.

    OUT=/tmp/out python3 benchmarks/piecewise_steps.py [--cases 8x24,32x96,64x128,128x128,160x100,256x256] [--steps 30]
"""

import argparse
import json
import os
import random
import time

import torch

from fuseformer.bench.engine import _COMMON, SHAPES
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.models.config import ModelConfig
from fuseformer.models.loader import empty_model


def model_8b() -> torch.nn.Module:
    config = ModelConfig.from_hf(dict(SHAPES["llama3-8b"], **_COMMON, architectures=["LlamaForCausalLM"],
                                      dtype="bfloat16"))  # fmt: skip
    model = empty_model(config, torch.bfloat16, "cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    return model.eval()


def timed_steps(llm: LLM, decodes: int, prompt: int, steps: int, rng: random.Random) -> dict:
    vocab = llm.model_config.vocab_size

    def tokens(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]}

    running = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    ids = [llm.add_request(None, tokens(32), running) for _ in range(decodes)]
    while llm.has_waiting_requests():
        llm.step()
    for _ in range(4):
        llm.step()
    arriving = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    before = llm.step_log.count
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        llm.add_request(None, tokens(prompt), arriving)
        llm.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    records = llm.step_log.since(before)
    llm.abort(ids)
    while llm.has_unfinished_requests():
        llm.step()
    kinds = {}
    for r in records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    gpu = [r.gpu_ms for r in records if r.gpu_ms is not None]
    return dict(step_ms=1e3 * seconds / steps, kinds=kinds, launch_ms=sum(r.launch_ms for r in records) / len(records),
                gpu_ms=sum(gpu) / max(len(gpu), 1))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="8x24,32x96,64x128,128x128,160x100,256x256")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    llm = LLM(model_8b(), device="cuda", max_model_len=4096)
    pieces = llm.runner.piecewise_graphs
    rng = random.Random(0)
    rows = []
    out = os.path.join(os.environ.get("OUT", "."), "piecewise_steps.json")
    for case in args.cases.split(","):
        d, pr = map(int, case.split("x"))
        rec = dict(decodes=d, prompt=pr, tokens=d + pr)
        for label, on in (("pieces", True), ("eager", False), ("pieces_again", True)):
            llm.runner.piecewise_graphs = pieces if on else None
            rec[label] = timed_steps(llm, d, pr, args.steps, rng)
        rec["speedup"] = rec["eager"]["step_ms"] / min(rec["pieces"]["step_ms"], rec["pieces_again"]["step_ms"])
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        info = dict(date=time.strftime("%Y-%m-%d %H:%M"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                    capture_s=pieces.capture_seconds, pool_mib=pieces.pool_bytes / 2**20)  # fmt: skip
        json.dump(dict(info, rows=rows), open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
