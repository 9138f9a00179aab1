"""gumbel_sample: the kernel picks the reference's token (one Philox stream, one score); the reference's
Philox is Triton's own (tl.randint4x); a row's token does not depend on its batch; the draws follow the
softmax; ties, -inf and NaN rows as torch.argmax; bad input."""

import importlib

import pytest
import torch
import triton
import triton.language as tl

import fuseformer
import fuseformer.ops as F

S = importlib.import_module("fuseformer.ops.sampling")


def _case(n, vocab, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype).to(device)
    temperature = (torch.rand(n, generator=gen) + 0.2).to(device)
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen).to(device)  # negative: seeds >= 2^63
    positions = torch.randint(0, 2**40, (n,), generator=gen).to(device)  # past 2^32: both counter words
    return logits, temperature, seeds, positions


@triton.jit
def _randint4x_kernel(OUT, seed, position, N: tl.constexpr):
    i = tl.arange(0, N)
    offset = (tl.full([N], position, tl.int64) << 32) | i.to(tl.int64)  # counter (i, position, 0, 0)
    words = tl.randint4x(seed, offset)
    for j in tl.static_range(4):
        tl.store(OUT + i * 4 + j, words[j].to(tl.uint32).to(tl.int64))


def test_reference_philox_is_tritons(device):
    """The reference's Philox-4x32-10 gives the words of Triton's own tl.randint4x for the same key and counter."""
    n, seed, position = 64, 0x3456789ABCDEF012, 77
    out = torch.zeros(n * 4, dtype=torch.int64, device=device)
    _randint4x_kernel[(1,)](out, seed, position, N=n)
    c0 = torch.arange(n)
    zeros = torch.zeros(n, dtype=torch.int64)
    words = S._philox_ref(c0, zeros + position, zeros, zeros, zeros + (seed & 0xFFFFFFFF), zeros + (seed >> 32))
    assert torch.equal((out.cpu().view(n, 4) & 0xFFFFFFFF), torch.stack(words, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n, vocab, splits", [(1, 5, None), (3, 1000, None), (8, 1024, 1), (2, 3000, 2), (3, 5000, 4), (2, 6000, 3)]
)
def test_kernel_picks_the_reference_token(n, vocab, splits, dtype, device):
    logits, temperature, seeds, positions = _case(n, vocab, dtype, device)
    temperature[-1] = 0  # a greedy row among sampled ones
    logits[0, :3] = float("-inf")  # banned tokens
    with fuseformer.use_backend("triton"):
        got = S.gumbel_sample_fwd(logits, temperature, seeds, positions, splits=splits)
    want = F.gumbel_sample_ref(logits, temperature, seeds, positions)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got, want)
    assert got[-1] == logits[-1].float().argmax()


def test_public_op_strided_logits_and_empty_batch(device):
    logits, temperature, seeds, positions = _case(4, 2100, torch.float32, device)
    wide = torch.zeros(4, 2 * 2100, device=device)
    wide[:, ::2] = logits  # a vocabulary stride of 2: copied, not read wrongly
    with fuseformer.use_backend("triton"):
        got = F.gumbel_sample(wide[:, ::2], temperature, seeds, positions)
        empty = F.gumbel_sample(logits[:0], temperature[:0], seeds[:0], positions[:0])
    assert torch.equal(got, F.gumbel_sample_ref(logits, temperature, seeds, positions))
    assert empty.shape == (0,)


def test_a_rows_token_does_not_depend_on_its_batch(device):
    logits, temperature, seeds, positions = _case(6, 1500, torch.float32, device)
    with fuseformer.use_backend("triton"):
        together = F.gumbel_sample(logits, temperature, seeds, positions)
        alone = [F.gumbel_sample(logits[i : i + 1], temperature[i : i + 1], seeds[i : i + 1], positions[i : i + 1])
                 for i in range(6)]  # fmt: skip
        reversed_rows = F.gumbel_sample(logits.flip(0), temperature.flip(0), seeds.flip(0), positions.flip(0))
    assert torch.equal(together, torch.cat(alone))
    assert torch.equal(together, reversed_rows.flip(0))


