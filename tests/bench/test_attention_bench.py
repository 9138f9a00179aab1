"""bench attention's paged decode case (issue 28 item 5): its inputs are one K/V in two layouts, ours
on the paged one equals SDPA on the contiguous one, and the bytes are the K/V read once."""

import torch

from fuseformer.bench import attention as A


def test_paged_decode_inputs_hold_the_same_kv_in_both_layouts():
    q, k_cache, v_cache, cu, lens, tables, k, v = A.paged_decode_inputs(3, 40, device="cpu", dtype=torch.float32)
    assert tables.shape == (3, 3) and sorted(tables.flatten().tolist()) == list(range(1, 10))  # block 0 free
    for b in range(3):
        for pos in (0, 17, 39):
            block, off = tables[b, pos // A.PAGED_BLOCK], pos % A.PAGED_BLOCK
            assert torch.equal(k[b, :, pos], k_cache[block, off]) and torch.equal(v[b, :, pos], v_cache[block, off])
    assert cu.tolist() == [0, 1, 2, 3] and lens.tolist() == [40] * 3 and q.shape == (3, 32, 128)


def test_paged_decode_impls_agree_on_the_cpu():
    inputs = A.paged_decode_inputs(2, 50, device="cpu", dtype=torch.float32)
    q, k, v = inputs[0], inputs[6], inputs[7]
    ref = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)
    impls = A._paged_decode_impls(inputs)
    for name in ("fuseformer paged", "sdpa_flash contiguous"):
        torch.testing.assert_close(impls[name](), ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_bytes():
    # 64 x 4096 tokens x 8 KV heads x 128 x 2 bytes, K and V, plus q and out (64 x 32 x 128 x 2 each)
    assert A.paged_decode_bytes(64, 4096) == 2 * 64 * 4096 * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2
