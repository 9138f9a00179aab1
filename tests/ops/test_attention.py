"""flash_attention: the Triton kernels against the fp64 reference (DESIGN.md §3), bad input, compile.

On the CPU the kernels run under the interpreter, which is slow: shapes stay small and the kernel
configs (fuseformer.ops._attention_common._INTERPRET_CONFIGS) are small and unequal (BLOCK_M 32 / BLOCK_N 16
forward, 16 / 32 for dk/dv) so that these shapes still cross several blocks and every mask edge.
"""

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.ops import _attention_common as common
from fuseformer.ops import _gluon
from fuseformer.ops import attention as attn_mod
from fuseformer.ops import attention_bwd as bwd_mod
from fuseformer.testing import assert_close, compile_offline


def _nan_gapped(shape, dtype, device):
    """Random values viewed out of a buffer whose head dim is wider by 3 NaN columns."""
    base = torch.full((*shape[:-1], shape[-1] + 3), float("nan"), dtype=dtype, device=device)
    base[..., : shape[-1]] = torch.randn(shape, dtype=dtype, device=device)
    return base[..., : shape[-1]]


def _heads_major(shape, dtype, device):
    """Random (..., S, H, D) values viewed out of a (..., H, S, D) buffer (non-contiguous seq/head)."""
    *lead, s, h, d = shape
    return torch.randn((*lead, h, s, d), dtype=dtype, device=device).transpose(-3, -2)


def _inputs(b, sq, sk, hq, hkv, d, dtype, device, lens_q=None, lens_k=None, noncontig=False):
    if lens_q is not None:
        qs, ks = (sum(lens_q), hq, d), (sum(lens_k), hkv, d)
    else:
        qs, ks = (b, sq, hq, d), (b, sk, hkv, d)
    if noncontig:
        q = _nan_gapped(qs, dtype, device)
        k = _heads_major(ks, dtype, device)
        v = _nan_gapped(ks, dtype, device)
    else:
        q, k, v = (torch.randn(s, dtype=dtype, device=device) for s in (qs, ks, ks))
    return q, k, v


def _cu(lens, device):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)


def _check(
    b, sq, sk, hq, hkv, d, device, *, causal=False, window=(-1, -1), dtype=torch.float16,
    lens_q=None, lens_k=None, noncontig=False, scale=None, lse_grad=False, softcap=0.0,
):  # fmt: skip
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, dtype, device, lens_q, lens_k, noncontig)
    if softcap:  # scores well past the cap, so that the tanh bends them
        q = q * 4
    kw = dict(causal=causal, window_size=window, softmax_scale=scale, return_lse=True, softcap=softcap)
    if lens_q is not None:
        kw.update(
            cu_seqlens_q=_cu(lens_q, device),
            cu_seqlens_k=_cu(lens_k, device),
            max_seqlen_q=max(lens_q),
            max_seqlen_k=max(lens_k),
        )

    def run(fn, cast, **extra):
        args = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*args, **kw, **extra)
        return out, lse, args

    with fuseformer.use_backend("triton"):
        out, lse, args = run(F.flash_attention, dtype)
    ref, ref_lse, ref_args = run(F.flash_attention_ref, torch.float64)
    base, base_lse, base_args = run(F.flash_attention_ref, dtype, upcast=False)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, ref, base)
    assert_close("lse", lse, ref_lse, base_lse)

    g = torch.randn(out.shape, dtype=dtype, device=device)
    g_lse = torch.randn(lse.shape, dtype=torch.float32, device=device) if lse_grad else None
    for o, lse_, cast in ((out, lse, dtype), (ref, ref_lse, torch.float64), (base, base_lse, dtype)):
        loss = (o * g.to(cast)).sum()
        if lse_grad:
            loss = loss + (lse_ * g_lse.to(lse_.dtype)).sum()
        loss.backward()
    for name, a, r, bs in zip(("dq", "dk", "dv"), args, ref_args, base_args):
        assert a.grad.dtype == dtype
        assert_close(name, a.grad, r.grad, bs.grad)
    return out, lse, args


# (b, sq, sk, hq, hkv, d, causal, window)
DENSE_CASES = [
    (2, 17, 17, 2, 2, 32, False, (-1, -1)),
    (1, 65, 65, 4, 2, 32, True, (-1, -1)),  # GQA 4/2, several blocks along both axes
    (2, 33, 65, 4, 1, 40, True, (-1, -1)),  # MQA, padded head dim, causal with Sq < Sk
    (1, 65, 33, 2, 2, 32, True, (-1, -1)),  # causal with Sq > Sk: the first 32 rows see no key
    (1, 1, 17, 2, 1, 59, True, (-1, -1)),  # one query
    (1, 17, 1, 2, 2, 32, False, (-1, -1)),  # one key
    (1, 65, 65, 2, 2, 32, True, (8, -1)),  # sliding window (causal)
    (1, 33, 65, 2, 1, 59, False, (5, 3)),  # two-sided window, Sq < Sk
    (1, 33, 33, 2, 2, 32, False, (0, -1)),  # left bound only
    (1, 33, 17, 2, 2, 32, False, (2, 1)),  # window with Sq > Sk: rows that see nothing
]


