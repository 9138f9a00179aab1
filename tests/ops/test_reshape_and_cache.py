"""reshape_and_cache: the Triton kernel and the CPU path write exactly the reference's slots (a copy: bitwise),
strided inputs, skipped slots (-1), bad input. (paged_attention's tests write their caches with it too.)"""

import importlib

import pytest
import torch

import fuseformer
import fuseformer.ops as F

RC = importlib.import_module("fuseformer.ops.reshape_and_cache")  # the module (F.reshape_and_cache is the op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d, block_size", [(8, 4), (59, 16), (128, 3)])
def test_reshape_and_cache_writes_the_reference_slots(dtype, d, block_size, device):
    """NaN-filled caches: every slot the kernel must not touch stays NaN, the others hold k and v."""
    t, hkv, blocks = 11, 3, 6
    k = torch.randn(t, 2 * hkv, d, dtype=dtype, device=device)[:, 1 : hkv + 1]  # strided: a slice of qkv
    v = torch.randn(t, hkv, d, dtype=dtype, device=device)
    slots = torch.randperm(blocks * block_size, device=device)[:t]
    slots[3] = -1  # padding: not written
    caches = [tuple(torch.full((blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
                    for _ in range(2)) for _ in range(2)]  # fmt: skip
    with fuseformer.use_backend("triton"):
        F.reshape_and_cache(k, v, *caches[0], slots)
    F.reshape_and_cache_ref(k, v, *caches[1], slots)
    for got, want in zip(caches[0], caches[1]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert caches[0][0].isnan().sum() == (blocks * block_size - (t - 1)) * hkv * d


def test_reshape_and_cache_empty_step(device):
    k_cache = torch.randn(2, 4, 2, 8, device=device)
    before = k_cache.clone()
    with fuseformer.use_backend("triton"):
        F.reshape_and_cache(
            k_cache[0, :0], k_cache[0, :0], k_cache, k_cache, torch.zeros(0, dtype=torch.long, device=device)
        )
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("pad", [False, True])
def test_reshape_and_cache_cpu_path_matches_reference(pad):
    k_cache = torch.randn(5, 4, 2, 8)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(3, 6, 8)[:, 1:3]  # strided, as a slice of a packed qkv
    v = torch.randn(3, 2, 8)
    slots = torch.tensor([7, -1 if pad else 0, 19])
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    RC._reshape_and_cache_cpu(k, v, *caches[0], slots)
    F.reshape_and_cache_ref(k, v, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(k=torch.randn(3, 2)), "k must have 3 dims"),
        (dict(v=torch.randn(3, 2, 8).half()), "v has dtype float16"),
        (dict(k_cache=torch.randn(2, 4, 3, 8), v_cache=torch.randn(2, 4, 3, 8)), r"k_cache has shape \(2, 4, 3, 8\)"),
        (dict(slot_mapping=torch.tensor([0, 1, 2.0])), "slot_mapping has dtype float32"),
        (dict(slot_mapping=torch.tensor([0, 1])), r"slot_mapping has shape \(2,\)"),
    ],
)
def test_reshape_and_cache_bad_input(change, match):
    args = dict(
        k=torch.randn(3, 2, 8),
        v=torch.randn(3, 2, 8),
        k_cache=torch.randn(2, 4, 2, 8),
        v_cache=torch.randn(2, 4, 2, 8),
        slot_mapping=torch.tensor([0, 5, 6]),
    )
    with pytest.raises(ValueError, match=match):
        F.reshape_and_cache(**{**args, **change})


# --------------------------------------------------------------------------------------------
# FP8 (e4m3) caches: stored = e4m3(clamp(x / scale, ±448)), round to nearest even
# --------------------------------------------------------------------------------------------
def _fp8_write(dtype, d, block_size, device, scales, nan=False):
    """The kernel's and the reference's e4m3 caches after one write of 11 tokens (one skipped), and the
    fp32 values x / scale of every slot (NaN where nothing is written)."""
    t, hkv, blocks = 11, 3, 6
    k = torch.randn(t, 2 * hkv, d, dtype=dtype, device=device)[:, 1 : hkv + 1] * 30  # past ±448 / scale
    v = torch.randn(t, hkv, d, dtype=dtype, device=device)
    k[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0])
    if nan:
        v[1, 1, 2] = float("nan")
    slots = torch.randperm(blocks * block_size, device=device)[:t]
    slots[3] = -1
    k_scale, v_scale = scales
    shape = (blocks, block_size, hkv, d)
    caches = [[torch.full(shape, float("nan"), dtype=torch.float8_e4m3fn, device=device) for _ in range(2)]
              for _ in range(2)]  # fmt: skip
    with fuseformer.use_backend("triton"):
        F.reshape_and_cache(k, v, *caches[0], slots, k_scale, v_scale)
    F.reshape_and_cache_ref(k, v, *caches[1], slots, k_scale, v_scale)
    xs = []
    for x, scale in ((k, k_scale), (v, v_scale)):
        full = torch.full((blocks * block_size, hkv, d), float("nan"), device=device)
        full[slots[slots >= 0]] = (x[slots >= 0].float() / (1.0 if scale is None else scale.float())).clamp(-448, 448)
        xs.append(full.view(shape))
    return caches, xs


