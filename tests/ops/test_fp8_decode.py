"""Weight-only FP8 at decode (ops/fp8_decode.py): fp8_weight_gemm and fp8_weight_mlp, the decode kernel
with e4m3 weights against the references (DESIGN.md §3: the baseline is PyTorch in x's dtype on the
same dequantized weights), the tile rule for e4m3, which path the FP8 layers take by token count, bad
input, opcheck and compile. On the CPU the decode path is enabled per test (it is CUDA-only by
default); the interpreter's tl.dot is wrong on bf16, so the CPU runs fp16."""

import importlib

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.layers.fp8 import Fp8Activation, Fp8GatedMLP, Fp8Linear, Fp8RMSNorm, decode_weight_only
from fuseformer.layers.mlp import GatedMLP
from fuseformer.testing import assert_close

MD = importlib.import_module("fuseformer.ops.mlp_decode")
FD = importlib.import_module("fuseformer.ops.fp8_decode")
HAS_CUDA = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn


@pytest.fixture
def decode_on_cpu(monkeypatch):
    monkeypatch.setattr(MD, "DECODE_DEVICE_TYPES", frozenset({"cuda", "cpu"}))


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float16


def _weight(n, k, device):
    return F.quantize_weight_fp8(torch.randn(n, k, device=device) / k**0.5)


def _deq(w, s):
    return w.float() * s[:, None]