@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, causal, window", DENSE_CASES)
def test_flash_attention_matches_reference(b, sq, sk, hq, hkv, d, causal, window, device):
    _check(b, sq, sk, hq, hkv, d, device, causal=causal, window=window)


@pytest.mark.parametrize("scale", [0.3, -0.3])
def test_flash_attention_scale_folding(scale, device):
    """The forward with the scale folded into the exponent (FOLD_SCALE, positive scales) and without
    it (a negative scale) both match the reference."""
    _check(1, 65, 65, 4, 2, 32, device, causal=True, scale=scale)
    _check(1, 33, 65, 2, 1, 40, device, window=(5, 3), scale=scale)


# (b, sq, sk, hq, hkv, d, causal, window, softcap)
SOFTCAP_CASES = [
    (2, 17, 17, 2, 2, 32, False, (-1, -1), 1.5),
    (1, 65, 65, 4, 2, 32, True, (-1, -1), 2.0),  # causal, GQA 4/2
    (1, 33, 65, 4, 1, 40, True, (8, -1), 1.0),  # sliding window, MQA, padded head dim, Sq < Sk
    (1, 33, 65, 2, 1, 59, False, (5, 3), 50.0),  # two-sided window, Gemma 2's cap (barely bends here)
]


@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, causal, window, softcap", SOFTCAP_CASES)
def test_flash_attention_softcap_matches_reference(b, sq, sk, hq, hkv, d, causal, window, softcap, device):
    """Logit soft-capping (Gemma 2): out, lse and every gradient through the tanh against the reference."""
    _check(b, sq, sk, hq, hkv, d, device, causal=causal, window=window, softcap=softcap)


def test_flash_attention_softcap_varlen_and_lse_gradient(device):
    lens = [5, 30]
    _check(None, None, None, 4, 2, 32, device, lens_q=lens, lens_k=lens, causal=True, softcap=1.5, lse_grad=True)


def test_flash_attention_softcap_changes_the_result(device):
    """The cap is applied: a small cap gives another output than none, and the reference agrees that
    capped scores are softcap * tanh(scores / softcap)."""
    q, k, v = _inputs(1, 9, 9, 2, 1, 16, torch.float32, device)
    q = q * 4
    capped = F.flash_attention_ref(q, k, v, softcap=1.0, return_lse=True)[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.expand(-1, -1, 2, -1)) * 16**-0.5
    torch.testing.assert_close(capped, torch.logsumexp(torch.tanh(scores), -1))
    assert not torch.allclose(F.flash_attention_ref(q, k, v), F.flash_attention_ref(q, k, v, softcap=1.0))


# (lens_q, lens_k, hq, hkv, d, causal, window)
VARLEN_CASES = [
    ([1, 17, 33], [1, 17, 33], 4, 2, 32, True, (-1, -1)),
    ([1, 5, 17], [3, 20, 17], 2, 1, 40, True, (-1, -1)),  # per-sequence bottom-right alignment
    ([17, 1, 33], [17, 4, 33], 2, 2, 32, False, (4, 2)),
    ([9, 0, 20], [9, 3, 20], 2, 2, 32, False, (-1, -1)),  # an empty query sequence
]


@pytest.mark.parametrize("lens_q, lens_k, hq, hkv, d, causal, window", VARLEN_CASES)
def test_flash_attention_varlen_matches_reference(lens_q, lens_k, hq, hkv, d, causal, window, device):
    _check(None, None, None, hq, hkv, d, device, causal=causal, window=window, lens_q=lens_q, lens_k=lens_k)


def test_flash_attention_noncontiguous_with_nan_gaps(device):
    _check(2, 33, 40, 4, 2, 32, device, causal=True, noncontig=True)


def test_flash_attention_varlen_noncontiguous(device):
    _check(None, None, None, 2, 1, 32, device, lens_q=[5, 30], lens_k=[5, 30], causal=True, noncontig=True)


def test_flash_attention_scale_and_lse_gradient(device):
    _check(1, 33, 33, 2, 2, 32, device, causal=False, scale=0.3, lse_grad=True)


def test_flash_attention_other_block_sizes(device, monkeypatch, tmp_path):
    """BLOCK_N > BLOCK_M in the forward and dq kernels, BLOCK_M > BLOCK_N in dk/dv: configs stored in
    the autotune cache (the one config mechanism) reach the kernels through the public op."""
    from dataclasses import asdict, replace

    from fuseformer.runtime import autotune

    monkeypatch.setenv("FUSEFORMER_CACHE_DIR", str(tmp_path))
    autotune.clear_memory()
    dtype = torch.float16
    try:
        for kind, (bm, bn) in {"fwd": (16, 32), "bwd_dq": (16, 32), "bwd_dkdv": (32, 16)}.items():
            cfg = replace(common.kernel_config(kind, 32, True, dtype, device), BLOCK_M=bm, BLOCK_N=bn)
            autotune.store(common.KERNELS[kind], common.config_key(32, True, dtype), asdict(cfg), device)
            assert common.kernel_config(kind, 32, True, dtype, device) == cfg
        _check(1, 50, 70, 2, 1, 32, device, causal=True, window=(20, -1), dtype=dtype)
    finally:
        autotune.clear_memory()


