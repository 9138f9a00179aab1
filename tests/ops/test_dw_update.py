"""The Gluon grad_weight update (ops/_dw_update.py): c += a.T @ b against cuBLAS's addmm_ on the GPU
(Gluon has no interpreter), and the cases where it declines."""

import pytest
import torch

from fuseformer.ops import _dw_update as du

pytestmark = pytest.mark.skipif(not du.HAVE_GLUON, reason="this Triton has no Gluon")


def test_usable_declines_cpu_tensors_and_mismatched_shapes():
    c, a, b = torch.zeros(8, 16), torch.zeros(4, 8), torch.zeros(4, 16)
    assert not du.usable(c, a, b)  # CPU
    if torch.cuda.is_available():
        c, a, b = (t.cuda().bfloat16() for t in (c, a, b))
        assert not du.usable(c, a[:, :4], b)  # a's columns != c's rows
        assert not du.usable(c, a, b[:3])  # K differs
        assert not du.usable(c.float(), a.float(), b.float())  # fp32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "k, m, n",
    [(240, 128256, 4096), (273, 50264, 1024), (17, 1000, 200), (1, 384, 256), (368, 4104, 4096), (64, 136, 264)],
)
def test_dw_update_matches_addmm_gpu(k, m, n, dtype):
    """M, N and K rows on 16-byte boundaries (TMA's rule; the FLCE falls back to cuBLAS otherwise).
    Tails in every dimension (M not a multiple of 128, N of 256, K of the K block): TMA's zero
    padding on loads and clipping on stores. The sum is fp32 and rounded once, like cuBLAS's: the two
    may differ by the last bit where their fp32 sums round differently."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    g = torch.Generator(device="cuda").manual_seed(k + m + n)
    c = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    a = (torch.randn(k, m, device="cuda", generator=g) * 0.1).to(dtype)
    b = torch.randn(k, n, device="cuda", generator=g).to(dtype)
    assert du.usable(c, a, b)
    ref = c.float() + a.float().T @ b.float()
    ours = c.clone()
    du.dw_update(ours, a, b)
    cublas = c.clone().addmm_(a.T, b)
    # Both one rounding of (nearly) the same fp32 sum: within one ulp of the exact result's dtype.
    ulp = torch.finfo(dtype).eps
    tol = ulp * ref.abs() + 1e-6 * ref.abs().max()
    assert ((ours.float() - ref).abs() <= tol).all(), float((ours.float() - ref).abs().max())
    assert ((ours.float() - cublas.float()).abs() <= 2 * tol).all()


@pytest.mark.gpu
def test_flce_with_the_gluon_update_matches_cublas_gpu(monkeypatch):
    """The whole FLCE with the Gluon update in its growing chunks: the gradients match the cuBLAS
    schedule's to bf16 rounding, the loss exactly (the update does not touch it)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from fuseformer.ops import cross_entropy as CE

    n, h, v = 3000, 512, 50257
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)

    def run():
        return CE.fused_linear_cross_entropy_fwd(hidden, weight, t, None, -100, "mean", 0.0, 0.0, True, True, False)

    monkeypatch.setattr(CE, "_GLUON_DW_UPDATE", False)
    loss0, dh0, dw0, _ = run()
    monkeypatch.setattr(CE, "_GLUON_DW_UPDATE", True)
    loss1, dh1, dw1, _ = run()
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    torch.testing.assert_close(dh1, dh0, rtol=0, atol=0)
    # 3000 - 512 tokens in growing chunks: each update rounds to bf16 once, as cuBLAS's does.
    torch.testing.assert_close(dw1.float(), dw0.float(), rtol=2e-2, atol=1e-2 * float(dw0.float().abs().max()))