@pytest.mark.parametrize("m", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("n, k", [(40, 96), (72, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_weight_gemm_matches_reference(m, n, k, bias, device, decode_on_cpu):
    dtype = _dtype(device)
    x = torch.randn(m, k, device=device).to(dtype)
    w, s = _weight(n, k, device)
    b = torch.randn(n, device=device) if bias else None
    with fuseformer.use_backend("triton"):
        out = F.fp8_weight_gemm(x, w, s, b)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = x.double() @ _deq(w, s).double().T + (0 if b is None else b.to(dtype).double())
    base = (x @ _deq(w, s).to(dtype).T + (0 if b is None else b.to(dtype))).to(dtype)
    assert_close("out", out, ref, base)
    assert F.fp8_weight_gemm_ref(x, w, s, b).dtype == dtype


def test_bf16_x_multiplies_in_fp16_clamped(device, decode_on_cpu):
    """bf16 x with e4m3 weights: the kernel's MMA runs in fp16 (exact for e4m3; x rounded to fp16, which
    holds bf16's 8 bits), so the interpreter computes it right too; x past fp16's range is clamped to
    +-65504 (documented) rather than turned into inf."""
    x = torch.randn(5, 64, device=device).bfloat16()
    w, s = _weight(48, 64, device)
    with fuseformer.use_backend("triton"):
        out = F.fp8_weight_gemm(x, w, s)
        assert_close("out", out, x.double() @ _deq(w, s).double().T, (x @ _deq(w, s).bfloat16().T))
        x[0, 0] = 1e6
        big = F.fp8_weight_gemm(x, w, s)
    assert torch.isfinite(big).all()
    clamped = x.float().clamp(-65504, 65504)
    torch.testing.assert_close(big.float(), clamped @ _deq(w, s).T, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("t", [1, 3, 16, 40])
def test_gpu_rule_configs_with_bf16_x(t, device, decode_on_cpu):
    """The whole MLP at the tiles the GPU takes (the e4m3 rule: split-K 4 at T 1, 32 x 256 at T 2-16,
    BLOCK_M 64 past 32) with bf16 x, so the fp16 MMA, the y padding and the split-K epilogue run as on
    the GPU (under the interpreter on the CPU: its fp16 dot is right; the down GEMM's bf16 MMA at T 2-16
    runs in fp16 there)."""
    h, i = 256, 384
    x = torch.randn(t, h, device=device).bfloat16()
    wgu, sgu = _weight(2 * i, h, device)
    wd, sd = _weight(h, i, device)
    gu_cfg = MD.decode_config(t, i, h, True, 132, on_gpu=True, w_fp8=True)
    down_cfg = MD.decode_config(t, h, i, False, 132, on_gpu=True, w_fp8=True)
    assert down_cfg.get("FP16_MMA", True) == (not 2 <= t <= 16) and "FP16_MMA" not in gu_cfg  # run 121's rule
    if device == "cpu":  # the interpreter's bf16 dot is wrong: the T 2-16 tile's bf16 MMA is checked on the GPU
        down_cfg = {**down_cfg, "FP16_MMA": True}
    out, _ = MD.mlp_decode_fwd(x, wgu, wd, "silu", gu_cfg, down_cfg, scales=(sgu, sd))
    ref = F.fused_mlp_ref(x.double(), _deq(wgu, sgu).double(), _deq(wd, sd).double())
    base = F.fused_mlp_ref(x, _deq(wgu, sgu).bfloat16(), _deq(wd, sd).bfloat16(), upcast=False)
    assert_close("out", out, ref, base)


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_fp8_weight_mlp_matches_reference(m, activation, device, decode_on_cpu):
    dtype = _dtype(device)
    h, i = 96, 144
    x = torch.randn(m, h, device=device).to(dtype)
    wgu, sgu = _weight(2 * i, h, device)
    wd, sd = _weight(h, i, device)
    with fuseformer.use_backend("triton"):
        out = F.fp8_weight_mlp(x, wgu, sgu, wd, sd, activation)
    ref = F.fused_mlp_ref(x.double(), _deq(wgu, sgu).double(), _deq(wd, sd).double(), activation)
    base = F.fused_mlp_ref(x, _deq(wgu, sgu).to(dtype), _deq(wd, sd).to(dtype), activation, upcast=False)
    assert_close("out", out, ref, base)
    torch.testing.assert_close(F.fp8_weight_mlp_ref(x, wgu, sgu, wd, sd, activation).double(), ref, rtol=2e-2,
                               atol=2e-2)  # fmt: skip


def test_split_k_applies_the_scales_before_the_sum(device, decode_on_cpu):
    """A down GEMM split in K: each split's fp32 partial is scaled, then the epilogue sums them."""
    dtype = _dtype(device)
    x = torch.randn(3, 256, device=device).to(dtype)
    w, s = _weight(48, 256, device)
    cfg = dict(MD.decode_config(3, 48, 256, False, 132, on_gpu=False, w_fp8=True), SPLIT_K=4)
    out = MD._decode_gemm(x, w, False, "silu", cfg, w_scale=s)
    base = (x @ _deq(w, s).to(dtype).T).to(dtype)
    assert_close("out", out, x.double() @ _deq(w, s).double().T, base)


def test_fp8_tile_rule_fits_and_splits_to_fill_the_gpu():
    """e4m3 weights: run 120's tiles (T 1: 64 x 128 tiles split to ~2 programs an SM; T 2-16: 32 x 256),
    every config within shared memory; the sweep's candidates fit too."""
    assert MD.decode_config(1, 4096, 14336, False, 132, w_fp8=True) == dict(
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=5
    )
    assert MD.decode_config(8, 6144, 4096, False, 132, w_fp8=True)["SPLIT_K"] == 2
    assert MD.decode_config(1, 64, 256, False, 132, w_fp8=True)["SPLIT_K"] == 1  # too few K tiles to split
    for t in (1, 2, 16, 32, 64):
        for glu, n, k in ((True, 14336, 4096), (False, 4096, 14336), (False, 6144, 4096)):
            f8 = MD.decode_config(t, n, k, glu, 132, w_fp8=True)
            assert f8["BLOCK_K"] <= 256 and MD.decode_smem_bytes(f8, glu, 2, 1) + 4096 <= MD.SM90_SMEM_BYTES
            assert not glu or f8["SPLIT_K"] == 1
            programs = -(-n // f8["BLOCK_N"]) * f8["SPLIT_K"]
            assert glu or programs >= 132, (t, n, f8)
            cands = MD.decode_candidates(t, n, k, glu, w_fp8=True)
            assert cands[0] == f8 and len(cands) > 3
    assert MD.decode_key(1, 8, 16, torch.bfloat16, w_fp8=True) != MD.decode_key(1, 8, 16, torch.bfloat16)


def test_reference_outside_the_kernel(device):
    """Rows past 64, fp32 x, or K not a multiple of 16 take the reference."""
    w, s = _weight(24, 40, device)  # K 40: no descriptor
    x = torch.randn(3, 40, device=device)
    torch.testing.assert_close(F.fp8_weight_gemm(x, w, s), x @ _deq(w, s).T, rtol=1e-5, atol=1e-5)
    x = torch.randn(80, 40, device=device).half()
    torch.testing.assert_close(F.fp8_weight_gemm(x, w, s).float(), x.float() @ _deq(w, s).T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=torch.zeros(3, 32, dtype=torch.int32)), "fp8_weight_gemm: x"),
        (dict(w=torch.zeros(8, 32)), "fp8_weight_gemm: w has dtype"),
        (dict(w=torch.zeros(8, 16, dtype=FP8)), r"fp8_weight_gemm: w has shape \(8, 16\); expected \(\*, 32\)"),
        (dict(w_scale=torch.ones(7)), "fp8_weight_gemm: w_scale"),
        (dict(w_scale=torch.ones(8, dtype=torch.float16)), "fp8_weight_gemm: w_scale"),
        (dict(bias=torch.ones(9)), "fp8_weight_gemm: bias"),
    ],
)
def test_fp8_weight_gemm_bad_input(change, match):
    args = dict(x=torch.zeros(3, 32), w=torch.zeros(8, 32, dtype=FP8), w_scale=torch.ones(8), bias=None)
    with pytest.raises(ValueError, match=match):
        F.fp8_weight_gemm(**(args | change))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(w_gate_up=torch.zeros(9, 32, dtype=FP8), gate_up_scale=torch.ones(9)), "even row count"),
        (dict(gate_up_scale=torch.ones(3)), "fp8_weight_mlp: gate_up_scale"),
        (dict(w_down=torch.zeros(32, 5, dtype=FP8)), r"w_down has shape \(32, 5\); expected \(\*, 8\)"),
        (dict(w_down=torch.zeros(16, 8, dtype=FP8), down_scale=torch.ones(16)), r"expected \(32, 8\)"),
        (dict(down_scale=torch.ones(32, dtype=torch.float64)), "fp8_weight_mlp: down_scale"),
        (dict(activation="relu"), "fp8_weight_mlp: activation must be one of"),
    ],
)
def test_fp8_weight_mlp_bad_input(change, match):
    args = dict(x=torch.zeros(2, 32), w_gate_up=torch.zeros(16, 32, dtype=FP8), gate_up_scale=torch.ones(16),
                w_down=torch.zeros(32, 8, dtype=FP8), down_scale=torch.ones(32), activation="silu")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        F.fp8_weight_mlp(**(args | change))


