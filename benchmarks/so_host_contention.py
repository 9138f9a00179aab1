"""Does the grammar fill slow the engine's own Python down? (issue 29 item 3; perf-notes, session 31)

In the SO benchmark a constrained step's host work (launch + post) is ~2x the free step's, and every
function of the step loop is ~1.5x slower in a constrained run, not only the grammar's. This times, on
the CPU alone (no model):

- ``fill``: one fill of a (128, V/32) bitmask for 128 matchers of the SO benchmark's schema, through
  ``GrammarCompiler.fill_bitmask`` with the library's executor at ``--threads`` (0: its default: 80% of the
  CPUs for llguidance, half for xgrammar), the matchers advanced between fills by tokens drawn uniformly
  from their masks (as the random model draws them). The schema's strings are length-bounded, so the
  compiler gives it to xgrammar; ``--llguidance`` keeps it with llguidance (the A/B of session 31);
- ``work``: a fixed piece of the engine's Python (the detokenizer over 256 tokens and some list/dict
  churn) alone, and while a fill runs on the fill thread (``fill_bitmask_async``): the slowdown is the
  contention;
- ``prepare`` and ``accept``: the main thread's own grammar bookkeeping a step (the fill's
  hand-over, accepting 128 tokens).

    python benchmarks/so_host_contention.py [--threads 0,1,2,4,8] [--steps 60] [--vocab 128000] [--llguidance]

Also prints the CPUs this process may use: the affinity and the cgroup's CPU quota (``cpu.max``): the
device hosts' fills did not speed up with threads (session 31), a quota below the visible cores suspected.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _work(detok_tokens: list[int], tokenizer) -> None:
    """A fixed slice of the engine's per-step Python: decode 256 single tokens and build some records, 25 times."""
    for _ in range(25):  # ~5 ms on the device's host, about a free step's post-processing
        out = []
        for t in detok_tokens:
            out.append(tokenizer.decode([t]))
        recs = [{"id": i, "tokens": [i, i + 1], "text": s} for i, s in enumerate(out)]
        sum(len(r["text"]) for r in recs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="0,1,2,4,8")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--llguidance", action="store_true", help="the bounded schema with llguidance, not xgrammar")
    parser.add_argument(
        "--slices",
        default="general",
        help="llguidance's token slices: general (its default), or regexes joined by ' ;; ' (finer string slices)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import llguidance
    from structured_outputs import trained_tokenizer_dir
    from structured_outputs_engine import SCHEMA

    from fuseformer.engine.grammar_xgrammar import xgrammar_module
    from fuseformer.engine.structured_outputs import GrammarCompiler, StructuredOutputsParams
    from fuseformer.models.tokenizer import Tokenizer

    tok = Tokenizer(trained_tokenizer_dir(args.vocab, Path(tempfile.mkdtemp())))
    compiler = GrammarCompiler(tok, tok.vocab_size)
    if args.slices != "general":
        compiler._lltokenizer = llguidance.LLTokenizer(
            tok.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids), slices=args.slices.split(" ;; ")
        )
    spec = StructuredOutputsParams(json=SCHEMA)
    vocab = tok.vocab_size
    shifts = torch.arange(32, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    detok = torch.randint(0, vocab, (256,), generator=gen).tolist()
    work_alone = []
    for _ in range(20):
        t = time.perf_counter()
        _work(detok, tok)
        work_alone.append(time.perf_counter() - t)
    info = dict(
        cpus=os.cpu_count(),
        affinity=len(os.sched_getaffinity(0)),
        work_alone_ms=round(1e3 * statistics.median(work_alone), 3),
    )
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(path):
            info[path] = open(path).read().strip()
    try:
        info["lscpu"] = [
            line
            for line in os.popen("lscpu").read().splitlines()
            if line.split(":")[0] in ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)")
        ]
    except OSError:
        pass
    print(json.dumps(info), flush=True)
    results = [info]
    if args.llguidance:
        compiler._xgrammar.compile = lambda *a, **k: None  # llguidance compiles it (the fallback path)
    for threads in [int(x) for x in args.threads.split(",")]:
        compiler._parallel = llguidance.LLExecutor(threads or None)
        xgr = xgrammar_module()
        compiler._xgr_executor = None if xgr is None else xgr.BatchGrammarMatcher(threads or "auto")
        matchers = [compiler.matcher(spec) for _ in range(args.rows)]
        matchers[0].wait()
        fills, works, prepares, accepts, restarts = [], [], [], [], 0
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fill = compiler.fill_bitmask_async(matchers)
            t1 = time.perf_counter()
            _work(detok, tok)
            t2 = time.perf_counter()
            bitmask = fill.result()
            fills.append(fill.seconds)
            works.append(t2 - t1)
            prepares.append(t1 - t0)
            allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(len(matchers), -1)[:, :vocab].float()
            picks = torch.multinomial(allowed + 1e-30 * (allowed.sum(-1, keepdim=True) == 0), 1, generator=gen)
            t3 = time.perf_counter()
            for m, p in zip(matchers, picks[:, 0].tolist()):
                m.accept_tokens([p])
            accepts.append(time.perf_counter() - t3)
            for i, m in enumerate(matchers):
                if m.is_terminated or m.error is not None:
                    matchers[i] = compiler.matcher(spec)
                    restarts += 1
        rec = dict(
            library="llguidance" if args.llguidance or xgrammar_module() is None else "xgrammar",
            slices=args.slices,
            threads=threads,
            fill_ms=round(1e3 * statistics.median(fills), 2),
            fill_p90_ms=round(1e3 * sorted(fills)[int(0.9 * (len(fills) - 1))], 2),
            work_during_fill_ms=round(1e3 * statistics.median(works), 3),
            slowdown=round(statistics.median(works) / statistics.median(work_alone), 2),
            prepare_ms=round(1e3 * statistics.median(prepares), 3),
            accept_ms=round(1e3 * statistics.median(accepts), 3),
            restarts=restarts,
        )
        print(json.dumps(rec), flush=True)
        results.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
