"""Where a process's first constrained run loses time (issue 29; run 139: half JSON schema 18.4% in the first
constrained run, 4.3% in the second): the grammar side alone, no model. A 128k byte-level BPE (the SO
benchmark's), ``GrammarCompiler.prepare`` as ``LLM`` calls it, then per schema and per round: the compile
(``matcher`` until ready), and N matchers walked through ``steps`` steps as the engine drives them (one
batch fill, then each row takes a random allowed token), with each step's fill time. Round 2 repeats round 1
with new matchers from the cached grammar: what it saves is the first run's one-time cost.

``--xgr-threads 8,12,15`` then walks the bounded schema (xgrammar's) once more for each size of xgrammar's
batch pool (its default: half the cores), the lab's look at whether the fill scales with more of the host's cores.

    python benchmarks/so_first_run.py [--rows 128] [--steps 64] [--other-first] [--xgr-threads N,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def walk(compiler, spec, rows: int, steps: int, seed: int) -> dict:
    """N new matchers of ``spec`` walked ``steps`` steps (random allowed tokens); times in ms."""
    start = time.perf_counter()
    matchers = [compiler.matcher(spec) for _ in range(rows)]
    error = matchers[0].wait()
    if error:
        raise RuntimeError(error)
    ready_ms = 1e3 * (time.perf_counter() - start)
    gen = torch.Generator().manual_seed(seed)
    fills = []
    for _ in range(steps):
        live = [m for m in matchers if not m.is_terminated]
        if not live:
            break
        t = time.perf_counter()
        mask = compiler.fill_bitmask(live)
        fills.append(1e3 * (time.perf_counter() - t))
        bits = ((mask.view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(1)
        for m, row in zip(live, bits):
            allowed = row.nonzero().flatten()
            m.accept_tokens([int(allowed[torch.randint(len(allowed), (1,), generator=gen)])])
    fills_sorted = sorted(fills)
    return dict(
        ready_ms=round(ready_ms, 2),
        first_fill_ms=round(fills[0], 2),
        fill_ms_p50=round(fills_sorted[len(fills) // 2], 2),
        fill_ms_max=round(fills_sorted[-1], 2),
        fill_ms_total=round(sum(fills), 1),
        top5=[round(f, 1) for f in fills_sorted[-5:]],
        steps=len(fills),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--other-first", action="store_true", help="walk another bounded schema first (2 rows, then all)"
    )
    parser.add_argument("--xgr-threads", default="", help="xgrammar pool sizes to walk the bounded schema with")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from structured_outputs import trained_tokenizer_dir
    from structured_outputs_engine import SCHEMA, SCHEMA_FREE_STRINGS

    from fuseformer.engine.structured_outputs import GrammarCompiler, StructuredOutputsParams
    from fuseformer.models.tokenizer import Tokenizer

    t = time.perf_counter()
    tok_dir = trained_tokenizer_dir(args.vocab, Path(tempfile.mkdtemp()))
    tokenizer = Tokenizer(tok_dir)
    record = {"tokenizer_s": round(time.perf_counter() - t, 1)}
    compiler = GrammarCompiler(tokenizer, args.vocab + 256)
    if torch.cuda.is_available():
        # The bitmasks are pinned on a CUDA machine, and a process's first pinned allocation creates the CUDA
        # context: an engine has made it long before (its model), this benchmark has not, so it is made here,
        # untimed (run 141: the first fill of the process, 2 rows of any schema, took 124 ms; likely this).
        t = time.perf_counter()
        torch.empty(1, pin_memory=True)
        record["cuda_init_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    compiler.prepare().result()
    record["prepare_s"] = round(time.perf_counter() - t, 2)
    print(
        f"# tokenizer {record['tokenizer_s']} s, CUDA init {record.get('cuda_init_s')} s, prepare {record['prepare_s']} s"
    )
    # Another bounded schema first, 2 rows then all: if the bounded schema's first fill is still slow after it,
    # the one-time cost is per grammar; if not, it is the batch matcher's threads at their first use.
    other = {"type": "object", "properties": {"id": {"type": "string", "maxLength": 8}}, "required": ["id"]}
    plan = [("other, 2 rows", other, 2, (1,)), ("other", other, args.rows, (1,))] if args.other_first else []
    plan += [("bounded", SCHEMA, args.rows, (1, 2)), ("free strings", SCHEMA_FREE_STRINGS, args.rows, (1, 2)),
             ("bounded again", SCHEMA, args.rows, (1, 2))]  # fmt: skip
    for name, schema, rows, rounds in plan:
        spec = StructuredOutputsParams(json=schema)
        for round_ in rounds:
            r = walk(compiler, spec, rows, args.steps, seed=round_)
            record[f"{name} round {round_}"] = r
            print(f"# {name:<14} round {round_}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    for threads in [int(n) for n in args.xgr_threads.split(",") if n]:
        import xgrammar

        compiler._xgr_executor = xgrammar.BatchGrammarMatcher(threads)  # lab: the pool GrammarCompiler keeps
        spec = StructuredOutputsParams(json=SCHEMA)
        for round_ in (1, 2):
            r = walk(compiler, spec, args.rows, args.steps, seed=round_)
            record[f"bounded, {threads} xgrammar threads, round {round_}"] = r
            print(
                f"# bounded, {threads:>2} xgr threads, round {round_}: " + ", ".join(f"{k} {v}" for k, v in r.items())
            )
    compiler.close()
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
