"""The cost of structured outputs in the engine (issue 29 item 3's criterion): output tok/s of 256 ×
(256 in, 256 out) with half the requests held to a JSON schema, against all of them free, in one run.

The model: the Llama-3-8B shape with random bf16 weights (``fuseformer.bench.engine``), or ``--model``
(a directory: the CPU smoke run uses the built-in model). The tokenizer for the random model: a 128,000-
token byte-level BPE trained here on the standard library's sources (``structured_outputs.py``'s
``trained_tokenizer_dir``: nothing is downloaded), so the grammar library's work per mask is that of a
real vocabulary of the model's size. Every request samples (temperature 1, its own seed unless ``--unseeded``) with
``ignore_eos`` and ``max_tokens`` 256, so both runs produce the same number of tokens: a constrained
request whose JSON is complete samples EOS (the only token its grammar allows) until its 256th.

Order: free (a warm-up: the first run of a process is slower, perf-notes run 115, and the prompts'
prefix-cache hits of the later runs compile prefill shapes of their own), then free runs alternating
with constrained ones: half constrained, half constrained by the same object with free-length strings
(no ``maxLength``), half constrained again. Each cost is a constrained run against the mean of the free
runs on either side of it (the free runs of one process drift: H100, 2026-12-07, 8,137 then 14,418).
Each run records its steps by kind, its five longest launches and the Triton kernels compiled inside it
(a compile in a timed run is a kernel the warm-up missed).
Every constrained output must parse and validate (``jsonschema``, when installed).

``--xgr-threads 12,15`` appends, for each size of xgrammar's batch pool (its default: half the cores), a half
json_schema run and a free one after it (lab: the pool the engine's GrammarCompiler keeps is replaced).

    python benchmarks/structured_outputs_engine.py [--out FILE] [--model DIR] [--scale 1.0] [--unseeded] [--profile]
        [--xgr-threads N,...]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
# The same object with free-length strings (no maxLength), as many schemas are written.
# llguidance masks a position inside a length-bounded string ~20x slower than inside a free one
# (docs/perf-notes.md, session 27: 1.4 ms against 75 us a row at 128k tokens), so both are run.
SCHEMA_FREE_STRINGS = {
    **SCHEMA,
    "properties": {
        "name": {"type": "string"},
        "age": SCHEMA["properties"]["age"],
        "role": SCHEMA["properties"]["role"],
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
}


def _print_profile(prof: cProfile.Profile, seconds: float) -> None:
    """The host's own time (tottime) by function, the top 14, and the time it spent waiting for the
    device (CUDA event/stream synchronize): little waiting means the host bounds the run."""
    stats = pstats.Stats(prof).stats
    rows = sorted(((v[2], f"{k[0].split('/')[-1]}:{k[1]}({k[2]})", v[1]) for k, v in stats.items()), reverse=True)
    waits = sum(v[2] for k, v in stats.items() if "synchronize" in k[2])
    print(f"  host profile: {seconds:.2f} s wall, {waits:.2f} s waiting for the device")
    for tottime, name, calls in rows[:14]:
        print(f"  {tottime:7.3f} s {calls:>8} calls  {name}")


def run(
    llm,
    prompts: list[list[int]],
    out_len: int,
    constrained: set[int],
    profile: bool = False,
    schema: dict = SCHEMA,
    seeded: bool = True,
) -> dict:
    from fuseformer.bench.engine import timed_generate
    from fuseformer.engine.sampling_params import SamplingParams
    from fuseformer.engine.step_log import summarize
    from fuseformer.engine.structured_outputs import StructuredOutputsParams

    spec = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i if seeded else None,
            max_tokens=out_len,
            ignore_eos=True,
            structured_outputs=spec if i in constrained else None,
        )
        for i in range(len(prompts))
    ]
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    outs, seconds, measured, records = timed_generate(llm, prompts, params, device)
    if prof is not None:
        prof.disable()
        _print_profile(prof, seconds)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    bad = []
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    for i in sorted(constrained):
        text = outs[i].outputs[0].text
        try:
            value = json.loads(text)
            if jsonschema is not None:
                jsonschema.validate(value, schema)
        except Exception as exc:  # recorded: the criterion is that every one parses
            bad.append(f"{i}: {type(exc).__name__}: {text[:120]!r}")
    masked = [r.mask_ms for r in records if r.mask_ms is not None]
    return dict(
        constrained=len(constrained),
        seconds=seconds,
        output_tokens=tokens,
        output_tok_s=tokens / seconds,
        **measured,  # steps by kind, slowest launches, compiles, collections
        steps=summarize(records),  # p50 and max of each interval, ms
        mask_ms_p90=round(sorted(masked)[int(0.9 * (len(masked) - 1))], 2) if masked else None,
        mask_ms_top=[round(m, 2) for m in sorted(masked)[-8:]],
        invalid=bad,
        sample=outs[min(constrained)].outputs[0].text[:200] if constrained else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default=None, help="a model directory (default: the 8B shape, random)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrinks requests and lengths (smoke runs)")
    parser.add_argument("--profile", action="store_true", help="cProfile each run: the host's time and its waits")
    parser.add_argument(
        "--unseeded",
        action="store_true",
        help="no per-request seeds (the sampler then draws every row's noise in one launch, not one a seeded row)",
    )
    parser.add_argument("--xgr-threads", default="", help="xgrammar pool sizes for extra half json_schema runs")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from fuseformer.engine.llm import LLM

    n = max(2, round(256 * args.scale))
    length = max(4, round(256 * args.scale))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    if args.model is None:
        from structured_outputs import trained_tokenizer_dir

        from fuseformer.bench.engine import SHAPES, build_models

        tok_dir = trained_tokenizer_dir(128000, Path(tempfile.mkdtemp()))
        hf, model = build_models(SHAPES["llama3-8b"], device, torch.bfloat16)
        del hf
        gc.collect()
        llm = LLM(model, tokenizer=tok_dir, device=device, max_model_len=2 * length + 8)
    else:
        llm = LLM(args.model, device=device, max_model_len=2 * length + 8)
    setup_s = time.perf_counter() - start
    vocab = min(llm.get_tokenizer().vocab_size, llm.core.runner.model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]
    half = set(range(0, n, 2))
    runs = [
        ("free (warm-up)", set(), SCHEMA),
        ("free", set(), SCHEMA),
        ("half json_schema", half, SCHEMA),
        ("free", set(), SCHEMA),
        ("half, free strings", half, SCHEMA_FREE_STRINGS),
        ("free", set(), SCHEMA),
        ("half json_schema", half, SCHEMA),
        ("free", set(), SCHEMA),
    ]
    pools = [int(t) for t in args.xgr_threads.split(",") if t]
    runs += [r for t in pools for r in ((f"half json_schema, {t} xgr threads", half, SCHEMA), ("free", set(), SCHEMA))]
    records = []
    for name, constrained, schema in runs:
        if "xgr threads" in name:
            import xgrammar

            compiler = llm.output_processor.grammar_compiler
            compiler.prepare().result()  # nothing of the default pool's making left in flight
            compiler._xgr_executor = xgrammar.BatchGrammarMatcher(int(name.split(", ")[1].split()[0]))
        r = run(llm, prompts, length, constrained, args.profile, schema, seeded=not args.unseeded)
        r["run"] = name
        records.append(r)
        kinds = r["step_kinds"].values()
        steps, mask, wait = (sum(k[f] for k in kinds) for f in ("steps", "mask_s", "mask_wait_s"))
        mask_p = r["steps"].get("mask_ms", {})
        print(f"{name:<18} {r['output_tok_s']:>9.0f} out tok/s  {r['seconds']:.2f} s  invalid {len(r['invalid'])}"
              f"  {steps} steps, mask {1e3 * mask / steps:.2f} ms a step (p50 {mask_p.get('p50')}, p90"
              f" {r['mask_ms_p90']}, max {mask_p.get('max')}), host waited {1e3 * wait / steps:.2f}"
              f"  compiled {len(r['triton_compiles'])}  gc {r['gc']}  slowest launches {r['slowest_launches'][-2:]}")  # fmt: skip
        print("  step p50 ms: " + ", ".join(f"{k[:-3]} {v['p50']}" for k, v in r["steps"].items()))
    costs: dict[str, list[float]] = {}
    for i, r in enumerate(records):
        if r["constrained"]:
            free = (records[i - 1]["output_tok_s"] + records[i + 1]["output_tok_s"]) / 2
            costs.setdefault(r["run"], []).append(100 * (1 - r["output_tok_s"] / free))
    for name, c in costs.items():
        if "xgr threads" in name:
            print(f"  {name}: {c[0]:.1f}%")
    cost, cost_free_strings = costs["half json_schema"], costs["half, free strings"]
    print(f"cost of structured outputs: {', '.join(f'{c:.1f}%' for c in cost)} of the free runs beside "
          f"(goal <= 5%); with free-length strings: {cost_free_strings[0]:.1f}%")  # fmt: skip
    result = dict(
        bench="structured_outputs_engine",
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        requests=n,
        length=length,
        seeded=not args.unseeded,
        setup_s=setup_s,
        runs=records,
        cost_pct=cost,
        cost_free_strings_pct=cost_free_strings[0],
        costs_pct=costs,
        step_kinds=llm.step_log.totals(),
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
