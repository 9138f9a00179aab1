"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties (vLLM's definitions), per-request
seeds independent of the batch, logprobs (and prompt logprobs); the token controls (logit_bias,
allowed_token_ids, min_tokens, bad_words) in greedy and random rows beside rows without them."""

import pytest
import torch

from fuseformer.engine.outputs import Logprob
from fuseformer.engine.sampler import (
    SamplingMetadata,
    apply_penalties,
    position_logprobs,
    prompt_logprobs,
    sample,
)
from fuseformer.engine.sampling_params import SamplingParams

V = 50


def _md(params, device="cpu", prompts=None, outputs=None, positions=None, vocab=V, eos=None, bad_words=None):
    n = len(params)
    return SamplingMetadata.build(
        params,
        vocab_size=vocab,
        device=device,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        positions=positions if positions is not None else [0] * n,
        eos_token_ids=eos if eos is not None else [() for _ in range(n)],
        bad_words_token_ids=bad_words if bad_words is not None else [[] for _ in range(n)],
    )


def _logits(n, v=V, device="cpu"):
    return torch.randn(n, v, device=device) * 3


def test_greedy_is_argmax():
    logits = _logits(7)
    out = sample(logits, _md([SamplingParams(temperature=0)] * 7))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=0.7, min_p=1.0),
        SamplingParams(temperature=1e-6),
    ],
    ids=["top_k=1", "top_p_tiny", "min_p=1", "temperature_tiny"],
)
def test_filters_that_leave_the_argmax(params):
    logits = _logits(64)
    for _ in range(3):
        out = sample(logits, _md([params] * 64))
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = _logits(8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 5.0) for i in range(8)]
    ids = sample(logits, _md(params)).sampled_token_ids
    assert torch.equal(ids[1::2], logits.argmax(-1)[1::2])
    assert ((ids >= 0) & (ids < V)).all()


def _frequencies(logits_row, params, n=20000):
    logits = logits_row.expand(n, -1).contiguous()
    ids = sample(logits, _md([params] * n, vocab=logits_row.numel())).sampled_token_ids
    return torch.bincount(ids, minlength=logits_row.numel()).double() / n


def test_temperature_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    freq = _frequencies(logits, SamplingParams(temperature=0.5))
    want = (logits / 0.5).double().softmax(-1)
    assert (freq - want).abs().max() < 0.015  # ~4 sigma at n = 20000


def test_top_k_top_p_min_p_distributions():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    p = logits.double().softmax(-1)  # 0.464 0.281 0.171 0.063 0.023 0.009
    # top-k 3: the three best, renormalised.
    freq = _frequencies(logits, SamplingParams(top_k=3))
    want = torch.zeros(6, dtype=torch.float64)
    want[:3] = p[:3] / p[:3].sum()
    assert (freq - want).abs().max() < 0.015
    # top-p 0.7: 0.464 < 0.7, 0.745 >= 0.7 -> the first two.
    freq = _frequencies(logits, SamplingParams(top_p=0.7))
    want = torch.zeros(6, dtype=torch.float64)
    want[:2] = p[:2] / p[:2].sum()
    assert (freq - want).abs().max() < 0.015
    # min-p 0.3: keep p >= 0.3 * 0.464 = 0.139 -> the first three.
    freq = _frequencies(logits, SamplingParams(min_p=0.3))
    want = torch.zeros(6, dtype=torch.float64)
    want[:3] = p[:3] / p[:3].sum()
    assert (freq - want).abs().max() < 0.015
    # top-k 4 then top-p 0.8 over the renormalised four (0.474 0.287 0.175 0.064): first three.
    freq = _frequencies(logits, SamplingParams(top_k=4, top_p=0.8))
    assert freq[3:].sum() == 0 and freq[2] > 0.1


def test_masked_tokens_never_sampled():
    logits = _logits(256)
    logits[:, 10:] = float("-inf")
    ids = sample(logits, _md([SamplingParams(temperature=3.0)] * 256)).sampled_token_ids
    assert (ids < 10).all()


def test_penalties_against_hand_computation():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.7)
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.6, -0.2, 1.0]])
    prompt, output = [1, 1, 2], [2, 3, 3, 3]
    md = _md([params], prompts=[prompt], outputs=[output], vocab=6)
    got = apply_penalties(logits, md)
    # token 0: unseen -> 2.0; 1: prompt only, negative -> -1.0 * 1.5;
    # 2: prompt + once in output, positive -> 3.0 / 1.5 - 0.3 * 1 - 0.7;
    # 3: three times in output -> 0.6 / 1.5 - 0.3 * 3 - 0.7; 4, 5: unseen.
    want = torch.tensor([[2.0, -1.5, 3.0 / 1.5 - 0.3 - 0.7, 0.6 / 1.5 - 0.9 - 0.7, -0.2, 1.0]])
    torch.testing.assert_close(got, want)
    # Greedy sees the penalised logits: token 2 (3.0) loses to token 0 (2.0).
    greedy = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.7)
    ids = sample(logits, _md([greedy], prompts=[prompt], outputs=[output], vocab=6)).sampled_token_ids
    assert ids.tolist() == [0]
    # A row without penalties in the same batch is untouched, and its tokens are not even read.
    mixed = _md([params, SamplingParams()], prompts=[prompt, [0, 0]], outputs=[output, [0]], vocab=6)
    both = apply_penalties(logits.expand(2, -1), mixed)
    torch.testing.assert_close(both, torch.cat([want, logits]))


def test_penalties_need_token_ids():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        SamplingMetadata.build([SamplingParams(presence_penalty=1.0)], vocab_size=V, device="cpu")


def _seeded_run(seed_params, others, steps_logits, device="cpu"):
    """Tokens of a seeded row over several steps (step i samples position 100 + i), sampled in a batch
    with ``others`` around it (their positions other than the seeded row's)."""
    tokens = []
    for i, step_logits in enumerate(steps_logits):
        n_other = len(others)
        params = others[: n_other // 2] + [seed_params] + others[n_other // 2 :]
        positions = [7 * k + 1 for k in range(len(params))]
        positions[n_other // 2] = 100 + i  # the others are unseeded or seeded elsewhere
        v, half = step_logits.numel(), n_other // 2
        rows = torch.cat([_logits(half, v, device), step_logits[None], _logits(n_other - half, v, device)])
        out = sample(rows, _md(params, device=device, positions=positions, vocab=step_logits.numel()))
        tokens.append(out.sampled_token_ids[n_other // 2].item())
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=1234, temperature=1.3),
        SamplingParams(seed=7, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01),
    ],
)
def test_seed_reproducible_whatever_the_batch(params):
    steps = [torch.randn(V) for _ in range(12)]
    alone = _seeded_run(params, [], steps)
    crowd = [SamplingParams(temperature=t, top_k=k) for t, k in [(1.0, -1), (0.0, -1), (2.0, 5), (0.5, 3), (1.0, 10)]]
    in_batch = _seeded_run(params, crowd, steps)
    seeded_crowd = [SamplingParams(seed=99, temperature=1.0)] * 3
    torch.manual_seed(0)  # another global RNG state
    in_other_batch = _seeded_run(params, seeded_crowd, steps)
    assert alone == in_batch == in_other_batch
    assert len(set(alone)) > 1  # really random, not argmax
    other_seed = SamplingParams(seed=params.seed + 1, temperature=params.temperature, top_k=params.top_k)
    assert _seeded_run(other_seed, [], steps) != alone


@pytest.mark.parametrize("num_logprobs", [0, 1, 5])
def test_logprobs_are_log_softmax_of_raw_logits(num_logprobs):
    logits = _logits(6)
    params = [
        SamplingParams(temperature=0.0 if i < 2 else 1.5, logprobs=num_logprobs, repetition_penalty=1.3)
        for i in range(6)
    ]
    md = _md(params, prompts=[[1, 2, 3]] * 6, outputs=[[4]] * 6)
    out = sample(logits, md)
    ref = logits.double().log_softmax(-1)
    ids = out.sampled_token_ids
    assert out.logprob_token_ids.shape == out.logprobs.shape == (6, 1 + num_logprobs)
    assert torch.equal(out.logprob_token_ids[:, 0], ids)
    torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.logprob_token_ids), atol=1e-5, rtol=1e-5)
    if num_logprobs:
        assert torch.equal(out.logprob_token_ids[:, 1:], ref.topk(num_logprobs, -1).indices)
    ranks = (ref > ref.gather(1, ids[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, ranks)


# ---- token controls ----------------------------------------------------------------------------

# Each row kind twice: greedy (temperature 0) and random (temperature 2: every token likely enough).
KINDS = [0.0, 2.0]


def test_logit_bias_moves_greedy_and_random_rows_and_leaves_the_others():
    logits = _logits(6)
    best = logits.argmax(-1)
    params = []
    for i in range(6):
        t = KINDS[i % 2]
        if i < 2:  # -100 on the row's argmax: never chosen
            params.append(SamplingParams(temperature=t, logit_bias={int(best[i]): -100}))
        elif i < 4:  # +100 on token 7: always chosen
            params.append(SamplingParams(temperature=t, logit_bias={"7": 100}))
        else:
            params.append(SamplingParams(temperature=t))
    for _ in range(20):
        ids = sample(logits, _md(params)).sampled_token_ids
        assert (ids[:2] != best[:2]).all() and (ids[2:4] == 7).all()
        assert ids[4] == best[4]
    masked = logits.clone()
    masked[0, best[0]] -= 100
    assert sample(logits[:1], _md(params[:1])).sampled_token_ids[0] == masked[0].argmax()  # the next best


def test_allowed_token_ids_restrict_every_draw():
    logits = _logits(64)
    allowed = [3, 17, 41]
    params = [SamplingParams(temperature=KINDS[i % 2], allowed_token_ids=allowed) for i in range(32)]
    params += [SamplingParams(temperature=KINDS[i % 2]) for i in range(32)]
    ids = sample(logits, _md(params)).sampled_token_ids
    assert set(ids[:32].tolist()) <= set(allowed) and len(set(ids[1:32:2].tolist())) > 1
    best_allowed = torch.tensor(allowed)[logits[:32, allowed].argmax(-1)]
    assert torch.equal(ids[:32:2], best_allowed[::2])  # greedy: the best of the allowed
    assert torch.equal(ids[32::2], logits[32::2].argmax(-1))  # untouched rows
    assert not set(ids[33::2].tolist()) <= set(allowed)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = _logits(4)
    logits[:, 5] = 50.0  # EOS would win every row
    logits[:, 6] = 40.0  # then the stop token id
    eos = [(5,)] * 4
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6]),
        SamplingParams(temperature=2.0, min_tokens=3, stop_token_ids=[6]),
        SamplingParams(temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[6]),  # EOS not a stop
        SamplingParams(temperature=0),
    ]
    before = sample(logits, _md(params, outputs=[[1, 2]] * 4, eos=eos)).sampled_token_ids.tolist()
    assert before[0] not in (5, 6) and before[1] not in (5, 6) and before[2] == 5 and before[3] == 5
    after = sample(logits, _md(params, outputs=[[1, 2, 3]] * 4, eos=eos)).sampled_token_ids.tolist()
    assert after == [5, 5, 5, 5]


