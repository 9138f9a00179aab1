"""apply_rotary: the Triton kernel against the fp64 reference (DESIGN.md §3), the reference against
independent forms (complex multiplication, HF's rotate_half), varlen, strides, bad input, compile."""

import importlib
import math

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.ops.rotary import apply_rotary_fwd
from fuseformer.testing import assert_close

# (B, S, H, D, rotary_dim)
CPU_SHAPES = [
    (2, 7, 3, 64, 64),  # full rotary
    (1, 1, 4, 64, 64),  # seqlen 1 (decode)
    (3, 13, 2, 80, 32),  # partial rotary, D not a power of two
    (2, 9, 5, 64, 48),  # rotary_dim / 2 = 24: a masked pair block
    (1, 5, 3, 59, 58),  # odd head dim, one pass-through dim
]
GPU_SHAPES = [
    (8, 4096, 32, 128, 128),  # the Llama-3-8B q of the speed target
    (8, 4096, 8, 128, 128),  # its k (GQA)
    (3, 1025, 12, 80, 32),
    (64, 1, 32, 128, 128),  # decode
    (2, 333, 7, 256, 256),
    (1, 97, 5, 59, 40),
]


def _table(n: int, half: int, device, dtype=torch.float32, base: float = 10000.0):
    """cos, sin (n, half) of real RoPE angles (positions 0..n-1)."""
    inv_freq = 1.0 / base ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def _nan_gapped(shape, dtype, device):
    """Random values viewed out of a tensor 3 wider in the last dim whose gap holds NaN."""
    base = torch.full((*shape[:-1], shape[-1] + 3), float("nan"), dtype=dtype, device=device)
    base[..., : shape[-1]] = torch.randn(shape, dtype=dtype, device=device)
    return base[..., : shape[-1]]


def _check(x, cos, sin, *, interleaved=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None, grad=None):
    """§3 criterion for out and dx: kernel (x's dtype) vs fp64 reference vs PyTorch in x's dtype."""
    dtype = x.dtype
    kw = dict(interleaved=interleaved, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens)
    x_k = x.detach().clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
    with fuseformer.use_backend("triton"):
        out = F.apply_rotary(x_k, cos, sin, max_seqlen=max_seqlen, **kw)
    x_r = x.detach().double().requires_grad_()
    ref = F.apply_rotary_ref(x_r, cos.double(), sin.double(), **kw)
    x_b = x.detach().clone().requires_grad_()
    base = F.apply_rotary_ref(x_b, cos, sin, upcast=False, **kw)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close("out", out, ref, base)

    g = grad if grad is not None else torch.randn(x.shape, dtype=dtype, device=x.device)
    out.backward(g)
    ref.backward(g.double())
    base.backward(g)
    assert_close("dx", x_k.grad, x_r.grad, x_b.grad)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_matches_reference(shape, dtype, interleaved, device):
    b, s, h, d, rot = shape
    x = torch.randn(b, s, h, d, dtype=dtype, device=device)
    cos, sin = _table(s, rot // 2, device)
    _check(x, cos, sin, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "int32", "int64"])
