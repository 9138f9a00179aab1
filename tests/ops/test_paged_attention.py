"""paged_attention: the Triton kernels against plain attention over the contiguous sequence in fp64
(DESIGN.md §3), steps mixing prefix + chunk + decode (the cache written by reshape_and_cache, whose own
tests are test_reshape_and_cache.py), GQA packing (the q heads of a KV group share a tile), split-K
decode, windows, bad input, compile."""

import importlib
import math

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.testing import assert_close, compile_offline

PA = importlib.import_module("fuseformer.ops.paged_attention")  # the module (F.paged_attention is the op)


def _dense(q, k, v, q_len, causal, window, dtype, softcap=0.0):
    """Plain attention of the last ``q_len`` queries of one contiguous sequence, computed in ``dtype``
    (scores capped at softcap * tanh(s / softcap) when ``softcap`` > 0).

    q (S, Hq, D), k, v (S, Hkv, D) -> (q_len, Hq, D) in ``dtype``.
    """
    s_len, hq, d = q.shape
    group = hq // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q[s_len - q_len :], k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * (1.0 / math.sqrt(d))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    q_pos = torch.arange(s_len - q_len, s_len, device=q.device)[:, None]
    k_pos = torch.arange(s_len, device=q.device)[None, :]
    allowed = torch.ones(q_len, s_len, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= k_pos <= q_pos
    if window > 0:
        allowed &= k_pos > q_pos - window
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def _nan_gapped(shape, dtype, device):
    base = torch.full((*shape[:-1], shape[-1] + 3), float("nan"), dtype=dtype, device=device)
    base[..., : shape[-1]] = torch.randn(shape, dtype=dtype, device=device)
    return base[..., : shape[-1]]


def _step(
    seqs, hq, hkv, d, block_size, dtype, device, *, causal=True, window=-1, noncontig=False, softcap=0.0, fp8=None
):
    """Run one step: ``seqs`` is a list of (context_len, q_len). The cached prefixes are written with
    the reference, the new tokens with ``reshape_and_cache`` (Triton), blocks assigned in a random
    order from a NaN-filled cache (a read outside the context yields NaN). Returns (out, ref, base).

    ``fp8``: (k_scale, v_scale) floats: e4m3 caches written with those scales; ref and base are then
    attention over the dequantized caches (what the kernel must compute), in fp64 and in ``dtype``."""
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks).tolist()
    cache_dtype = dtype if fp8 is None else torch.float8_e4m3fn
    scales = {}
    if fp8 is not None:  # a 0-dim and a (1,) scale
        scales = dict(k_scale=torch.tensor(fp8[0], device=device), v_scale=torch.tensor([fp8[1]], device=device))
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=cache_dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    max_blocks = max(blocks_per_seq, default=1) + 2
    block_tables = torch.full((len(seqs), max_blocks), 10**6, dtype=torch.int32, device=device)  # junk past the end
    full, new_q, new_k, new_v, slots, cu, refs, bases = [], [], [], [], [], [0], [], []
    for b, (ctx, q_len) in enumerate(seqs):
        table = [perm.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        q = torch.randn(ctx, hq, d, dtype=dtype, device=device) * (4 if softcap else 1)  # scores past the cap
        k = torch.randn(ctx, hkv, d, dtype=dtype, device=device)
        v = torch.randn(ctx, hkv, d, dtype=dtype, device=device)
        slot = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)], device=device)
        pre = ctx - q_len
        F.reshape_and_cache_ref(k[:pre], v[:pre], k_cache, v_cache, slot[:pre], **scales)
        new_q.append(q[pre:])
        new_k.append(k[pre:])
        new_v.append(v[pre:])
        slots.append(slot[pre:])
        cu.append(cu[-1] + q_len)
        full.append((q, k, v))
        refs.append(_dense(q, k, v, q_len, causal, window, torch.float64, softcap).cpu())
        bases.append(_dense(q, k, v, q_len, causal, window, dtype, softcap).cpu())
    q, k, v = torch.cat(new_q), torch.cat(new_k), torch.cat(new_v)
    if noncontig:  # slices of wider tensors whose gaps hold NaN, as slices of a packed qkv would be
        q, k, v = (_nan_gapped(t.shape, dtype, device).copy_(t) for t in (q, k, v))
    slot_mapping = torch.cat(slots).long()
    # A padding token with slot -1 must not be written.
    k_pad = torch.cat([k, torch.randn(1, hkv, d, dtype=dtype, device=device)])
    v_pad = torch.cat([v, torch.randn(1, hkv, d, dtype=dtype, device=device)])
    slot_pad = torch.cat([slot_mapping, torch.tensor([-1], device=device)])
    cu_q = torch.tensor(cu, dtype=torch.int32, device=device)
    ctx_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=device)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    F.reshape_and_cache_ref(k, v, ref_k_cache, ref_v_cache, slot_mapping, **scales)
    with fuseformer.use_backend("triton"):
        F.reshape_and_cache(k_pad, v_pad, k_cache, v_cache, slot_pad, **scales)
        out = F.paged_attention(
            q, k_cache, v_cache, cu_q, ctx_lens, block_tables, causal=causal, window=window, softcap=softcap, **scales
        )
    if fp8 is not None:  # the caches' bytes as the reference writes them (unwritten slots keep their NaN)
        for cache, ref_cache in ((k_cache, ref_k_cache), (v_cache, ref_v_cache)):
            assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)), (
                "reshape_and_cache wrote wrong bytes"
            )
        return (
            out.cpu(),
            *_fp8_refs(q, k_cache, v_cache, cu_q, ctx_lens, block_tables, scales, causal, window, softcap),
        )
    for cache, ref_cache in ((k_cache, ref_k_cache), (v_cache, ref_v_cache)):
        assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0)), "reshape_and_cache wrote wrong slots"
    ref = torch.cat(refs) if refs else torch.zeros(0, hq, d, dtype=torch.float64)
    base = torch.cat(bases) if bases else torch.zeros(0, hq, d, dtype=dtype)
    # The paged reference computes the same thing as the dense one.
    paged_ref = F.paged_attention_ref(
        q.double(), k_cache.double(), v_cache.double(), cu_q, ctx_lens, block_tables, causal=causal, window=window,
        softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(paged_ref.cpu(), ref, rtol=1e-9, atol=1e-9)
    return out.cpu(), ref, base


def _fp8_refs(q, k_cache, v_cache, cu_q, ctx_lens, block_tables, scales, causal, window, softcap):
    """(ref, base) of a step over e4m3 caches: the paged reference over the caches dequantized by hand
    (stored * scale) in fp64, and in q's dtype; checks the reference's own dequantization against it."""
    ks, vs = scales["k_scale"].item(), scales["v_scale"].item()  # the fp32 values, as Python floats
    args = (cu_q, ctx_lens, block_tables)
    kw = dict(causal=causal, window=window, softcap=softcap)
    ref = F.paged_attention_ref(q.double(), k_cache.double() * ks, v_cache.double() * vs, *args, **kw)
    own = F.paged_attention_ref(q.double(), k_cache, v_cache, *args, **kw, **scales)
    torch.testing.assert_close(own, ref, rtol=1e-12, atol=1e-12)
    base = F.paged_attention_ref(q, k_cache.to(q.dtype) * ks, v_cache.to(q.dtype) * vs, *args, **kw, upcast=False)
    return ref.cpu(), base.cpu()


# (context_len, q_len): a prefill without prefix, a chunk after a cached prefix, decodes, a one-token sequence.
MIX = [(37, 37), (50, 13), (20, 1), (1, 1), (70, 1)]
CPU_CASES = [
    # seqs, hq, hkv, d, block_size
    (MIX, 4, 2, 32, 16),
    (MIX, 4, 4, 59, 5),
    ([(23, 23)], 2, 1, 16, 16),
    ([(81, 1), (33, 1), (5, 1)], 6, 2, 64, 8),
    ([(90, 70)], 2, 2, 80, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seqs, hq, hkv, d, block_size", CPU_CASES)
def test_paged_attention_matches_contiguous_attention(seqs, hq, hkv, d, block_size, dtype, device):
    out, ref, base = _step(seqs, hq, hkv, d, block_size, dtype, device)
    assert out.dtype == dtype
    assert_close("out", out, ref, base)


# GQA packing: a tile's rows are (query, q head) pairs of one KV group. Groups 1 (MHA), 2, 3, 4, 8,
# MQA (Hkv 1), groups that do not divide BLOCK_M (24: rows left over) or exceed it (fp32 decode of 24
# heads: two head chunks of 16), decode-only and mixed steps, block sizes 1, 16, odd, 64 (>= BLOCK_N:
# one table entry per tile), head dims 64, 80, 128.
DECODE = [(45, 1), (17, 1), (3, 1), (130, 1)]
MIX_SMALL = [(21, 21), (40, 9), (20, 1), (1, 1)]  # prefill, chunk after a prefix, decodes
PACK_CASES = [
    # seqs, hq, hkv, d, block_size, dtype
    (DECODE, 8, 2, 128, 16, torch.float16),  # Llama-3-8B's group 4, decode
    (DECODE, 8, 2, 128, 16, torch.float32),
    (DECODE, 16, 2, 64, 1, torch.float16),  # group 8
    (DECODE, 6, 2, 80, 7, torch.float32),  # group 3
    (DECODE, 5, 1, 64, 16, torch.float16),  # MQA, group 5
    (DECODE, 24, 1, 64, 5, torch.float16),  # group 24: BLOCK_M 32, 8 rows left over
    ([(70, 1), (9, 1)], 24, 1, 128, 16, torch.float32),  # fp32 BLOCK_M 16 < group 24: 2 head chunks
    ([(24, 17), (30, 1), (1, 1)], 8, 2, 128, 16, torch.float16),  # 8B's group 4: 128 rows = 32 queries x 4
    ([(30, 12), (25, 1), (1, 1)], 6, 2, 80, 1, torch.float32),  # group 3, block_size 1
    (MIX_SMALL, 4, 2, 64, 5, torch.float16),  # group 2
    (MIX_SMALL, 3, 3, 64, 16, torch.float32),  # MHA
    (MIX_SMALL, 8, 1, 64, 7, torch.float16),  # MQA, group 8
    ([(40, 6), (150, 1), (7, 7)], 24, 1, 64, 16, torch.float16),  # group 24 in 128 rows: 5 queries per tile
    ([(100, 40), (130, 1)], 8, 2, 64, 64, torch.float16),  # pages of 64 = BLOCK_N
]


@pytest.mark.parametrize("seqs, hq, hkv, d, block_size, dtype", PACK_CASES)
def test_paged_attention_gqa_packing(seqs, hq, hkv, d, block_size, dtype, device):
    out, ref, base = _step(seqs, hq, hkv, d, block_size, dtype, device)
    assert_close("out", out, ref, base)


@pytest.mark.parametrize(
    "seqs, hq, hkv, window, causal",
    [
        (MIX_SMALL, 8, 2, 7, True),  # group 4
        ([(90, 60), (60, 1)], 6, 2, 33, True),  # group 3, queries of a tile at the window's edge
        ([(150, 1), (60, 1), (5, 1)], 8, 1, 20, True),  # MQA decode
        ([(60, 40), (33, 1)], 6, 2, 9, False),  # group 3, window without causal
    ],
)
def test_paged_attention_gqa_packing_window(seqs, hq, hkv, window, causal, device):
    out, ref, base = _step(seqs, hq, hkv, 64, 16, torch.float16, device, window=window, causal=causal)
    assert_close("out", out, ref, base)


def test_attn_config_packs_the_group():
    """Decode of Llama-3-8B (GROUP 4, hd 128, bf16): one 16-row tile holds the group's 4 heads;
    prefill: 128 rows = 32 queries x 4 heads; a group wider than the tile is split into head chunks."""
    decode = PA._attn_config(1, 4, 128, 2)
    assert (decode["BLOCK_M"], decode["HEADS"], decode["BLOCK_N"]) == (16, 4, 64)
    prefill = PA._attn_config(4096, 4, 128, 2)
    assert (prefill["BLOCK_M"], prefill["HEADS"], prefill["num_warps"]) == (128, 4, 8)
    assert PA._attn_config(1, 32, 128, 2)["BLOCK_M"] == 32
    assert PA._attn_config(1, 24, 128, 4)["HEADS"] == 16
    for q, g, d, es in [(1, 1, 256, 2), (4096, 7, 80, 2), (1, 64, 64, 4), (37, 3, 256, 4)]:
        cfg = PA._attn_config(q, g, d, es)
        assert cfg["HEADS"] <= cfg["BLOCK_M"] and cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1) == 0


def test_num_splits():
    # 8B decode at 256 sequences: 2048 programs fill 132 SMs; no split.
    assert PA._num_splits(256 * 8, 300, 132) == 1
    # 2 sequences x 8 KV heads over 8k tokens: split to about 2 x 132 programs.
    assert PA._num_splits(16, 8192, 132) == 16
    # Short contexts are not split below _SPLIT_MIN_KEYS keys per run.
    assert PA._num_splits(16, 700, 132) == 1
    assert PA._num_splits(1, 10**6, 132) == PA._MAX_SPLITS


@pytest.fixture
def merges(monkeypatch):
    """A record of the split-K merge kernel's launches (their grids)."""
    calls = []
    real = PA._paged_attention_merge_kernel

    class _Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(PA, "_paged_attention_merge_kernel", _Spy())
    return calls


@pytest.fixture
def force_split(monkeypatch, merges):
    """Split-K on CPU-sized steps (runs of >= 16 keys; 4 x 4 "SMs" to fill); returns the merges."""
    monkeypatch.setattr(PA, "_SPLIT_MIN_KEYS", 16)
    monkeypatch.setattr(PA, "_SPLIT_FILL", 4)
    return merges


@pytest.mark.parametrize(
    "seqs, hq, hkv, d, block_size, dtype, window",
    [
        ([(200, 1), (77, 1), (1, 1)], 8, 2, 64, 16, torch.float16, -1),  # empty splits for the short ones
        ([(150, 1), (31, 1)], 6, 2, 80, 7, torch.float32, -1),  # group 3, odd pages
        ([(200, 1), (100, 1)], 4, 1, 64, 16, torch.float16, 50),  # MQA with a window
        ([(150, 3), (90, 2)], 8, 2, 64, 16, torch.float16, -1),  # a few queries per sequence (one tile)
    ],
)
def test_paged_attention_split_k(seqs, hq, hkv, d, block_size, dtype, window, device, force_split):
    out, ref, base = _step(seqs, hq, hkv, d, block_size, dtype, device, window=window)
    assert len(force_split) == 1, "the split-K path did not run"
    assert_close("out", out, ref, base)


def test_paged_attention_explicit_num_splits(device, merges):
    """``num_splits`` (what a sweep varies) overrides the rule: 3 runs of keys merged, within §3 of fp64 as
    the rule's one run is; refused below 1, or above 1 where a sequence's queries take several tiles."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=gen).to(device=device, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(20, 16, 2, 64, generator=gen).to(device=device, dtype=torch.float16) for _ in "kv")
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    lens = torch.tensor([150, 70], dtype=torch.int32, device=device)
    tables = torch.randperm(20, generator=gen).to(device=device, dtype=torch.int32).reshape(2, 10)
    ref = F.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), cu, lens, tables)
    base = F.paged_attention_ref(q, k_cache, v_cache, cu, lens, tables, upcast=False)
    args = (q, k_cache, v_cache, cu, lens, tables, 64**-0.5, True, -1, 1)
    one = PA.paged_attention_fwd(*args, num_splits=1)
    assert not merges
    three = PA.paged_attention_fwd(*args, num_splits=3)
    assert len(merges) == 1, merges
    assert_close("out, 1 split", one, ref, base)
    assert_close("out, 3 splits", three, ref, base)
    with pytest.raises(ValueError, match="num_splits 0"):
        PA.paged_attention_fwd(*args, num_splits=0)
    long_q = torch.randn(100, 4, 64, device=device, dtype=torch.float16)  # 100 queries x 2 heads: 2 tiles of 128
    cu_long = torch.tensor([0, 100], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="num_splits 2"):
        PA.paged_attention_fwd(long_q, k_cache, v_cache, cu_long, lens[:1], tables[:1], 64**-0.5, True, -1, 100,
                               num_splits=2)  # fmt: skip


def test_paged_attention_split_k_nan_propagates(device, force_split):
    q = torch.randn(2, 4, 16, device=device)
    q[1, 2, 5] = float("nan")
    k_cache = torch.randn(20, 16, 2, 16, device=device)
    v_cache = torch.randn(20, 16, 2, 16, device=device)
    args = (
        torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
        torch.tensor([100, 70], dtype=torch.int32, device=device),
        torch.arange(40, dtype=torch.int32, device=device).remainder(20).reshape(2, 20),
    )
    with fuseformer.use_backend("triton"):
        out = F.paged_attention(q, k_cache, v_cache, *args)
    assert len(force_split) == 1
    ref = F.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), *args)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close(
        "out",
        out.nan_to_num(),
        ref.nan_to_num(),
        F.paged_attention_ref(q, k_cache, v_cache, *args, upcast=False).nan_to_num(),
    )


@pytest.mark.parametrize("window", [1, 7, 20])
def test_paged_attention_sliding_window(window, device):
    out, ref, base = _step(MIX, 4, 2, 32, 16, torch.float16, device, window=window)
    assert_close("out", out, ref, base)


@pytest.mark.parametrize(
    "seqs, hq, hkv, d, block_size, dtype, causal, window, softcap",
    [
        (MIX, 4, 2, 32, 16, torch.float16, True, -1, 1.5),  # prefill, chunk, decodes; group 2
        (MIX_SMALL, 8, 1, 64, 7, torch.float32, True, 7, 2.0),  # MQA (group 8) with a window
        ([(60, 40), (33, 1)], 6, 2, 40, 16, torch.float16, False, 9, 1.0),  # group 3, window, not causal
        (DECODE, 8, 2, 128, 16, torch.float32, True, -1, 50.0),  # decodes at Gemma 2's cap
    ],
)
def test_paged_attention_softcap(seqs, hq, hkv, d, block_size, dtype, causal, window, softcap, device):
    """Logit soft-capping (Gemma 2) against the capped dense attention, with causal, windows and GQA."""
    out, ref, base = _step(seqs, hq, hkv, d, block_size, dtype, device, causal=causal, window=window, softcap=softcap)
    assert_close("out", out, ref, base)


def test_paged_attention_softcap_split_k(device, force_split):
    out, ref, base = _step([(200, 1), (77, 1)], 8, 2, 64, 16, torch.float16, device, window=50, softcap=1.5)
    assert len(force_split) == 1, "the split-K path did not run"
    assert_close("out", out, ref, base)


def test_paged_attention_not_causal(device):
    out, ref, base = _step([(30, 30), (40, 9), (12, 1)], 4, 2, 32, 8, torch.float32, device, causal=False)
    assert_close("out", out, ref, base)


def test_paged_attention_noncontiguous_with_nan_gaps(device):
    out, ref, base = _step(MIX, 4, 2, 32, 16, torch.float16, device, noncontig=True)
    assert_close("out", out, ref, base)


def test_paged_attention_empty_step(device):
    k_cache = torch.randn(2, 4, 2, 16, device=device)
    q = torch.randn(0, 2, 16, device=device)
    zeros = torch.zeros(1, dtype=torch.int32, device=device)
    with fuseformer.use_backend("triton"):
        out = F.paged_attention(q, k_cache, k_cache, zeros, zeros[:0], zeros[:0, None])
        F.reshape_and_cache(q, q, k_cache, k_cache, zeros[:0].long())
    assert out.shape == (0, 2, 16)


def test_paged_attention_nan_inf_propagate_like_reference(device):
    seqs = [(20, 5), (9, 1)]
    q = torch.randn(6, 2, 16, device=device)
    q[1, 0, 3] = float("nan")
    q[5, 1, 2] = float("inf")
    k_cache = torch.randn(8, 4, 1, 16, device=device)
    v_cache = torch.randn(8, 4, 1, 16, device=device)
    args = (
        torch.tensor([0, 5, 6], dtype=torch.int32, device=device),
        torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=device),
        torch.tensor([[0, 2, 4, 6, 7], [1, 3, 5, 0, 0]], dtype=torch.int32, device=device),
    )
    with fuseformer.use_backend("triton"):
        out = F.paged_attention(q, k_cache, v_cache, *args)
    ref = F.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), *args)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.isnan(out[1, 0]).all() and torch.isnan(out[5, 1]).all() and not torch.isnan(out[0]).any()
    assert_close("out", out, ref, F.paged_attention_ref(q, k_cache, v_cache, *args, upcast=False))


def test_paged_attention_reference_backend_is_used_when_forced(device):
    q, kc = torch.randn(3, 2, 8, device=device), torch.randn(2, 4, 2, 8, device=device)
    args = (
        torch.tensor([0, 3], dtype=torch.int32, device=device),
        torch.tensor([5], dtype=torch.int32, device=device),
        torch.tensor([[1, 0]], dtype=torch.int32, device=device),
    )
    with fuseformer.use_backend("reference"):
        torch.testing.assert_close(F.paged_attention(q, kc, kc, *args), F.paged_attention_ref(q, kc, kc, *args))


def _good():
    return dict(
        q=torch.randn(3, 4, 8),
        k_cache=torch.randn(2, 4, 2, 8),
        v_cache=torch.randn(2, 4, 2, 8),
        cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
        context_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[1, 0]], dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.randint(0, 3, (3, 4, 8))), "q has dtype int64"),
        (dict(q=torch.randn(3, 32)), "q must have 3 dims"),
        (dict(k_cache=torch.randn(2, 4, 2, 8).half()), "k_cache has dtype float16"),
        (dict(v_cache=torch.randn(2, 4, 2, 9)), r"v_cache has shape \(2, 4, 2, 9\)"),
        (dict(q=torch.randn(3, 3, 8)), "not a multiple of k_cache's 2 kv heads"),
        (dict(q=torch.randn(3, 4, 4)), "k_cache has head dim 8 but q has 4"),
        (dict(cu_seqlens_q=torch.tensor([0.0, 3.0])), "cu_seqlens_q has dtype float32"),
        (dict(context_lens=torch.tensor([5, 5], dtype=torch.int32)), r"context_lens has shape \(2,\)"),
        (dict(block_tables=torch.tensor([1, 0], dtype=torch.int32)), "block_tables must have 2 dims"),
        (dict(window=0), "window must be -1 or a positive int"),
        (dict(softcap=-0.5), "softcap must be a float >= 0"),
    ],
)
def test_paged_attention_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        F.paged_attention(**{**_good(), **change})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a second device")
def test_paged_attention_device_mismatch():
    args = {**_good(), "q": torch.randn(3, 4, 8, device="cuda")}
    with pytest.raises(ValueError, match="k_cache is on cpu but q is on cuda"):
        F.paged_attention(**args)


def test_paged_attention_compiles_fullgraph(device, compile_backend):
    q = torch.randn(4, 4, 16, device=device)
    k = torch.randn(4, 2, 16, device=device)
    v = torch.randn(4, 2, 16, device=device)
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
    ctx = torch.tensor([3, 6], dtype=torch.int32, device=device)
    tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=device)
    slots = torch.tensor([8, 9, 10, 13], device=device)

    def fn(q, k, v, k_cache, v_cache):
        F.reshape_and_cache(k, v, k_cache, v_cache, slots)
        return F.paged_attention(q, k_cache, v_cache, cu_q, ctx, tables, max_seqlen_q=3) * 2

    with fuseformer.use_backend("triton"):
        caches = [torch.randn(4, 4, 2, 16, device=device) for _ in range(2)]
        caches_c = [c.clone() for c in caches]
        eager = fn(q, k, v, *caches)
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(q, k, v, *caches_c)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(caches_c, caches)


GPU_CASES = [
    # Llama-3-8B heads: a step mixing prefill chunks with cached prefixes and many decodes.
    ([(4096, 4096), (3000, 512), (1500, 1)] + [(int(c), 1) for c in torch.randint(1, 4000, (61,))], 32, 8, 128, 16),
    ([(1025, 97), (97, 97), (1, 1), (2049, 1)], 28, 4, 128, 16),
    ([(777, 300), (5125, 1)], 16, 2, 64, 32),
    ([(1000, 1000), (300, 1)], 8, 8, 256, 16),
    ([(513, 200), (33, 1)], 12, 4, 80, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seqs, hq, hkv, d, block_size", GPU_CASES)
def test_paged_attention_gpu(seqs, hq, hkv, d, block_size, dtype):
    out, ref, base = _step(seqs, hq, hkv, d, block_size, dtype, "cuda")
    assert_close("out", out, ref, base)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "seqs, hq, hkv, d, window, softcap",
    [
        (MIX, 4, 2, 16, 4, 5.0),  # the tiny Gemma 2 checkpoint's shape (its logits failed on an H100, run 142)
        (MIX, 8, 4, 256, -1, 50.0),  # Gemma 2's head dim and cap
        ([(513, 200), (33, 1), (1, 1)], 8, 4, 256, 100, 50.0),
    ],
)
def test_paged_attention_softcap_gpu(seqs, hq, hkv, d, window, softcap, dtype):
    """Soft-capped paged attention on the GPU (the device-parametrized softcap tests are not marked gpu)."""
    out, ref, base = _step(seqs, hq, hkv, d, 16, dtype, "cuda", window=window, softcap=softcap)
    assert_close("out", out, ref, base)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 1000])
def test_paged_attention_window_gpu(window):
    out, ref, base = _step([(3000, 800), (2000, 1), (50, 50)], 32, 8, 128, 16, torch.bfloat16, "cuda", window=window)
    assert_close("out", out, ref, base)


# Llama-3-8B decode as the engine runs it (32 q heads, 8 KV heads, hd 128, bf16, pages of 16): 256
# sequences of ~300 tokens (2048 programs, no split), and a few long ones (split-K).
DECODE_8B = [(280 + (37 * i) % 41, 1) for i in range(256)]


@pytest.mark.gpu
def test_paged_attention_llama3_8b_decode_gpu(merges):
    out, ref, base = _step(DECODE_8B, 32, 8, 128, 16, torch.bfloat16, "cuda")
    assert not merges, "256 sequences fill the GPU: no split-K expected"
    assert_close("out", out, ref, base)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [-1, 2000])  # a window of 2000 keys: 3 runs of >= 512
def test_paged_attention_split_k_gpu(window, merges):
    seqs = [(8192, 1), (5000, 1), (3000, 1), (1, 1)]
    out, ref, base = _step(seqs, 32, 8, 128, 16, torch.bfloat16, "cuda", window=window)
    assert len(merges) == 1, "4 sequences x 8 KV heads leave the GPU idle: split-K expected"
    assert_close("out", out, ref, base)


@pytest.mark.gpu
def test_paged_attention_compiles_once_whatever_the_step_gpu():
    """Steps that differ in their block table's width (1, a multiple of 16, neither), query tiles and
    key splits reuse the kernels the first such step compiled: an engine meets every mix of these in
    its eager steps, and a compile there is seconds inside a user's request."""
    from fuseformer.bench.engine import TritonCompiles

    # _step's block tables are 2 blocks wider than the longest context: widths 3, 16, 21, 32; query
    # tiles 32, 16, 17 (32 queries a tile); splits 16, 9, 3.
    steps = {
        "prefill": [[(16, 16)], [(224, 16)] * 8, [(300, 16), (40, 16)], [(480, 16)]],  # 16 new tokens each
        "long": [[(1000, 1000)], [(600, 512), (300, 200)], [(1500, 520)]],
        "split": [[(8192, 1), (3000, 1)], [(5000, 1)] * 3, [(2000, 1), (700, 1)]],  # split-K decodes
    }
    for name, cases in steps.items():
        _step(cases[0], 32, 8, 128, 16, torch.bfloat16, "cuda")  # compiles this kind's kernels
        with TritonCompiles() as compiles:
            for seqs in cases[1:]:
                out, ref, base = _step(seqs, 32, 8, 128, 16, torch.bfloat16, "cuda")
                assert_close("out", out, ref, base)
        assert compiles.available
        attention = [c for c in compiles.names if "_paged_attention" in c]
        assert not attention, f"{name}: {attention}"


_OFFLINE_COMPILE = r"""
import importlib, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PA = importlib.import_module("fuseformer.ops.paged_attention")
K = PA._paged_attention_fwd_kernel
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
PTRS = {"Q": "*bf16", "K_CACHE": "*bf16", "V_CACHE": "*bf16", "OUT": "*bf16", "LSE": "*fp32",
        "CU_Q": "*i32", "CTX_LENS": "*i32", "BLOCK_TABLES": "*i32"}


def build(max_seqlen_q, split, fp8=False):
    cfg = PA._attn_config(max_seqlen_q, 4, 128, 2, kv_element_size=1 if fp8 else 2)
    opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    consts = dict(CAUSAL=True, HAS_WINDOW=False, SPLIT=split, SOFTCAP=False, DOT_PRECISION="tf32", GROUP=4,
                  PAGE_SIZE=16,
                  HEAD_DIM=128, BLOCK_D=128, **cfg)
    ptrs = dict(PTRS, OUT="*fp32") if split else dict(PTRS)
    if fp8:  # e4m3 caches and their fp32 scales
        ptrs.update(K_CACHE="*fp8e4nv", V_CACHE="*fp8e4nv", K_SCALE="*fp32", V_SCALE="*fp32")
    else:  # no scales: constexpr None
        consts.update(K_SCALE=None, V_SCALE=None)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in ("qk_scale", "softcap") else "i32")
           for n in K.arg_names}
    # As the JIT specializes them: the step-varying integers (do_not_specialize) carry no divisibility.
    aligned = [i for i, n in enumerate(K.arg_names) if n in ptrs or (n.startswith("stride_") and n != "stride_bt")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    k = triton.compile(ASTSource(fn=K, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    # Register spills live in the stack frame: none allowed in the shipped configs.
    assert stack == 0 and k.metadata.shared <= 227 * 1024, (max_seqlen_q, split, regs, stack, k.metadata.shared)
    print(max_seqlen_q, split, fp8, cfg, opts, "regs", regs, "smem", k.metadata.shared)


build(1, False)  # Llama-3-8B decode
build(1, True)  # the same, split-K
build(4096, False)  # its prefill
build(1, False, fp8=True)  # the same three over an FP8 (e4m3) KV cache
build(1, True, fp8=True)
build(4096, False, fp8=True)
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile these for real")
def test_llama3_8b_configs_compile_for_sm90_offline():
    """The bf16 configs of Llama-3-8B's decode (also split-K) and prefill, over bf16 and e4m3 caches,
    compile for sm_90 (Triton's bundled ptxas, no GPU needed) without register spills and fit in
    shared memory."""
    compile_offline(_OFFLINE_COMPILE, timeout=300, tools=("ptxas", "cuobjdump"))


# --------------------------------------------------------------------------------------------
# The CPU path (what the reference backend runs on CPU tensors unless the reference is forced)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seqs, window, causal, consecutive",
    [
        ([(37, 1)], -1, True, True),  # decode, blocks in a run: a view of the cache
        ([(37, 1)], -1, True, False),  # decode, scattered blocks: index_select
        ([(40, 40)], -1, True, True),  # prefill without a prefix: SDPA's is_causal
        ([(50, 13), (9, 1), (5, 0), (16, 16)], -1, True, False),  # a mixed step, one sequence empty
        ([(50, 13), (33, 1)], 8, True, False),  # window shorter than the context
        ([(30, 7)], -1, False, True),  # not causal
    ],
)
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_paged_attention_cpu_path_matches_reference(seqs, window, causal, consecutive, dtype, softcap):
    hq, hkv, d, bs = 6, 2, 40, 16
    blocks = [-(-ctx // bs) for ctx, _ in seqs]
    n = sum(blocks) + 2
    order = list(range(n)) if consecutive else torch.randperm(n).tolist()
    # NaN in every slot outside the contexts: a read past a context fails.
    k_cache = torch.full((n, bs, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.full((len(seqs), max(blocks) + 1), n - 1, dtype=torch.int32)
    used = 0
    for b, ((ctx, _), m) in enumerate(zip(seqs, blocks, strict=True)):
        tables[b, :m] = torch.tensor(order[used : used + m], dtype=torch.int32)
        used += m
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(ctx)])
        k_cache.view(-1, hkv, d)[slots] = torch.randn(ctx, hkv, d, dtype=dtype)
        v_cache.view(-1, hkv, d)[slots] = torch.randn(ctx, hkv, d, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    ctx_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, dtype=dtype) * (4 if softcap else 1)
    args = (cu, ctx_lens, tables, d**-0.5, causal, window, softcap)
    out = PA._paged_attention_cpu(q, k_cache, v_cache, *args)
    ref = F.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), *args)
    assert out.dtype == dtype and out.shape == q.shape and not torch.isnan(out).any()
    assert_close("out", out, ref, F.paged_attention_ref(q, k_cache, v_cache, *args, upcast=False))


def test_paged_attention_cpu_path_is_the_natural_reference_backend(monkeypatch):
    # Under TRITON_INTERPRET the tests' CPU tensors go to Triton; choose "reference" as a CPU-only install would.
    monkeypatch.setattr(PA, "choose_backend", lambda *args: "reference")
    calls = []
    monkeypatch.setattr(
        PA, "_paged_attention_cpu", lambda *args, **kw: calls.append("cpu") or PA.paged_attention_ref(*args, **kw)
    )
    q, kc = torch.randn(3, 2, 8), torch.randn(2, 4, 2, 8)
    args = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), torch.tensor([[1, 0]]))
    F.paged_attention(q, kc, kc, *args)
    assert calls == ["cpu"]
    with fuseformer.use_backend("reference"):  # forced: the reference itself
        F.paged_attention(q, kc, kc, *args)
    assert calls == ["cpu"]


# --------------------------------------------------------------------------------------------
# FP8 (e4m3) KV caches: read as stored * scale, against the reference over the dequantized caches
# --------------------------------------------------------------------------------------------
FP8_SCALES = [(0.05, 3.0), (3.0, 0.05), (1.0, 1.0)]
FP8_CASES = [
    # seqs, hq, hkv, d, block_size, dtype (fp16 and fp32 queries: the interpreter's bf16 dot is wrong)
    (MIX, 4, 2, 32, 16, torch.float16),  # prefill, chunk after a prefix, decodes; group 2
    (MIX_SMALL, 8, 2, 64, 5, torch.float32),  # group 4, odd pages
    (DECODE, 8, 2, 128, 16, torch.float16),  # Llama-3-8B's group 4, decode only
    ([(90, 70), (20, 1)], 6, 2, 80, 16, torch.float32),  # group 3, hd 80, a long chunk after a prefix
    ([(40, 6), (7, 7)], 8, 1, 64, 64, torch.float16),  # MQA, pages of 64 = BLOCK_N
]


@pytest.mark.parametrize("scales", FP8_SCALES)
@pytest.mark.parametrize("seqs, hq, hkv, d, block_size, dtype", FP8_CASES)
def test_paged_attention_fp8_cache(seqs, hq, hkv, d, block_size, dtype, scales, device):
    """e4m3 caches (block tables in a random order with junk past their ends): decode and prefill
    steps, GQA, within DESIGN.md §3 of attention over the dequantized caches."""
    out, ref, base = _step(seqs, hq, hkv, d, block_size, dtype, device, fp8=scales)
    assert out.dtype == dtype
    assert_close("out", out, ref, base)


@pytest.mark.parametrize(
    "seqs, dtype, window, softcap, causal",
    [
        (MIX_SMALL, torch.float16, 7, 0.0, True),
        ([(60, 40), (33, 1)], torch.float32, 9, 0.0, False),
        (MIX, torch.float16, -1, 1.5, True),  # k_scale folded into the score scale before the cap
    ],
)
def test_paged_attention_fp8_cache_window_softcap(seqs, dtype, window, softcap, causal, device):
    out, ref, base = _step(
        seqs, 6, 2, 64, 16, dtype, device, causal=causal, window=window, softcap=softcap, fp8=(0.05, 3.0)
    )
    assert_close("out", out, ref, base)


def test_paged_attention_fp8_cache_split_k(device, force_split):
    """Split-K: each split's partial carries v_scale, the merge is linear."""
    out, ref, base = _step([(200, 1), (77, 1), (1, 1)], 8, 2, 64, 16, torch.float16, device, fp8=(0.05, 3.0))
    assert len(force_split) == 1, "the split-K path did not run"
    assert_close("out", out, ref, base)


def _fp8_inputs(device="cpu", dtype=torch.float32):
    """A small step over e4m3 caches with scales: (q, k_cache, v_cache, cu, ctx, tables, scales)."""
    k_cache = (torch.randn(6, 4, 2, 16, device=device) * 20).to(torch.float8_e4m3fn)
    v_cache = (torch.randn(6, 4, 2, 16, device=device) * 20).to(torch.float8_e4m3fn)
    q = torch.randn(4, 4, 16, device=device, dtype=dtype)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
    ctx = torch.tensor([7, 10], dtype=torch.int32, device=device)
    tables = torch.tensor([[4, 1, 0], [2, 0, 5]], dtype=torch.int32, device=device)
    scales = dict(k_scale=torch.tensor(0.05, device=device), v_scale=torch.tensor([3.0], device=device))
    return q, k_cache, v_cache, cu, ctx, tables, scales


@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_paged_attention_fp8_cpu_path_matches_reference(softcap):
    q, k_cache, v_cache, cu, ctx, tables, scales = _fp8_inputs()
    args = (cu, ctx, tables, 0.25, True, -1, softcap)
    out = PA._paged_attention_cpu(q, k_cache, v_cache, *args, **scales)
    ref = F.paged_attention_ref(q.double(), k_cache, v_cache, *args, **scales)
    base = F.paged_attention_ref(q, k_cache, v_cache, *args, upcast=False, **scales)
    assert_close("out", out, ref, base)


def test_paged_attention_fp8_without_kernel_support_takes_the_reference(monkeypatch):
    """e4m3 caches where the kernels cannot run (Triton has no fp8e4nv before sm_89) go to the
    reference backend, not to the kernel."""
    monkeypatch.setattr(
        importlib.import_module("fuseformer.ops._fp8_kv_cache"), "kernels_support_fp8", lambda device: False
    )
    monkeypatch.setattr(PA, "paged_attention_fwd", lambda *a, **kw: pytest.fail("the kernel ran"))
    q, k_cache, v_cache, cu, ctx, tables, scales = _fp8_inputs()
    out = F.paged_attention(q, k_cache, v_cache, cu, ctx, tables, **scales)
    assert_close(
        "out", out, *(F.paged_attention_ref(x, k_cache, v_cache, cu, ctx, tables, **scales) for x in (q.double(), q))
    )


def test_fp8_kernels_need_sm89(monkeypatch):
    FP8 = importlib.import_module("fuseformer.ops._fp8_kv_cache")
    for capability, ok in [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)]:
        monkeypatch.setattr(FP8, "_capability", lambda index, c=capability: c)
        assert FP8.kernels_support_fp8(torch.device("cuda", 0)) is ok
    assert FP8.kernels_support_fp8(torch.device("cpu"))


def test_paged_attention_scales_unused_for_model_dtype_caches(device):
    q, kc = torch.randn(3, 2, 8, device=device), torch.randn(2, 4, 2, 8, device=device)
    args = (
        torch.tensor([0, 3], dtype=torch.int32, device=device),
        torch.tensor([5], dtype=torch.int32, device=device),
        torch.tensor([[1, 0]], dtype=torch.int32, device=device),
    )
    scales = dict(k_scale=torch.tensor(0.1, device=device), v_scale=torch.tensor(7.0, device=device))
    with fuseformer.use_backend("triton"):
        torch.testing.assert_close(F.paged_attention(q, kc, kc, *args, **scales), F.paged_attention(q, kc, kc, *args))


def test_fp8_cache_has_its_own_autotune_key():
    """The key tells 1-byte caches from q's dtype's (bf16 caches keep their keys: tuned configs apply)."""
    bf16 = PA.config_key(True, 16, 128, 2)
    assert PA.config_key(True, 16, 128, 2, 2) == bf16 == "decode-R16-D128-E2"
    assert PA.config_key(True, 16, 128, 2, 1) == "decode-R16-D128-E2-KV1"
    assert PA.config_key(False, 128, 128, 4, 1) == "prefill-R128-D128-E4-KV1"
    keys = []
    real = PA.autotune.get_config
    PA.autotune.clear_plans()
    try:
        PA.autotune.get_config = lambda kernel, key, **kw: keys.append(key) or real(kernel, key, **kw)
        assert PA._attn_config(1, 4, 128, 2, kv_element_size=1) == PA._attn_config(1, 4, 128, 2)  # same defaults
    finally:
        PA.autotune.get_config = real
        PA.autotune.clear_plans()
    assert keys == ["decode-R16-D128-E2-KV1", "decode-R16-D128-E2"]


def _fp8_good():
    q, k_cache, v_cache, cu, ctx, tables, scales = _fp8_inputs()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu, context_lens=ctx, block_tables=tables, **scales)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(v_cache=torch.randn(6, 4, 2, 16)), "v_cache has dtype float32; expected one of float8_e4m3fn"),
        (dict(k_cache=torch.zeros(6, 4, 2, 16, dtype=torch.float8_e5m2)), "k_cache has dtype float8_e5m2"),
        (dict(k_scale=torch.tensor(1.0, dtype=torch.bfloat16)), "k_scale has dtype bfloat16"),
        (dict(v_scale=torch.ones(2)), "v_scale must hold one value"),
        (dict(k_scale=2.0), "k_scale must be a torch.Tensor"),
    ],
)
def test_paged_attention_fp8_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        F.paged_attention(**{**_fp8_good(), **change})