def test_bad_words_one_token_always_longer_after_their_prefix():
    logits = _logits(4)
    logits[[0, 1, 3], 9] = 50.0  # each row's banned token is its best by far
    logits[2, 8] = 50.0
    words = [[[9]], [[4, 9]], [[2, 3, 8]], []]
    params = [SamplingParams(temperature=t, bad_words=["w"] if w else None) for t, w in zip([0, 2.0, 0, 0], words)]

    def after(output):
        return sample(logits, _md(params, outputs=[output] * 4, bad_words=words)).sampled_token_ids.tolist()

    for _ in range(5):
        ids = after([1, 4])
        assert ids[0] != 9 and ids[1] != 9 and ids[2] == 8 and ids[3] == 9
        ids = after([1, 2, 3])
        assert ids[0] != 9 and ids[1] == 9 and ids[2] != 8 and ids[3] == 9
        assert after([])[1:3] == [9, 8]  # the output does not end with the word's other tokens


def test_token_controls_leave_logprobs_raw_and_cost_nothing_unused():
    """logprobs are of the raw logits (vLLM's default), whatever the bias; a batch without controls
    builds no mask."""
    logits = _logits(2)
    params = [SamplingParams(temperature=0, logprobs=1, logit_bias={0: -100, 1: 100})] * 2
    out = sample(logits, _md(params))
    assert out.sampled_token_ids.tolist() == [1, 1]
    torch.testing.assert_close(out.logprobs[:, 0], logits.log_softmax(-1)[:, 1])
    assert _md([SamplingParams()] * 2).banned is None and _md(params).banned is None
    assert _md(params).logit_bias is not None