@pytest.mark.parametrize("varlen", [False, True])
def test_flash_attention_pointer_loads_without_tma(varlen, device, monkeypatch):
    """The non-TMA path of every kernel (taken where a layout cannot have a TMA descriptor, and below
    sm_90)."""
    _no_tma(monkeypatch)
    if varlen:
        _check(None, None, None, 4, 2, 32, device, lens_q=[20, 3], lens_k=[20, 9], causal=True, window=(6, -1))
    else:
        _check(1, 40, 50, 4, 1, 40, device, causal=True, window=(12, -1))


def _no_tma(monkeypatch):
    """Pointer loads in every kernel, as on a GPU below sm_90 (_use_tma is imported by attention_bwd)."""
    monkeypatch.setattr(attn_mod, "_use_tma", lambda t: False)
    monkeypatch.setattr(bwd_mod, "_use_tma", lambda t: False)


def test_flash_attention_backward_is_bitwise_repeatable(device):
    """No atomics anywhere in the backward: the same inputs give the same bits."""
    q, k, v = _inputs(1, 33, 33, 2, 1, 32, torch.float16, device)
    g = torch.randn_like(q)
    grads = []
    for _ in range(2):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        with fuseformer.use_backend("triton"):
            F.flash_attention(*args, causal=True).backward(g)
        grads.append([a.grad for a in args])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_flash_attention_rows_that_see_no_key_are_zero(device):
    # Causal, Sq 40 > Sk 16: query rows 0..23 see no key. Window (0, 0) with Sq > Sk likewise.
    out, lse, args = _check(1, 40, 16, 2, 2, 32, device, causal=True)
    assert torch.equal(out[:, :24], torch.zeros_like(out[:, :24]))
    assert torch.isneginf(lse[:, :, :24]).all() and torch.isfinite(lse[:, :, 24:]).all()
    assert all(torch.isfinite(a.grad).all() for a in args)
    assert torch.equal(args[0].grad[:, :24], torch.zeros_like(args[0].grad[:, :24]))


def test_flash_attention_empty_key_sequence(device):
    lens_q, lens_k = [4, 6], [0, 6]
    q, k, v = _inputs(None, None, None, 2, 2, 32, torch.float16, device, lens_q, lens_k)
    with fuseformer.use_backend("triton"):
        out, lse = F.flash_attention(
            q, k, v, cu_seqlens_q=_cu(lens_q, device), cu_seqlens_k=_cu(lens_k, device), return_lse=True
        )
    assert torch.equal(out[:4], torch.zeros_like(out[:4])) and torch.isneginf(lse[:, :4]).all()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_nan_inf_propagate_like_reference(causal, device):
    q, k, v = _inputs(1, 33, 33, 2, 2, 32, torch.float16, device)
    q[0, 3, 1, 5] = float("nan")
    q[0, 20, 0, 2] = float("inf")
    k[0, 10, 1, 7] = float("nan")  # with causal, rows before 10 never see it
    with fuseformer.use_backend("triton"):
        out = F.flash_attention(q, k, v, causal=causal)
    ref = F.flash_attention_ref(q.double(), k.double(), v.double(), causal=causal)
    assert torch.isnan(ref).any() and not torch.isnan(ref).all()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close("out", out, ref, F.flash_attention_ref(q, k, v, causal=causal, upcast=False))


