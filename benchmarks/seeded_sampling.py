"""The sampler's draw on the GPU (issue 29's host-cost question): the engine's ``sample()`` with every row
seeded and with none, and the ``gumbel_sample`` op alone (ops/sampling.py), which ``sample()`` runs for
the random rows of a step on CUDA. Before session 30, a seeded row drew its noise with its own
``torch.Generator``, one launch a row (256 a step in ``structured_outputs_engine.py``): 4.07 ms a call
against 0.56 unseeded (H100, run 124); the op took 0.25-0.27 ms there.

Timed: wall ms per call as a host-bound loop sees it (launches included; ``--calls`` calls, one sync), and
``do_bench``'s median of the device time, for ``--rows`` rows of ``--vocab`` tokens at temperature 1, the
metadata built once (as a step builds it). Correctness is tests/ops/test_sampling.py and
tests/engine/test_sampler.py (``-m gpu`` for the real sizes).

    python benchmarks/seeded_sampling.py [--rows 256] [--vocab 128256] [--calls 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from fuseformer.engine.sampler import SamplingMetadata, sample
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.ops.sampling import gumbel_sample


def _wall_ms(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("seeded_sampling: needs a CUDA GPU")
    device, n, v = "cuda", args.rows, args.vocab
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(n, v, device=device, generator=gen) * 3).bfloat16()  # the LM head's dtype
    seeded_params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    seeded = SamplingMetadata.build(seeded_params, vocab_size=v, device=device, positions=[300] * n)
    unseeded = SamplingMetadata.build([SamplingParams(temperature=1.0)] * n, vocab_size=v, device=device)
    ones = torch.ones(n, dtype=torch.float32, device=device)
    seeds = torch.arange(n, dtype=torch.int64, device=device)
    positions = torch.full((n,), 300, dtype=torch.int64, device=device)
    cases = {
        "engine sample(), every row seeded": lambda: sample(logits, seeded),
        "engine sample(), unseeded": lambda: sample(logits, unseeded),
        "gumbel_sample op, bf16 logits": lambda: gumbel_sample(logits, ones, seeds, positions),
    }
    result: dict = dict(bench="seeded_sampling", device=torch.cuda.get_device_name(), rows=n, vocab=v)
    for name, fn in cases.items():
        wall = _wall_ms(fn, args.calls)
        gpu = triton.testing.do_bench(fn)
        result[name] = dict(wall_ms=round(wall, 3), device_ms=round(gpu, 3))
        print(f"{name:<36} wall {wall:8.3f} ms a call   device {gpu:8.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