def test_apply_rotary_seqlen_offsets(offsets, interleaved, device):
    b, s, h, d, rot = 3, 5, 2, 64, 64
    x = torch.randn(b, s, h, d, dtype=torch.float16, device=device)
    if offsets == "int":
        seqlen_offsets, s_max = 11, s + 11
    else:
        dtype = torch.int32 if offsets == "int32" else torch.int64
        seqlen_offsets = torch.tensor([0, 17, 4], dtype=dtype, device=device)
        s_max = s + 17
    cos, sin = _table(s_max, rot // 2, device)
    out = _check(x, cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets)
    # The offset really moved the positions: without it the answer differs.
    with fuseformer.use_backend("triton"):
        assert not torch.allclose(out, F.apply_rotary(x, cos, sin, interleaved), atol=1e-2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
@pytest.mark.parametrize("dims", [(64, 64), (80, 32)])
def test_apply_rotary_varlen(offsets, interleaved, dims, device):
    d, rot = dims
    lens = [3, 1, 6, 0, 2]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    t = int(cu[-1])
    x = torch.randn(t, 3, d, dtype=torch.float16, device=device)
    if offsets == "int":
        seqlen_offsets, hi = 4, 4
    else:
        seqlen_offsets = torch.tensor([2, 0, 9, 1, 5], dtype=torch.int32, device=device)
        hi = 9
    cos, sin = _table(max(lens) + hi, rot // 2, device)
    out = _check(x, cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets, cu_seqlens=cu)
    # Packed equals each sequence on its own (batch 1, its offset), so tokens are not mixed up.
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        off = seqlen_offsets if isinstance(seqlen_offsets, int) else int(seqlen_offsets[i])
        with fuseformer.use_backend("triton"):
            alone = F.apply_rotary(x[None, a:b], cos, sin, interleaved, off)
        torch.testing.assert_close(out[a:b], alone[0].detach(), rtol=0, atol=0)


def test_apply_rotary_varlen_max_seqlen_given_larger(device):
    cu = torch.tensor([0, 2, 7], dtype=torch.int32, device=device)
    x = torch.randn(7, 2, 32, device=device)
    cos, sin = _table(9, 16, device)
    _check(x, cos, sin, cu_seqlens=cu, max_seqlen=9)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_q_sliced_from_packed_qkv_with_nan(interleaved, device):
    """q and k as (B, S, H, D) views of a packed (B, S, 3, H, D) QKV (strided in S and H), the rest NaN;
    the upstream gradient non-contiguous too."""
    b, s, h, d = 2, 6, 3, 64
    qkv = torch.full((b, s, 3, h, d), float("nan"), dtype=torch.float16, device=device)
    qkv[:, :, 0] = torch.randn(b, s, h, d, dtype=torch.float16, device=device)
    q = qkv[:, :, 0]
    assert not q.is_contiguous()
    cos, sin = _table(s + 2, d // 2, device)
    grad = _nan_gapped((b, s, h, d), torch.float16, device)
    out = _check(q, cos, sin, interleaved=interleaved, seqlen_offsets=2, grad=grad)
    assert not out.isnan().any()


def test_apply_rotary_varlen_strided_and_nan_gapped(device):
    cu = torch.tensor([0, 4, 5, 8], dtype=torch.int32, device=device)
    x = _nan_gapped((8, 2, 80), torch.float32, device)
    cos, sin = _table(8, 24, device)
    out = _check(x, cos, sin, cu_seqlens=cu, seqlen_offsets=torch.tensor([1, 0, 3], device=device))
    assert not out.isnan().any()


def test_apply_rotary_nan_inf_propagate_like_reference(device):
    x = torch.randn(2, 4, 3, 64, device=device)
    x[0, 1, 2, 5] = float("nan")  # pair (5, 37)
    x[1, 3, 0, 40] = float("inf")  # pair (8, 40)
    x[1, 2, 1, 63] = float("-inf")
    cos, sin = _table(4, 32, device)
    with fuseformer.use_backend("triton"):
        out = F.apply_rotary(x, cos, sin)
    ref = F.apply_rotary_ref(x.double(), cos.double(), sin.double())
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and ref.isnan().any()
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert_close("out", out, ref, F.apply_rotary_ref(x, cos, sin, upcast=False))


def test_apply_rotary_empty(device):
    cos, sin = _table(4, 8, device)
    with fuseformer.use_backend("triton"):
        assert F.apply_rotary(torch.randn(0, 4, 2, 16, device=device), cos, sin).shape == (0, 4, 2, 16)
        assert F.apply_rotary(torch.randn(2, 0, 2, 16, device=device), cos, sin).shape == (2, 0, 2, 16)
        cu = torch.zeros(3, dtype=torch.int32, device=device)
        assert F.apply_rotary(torch.randn(0, 2, 16, device=device), cos, sin, cu_seqlens=cu).shape == (0, 2, 16)


def test_apply_rotary_position_past_table_gives_nan_in_launcher(device):
    """The launcher does not check; a position past cos must give NaN there, never a wild read."""
    x = torch.randn(1, 4, 2, 16, device=device)
    cos, sin = _table(5, 8, device)
    out = apply_rotary_fwd(x, cos, sin, torch.tensor([2], device=device))  # positions 2..5; 5 is past
    assert not out[0, :3].isnan().any()
    assert out[0, 3, :, :].isnan().all()


def test_apply_rotary_float64_runs_on_reference(device):
    x = torch.randn(1, 3, 2, 16, dtype=torch.float64, device=device)
    cos, sin = _table(3, 8, device, torch.float64)
    torch.testing.assert_close(F.apply_rotary(x, cos, sin), F.apply_rotary_ref(x, cos, sin))


def test_apply_rotary_reference_backend_is_used_when_forced(device):
    x = torch.randn(1, 3, 2, 16, device=device)
    cos, sin = _table(3, 8, device)
    with fuseformer.use_backend("reference"):
        torch.testing.assert_close(F.apply_rotary(x, cos, sin), F.apply_rotary_ref(x, cos, sin))


# --------------------------------------------------------------------------------------------
# The reference against independent forms
# --------------------------------------------------------------------------------------------
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("rot", [64, 32])
def test_reference_matches_hf_rotate_half(rot):
    """HF's form with full-width cos/sin tables and positions, on the first rot dims."""
    b, s, h, d, off = 2, 6, 3, 64, 3
    x = torch.randn(b, s, h, d, dtype=torch.float64)
    cos, sin = _table(s + off, rot // 2, "cpu", torch.float64)
    pos = torch.arange(s) + off
    c = torch.cat((cos, cos), -1)[pos][None, :, None, :]  # (1, S, 1, rot)
    sn = torch.cat((sin, sin), -1)[pos][None, :, None, :]
    xr = x[..., :rot]
    expected = torch.cat((xr * c + _rotate_half(xr) * sn, x[..., rot:]), -1)
    torch.testing.assert_close(F.apply_rotary_ref(x, cos, sin, seqlen_offsets=off), expected, rtol=1e-12, atol=1e-12)


def test_reference_interleaved_matches_complex_multiplication():
    """GPT-J / Meta Llama form: pairs (2i, 2i+1) as complex numbers times exp(i * angle)."""
    b, s, h, d = 2, 5, 2, 32
    offsets = torch.tensor([0, 7])
    x = torch.randn(b, s, h, d, dtype=torch.float64)
    half = d // 2
    inv_freq = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float64) / half)
    cos, sin = _table(s + 7, half, "cpu", torch.float64)
    pos = torch.arange(s)[None, :] + offsets[:, None]  # (B, S)
    rotor = torch.polar(torch.ones(b, s, half, dtype=torch.float64), pos[..., None] * inv_freq)
    xc = torch.view_as_complex(x.reshape(b, s, h, half, 2))
    expected = torch.view_as_real(xc * rotor[:, :, None, :]).reshape(b, s, h, d)
    got = F.apply_rotary_ref(x, cos, sin, interleaved=True, seqlen_offsets=offsets)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_reference_rotation_preserves_pair_norms_and_inverts():
    x = torch.randn(1, 4, 2, 16, dtype=torch.float64)
    cos, sin = _table(4, 8, "cpu", torch.float64)
    y = F.apply_rotary_ref(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(F.apply_rotary_ref(y, cos, -sin), x)
    assert not torch.allclose(y[:, 1:], x[:, 1:])


def test_reference_varlen_matches_per_sequence():
    lens, offsets = [2, 1, 4], [5, 0, 1]
    cu = torch.tensor([0, 2, 3, 7], dtype=torch.int32)
    x = torch.randn(7, 2, 16, dtype=torch.float64)
    cos, sin = _table(9, 8, "cpu", torch.float64)
    got = F.apply_rotary_ref(x, cos, sin, seqlen_offsets=torch.tensor(offsets), cu_seqlens=cu)
    parts = [
        F.apply_rotary_ref(x[None, a : a + n], cos, sin, seqlen_offsets=o)[0]
        for a, n, o in zip(cu[:-1].tolist(), lens, offsets)
    ]
    torch.testing.assert_close(got, torch.cat(parts))


# --------------------------------------------------------------------------------------------
# Bad input and compile
# --------------------------------------------------------------------------------------------
def _args(**over):
    cos, sin = _table(8, 8, "cpu")
    args = dict(x=torch.randn(2, 6, 2, 32), cos=cos, sin=sin)
    args.update(over)
    return args


_CU = torch.tensor([0, 3, 7], dtype=torch.int32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (_args(x=torch.randn(6, 2, 32)), "x must have 4 dims"),
        (_args(x=torch.randn(1, 7, 2, 32), cu_seqlens=_CU), "x must have 3 dims"),
        (_args(x=torch.randint(0, 3, (2, 6, 2, 32))), "x has dtype int64"),
        (_args(x=torch.randn(1, 2, 2, 258), cos=torch.randn(8, 8)), "head dim 258"),
        (_args(sin=torch.randn(8, 7)), r"sin has shape \(8, 7\)"),
        (_args(sin=torch.randn(8, 8).half()), "sin has dtype"),
        (_args(cos=torch.randn(8), sin=torch.randn(8)), "cos must have 2 dims"),
        (_args(cos=torch.randn(8, 17), sin=torch.randn(8, 17)), "rotary_dim = 2 \\* 17 = 34"),
        (_args(cos=torch.randn(8, 0), sin=torch.randn(8, 0)), "rotary_dim"),
        (_args(cos=torch.randn(5, 8), sin=torch.randn(5, 8)), "cos and sin have 5 positions but the input needs 6"),
        (_args(seqlen_offsets=3), "needs 9"),
        (_args(seqlen_offsets=torch.tensor([0, 3])), "needs 9"),
        (_args(seqlen_offsets=torch.tensor([0, 1, 2])), r"seqlen_offsets has shape \(3,\); expected \(2,\)"),
        (_args(seqlen_offsets=torch.tensor([0.0, 1.0])), "seqlen_offsets has dtype"),
        (_args(seqlen_offsets=-1), "seqlen_offsets must be >= 0"),
        (_args(seqlen_offsets=torch.tensor([0, -1])), "seqlen_offsets must be >= 0"),
        (_args(seqlen_offsets=1.5), "seqlen_offsets must be an int"),
        (_args(interleaved="yes"), "interleaved must be a bool"),
        (_args(max_seqlen=6), "max_seqlen is only used with cu_seqlens"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=_CU.long()), "cu_seqlens has dtype int64"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=_CU[None]), "cu_seqlens must have 1 dims"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), "non-decreasing"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)), "start at 0"),
        (_args(x=torch.randn(8, 2, 32), cu_seqlens=_CU), "cu_seqlens ends at 7; expected the token count 8"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=_CU, max_seqlen=3), "max_seqlen 3 is below the longest"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=_CU, seqlen_offsets=5), "needs 9"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=_CU, seqlen_offsets=torch.tensor([0, 5])), "needs 9"),
        (_args(x=torch.randn(7, 2, 32), cu_seqlens=_CU, seqlen_offsets=torch.tensor([0])), "seqlen_offsets has shape"),
    ],
)
def test_apply_rotary_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.apply_rotary(**kwargs)