def test_prompt_logprobs_and_position_dicts():
    logits = _logits(5)
    targets = torch.tensor([3, 0, 49, 7, 7])
    ids, lps, ranks = prompt_logprobs(logits, targets, 2)
    ref = logits.double().log_softmax(-1)
    assert torch.equal(ids[:, 0], targets) and torch.equal(ids[:, 1:], ref.topk(2, -1).indices)
    torch.testing.assert_close(lps.double(), ref.gather(1, ids), atol=1e-6, rtol=1e-6)
    assert torch.equal(ranks, (ref > ref.gather(1, targets[:, None])).sum(-1) + 1)
    d = position_logprobs([7, 7, 2], [-0.5, -0.5, -1.0], 1)  # the chosen token is also the top one
    assert list(d) == [7, 2] and d[7] == Logprob(-0.5, 1) and d[2] == Logprob(-1.0, 2)
    d = position_logprobs([9, 7, 2], [-3.0, -0.5, -1.0], 12)
    assert list(d) == [9, 7, 2] and d[9].rank == 12 and d[7].rank == 1


def test_bad_logits_shape():
    md = _md([SamplingParams()] * 3)
    with pytest.raises(ValueError, match="logits"):
        sample(torch.randn(2, V), md)
    with pytest.raises(ValueError, match="logits"):
        sample(torch.randn(3, 2, V), md)
    with pytest.raises(ValueError, match="logits"):
        sample(torch.randn(3, V + 1), md)  # a vocab other than the metadata's


