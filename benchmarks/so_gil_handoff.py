"""Why a constrained step's mask fill took 11 ms in the engine and 4.5 ms alone (issue 29, run 141): the fill
thread needs the GIL back when the grammar library returns, and the engine's thread, busy in Python, gives it
up only at the interpreter's switch interval (5 ms by default).

The length-bounded schema of the SO benchmark, N matchers walked a few tokens into the JSON, then async fills
(``GrammarCompiler.fill_bitmask_async``) with the calling thread (a) asleep, (b) running Python for 15 ms,
(c) running Python with the switch interval at 0.2 ms set by hand, and (d) as shipped (the compiler lowers the
interval itself while a fill is in flight). Fill times in ms (``MaskFill.seconds``: until the fill thread
has the GIL back).

    python benchmarks/so_gil_handoff.py [--rows 128] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def _python_for(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from structured_outputs import trained_tokenizer_dir
    from structured_outputs_engine import SCHEMA

    from fuseformer.engine import structured_outputs as so
    from fuseformer.engine.structured_outputs import GrammarCompiler, StructuredOutputsParams
    from fuseformer.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(trained_tokenizer_dir(args.vocab, Path(tempfile.mkdtemp())))
    compiler = GrammarCompiler(tokenizer, args.vocab + 256)
    compiler.prepare().result()
    spec = StructuredOutputsParams(json=SCHEMA)
    matchers = [compiler.matcher(spec) for _ in range(args.rows)]
    matchers[0].wait()
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):  # into the object, where masks cost more than at the start
        mask = compiler.fill_bitmask(matchers)
        bits = ((mask.view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(1)
        for m, row in zip(matchers, bits):
            allowed = row.nonzero().flatten()
            m.accept_tokens([int(allowed[torch.randint(len(allowed), (1,), generator=gen)])])
    shipped = so._SHORT_SWITCHES.seconds
    cases = [("caller asleep", "sleep", None), ("caller in Python, 5 ms switches", "python", None),
             ("caller in Python, 0.2 ms switches by hand", "python", 2e-4),
             (f"caller in Python, as shipped ({shipped * 1e3:g} ms while filling)", "python", "shipped")]  # fmt: skip
    for label, caller, interval in cases * 2:
        so._SHORT_SWITCHES.seconds = shipped if interval == "shipped" else 1.0  # 1 s: never lowers
        fills = []
        for _ in range(args.reps):
            saved = sys.getswitchinterval()
            if isinstance(interval, float):
                sys.setswitchinterval(interval)
            fill = compiler.fill_bitmask_async(matchers)
            time.sleep(0.015) if caller == "sleep" else _python_for(15)
            fill.result()
            sys.setswitchinterval(saved)
            fills.append(1e3 * fill.seconds)
        fills.sort()
        print(f"# {label:<48} fill p50 {fills[len(fills) // 2]:6.2f}  max {fills[-1]:6.2f} ms")
    so._SHORT_SWITCHES.seconds = shipped
    compiler.close()


if __name__ == "__main__":
    main()