def test_flash_attention_empty_batch(device):
    q = torch.randn(0, 8, 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    k = torch.randn(0, 8, 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        out = F.flash_attention(q, k, k)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape


def test_flash_attention_float32_runs_on_reference(device):
    q, k, v = (torch.randn(1, 9, 2, 16, device=device) for _ in range(3))
    torch.testing.assert_close(F.flash_attention(q, k, v, causal=True), F.flash_attention_ref(q, k, v, causal=True))


def test_flash_attention_reference_backend_is_used_when_forced(device):
    q, k, v = (torch.randn(1, 9, 2, 16, dtype=torch.float16, device=device) for _ in range(3))
    with fuseformer.use_backend("reference"):
        out = F.flash_attention(q, k, v, window_size=(2, 2))
    torch.testing.assert_close(out, F.flash_attention_ref(q, k, v, window_size=(2, 2)))


def _t(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


CU = torch.tensor([0, 3, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((_t(1, 4, 2, 32), _t(1, 4, 2, 16), _t(1, 4, 2, 16)), {}, "k has head_dim 16 but q has 32"),
        ((_t(1, 4, 2, 32), _t(1, 4, 2, 32), _t(1, 4, 2, 16)), {}, "v has head_dim 16"),
        ((_t(1, 4, 3, 32), _t(1, 4, 2, 32), _t(1, 4, 2, 32)), {}, "q has 3 heads, not a multiple of k's 2"),
        ((_t(1, 4, 2, 300), _t(1, 4, 2, 300), _t(1, 4, 2, 300)), {}, "head_dim 300 is outside"),
        ((_t(1, 4, 2, 32), _t(1, 4, 2, 32, dtype=torch.bfloat16), _t(1, 4, 2, 32)), {}, "k has dtype"),
        ((_t(1, 4, 2, 32), _t(1, 4, 2, 32), _t(1, 4, 2, 32, dtype=torch.float32)), {}, "v has dtype"),
        ((_t(1, 4, 2, 32), _t(2, 4, 2, 32), _t(2, 4, 2, 32)), {}, "k has batch 2"),
        ((_t(4, 2, 32), _t(4, 2, 32), _t(4, 2, 32)), {}, "q must be"),
        ((_t(1, 4, 2, 32),) * 3, {"window_size": (-2, 0)}, "window_size"),
        ((_t(1, 4, 2, 32),) * 3, {"softcap": -1.0}, "softcap must be a float >= 0"),
        (
            (_t(8, 2, 32),) * 3,
            {"cu_seqlens_q": CU.long(), "cu_seqlens_k": CU},
            "cu_seqlens_q has dtype int64",
        ),
        ((_t(8, 2, 32),) * 3, {"cu_seqlens_q": CU}, "cu_seqlens_k is None"),
        (
            (_t(8, 2, 32),) * 3,
            {"cu_seqlens_q": CU, "cu_seqlens_k": torch.tensor([0, 5, 3], dtype=torch.int32)},
            "cu_seqlens_k must start at 0 and be non-decreasing",
        ),
        (
            (_t(8, 2, 32),) * 3,
            {"cu_seqlens_q": torch.tensor([0, 3, 9], dtype=torch.int32), "cu_seqlens_k": CU},
            "cu_seqlens_q ends at 9",
        ),
        (
            (_t(8, 2, 32),) * 3,
            {"cu_seqlens_q": CU, "cu_seqlens_k": CU, "max_seqlen_q": 2},
            "max_seqlen_q=2 is below",
        ),
        ((_t(1, 4, 2, 32), "k", _t(1, 4, 2, 32)), {}, "k must be a torch.Tensor"),
    ],
)
def test_flash_attention_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.flash_attention(*args, **kwargs)


@pytest.mark.parametrize("lens", [[16, 48, 32], [1, 47, 0, 33]])
def test_flash_attention_varlen_padded_stats(lens, device):
    """The varlen dk/dv kernel with lse/delta from the padded copies (16-aligned sequence starts)
    matches the reference, with lse's gradient too."""
    _check(None, None, None, 4, 2, 32, device, causal=True, lens_q=lens, lens_k=lens, lse_grad=True)


def test_flash_attention_reads_each_offsets_tensor_once(host_reads):
    """One cu_seqlens tensor passed to many calls (every layer of a model) is read on the host
    (a sync) once; an in-place change is seen (and checked) again, and so is another tensor."""
    reads = host_reads
    q = _t(8, 2, 32)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    first = F.flash_attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for _ in range(3):
        torch.testing.assert_close(F.flash_attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu), first)
    assert len(reads) == 1
    with pytest.raises(ValueError, match="max_seqlen_q=4 is below the longest sequence in cu_seqlens_q \\(5\\)"):
        F.flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4)
    cu[1] = 9  # in place: the version counter moves, the tensor is read again and rejected
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and be non-decreasing"):
        F.flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert len(reads) == 2
    other, zeros = torch.tensor([0, 3, 8], dtype=torch.int32), cu.clone().fill_(0)
    F.flash_attention(q, q, q, cu_seqlens_q=other, cu_seqlens_k=zeros)
    assert len(reads) == 4
    bad_end = torch.tensor([0, 3, 9], dtype=torch.int32)
    for _ in range(2):  # a cached summary still meets the per-call length check
        with pytest.raises(ValueError, match="cu_seqlens_q ends at 9"):
            F.flash_attention(q, q, q, cu_seqlens_q=bad_end, cu_seqlens_k=bad_end)


def test_flash_attention_compiles_fullgraph(device, compile_backend):
    q, k, v = _inputs(1, 20, 20, 2, 1, 32, torch.float16, device)
    lens = [7, 13]
    cu = _cu(lens, device)

    def fn(q, k, v):
        dense = F.flash_attention(q, k, v, causal=True)
        packed = F.flash_attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13)
        return dense.float().sum() + packed.float().square().sum()

    leaves = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
    with fuseformer.use_backend("triton"):
        eager = fn(*leaves[0])
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(*leaves[1])
        eager.backward()
        compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(*leaves):
        torch.testing.assert_close(a.grad, b.grad)


