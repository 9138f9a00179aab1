"""Some of `fuseformer bench engine`'s workloads, ours only, JSON to $OUT/workloads.json:

python benchmarks/engine_workloads.py mix,prefix [--eager] [--no-pieces]

Each workload runs with the defaults; ``--eager`` adds ``enforce_eager=True``; ``--no-pieces`` adds the
defaults less the graph pieces of steps with prefill chunks (those steps eager, as before they existed):
the A/B of issue 28 item 2, in the same process.
"""

import json
import os
import sys

import torch

from fuseformer.bench.engine import SHAPES, _run_ours, build_models, format_table, workload

hf, ours = build_models(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
del hf  # ours only: 16 GB back
torch.cuda.empty_cache()
variants = [("fuseformer LLM", {})]
if "--eager" in sys.argv[2:]:
    variants.append(("fuseformer LLM enforce_eager", dict(enforce_eager=True)))
if "--no-pieces" in sys.argv[2:]:
    no_pieces = dict(after_build=lambda llm: setattr(llm.core.runner, "piecewise_graphs", None))
    variants.append(("fuseformer LLM, no graph pieces", no_pieces))
recs = []
for w in sys.argv[1].split(","):
    prompts, lens = workload(w, ours.config.vocab_size)
    case = dict(model="llama3-8b", workload=w, requests=len(prompts), dtype="torch.bfloat16",
                input_tokens=sum(map(len, prompts)), max_output_len=max(lens))  # fmt: skip
    for impl, kw in variants:
        try:
            recs.append(_run_ours(ours, prompts, lens, case, "cuda", impl, **kw))
        except Exception as exc:  # a failing variant is a result; the others still run
            recs.append(dict(bench="engine", impl=impl, **case, error=f"{type(exc).__name__}: {exc}"))
        print(format_table(recs), flush=True)
        json.dump(recs, open(os.environ["OUT"] + "/workloads.json", "w"), indent=1)
