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