def test_apply_rotary_bad_input_on_the_kernel_path_too():
    with fuseformer.use_backend("triton"), pytest.raises(ValueError, match="needs 9"):
        F.apply_rotary(**_args(seqlen_offsets=torch.tensor([0, 3])))


def test_apply_rotary_compile_fullgraph(device, compile_backend):
    cos, sin = _table(16, 16, device)
    q = torch.randn(2, 5, 4, 32, device=device, requires_grad=True)
    k = torch.randn(2, 5, 2, 32, device=device, requires_grad=True)
    offsets = torch.tensor([3, 0], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32, device=device)
    packed = torch.randn(5, 2, 32, device=device, requires_grad=True)

    def fn(q, k, packed):
        q2 = F.apply_rotary(q, cos, sin, seqlen_offsets=offsets)
        k2 = F.apply_rotary(k, cos, sin, interleaved=True, seqlen_offsets=2)
        p2 = F.apply_rotary(packed, cos, sin, cu_seqlens=cu, max_seqlen=4)
        return (q2 * 2).sum() + (k2 * k2).sum() + p2.pow(2).sum()

    with fuseformer.use_backend("triton"):
        eager = fn(q, k, packed)
        grads_eager = torch.autograd.grad(eager, (q, k, packed))
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(q, k, packed)
        grads_compiled = torch.autograd.grad(compiled, (q, k, packed))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(grads_compiled, grads_eager):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("varlen", [False, True])