def test_paged_attention_fp8_compiles_fullgraph(compile_backend, device):
    q, k_cache, v_cache, cu, ctx, tables, scales = _fp8_inputs(device)
    k, v = torch.randn(4, 2, 16, device=device), torch.randn(4, 2, 16, device=device)
    slots = torch.tensor([8, 9, 10, 13], device=device)

    def fn(q, k, v, k_cache, v_cache, k_scale, v_scale):
        F.reshape_and_cache(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        return F.paged_attention(q, k_cache, v_cache, cu, ctx, tables, max_seqlen_q=3, k_scale=k_scale, v_scale=v_scale)

    with fuseformer.use_backend("triton"):
        caches_c = [k_cache.clone(), v_cache.clone()]
        eager = fn(q, k, v, k_cache, v_cache, *scales.values())
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(q, k, v, *caches_c, *scales.values())
    torch.testing.assert_close(compiled, eager)
    for c, e in zip(caches_c, (k_cache, v_cache)):
        assert torch.equal(c.view(torch.uint8), e.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seqs, hq, hkv, d, block_size", GPU_CASES)
def test_paged_attention_fp8_cache_gpu(seqs, hq, hkv, d, block_size, dtype):
    out, ref, base = _step(seqs, hq, hkv, d, block_size, dtype, "cuda", fp8=(0.05, 3.0))
    assert_close("out", out, ref, base)


@pytest.mark.gpu
def test_paged_attention_fp8_llama3_8b_decode_and_split_k_gpu(merges):
    out, ref, base = _step(DECODE_8B, 32, 8, 128, 16, torch.bfloat16, "cuda", fp8=(0.05, 3.0))
    assert not merges
    assert_close("out", out, ref, base)
    seqs = [(8192, 1), (5000, 1), (3000, 1), (1, 1)]
    out, ref, base = _step(seqs, 32, 8, 128, 16, torch.bfloat16, "cuda", window=2000, fp8=(3.0, 0.05))
    assert len(merges) == 1, "split-K expected"
    assert_close("out", out, ref, base)