def test_draws_follow_the_softmax(device):
    """One row drawn at 3,000 positions: the tokens' counts against softmax(logits / T) (chi-square). The
    reference's draws on a CPU (the kernel picks its tokens: above; 3,000 programs are slow interpreted)."""
    vocab, draws, t = 24, 3000, 0.7
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    sample = F.gumbel_sample if device == "cuda" else F.gumbel_sample_ref
    tokens = sample(
        row.expand(draws, vocab).contiguous().to(device),
        torch.full((draws,), t, device=device),
        torch.full((draws,), 12345, dtype=torch.int64, device=device),
        torch.arange(draws, device=device),
    )
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    expected = torch.softmax(row.double() / t, 0) * draws
    keep = expected >= 5
    chi2 = float((((counts - expected) ** 2) / expected)[keep].sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
    assert counts.sum() == draws


def test_ties_inf_and_nan_as_argmax(device):
    """Greedy ties keep the lowest index; a row of -inf takes token 0; NaN logits win (torch.argmax's rules)."""
    vocab = 2500
    logits = torch.zeros(4, vocab, device=device)
    logits[0, [7, 1800]] = 5.0  # a tie across chunks
    logits[1] = float("-inf")
    logits[2, 2000] = float("nan")
    logits[3, :] = float("-inf")
    logits[3, 2400] = 1.0  # the only finite token, in the last chunk
    temperature = torch.tensor([0.0, 1.0, 1.0, 2.0], device=device)
    seeds = torch.arange(4, device=device)
    positions = torch.zeros(4, dtype=torch.int64, device=device)
    for splits in (1, 2):
        with fuseformer.use_backend("triton"):
            got = S.gumbel_sample_fwd(logits, temperature, seeds, positions, splits=splits)
        assert got.tolist() == [7, 0, 2000, 2400]
    assert F.gumbel_sample_ref(logits, temperature, seeds, positions).tolist() == [7, 0, 2000, 2400]


def test_split_count_is_checked():
    with pytest.raises(ValueError, match="splits must be 1 to 64"):
        S.gumbel_sample_fwd(*_case(2, 1000, torch.float32, "cpu"), splits=65)


def test_splits_rule():
    assert S._splits(256, 126, 132) == 1  # a big batch: one program a row
    assert S._splits(1, 126, 132) == 64  # one row: spread over the SMs, at most 64
    assert S._splits(16, 126, 132) == 16
    assert S._splits(1, 3, 132) == 2  # never more programs than chunks


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(logits=torch.zeros(3, 10, dtype=torch.int64)), "logits has dtype int64"),
        (dict(logits=torch.zeros(30)), "logits must have 2 dims"),
        (dict(temperature=torch.ones(2)), r"temperature has shape \(2,\)"),
        (dict(temperature=torch.ones(3, dtype=torch.float64)), "temperature has dtype float64"),
        (dict(seeds=torch.zeros(3, dtype=torch.int32)), "seeds has dtype int32"),
        (dict(positions=torch.zeros(4, dtype=torch.int64)), r"positions has shape \(4,\)"),
        (dict(positions=[0, 1, 2]), "positions must be a torch.Tensor"),
    ],
)
def test_bad_input(change, match):
    args = dict(
        logits=torch.zeros(3, 10),
        temperature=torch.ones(3),
        seeds=torch.zeros(3, dtype=torch.int64),
        positions=torch.zeros(3, dtype=torch.int64),
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        F.gumbel_sample(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 256])
def test_kernel_picks_the_reference_token_at_the_engines_size_gpu(n):
    """bf16 logits of a 128k vocabulary (the Llama-3 head), every split count the rule gives."""
    logits, temperature, seeds, positions = _case(n, 128256, torch.bfloat16, "cuda", seed=n)
    got = F.gumbel_sample(logits, temperature, seeds, positions)
    want = F.gumbel_sample_ref(logits, temperature, seeds, positions)
    # The kernel's log is the GPU's approximate one: where two tokens' scores are within an ulp or two the
    # pick may differ; the kernel's token must then score within 1e-5 of the best.
    u = S.philox_uniform_ref(seeds, positions, 128256)
    scores = logits.float() / temperature[:, None] - torch.log(-torch.log(u))
    picked, best = scores.gather(1, got[:, None])[:, 0], scores.gather(1, want[:, None])[:, 0]
    assert torch.allclose(picked, best, rtol=0, atol=1e-5), (got, want)
    assert (got == want).float().mean() >= 0.99


@pytest.mark.gpu
def test_kernel_compiles_once_per_dtype_whatever_the_batch_gpu():
    """Batches of 1 to 256 rows (split counts 64 down to 1, chunks a split from 2 to 126) reuse the kernels
    the first batch of that dtype compiled, with the per-row vectors at any alignment (the engine's
    positions follow its seeds in one buffer): a server's first batch of a new size compiles nothing."""
    from fuseformer.bench.engine import TritonCompiles

    for dtype in (torch.bfloat16, torch.float32):
        F.gumbel_sample(*_case(1, 128256, dtype, "cuda", seed=0))  # compiles both kernels (64 splits)
        with TritonCompiles() as compiles:
            for n in (2, 7, 16, 33, 100, 255, 256):
                logits, temperature, seeds, positions = _case(n, 128256, dtype, "cuda", seed=n)
                keys = torch.stack([seeds, positions])  # positions 8 bytes past a 16-byte boundary when n is odd
                got = F.gumbel_sample(logits, temperature, keys[0], keys[1])
                assert torch.equal(got, F.gumbel_sample(logits, temperature, seeds, positions))
        assert compiles.available
        assert not [c for c in compiles.names if "_gumbel" in c], (dtype, compiles.names)