def test_apply_rotary_custom_op_passes_opcheck(varlen, device):
    """Schema, fake tensor, autograd registration and AOT dispatch of fuseformer::apply_rotary."""
    from fuseformer.ops.rotary import _apply_rotary_op

    cos, sin = _table(8, 8, device)
    if varlen:
        x = torch.randn(6, 2, 24, device=device, requires_grad=True)
        cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
        args = (x, cos, sin, torch.tensor([1, 3], device=device), 0, cu, 4, False, False)
    else:
        x = torch.randn(2, 3, 2, 24, device=device, requires_grad=True)
        args = (x, cos, sin, None, 2, None, 0, True, False)
    with fuseformer.use_backend("triton"):
        torch.library.opcheck(_apply_rotary_op, args)


def test_apply_rotary_config_override_matches_default(device):
    """``config=`` (tuning sweeps) launches the given tile: other tiles, same values."""
    x = torch.randn(2, 11, 5, 40, device=device)
    cos, sin = _table(11, 16, device)
    offsets = torch.tensor([0, 0], device=device)
    expected = apply_rotary_fwd(x, cos, sin)
    for cfg in (
        dict(BLOCK_M=4, BLOCK_H=2, BLOCK_K=16, BLOCK_P=8, num_warps=2),
        dict(BLOCK_M=1, BLOCK_H=8, BLOCK_K=32, BLOCK_P=16, num_warps=4),
    ):
        torch.testing.assert_close(apply_rotary_fwd(x, cos, sin, config=cfg), expected, rtol=0, atol=0)
        got = apply_rotary_fwd(x, cos, sin, offsets, interleaved=False, config=cfg)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_apply_rotary_launch_plan_is_cached(monkeypatch, device):
    """The autotune lookup happens once per launch plan, never per call."""
    from fuseformer.runtime import autotune

    x = torch.randn(1, 3, 2, 16, device=device)
    cos, sin = _table(3, 8, device)
    with fuseformer.use_backend("triton"):
        first = F.apply_rotary(x, cos, sin)

        def no_lookup(*args, **kwargs):
            raise AssertionError("autotune.get_config called on a cached plan")

        monkeypatch.setattr(autotune, "get_config", no_lookup)
        torch.testing.assert_close(F.apply_rotary(x, cos, sin), first, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# GPU, real sizes
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_gpu(shape, dtype, interleaved):
    b, s, h, d, rot = shape
    x = torch.randn(b, s, h, d, dtype=dtype, device="cuda")
    offsets = torch.randint(0, 300, (b,), device="cuda")
    cos, sin = _table(s + 300, rot // 2, "cuda")
    _check(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apply_rotary_gpu_varlen_and_packed_qkv(dtype):
    lens = [1, 4096, 17, 1000, 1, 2047]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t, h, d = int(cu[-1]), 32, 128
    qkv = torch.full((t, 3, h, d), float("nan"), dtype=dtype, device="cuda")
    qkv[:, 1] = torch.randn(t, h, d, dtype=dtype, device="cuda")
    offsets = torch.randint(0, 100, (len(lens),), dtype=torch.int32, device="cuda")
    cos, sin = _table(4096 + 100, d // 2, "cuda")
    out = _check(qkv[:, 1], cos, sin, seqlen_offsets=offsets, cu_seqlens=cu)
    assert not out.isnan().any()


@pytest.mark.gpu
def test_apply_rotary_gpu_past_2_31_elements():
    """x of 2^31 + 4096 elements: offsets past int32; the last tokens checked against the reference."""
    s, h, d = (1 << 31) // (32 * 128) + 1, 32, 128
    x = torch.randn(1, s, h, d, dtype=torch.bfloat16, device="cuda")
    cos, sin = _table(s, d // 2, "cuda")
    out = F.apply_rotary(x, cos, sin)
    tail = slice(s - 8, s)
    ref = F.apply_rotary_ref(x[:, tail].double(), cos.double(), sin.double(), seqlen_offsets=s - 8)
    base = F.apply_rotary_ref(x[:, tail], cos, sin, seqlen_offsets=s - 8, upcast=False)
    assert_close("out tail", out[:, tail], ref, base)
    assert math.prod(x.shape) > 2**31


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rotary_fast_launch_matches_normal_launch(dtype):
    """The direct launch path gives bitwise the outputs and gradients of kernel[grid](...), and is
    taken: q and k of the speed target, decode, partial rotary, interleaved, tensor offsets, varlen,
    a pointer off 16-byte alignment and q sliced out of a packed QKV tensor."""
    from fuseformer.ops._utils import fast_launch
    from fuseformer.ops.rotary import _launcher
    from fuseformer.testing import skip_unless_direct_launch_triton

    skip_unless_direct_launch_triton()
    cos, sin = _table(4096 + 64, 64, "cuda")
    cos32, sin32 = _table(1100, 16, "cuda")

    def cases():
        for b, s, h in [(2, 4096, 32), (2, 4096, 8), (64, 1, 32)]:
            yield torch.randn(b, s, h, 128, dtype=dtype, device="cuda"), (cos, sin), {}
        yield torch.randn(3, 1025, 12, 80, dtype=dtype, device="cuda"), (cos32, sin32), dict(interleaved=True)
        offsets = torch.tensor([5, 0, 63], dtype=torch.int32, device="cuda")
        yield torch.randn(3, 97, 8, 128, dtype=dtype, device="cuda"), (cos, sin), dict(seqlen_offsets=offsets)
        base = torch.randn(2 * 33 * 4 * 128 + 1, dtype=dtype, device="cuda")
        yield base[1:].view(2, 33, 4, 128), (cos, sin), dict(seqlen_offsets=7)  # off 16-byte alignment
        qkv = torch.randn(2, 77, 3, 8, 128, dtype=dtype, device="cuda")
        yield qkv[:, :, 0], (cos, sin), {}  # row-strided q
        cu = torch.tensor([0, 1, 1000, 1017], dtype=torch.int32, device="cuda")
        packed = torch.randn(1017, 8, 128, dtype=dtype, device="cuda")
        yield packed, (cos, sin), dict(cu_seqlens=cu, max_seqlen=999, seqlen_offsets=cu[:3].long())

    def run(x, tables, kw):
        # detach(): the same storage and strides (a clone would be a fresh, aligned tensor).
        xs = x.detach().requires_grad_()
        out = F.apply_rotary(xs, *tables, **kw)
        out.backward(out.detach() * 0.5 + 1)  # a gradient the same in both runs
        with torch.no_grad():
            inference = F.apply_rotary(x, *tables, **kw)
        return [out.detach(), xs.grad, inference]

    for x, tables, kw in cases():
        with fast_launch(False):
            expected = run(x, tables, kw)
        with fast_launch(True):
            run(x, tables, kw)  # first launch of each key: compiles, fills the cache
            misses = _launcher.misses
            got = run(x, tables, kw)
            assert _launcher.misses == misses, f"direct path not taken: {tuple(x.shape)} {list(kw)}"
        for e, g in zip(expected, got):
            assert torch.equal(e, g)
    torch.cuda.synchronize()


def test_apply_rotary_reads_each_offsets_tensor_once(host_reads):
    """One cu_seqlens tensor across calls (every layer of a model) is read on the host once; its
    per-call checks still apply, and an in-place change is read (and checked) again."""
    reads = host_reads
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    args = _args(x=torch.randn(7, 2, 32), cu_seqlens=cu)
    first = F.apply_rotary(**args)
    for _ in range(3):
        torch.testing.assert_close(F.apply_rotary(**args), first)
    assert reads == [3]
    with pytest.raises(ValueError, match="cu_seqlens ends at 7; expected the token count 8"):
        F.apply_rotary(**_args(x=torch.randn(8, 2, 32), cu_seqlens=cu))
    with pytest.raises(ValueError, match="max_seqlen 3 is below the longest"):
        F.apply_rotary(**_args(x=torch.randn(7, 2, 32), cu_seqlens=cu, max_seqlen=3))
    cu[1] = 8  # in place: read again and rejected
    with pytest.raises(ValueError, match="non-decreasing"):
        F.apply_rotary(**args)
    assert reads == [3, 3]


# --------------------------------------------------------------------------------------------
# The CPU path (what the reference backend runs on CPU tensors without autograd)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor", "varlen"])
def test_apply_rotary_cpu_path_matches_reference(shape, dtype, interleaved, offsets):
    rot_module = importlib.import_module("fuseformer.ops.rotary")
    b, s, h, d, rot = shape
    x = _nan_gapped((b, s, h, d), dtype, "cpu")  # strided with NaN gaps: a read outside x fails
    cos, sin = _table(s + 5, rot // 2, "cpu")
    kw = dict(interleaved=interleaved, seqlen_offsets=3, cu_seqlens=None)
    if offsets == "tensor":
        kw["seqlen_offsets"] = torch.arange(b) + 1
    elif offsets == "varlen":
        x = x.reshape(b * s, h, d)
        kw["cu_seqlens"] = (torch.arange(b + 1) * s).to(torch.int32)
        kw["seqlen_offsets"] = 2
    out = rot_module._apply_rotary_cpu(x, cos, sin, **kw)
    ref = F.apply_rotary_ref(x.double(), cos.double(), sin.double(), **kw)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous() and not torch.isnan(out).any()
    assert_close("out", out, ref, F.apply_rotary_ref(x, cos, sin, upcast=False, **kw))
    assert torch.equal(out, F.apply_rotary_ref(x, cos, sin, **kw))  # the reference's roundings exactly


def test_apply_rotary_cpu_path_only_without_autograd(monkeypatch):
    rot_module = importlib.import_module("fuseformer.ops.rotary")
    monkeypatch.setattr(rot_module, "choose_backend", lambda *args: "reference")  # as a CPU-only install
    calls = []
    real = rot_module._apply_rotary_cpu
    monkeypatch.setattr(rot_module, "_apply_rotary_cpu", lambda *args: calls.append(1) or real(*args))
    x = torch.randn(1, 3, 2, 16)
    cos, sin = _table(3, 8, "cpu")
    torch.testing.assert_close(F.apply_rotary(x, cos, sin), F.apply_rotary_ref(x, cos, sin))
    assert calls == [1]
    x.requires_grad_()
    F.apply_rotary(x, cos, sin).sum().backward()  # the out= ops have no autograd: the reference runs
    assert calls == [1] and x.grad is not None
    with fuseformer.use_backend("reference"):
        F.apply_rotary(x.detach(), cos, sin)
    assert calls == [1]
