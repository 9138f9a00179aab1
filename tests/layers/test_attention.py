"""Attention module against a plain PyTorch composition of the same parameters."""

import pytest
import torch

import fuseformer
from fuseformer.layers import Attention
from fuseformer.testing import assert_close


def _rope_tables(seqlen, rotary_dim, device):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(seqlen, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()  # (S, rotary_dim / 2)


def _plain_one(layer, x, cos, sin, cast):
    """One sequence x (S, hidden) through plain torch ops in dtype ``cast``."""
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    p = {n: t.to(cast) for n, t in layer.named_parameters()}
    x = x.to(cast)
    s = x.shape[0]
    qkv = torch.nn.functional.linear(x, p["qkv_proj.weight"], p.get("qkv_proj.bias")).view(s, hq + 2 * hkv, d)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    if layer.qk_norm:
        eps = layer.q_norm.eps
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * p["q_norm.weight"]
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * p["k_norm.weight"]
    if cos is not None:
        half = cos.shape[1]
        c, sn = cos[:s, None, :].to(cast), sin[:s, None, :].to(cast)

        def rot(t):
            t1, t2, rest = t[..., :half], t[..., half : 2 * half], t[..., 2 * half :]
            return torch.cat([t1 * c - t2 * sn, t2 * c + t1 * sn, rest], dim=-1)

        q, k = rot(q), rot(k)
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(s, hq * d)
    return torch.nn.functional.linear(out, p["o_proj.weight"], p.get("o_proj.bias"))


def _plain(layer, x, cos, sin, cast, cu=None):
    if cu is not None:
        offsets = cu.tolist()
        return torch.cat([_plain_one(layer, x[a:b], cos, sin, cast) for a, b in zip(offsets, offsets[1:])])
    return torch.stack([_plain_one(layer, xb, cos, sin, cast) for xb in x])


def _layer(device, qk_norm=True, bias=True, hkv=2):
    torch.manual_seed(0)
    layer = Attention(64, 4, hkv, 16, bias=bias, qk_norm=qk_norm, device=device)
    if qk_norm:
        with torch.no_grad():
            layer.q_norm.weight.uniform_(0.5, 1.5)
            layer.k_norm.weight.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("qk_norm, bias, hkv", [(True, True, 2), (False, False, 4), (True, False, 1)])
def test_attention_layer_matches_plain_torch(qk_norm, bias, hkv, device):
    layer = _layer(device, qk_norm, bias, hkv)
    cos, sin = _rope_tables(16, 16, device)
    x = torch.randn(2, 9, 64, device=device, requires_grad=True)
    out = layer(x, cos, sin)
    ref = _plain(layer, x, cos, sin, torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], g)
    ref_grads = torch.autograd.grad(ref, [x, *layer.parameters()], g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_attention_layer_packed_varlen(device):
    layer = _layer(device)
    cos, sin = _rope_tables(16, 8, device)  # partial rotary: 8 of 16 dims
    lens = [3, 1, 7]
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32, device=device)
    x = torch.randn(sum(lens), 64, device=device)
    out = layer(x, cos, sin, cu_seqlens=cu, max_seqlen=max(lens))
    torch.testing.assert_close(out, _plain(layer, x, cos, sin, torch.float32, cu), atol=2e-5, rtol=2e-5)


def test_attention_layer_fp16_on_the_kernels(device):
    """fp16: flash attention, rms_norm and rotary all on Triton (the interpreter on the CPU)."""
    layer = _layer(device).half()
    cos, sin = _rope_tables(40, 16, device)
    x = torch.randn(1, 37, 64, device=device, dtype=torch.float16)
    with fuseformer.use_backend("triton"):
        out = layer(x, cos, sin)
    ref = _plain(layer, x, cos, sin, torch.float64)
    assert_close("out", out, ref, _plain(layer, x, cos, sin, torch.float16))


def test_attention_layer_bad_heads():
    with pytest.raises(ValueError, match="num_heads"):
        Attention(64, 6, 4)
    with pytest.raises(ValueError, match="hidden_size 65"):
        Attention(65, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_layer_gpu(dtype):
    torch.manual_seed(0)
    layer = Attention(2048, 16, 4, 128, qk_norm=True, device="cuda", dtype=dtype)
    cos, sin = _rope_tables(1024, 128, "cuda")
    x = torch.randn(2, 1000, 2048, device="cuda", dtype=dtype)
    out = layer(x, cos, sin)
    assert_close("out", out, _plain(layer, x, cos, sin, torch.float64), _plain(layer, x, cos, sin, dtype))