@pytest.mark.gpu
def test_sampler_cuda_full_vocab():
    """Real sizes on the GPU: 256 rows x 128256 (Llama-3 vocab), bf16 logits, mixed params, seeded rows
    reproducible across batches, greedy rows equal argmax."""
    vocab, n = 128256, 256
    logits = (torch.randn(n, vocab, device="cuda") * 4).bfloat16()
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.1, frequency_penalty=0.2),
        SamplingParams(temperature=0.7, min_p=0.05, logprobs=5),
    ]
    params = [kinds[i % 4] for i in range(n)]
    prompts = [list(range(i, i + 100)) for i in range(n)]
    outputs = [list(range(i, i + 20)) for i in range(n)]
    md = SamplingMetadata.build(
        params, vocab_size=vocab, device="cuda", prompt_token_ids=prompts, output_token_ids=outputs
    )
    out = sample(logits, md)
    assert torch.equal(out.sampled_token_ids[0::4], logits[0::4].float().argmax(-1))
    assert out.logprobs.shape == (n, 6)
    seeded = SamplingParams(seed=5, temperature=1.0, top_p=0.9)
    steps = [torch.randn(vocab, device="cuda") for _ in range(5)]
    assert _seeded_run(seeded, [], steps, "cuda") == _seeded_run(seeded, kinds * 16, steps, "cuda")
