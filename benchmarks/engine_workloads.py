"""Some of `fuseformer bench engine`'s workloads, ours only (defaults and enforce_eager), JSON to $OUT/workloads.json:

python benchmarks/engine_workloads.py mix,prefix [--no-pieces]

``--no-pieces`` also runs each workload with the defaults less the graph pieces of steps with prefill
chunks (those steps eager, as before they existed): the A/B of issue 28 item 2, in the same process.
"""

import json
import os
import sys

import torch

from fuseformer.bench.engine import SHAPES, _run_ours, build_models, format_table, run_workload, workload

hf, ours = build_models(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
recs = []
for w in sys.argv[1].split(","):
    recs += run_workload(w, hf, ours, shape_name="llama3-8b", peers=False)
    if "--no-pieces" in sys.argv[2:]:
        prompts, lens = workload(w, ours.config.vocab_size)
        case = {k: recs[-1][k] for k in ("model", "workload", "requests", "dtype", "input_tokens", "max_output_len")}
        recs.append(_run_ours(ours, prompts, lens, case, "cuda", "fuseformer LLM, no graph pieces",
                              after_build=lambda llm: setattr(llm.core.runner, "piecewise_graphs", None)))  # fmt: skip
    print(format_table(recs), flush=True)
    json.dump(recs, open(os.environ["OUT"] + "/workloads.json", "w"), indent=1)
