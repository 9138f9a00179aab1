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

from fuseformer.bench.engine import SHAPES, build_models, format_table, run_workload

hf, ours = build_models(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
del hf  # ours only: 16 GB back
torch.cuda.empty_cache()
variants = {}
if "--no-pieces" in sys.argv[2:]:
    no_pieces = dict(after_build=lambda llm: setattr(llm.core.runner, "piecewise_graphs", None))
    variants["fuseformer LLM, no graph pieces"] = no_pieces
recs = []
for w in sys.argv[1].split(","):
    recs += run_workload(
        w, None, ours, shape_name="llama3-8b", peers=False, eager="--eager" in sys.argv[2:], variants=variants
    )
    print(format_table(recs), flush=True)
    json.dump(recs, open(os.environ["OUT"] + "/workloads.json", "w"), indent=1)
