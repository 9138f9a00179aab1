"""Some of `fuseformer bench engine`'s workloads, ours only (defaults and enforce_eager), JSON to $OUT/workloads.json:

python benchmarks/engine_workloads.py mix,prefix
"""

import json
import os
import sys

import torch

from fuseformer.bench.engine import SHAPES, build_models, format_table, run_workload

hf, ours = build_models(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
recs = []
for w in sys.argv[1].split(","):
    recs += run_workload(w, hf, ours, shape_name="llama3-8b", peers=False)
    print(format_table(recs), flush=True)
    json.dump(recs, open(os.environ["OUT"] + "/workloads.json", "w"), indent=1)
