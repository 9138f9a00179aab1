"""Seeded sampling: the sampler's per-row torch.Generator draws against one batched kernel (issue 29's
host-cost question; a lab prototype, not the package's sampler).

The engine's sampler (``fuseformer.engine.sampler.sample``) draws each row's exponential noise for the
race ``argmax(probs / q)``: one ``exponential_`` over the batch, then one more launch per seeded row
with that request's ``torch.Generator`` (256 launches a step when every request is seeded, as in
``structured_outputs_engine.py``). The prototype here draws every row's noise from Philox keyed by the
row's seed at the row's token position (``tl.randint``), and fuses the race: one program per row reads
its probabilities once and keeps the running best, one launch in all.

Timed (CUDA): wall ms per call as a host-bound loop sees it (launches included; ``--calls`` calls, one
sync), and ``do_bench``'s median of the device time, for 256 rows of 128,256 tokens at temperature 1: the
engine's ``sample`` with every row seeded and with none (its metadata built once, as a step builds it),
and the prototype after the same softmax.
``--check`` (CPU with ``TRITON_INTERPRET=1``, or CUDA) checks the prototype's draws: the same seed and
position give the same token whatever the batch, and over many positions the tokens follow ``probs``
(chi-square over a small vocabulary).

    python benchmarks/seeded_sampling.py [--rows 256] [--vocab 128256] [--calls 50] [--check] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from fuseformer.ops.sampling import gumbel_sample


def seeded_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The package's op on probabilities (log-probs + Gumbel noise: the same race as probs / q)."""
    t = torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    return gumbel_sample(probs.log(), t, seeds, positions)


def _wall_ms(fn, calls: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / calls


def check(device: str) -> dict:
    """Batch independence and the distribution of the prototype's draws."""
    gen = torch.Generator().manual_seed(0)
    v = 40
    probs = torch.softmax(torch.randn(8, v, generator=gen) * 2, dim=-1).to(device)
    seeds = torch.arange(8, dtype=torch.int64, device=device) * 7919 + 3
    positions = torch.full((8,), 5, dtype=torch.int64, device=device)
    full = seeded_race(probs, seeds, positions)
    alone = torch.cat([seeded_race(probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1]) for i in range(8)])
    assert torch.equal(full, alone), "a row's token depends on the batch"
    # One row at 4,000 positions: the tokens' counts against probs (chi-square, v - 1 degrees of freedom).
    draws = 4000
    row = probs[:1].expand(draws, v).contiguous()
    tokens = seeded_race(row, seeds[:1].expand(draws).contiguous(), torch.arange(draws, device=device))
    counts = torch.bincount(tokens.long().cpu(), minlength=v).double()
    expected = probs[0].double().cpu() * draws
    keep = expected >= 5
    chi2 = float((((counts - expected) ** 2) / expected)[keep].sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~5 sigma above the mean of chi-square
    return dict(batch_independent=True, chi2=round(chi2, 1), dof=dof)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = dict(bench="seeded_sampling", device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    if args.check:
        result["check"] = check(device)
        print("check:", result["check"])
    if device == "cuda":
        from fuseformer.engine.sampler import SamplingMetadata, make_generator, sample
        from fuseformer.engine.sampling_params import SamplingParams

        gen = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(args.rows, args.vocab, device=device, generator=gen) * 3
        params = [SamplingParams(temperature=1.0, seed=i) for i in range(args.rows)]
        generators = [make_generator(i, device) for i in range(args.rows)]
        seeded = SamplingMetadata.build(params, vocab_size=args.vocab, device=device, generators=generators)
        unseeded = SamplingMetadata.build(params, vocab_size=args.vocab, device=device)
        seeds = torch.arange(args.rows, dtype=torch.int64, device=device)
        positions = torch.full((args.rows,), 300, dtype=torch.int64, device=device)
        ones = torch.ones(args.rows, dtype=torch.float32, device=device)
        logits_bf16 = logits.bfloat16()
        cases = {
            "engine sample(), every row seeded": lambda: sample(logits, seeded),
            "engine sample(), unseeded": lambda: sample(logits, unseeded),
            "softmax + batched seeded race (prototype)": lambda: seeded_race(logits.softmax(-1), seeds, positions),
            "gumbel_sample op on the logits": lambda: gumbel_sample(logits, ones, seeds, positions),
            "gumbel_sample op on bf16 logits": lambda: gumbel_sample(logits_bf16, ones, seeds, positions),
        }
        for name, fn in cases.items():
            wall = _wall_ms(fn, args.calls, device)
            gpu = triton.testing.do_bench(fn)
            result[name] = dict(wall_ms=round(wall, 3), device_ms=round(gpu, 3))
            print(f"{name:<46} wall {wall:8.3f} ms a call   device {gpu:8.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