SCALES = [
    (None, None),  # 1.0
    (torch.tensor(0.05), torch.tensor([3.0])),  # 0-dim and (1,)
    (torch.tensor(0.7), None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d, block_size", [(8, 4), (59, 16), (128, 3)])
@pytest.mark.parametrize("scales", range(len(SCALES)))
def test_reshape_and_cache_fp8_matches_reference(dtype, d, block_size, scales, device):
    """e4m3 caches: the kernel's bytes are the reference's, saturation at ±448 and ±inf included; skipped
    slots stay NaN. Bit for bit under the interpreter too (the kernel rounds to e4m3's grid itself)."""
    scales = tuple(s if s is None else s.to(device) for s in SCALES[scales])
    (got, want), xs = _fp8_write(dtype, d, block_size, device, scales)
    for g, w, x in zip(got, want, xs):
        assert torch.equal(g.float().isnan(), w.float().isnan()), "wrong slots written"
        differ = g.view(torch.uint8) != w.view(torch.uint8)
        assert not differ.any(), (g.float()[differ][:8], w.float()[differ][:8], x[differ][:8])
    assert want[0].float().nan_to_num(0.0).abs().max() == 448  # some values saturated


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scales", range(len(SCALES)))
def test_reshape_and_cache_fp8_bit_exact_gpu(dtype, scales):
    """On the GPU the e4m3 cast is exact: every byte is the reference's, NaN included."""
    scales = tuple(s if s is None else s.cuda() for s in SCALES[scales])
    (got, want), _ = _fp8_write(dtype, 128, 16, "cuda", scales, nan=True)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    assert want[1].float().isnan().any()


def test_reshape_and_cache_fp8_cpu_path_matches_reference():
    k = torch.randn(3, 6, 8)[:, 1:3] * 40  # strided
    v = torch.randn(3, 2, 8)
    scales = (torch.tensor(0.1), torch.tensor([2.0]))
    for slots in (torch.tensor([7, 0, 19]), torch.tensor([7, -1, 19])):
        caches = [[torch.zeros(5, 4, 2, 8, dtype=torch.float8_e4m3fn) for _ in range(2)] for _ in range(2)]
        RC._reshape_and_cache_cpu(k, v, *caches[0], slots, *scales)
        F.reshape_and_cache_ref(k, v, *caches[1], slots, *scales)
        for got, want in zip(*caches):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[1][0].float().abs().max() == 448


def test_reshape_and_cache_fp8_without_kernel_support_takes_the_reference(monkeypatch):
    """An e4m3 cache where the kernels cannot run (a GPU before sm_89) goes to the reference."""
    monkeypatch.setattr(
        importlib.import_module("fuseformer.ops._fp8_kv_cache"), "kernels_support_fp8", lambda device: False
    )
    calls = []
    monkeypatch.setattr(RC, "reshape_and_cache_fwd", lambda *a: calls.append("kernel"))
    monkeypatch.setattr(RC, "_reshape_and_cache_cpu", lambda *a: calls.append("cpu"))
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    F.reshape_and_cache(k, k, cache, cache.clone(), torch.tensor([0, 5, 6]), torch.tensor(0.5))
    assert calls == ["cpu"]


def test_reshape_and_cache_scales_unused_for_model_dtype_caches():
    """Caches in k's dtype are a plain copy whatever the scales (the model passes its buffers always)."""
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    caches = [[torch.zeros(2, 4, 2, 8) for _ in range(2)] for _ in range(2)]
    with fuseformer.use_backend("triton"):
        F.reshape_and_cache(k, v, *caches[0], torch.tensor([0, 5, 6]), torch.tensor(0.1), torch.tensor(7.0))
    F.reshape_and_cache_ref(k, v, *caches[1], torch.tensor([0, 5, 6]))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def _fp8_cache():
    return torch.zeros(2, 4, 2, 8, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(k_cache=_fp8_cache()), "v_cache has dtype float32; expected one of float8_e4m3fn"),
        (dict(k_cache=_fp8_cache().to(torch.float8_e5m2), v_cache=_fp8_cache().to(torch.float8_e5m2)),
         "k_cache has dtype float8_e5m2"),
        (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), k_scale=torch.tensor(1.0).half()),
         "k_scale has dtype float16"),
        (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), v_scale=torch.ones(2)), r"v_scale must hold one value"),
        (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), v_scale=torch.ones(1, 1)), "v_scale must have 0 or 1 dims"),
        (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), k_scale=0.5), "k_scale must be a torch.Tensor"),
    ],
)  # fmt: skip
def test_reshape_and_cache_fp8_bad_input(change, match):
    args = dict(
        k=torch.randn(3, 2, 8),
        v=torch.randn(3, 2, 8),
        k_cache=torch.randn(2, 4, 2, 8),
        v_cache=torch.randn(2, 4, 2, 8),
        slot_mapping=torch.tensor([0, 5, 6]),
    )
    with pytest.raises(ValueError, match=match):
        F.reshape_and_cache(**{**args, **change})