# --------------------------------------------------------------------------------------------
# GPU: real sizes, bf16 and fp16 (the lead runs these on the H200)
# --------------------------------------------------------------------------------------------
GPU_DENSE = [
    # (b, sq, sk, hq, hkv, d, causal, window)
    (2, 1, 1, 8, 8, 64, False, (-1, -1)),
    (2, 17, 17, 8, 2, 59, True, (-1, -1)),
    (1, 97, 257, 8, 1, 80, True, (-1, -1)),
    (2, 128, 128, 8, 8, 128, True, (-1, -1)),
    (2, 257, 97, 8, 2, 128, True, (-1, -1)),
    (1, 1025, 1025, 8, 2, 128, False, (-1, -1)),
    (1, 1025, 1025, 8, 1, 128, True, (256, -1)),
    (1, 257, 1025, 8, 8, 256, False, (64, 32)),
    (1, 1025, 1025, 8, 2, 256, True, (-1, -1)),
    (2, 257, 257, 8, 8, 64, True, (-1, -1)),
    (1, 1025, 1025, 8, 1, 64, True, (-1, -1)),
    (1, 128, 128, 8, 2, 192, True, (-1, -1)),
    (1, 257, 257, 8, 2, 96, False, (16, 0)),
    (1, 1025, 257, 8, 8, 32, True, (-1, -1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, causal, window", GPU_DENSE)
def test_flash_attention_gpu(b, sq, sk, hq, hkv, d, causal, window, dtype):
    _check(b, sq, sk, hq, hkv, d, "cuda", causal=causal, window=window, dtype=dtype)


GPU_VARLEN = [
    ([1, 17, 97, 128, 257, 1025], [1, 17, 97, 128, 257, 1025], 8, 2, 128, True, (-1, -1)),
    ([1, 17, 97, 1025], [33, 17, 257, 1025], 8, 1, 64, True, (-1, -1)),
    ([257, 1, 1025], [257, 5, 1025], 8, 8, 80, False, (128, 64)),
    ([128, 1025, 3], [128, 1025, 3], 8, 2, 256, True, (-1, -1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens_q, lens_k, hq, hkv, d, causal, window", GPU_VARLEN)
def test_flash_attention_varlen_gpu(lens_q, lens_k, hq, hkv, d, causal, window, dtype):
    kw = dict(causal=causal, window=window, dtype=dtype, lens_q=lens_q, lens_k=lens_k)
    _check(None, None, None, hq, hkv, d, "cuda", **kw)


# Gemma 2's soft-capped attention on the GPU (the device-parametrized softcap tests above are not marked gpu,
# so an ordered `-m gpu` run never took them there): head dim 16 (the tiny test checkpoint's) and 256 (Gemma 2's),
# a window of 4 keys, packed varlen as the engine calls it.
GPU_SOFTCAP = [
    (None, [40, 97, 1], 4, 2, 16, True, (3, 0), 5.0),
    (None, [40, 97, 1], 4, 2, 16, True, (-1, -1), 5.0),
    (2, None, 8, 4, 256, True, (-1, -1), 50.0),
    (1, None, 8, 4, 256, True, (1023, 0), 50.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, lens, hq, hkv, d, causal, window, softcap", GPU_SOFTCAP)
def test_flash_attention_softcap_gpu(b, lens, hq, hkv, d, causal, window, softcap, dtype):
    kw = dict(causal=causal, window=window, dtype=dtype, softcap=softcap)
    if lens is None:
        _check(b, 1025, 1025, hq, hkv, d, "cuda", **kw)
    else:
        _check(None, None, None, hq, hkv, d, "cuda", lens_q=lens, lens_k=lens, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False])
def test_flash_attention_gpu_tma_and_noncontiguous(tma, monkeypatch):
    if not tma:
        _no_tma(monkeypatch)
    _check(2, 1025, 1025, 8, 2, 128, "cuda", causal=True, dtype=torch.bfloat16)
    _check(2, 1025, 1025, 8, 2, 128, "cuda", causal=True, dtype=torch.bfloat16, noncontig=True)
    lens = [1, 17, 97, 1025]
    _check(None, None, None, 8, 2, 128, "cuda", lens_q=lens, lens_k=lens, causal=True, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_flash_attention_gpu_large_offsets():
    """A packed batch whose element offsets pass 2^31 (int64 indexing): compare the last sequence."""
    hq, d = 16, 128
    lens = [131072, 1024]  # 132096 tokens * 16 heads * 128 = 2.7e8 elements per tensor; x 16 via stride
    t = sum(lens)
    # q, k, v views with a head stride of 16*d (of a 16x wider buffer): offsets reach 2^31+.
    buf = torch.randn(t, hq * 16, d, dtype=torch.bfloat16, device="cuda")
    q = buf[:, :hq]
    cu = _cu(lens, "cuda")
    out = F.flash_attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    tail = q[lens[0] :]
    ref = F.flash_attention_ref(tail[None].double(), tail[None].double(), tail[None].double(), causal=True)[0]
    base = F.flash_attention_ref(tail[None], tail[None], tail[None], causal=True, upcast=False)[0]
    assert_close("out", out[lens[0] :], ref, base)


GLUON_CASES = [  # (b, s, hq, hkv, causal): hd 128, equal lengths, multiples of 128
    (2, 256, 8, 2, True),
    (2, 256, 8, 2, False),
    (1, 1024, 4, 4, True),
    (1, 128, 2, 1, False),
    (3, 384, 4, 1, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, s, hq, hkv, causal", GLUON_CASES)
def test_flash_attention_gluon_forward_gpu(b, s, hq, hkv, causal, dtype, stages, monkeypatch):
    """The Gluon forward (ops/attention_hopper.py) where it applies, at 2 and 3 K/V stages: out and lse
    against the fp64 reference, and the backward's gradients from its out and lse. It must have run."""
    from fuseformer.ops import attention_hopper as hopper

    if not _gluon.runs_on("cuda"):
        pytest.skip("needs an sm_90 GPU and Gluon")
    monkeypatch.setattr(hopper, "CONFIG", dict(hopper.CONFIG, STAGES=stages))
    calls = []
    real = hopper.forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("causal"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attn_mod, "_GLUON_FWD", True)
    monkeypatch.setattr(hopper, "forward", spy)
    _check(b, s, s, hq, hkv, 128, "cuda", causal=causal, dtype=dtype)
    assert calls == [causal]


def test_gluon_forward_declines_what_it_does_not_take():
    """CPU tensors, varlen, windows, other head dims, lengths not a multiple of 128, non-positive
    scales; the forward also head dim 64 below FWD_MIN_SEQ: the Triton kernel (or the reference) takes them."""
    from fuseformer.ops import attention_hopper as hopper

    q = torch.randn(1, 128, 2, 128)
    assert not hopper.usable(q, q, q, False, -1, 0, 0.1)  # CPU
    if _gluon.runs_on("cuda"):
        g = q.cuda().half()
        assert hopper.usable(g, g, g, False, -1, 0, 0.1) and hopper.usable(g, g, g, False, -1, -1, 0.1)
        assert not hopper.usable(g, g, g, True, -1, 0, 0.1)
        assert not hopper.usable(g, g, g, False, 8, 0, 0.1)
        assert not hopper.usable(g, g, g, False, -1, 0, 0.0)
        g64, g96 = g[..., :64].contiguous(), g[..., :96].contiguous()
        assert hopper.usable(g64, g64, g64, False, -1, 0, 0.1)
        assert not hopper.forward_usable(g64, g64, g64, False, -1, 0, 0.1)  # S 128 < FWD_MIN_SEQ[64]
        assert hopper.forward_usable(g, g, g, False, -1, 0, 0.1)  # head dim 128: every length
        long64 = torch.randn(1, hopper.FWD_MIN_SEQ[64], 2, 64, device="cuda", dtype=torch.half)
        assert hopper.forward_usable(long64, long64, long64, False, -1, 0, 0.1)
        assert not hopper.usable(g96, g96, g96, False, -1, 0, 0.1)
        h = torch.randn(1, 200, 2, 128, device="cuda", dtype=torch.half)
        assert not hopper.usable(h, h, h, False, -1, 0, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("gluon_dq", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, s, hq, hkv, causal", GLUON_CASES)
def test_flash_attention_gluon_backward_gpu(b, s, hq, hkv, causal, dtype, gluon_dq, monkeypatch):
    """The Gluon dK/dV kernel, with the Gluon dq kernel or the Triton one: dq, dk, dv against the fp64
    reference, GQA gradients summed over the group. The Gluon kernels asked for must have run."""
    from fuseformer.ops import attention_hopper as hopper

    if not _gluon.runs_on("cuda"):
        pytest.skip("needs an sm_90 GPU and Gluon")
    calls = []
    for name in ("backward_dkdv", "backward_dq"):
        real = getattr(hopper, name)
        monkeypatch.setattr(
            hopper, name, lambda *a, real=real, name=name, **kw: calls.append((name, a[-1])) or real(*a, **kw)
        )
    monkeypatch.setattr(bwd_mod, "_GLUON_BWD", True)
    if not gluon_dq:  # the Gluon dK/dV kernel with the Triton dq kernel, as at head dims outside DQ_HEAD_DIMS
        monkeypatch.setattr(hopper, "DQ_HEAD_DIMS", ())
    _check(b, s, s, hq, hkv, 128, "cuda", causal=causal, dtype=dtype)
    assert calls == [("backward_dkdv", causal)] + ([("backward_dq", causal)] if gluon_dq else [])


_OFFLINE_GLUON = r"""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
import fuseformer.ops.attention_hopper as A

def desc(block, dt=gl.bfloat16, name="bf16"):
    return f"tensordesc<{name}[{', '.join(map(str, block))}],{gl.NVMMASharedLayout.get_default_for(block, dt)!r}>"

half, bn = A.BLOCK_M // 2, A.BLOCK_N
stat = desc([A.BWD_BLOCK_M], gl.float32, "fp32")


def jobs(d):
    fwd, dkdv, dq = (A.launch_config(kind, True, torch.bfloat16, "cpu", head_dim=d) for kind in ("fwd", "dkdv", "dq"))
    return [
        (A._attention_fwd_kernel, dict(q_desc=desc([half, d]), k_desc=desc([bn, d]), v_desc=desc([bn, d]),
         o_desc=desc([half, d]), lse_ptr="*fp32", seqlen="i32", hq="i32", group="i32", qk_scale="fp32"),
         dict(CAUSAL=True, STAGES=fwd["STAGES"], CONSUMER_REGS=fwd["CONSUMER_REGS"],
              PRODUCER_REGS=fwd["PRODUCER_REGS"])),
        (A._dkdv_kernel, dict(q_desc=desc([A.BWD_BLOCK_M, d]), do_desc=desc([A.BWD_BLOCK_M, d]), lse_desc=stat,
         delta_desc=stat, k_desc=desc([bn // 2, d]), v_desc=desc([bn // 2, d]), dk_desc=desc([bn // 2, d]),
         dv_desc=desc([bn // 2, d]), seqlen="i32", hkv="i32", group="i32", qk_scale="fp32", sm_scale="fp32"),
         dict(CAUSAL=True, STAGES=dkdv["STAGES"], CONSUMER_REGS=dkdv["CONSUMER_REGS"],
              PRODUCER_REGS=dkdv["PRODUCER_REGS"])),
        (A._dq_kernel, dict(q_desc=desc([half, d]), do_desc=desc([half, d]), k_desc=desc([A.DQ_BLOCK_N, d]),
         v_desc=desc([A.DQ_BLOCK_N, d]), dq_desc=desc([half, d]), lse_ptr="*fp32", delta_ptr="*fp32", seqlen="i32",
         hq="i32", group="i32", qk_scale="fp32", sm_scale="fp32"),
         dict(CAUSAL=True, STAGES=dq["STAGES"], CONSUMER_REGS=dq["CONSUMER_REGS"],
              PRODUCER_REGS=dq["PRODUCER_REGS"])),
    ]


for d in (64, 128):
    for fn, sig, consts in jobs(d):
        src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=168))
        assert k.metadata.shared <= 227 * 1024, (fn.__name__, d, k.metadata.shared)
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile them for real")
def test_gluon_attention_kernels_compile_for_sm90_offline():
    """The Gluon kernels (forward, dK/dV, dq) compile for sm_90 with their shipped configs and fit in
    shared memory, at head dims 128 and 64: Gluon has no interpreter, so this is what CI can check of
    them without a GPU."""
    if not _gluon.HAVE_GLUON:
        pytest.skip(f"Gluon kernels off: {_gluon.UNAVAILABLE}")
    compile_offline(_OFFLINE_GLUON, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreted preprocess kernel")
def test_gluon_kernels_write_into_the_launchers_outputs(monkeypatch):
    """The launchers allocate out / lse and dq / dk / dv once (through the poisoning `empty`), and the
    Gluon kernels write into those: no second allocation. The kernels are stubbed (Gluon runs on sm_90
    only); what is checked is the buffers their descriptors and pointers point at."""
    from fuseformer.ops import attention_hopper as hopper

    if not _gluon.HAVE_GLUON:
        pytest.skip(f"Gluon kernels off: {_gluon.UNAVAILABLE}")
    seen = {}

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.__setitem__(self.name, args)

    for name in ("_attention_fwd_kernel", "_dkdv_kernel", "_dq_kernel"):
        monkeypatch.setattr(hopper, name, Stub(name))
    monkeypatch.setattr(hopper, "usable", lambda *a: True)
    monkeypatch.setattr(hopper, "FWD_MIN_SEQ", {64: 0, 128: 0})
    monkeypatch.setattr(hopper, "empty", lambda *a, **kw: pytest.fail("a Gluon launcher allocated an output"))
    monkeypatch.setattr(hopper, "DQ_HEAD_DIMS", (64,))
    monkeypatch.setattr(attn_mod, "_GLUON_FWD", True)
    monkeypatch.setattr(bwd_mod, "_GLUON_BWD", True)
    q, k, v, do = (torch.randn(1, 128, 2, 64, dtype=torch.float16) for _ in range(4))
    out, lse = attn_mod.flash_attention_fwd(q, k, v, None, None, 128, 128, 0.125, -1, 0)
    fwd = seen["_attention_fwd_kernel"]
    assert fwd[3].base.data_ptr() == out.data_ptr() and fwd[4] is lse
    dq, dk, dv = bwd_mod.flash_attention_bwd(do, q, k, v, out, lse, None, None, None, 128, 128, 0.125, -1, 0)
    dkdv, dqk = seen["_dkdv_kernel"], seen["_dq_kernel"]
    assert dkdv[6].base.data_ptr() == dk.data_ptr() and dkdv[7].base.data_ptr() == dv.data_ptr()
    assert dqk[4].base.data_ptr() == dq.data_ptr()


def test_gluon_launch_config_comes_from_the_autotune_cache(tmp_path, monkeypatch):
    """The Gluon kernels' stages and register split: the autotune cache's entry for (kernel, GPU,
    Triton, causal/full and dtype) where there is one, else the module defaults; a sweep's config on top."""
    from fuseformer.ops import attention_hopper as hopper
    from fuseformer.runtime import autotune

    monkeypatch.setenv("FUSEFORMER_CACHE_DIR", str(tmp_path))
    autotune.clear_memory()
    try:
        assert hopper.launch_config("fwd", True, torch.bfloat16, "cpu") == hopper.CONFIG
        assert hopper.launch_config("dkdv", True, torch.bfloat16, "cpu")["STAGES"] == 4
        assert hopper.launch_config("dkdv", False, torch.bfloat16, "cpu")["STAGES"] == 3
        stored = dict(STAGES=2, CONSUMER_REGS=232, PRODUCER_REGS=40)
        autotune.store(hopper.KERNELS["dq"], "causal-bfloat16", stored, device="cpu")
        assert hopper.launch_config("dq", True, torch.bfloat16, "cpu") == stored
        assert hopper.launch_config("dq", False, torch.bfloat16, "cpu") == hopper.DQ_CONFIG
        assert hopper.launch_config("dq", True, torch.float16, "cpu") == hopper.DQ_CONFIG
        assert hopper.launch_config("dq", True, torch.bfloat16, "cpu", dict(STAGES=4))["STAGES"] == 4
        # Other head dims: their own defaults (hd 64: 4 forward stages) and their own cache keys.
        assert hopper.launch_config("fwd", True, torch.bfloat16, "cpu", head_dim=64) == hopper.HD_CONFIGS[64]["fwd"]
        assert hopper.launch_config("dq", True, torch.bfloat16, "cpu", head_dim=64) == hopper.DQ_CONFIG
        autotune.store(hopper.KERNELS["fwd"], "causal-bfloat16-hd64", stored, device="cpu")
        assert hopper.launch_config("fwd", True, torch.bfloat16, "cpu", head_dim=64) == stored
        assert hopper.launch_config("fwd", True, torch.bfloat16, "cpu") == hopper.CONFIG
    finally:
        autotune.clear_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("gluon_dq", [False, True])
@pytest.mark.parametrize("b, s, hq, hkv, causal", [(2, 256, 8, 2, True), (1, 384, 4, 4, False), (2, 1024, 4, 1, True)])
def test_flash_attention_gluon_hd64_gpu(b, s, hq, hkv, causal, gluon_dq, monkeypatch):
    """Head dim 64 through the Gluon forward and dK/dV kernels with the Triton dq kernel (as shipped), or
    with the Gluon dq kernel (DQ_HEAD_DIMS patched): out, lse and gradients against the fp64 reference."""
    from fuseformer.ops import attention_hopper as hopper

    if not _gluon.runs_on("cuda"):
        pytest.skip("needs an sm_90 GPU and Gluon")
    assert 64 in hopper.HEAD_DIMS and 64 not in hopper.DQ_HEAD_DIMS
    calls = []
    for name in ("forward", "backward_dkdv", "backward_dq"):
        real = getattr(hopper, name)
        monkeypatch.setattr(hopper, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    if gluon_dq:
        monkeypatch.setattr(hopper, "DQ_HEAD_DIMS", (64, 128))
    monkeypatch.setattr(hopper, "FWD_MIN_SEQ", {64: 0, 128: 0})  # the kernel at these short lengths too
    monkeypatch.setattr(attn_mod, "_GLUON_FWD", True)
    monkeypatch.setattr(bwd_mod, "_GLUON_BWD", True)
    _check(b, s, s, hq, hkv, 64, "cuda", causal=causal, dtype=torch.bfloat16)
    assert calls == ["forward", "backward_dkdv"] + (["backward_dq"] if gluon_dq else [])


# The CPU path (what the reference backend runs on CPU tensors unless the reference is forced): torch's
# SDPA where it computes what the reference does, outputs and gradients against the fp64 reference.
@pytest.mark.parametrize(
    "sq, sk, hq, hkv, causal",
    [(7, 7, 4, 4, False), (7, 7, 4, 2, True), (5, 9, 2, 1, False), (1, 1, 4, 1, True), (33, 33, 8, 2, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_cpu_path_matches_reference(sq, sk, hq, hkv, causal, dtype, monkeypatch):
    monkeypatch.setattr(attn_mod, "choose_backend", lambda *args: "reference")  # as on a CPU-only install
    calls = []
    real = attn_mod.flash_attention_ref
    monkeypatch.setattr(attn_mod, "flash_attention_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    leaves = [torch.randn(2, s, h, 16, generator=gen) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))]

    def run(fn, cast, **kw):
        args = [t.detach().to(cast).requires_grad_() for t in leaves]
        return fn(*args, causal=causal, softmax_scale=0.3, **kw), args

    out, args = run(F.flash_attention, dtype)
    assert calls == [] and out.dtype == dtype  # the CPU path, not the reference
    ref, ref_args = run(F.flash_attention_ref, torch.float64)
    base, base_args = run(F.flash_attention_ref, dtype, upcast=False)
    assert_close("out", out, ref, base)
    grad = torch.randn(out.shape, generator=gen)
    for o in (out, ref, base):
        o.backward(grad.to(o.dtype))
    for name, a, r, b in zip("qkv", args, ref_args, base_args):
        assert_close(f"d{name}", a.grad, r.grad, b.grad)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(causal=True, k_len=9),  # SDPA's causal mask is top-left: Sq != Sk takes the reference
        dict(window_size=(2, 0)),
        dict(softcap=5.0),
        dict(return_lse=True),
    ],
)
def test_flash_attention_cpu_path_leaves_the_rest_to_the_reference(kwargs, monkeypatch):
    monkeypatch.setattr(attn_mod, "choose_backend", lambda *args: "reference")
    calls = []
    real = attn_mod.flash_attention_ref
    monkeypatch.setattr(attn_mod, "flash_attention_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    kwargs = dict(kwargs)
    sk = kwargs.pop("k_len", 5)
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, sk, 2, 8), torch.randn(1, sk, 2, 8)
    F.flash_attention(q, k, v, **kwargs)
    assert calls == [1]