# --------------------------------------------------------------------------------------------
# The layers: weight-only at decode, W8A8 past it
# --------------------------------------------------------------------------------------------
def _mlp(device, dtype):
    ref = GatedMLP(96, 144).to(device=device, dtype=dtype)
    return ref, Fp8GatedMLP.from_mlp(ref)


def test_layers_take_weight_only_at_decode(device, decode_on_cpu, monkeypatch):
    dtype = _dtype(device)
    calls = []
    for name in ("fp8_weight_gemm", "fp8_weight_mlp", "fp8_gemm", "quantize_fp8", "rms_norm_quant_fp8"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    _, mlp = _mlp(device, dtype)
    lin = Fp8Linear.from_linear(torch.nn.Linear(96, 40, bias=True).to(device=device, dtype=dtype))
    norm = Fp8RMSNorm(torch.nn.Parameter(torch.rand(96, device=device, dtype=dtype) + 0.5), 1e-6)
    x = torch.randn(2, 3, 96, device=device).to(dtype)
    r = torch.randn_like(x)
    with fuseformer.use_backend("triton"):
        y, summed = norm(x, r)
        assert isinstance(y, torch.Tensor) and y.dtype == dtype
        torch.testing.assert_close(summed, x + r)
        assert mlp(y).shape == x.shape and lin(y).shape == (2, 3, 40)
        assert calls == ["fp8_weight_mlp", "fp8_weight_gemm"] and decode_weight_only(y)
        calls.clear()
        big = torch.randn(65, 96, device=device).to(dtype)
        yq = norm(big)
        assert not isinstance(yq, torch.Tensor) and not decode_weight_only(big)
        lin(big)
        assert calls == ["rms_norm_quant_fp8", "quantize_fp8", "fp8_gemm"]


def test_fp8_mlp_at_decode_close_to_bf16(device, decode_on_cpu):
    """The whole layer at decode against the unquantized MLP: within e4m3's weight error (~3% of the
    output's scale), and closer than the W8A8 path past decode on the same rows."""
    dtype = _dtype(device)
    ref_mlp, mlp = _mlp(device, dtype)
    x = torch.randn(4, 96, device=device).to(dtype)
    w_gu, w_d = ref_mlp.gate_up_proj.weight.detach().double(), ref_mlp.down_proj.weight.detach().double()
    exact = F.fused_mlp_ref(x.double(), w_gu, w_d).float()
    with fuseformer.use_backend("triton"), torch.no_grad():
        w_only = mlp(x).float()
        w8a8 = mlp(Fp8Activation(*F.quantize_fp8(x))).float()  # a quantized input takes the W8A8 path
    err = (w_only - exact).norm() / exact.norm()
    assert err < 0.06, err
    assert err < (w8a8 - exact).norm() / exact.norm(), (err, w8a8)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------
def test_fp8_weight_ops_pass_opcheck(device, decode_on_cpu):
    dtype = _dtype(device)
    x = torch.randn(3, 64, device=device).to(dtype)
    w, s = _weight(48, 64, device)
    wd, sd = _weight(64, 32, device)
    # test_schema compares e4m3 inputs with allclose, which torch does not implement for float8 on the CPU.
    skip = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    utils = ("test_schema", *skip) if x.is_cuda else skip
    with fuseformer.use_backend("triton"):
        torch.library.opcheck(FD._gemm_op, (x, w, s, None), test_utils=utils)
        torch.library.opcheck(FD._gemm_op, (x, w, s, torch.randn(48, device=device).to(dtype)), test_utils=utils)
        torch.library.opcheck(FD._mlp_op, (x, *_weight(64, 64, device), wd, sd, "silu"), test_utils=utils)


def test_fp8_weight_ops_compile_fullgraph(device, compile_backend, decode_on_cpu):
    dtype = _dtype(device)
    x = torch.randn(2, 64, device=device).to(dtype)
    w, s = _weight(64, 64, device)
    wd, sd = _weight(64, 32, device)

    def f(x):
        ones = torch.ones(32, device=device)
        return F.fp8_weight_mlp(x, w, s, wd, sd) + F.fp8_weight_gemm(x, wd.T.contiguous(), ones).sum()

    with fuseformer.use_backend("triton"):
        eager = f(x)
        compiled = torch.compile(f, fullgraph=True, backend=compile_backend)(x)
    torch.testing.assert_close(compiled, eager)


# --------------------------------------------------------------------------------------------
# GPU: the 8B shapes in bf16, CUDA graphs
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 33, 64])
def test_fp8_weight_mlp_8b_shape_gpu(m):
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    wgu, sgu = _weight(2 * 14336, 4096, "cuda")
    wd, sd = _weight(4096, 14336, "cuda")
    out = F.fp8_weight_mlp(x, wgu, sgu, wd, sd)
    ref = F.fused_mlp_ref(x.float(), _deq(wgu, sgu), _deq(wd, sd))
    base = F.fused_mlp_ref(x, _deq(wgu, sgu).bfloat16(), _deq(wd, sd).bfloat16(), upcast=False)
    assert_close("out", out, ref, base)
    for n, k in ((6144, 4096), (4096, 4096)):
        w, s = _weight(n, k, "cuda")
        xk = x[:, :k].contiguous()
        assert_close("gemm", F.fp8_weight_gemm(xk, w, s), xk.float() @ _deq(w, s).T, (xk @ _deq(w, s).bfloat16().T))


@pytest.mark.gpu
def test_fp8_weight_mlp_cuda_graph_gpu():
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    wgu, sgu = _weight(2 * 14336, 4096, "cuda")
    wd, sd = _weight(4096, 14336, "cuda")
    eager = F.fp8_weight_mlp(x, wgu, sgu, wd, sd)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = F.fp8_weight_mlp(x, wgu, sgu, wd, sd)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out, F.fp8_weight_mlp(x, wgu, sgu, wd, sd))
    assert not torch.equal(out, eager)
