"""BlockPool and KVCacheManager: ref counts, LRU eviction, prefix caching by chain hash, no leaks."""

import random

import pytest

from fuseformer.engine.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens, hash_token_blocks
from fuseformer.engine.kv_cache import NO_HIT, KVCacheManager
from fuseformer.engine.request import Request

BS = 4


def _req(rid, tokens):
    return Request(rid, tokens)


def _compute(kv, req, n):
    """Allocate slots for n more tokens and mark them computed (what a step does)."""
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n


def _admit(kv, req, num_new=None):
    """Admit a waiting request as the scheduler does: prefix hit, allocate, advance."""
    computed = kv.get_computed_blocks(req)
    n = req.num_tokens - computed.num_tokens if num_new is None else num_new
    new = kv.allocate_slots(req, n, computed)
    assert new is not None
    req.num_computed_tokens = computed.num_tokens + n
    return computed


# ---- hashing ---------------------------------------------------------------------------------


def test_chain_hash():
    a = hash_token_blocks(list(range(10)), BS)
    assert len(a) == 2  # the partial third block is not hashed
    assert a == hash_token_blocks(list(range(8)), BS)
    assert a[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert a[1] == hash_block_tokens(a[0], [4, 5, 6, 7])
    # Same tokens under another parent, or another extra key: another hash.
    assert hash_block_tokens(None, [4, 5, 6, 7]) != a[1]
    assert hash_block_tokens(a[0], [4, 5, 6, 7], extra_key="lora-1") != a[1]
    b = hash_token_blocks([0, 1, 2, 3, 4, 5, 6, 9], BS)
    assert b[0] == a[0] and b[1] != a[1]
    assert hash_token_blocks(list(range(12)), BS, parent_hashes=a) == hash_token_blocks(list(range(12)), BS)


# ---- BlockPool ---------------------------------------------------------------------------------


def test_allocate_free_refcount_and_null_block():
    pool = BlockPool(6, BS)
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    blocks = pool.allocate(5)
    assert NULL_BLOCK_ID not in {b.block_id for b in blocks}
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 1 for b in blocks) and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.touch(blocks[:2])  # a second user of the first two
    pool.free(blocks)
    assert pool.num_free_blocks == 3 and [b.ref_cnt for b in blocks] == [1, 1, 0, 0, 0]
    pool.free(blocks[:2])
    assert pool.num_free_blocks == 5
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])
    pool.check_invariants()


def test_free_order_and_lru_eviction():
    pool = BlockPool(9, BS)
    a = pool.allocate(4)  # ids 1..4
    b = pool.allocate(4)  # ids 5..8
    pool.free(a)  # tail first: 4, 3, 2, 1
    pool.free(b)  # then 8, 7, 6, 5
    assert [x.block_id for x in pool.free_queue] == [4, 3, 2, 1, 8, 7, 6, 5]
    assert [x.block_id for x in pool.allocate(3)] == [4, 3, 2]


def test_cached_block_findable_until_evicted():
    pool = BlockPool(4, BS)  # 3 usable
    tokens = list(range(8))
    hashes = hash_token_blocks(tokens, BS)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, hashes)
    pool.free(blocks)  # free queue: [2, 1, 3]? no: 3 was never used, so [3, 2, 1]
    assert [b.block_id for b in pool.free_queue] == [3, 2, 1]
    assert pool.get_cached_blocks(hashes) == blocks
    # A hit takes block 1 out of the middle of the free queue.
    pool.touch(pool.get_cached_blocks(hashes[:1]))
    assert [b.block_id for b in pool.free_queue] == [3, 2]
    assert blocks[0].ref_cnt == 1
    # Evicting block 2 (its hash) leaves the chain's first block findable, the second not.
    assert [b.block_id for b in pool.allocate(2)] == [3, 2]
    assert pool.get_cached_blocks(hashes) == blocks[:1]
    assert blocks[1].block_hash is None
    pool.check_invariants()


def test_cache_disabled_and_reset():
    pool = BlockPool(4, BS, enable_prefix_caching=False)
    hashes = hash_token_blocks(list(range(4)), BS)
    blocks = pool.allocate(1)
    pool.cache_full_blocks(blocks, hashes)
    assert pool.get_cached_blocks(hashes) == []

    pool = BlockPool(4, BS)
    blocks = pool.allocate(1)
    pool.cache_full_blocks(blocks, hashes)
    pool.free(blocks)
    assert pool.get_cached_blocks(hashes) == blocks
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_blocks(hashes) == [] and blocks[0].block_hash is None
    pool.check_invariants()


def test_duplicate_hash_keeps_first():
    pool = BlockPool(4, BS)
    hashes = hash_token_blocks(list(range(4)), BS)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_full_blocks(a, hashes)
    pool.cache_full_blocks(b, hashes)  # the same prefix computed twice at once
    assert pool.get_cached_blocks(hashes) == a and b[0].block_hash is None
    pool.free(b)
    pool.free(a)
    pool.allocate(3)  # evict everything
    assert pool.cached == {}
    pool.check_invariants()


@pytest.mark.parametrize("num_blocks,block_size", [(1, 16), (0, 16), (4, 0)])
def test_bad_pool(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks" if num_blocks < 2 else "block_size"):
        BlockPool(num_blocks, block_size)


# ---- KVCacheManager ------------------------------------------------------------------------------


def test_prefix_shared_and_freed_by_refcount():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 112))  # 3 full blocks
    a = _req("a", prefix + [1, 2])
    assert _admit(kv, a) is NO_HIT
    assert len(a.block_ids) == 4 and kv.get_block_ids(a) == a.block_ids
    # a's computed full blocks are cached at its next allocation (or when it is freed).
    _compute(kv, a, 1)
    b = _req("b", prefix + [7, 8, 9, 10, 11])
    hit = _admit(kv, b)
    assert hit.num_tokens == 12 and b.block_ids[:3] == a.block_ids[:3]
    assert b.block_ids[3] != a.block_ids[3]
    shared = [kv.pool.blocks[i] for i in a.block_ids[:3]]
    assert [x.ref_cnt for x in shared] == [2, 2, 2]
    kv.free(a)
    assert [x.ref_cnt for x in shared] == [1, 1, 1]
    assert all(x not in list(kv.pool.free_queue) for x in shared)
    kv.free(b)
    assert kv.num_free_blocks == 15 and a.block_ids == [] and b.block_ids == []
    # Hit counting, in tokens, at admission: a asked 14 and hit 0; b asked 17 and hit 12.
    assert kv.pool.prefix_stats.queries == 14 + 17 and kv.pool.prefix_stats.hits == 12
    assert kv.prefix_cache_hit_rate == pytest.approx(12 / 31)
    # Freed blocks are still findable: c hits the same 3 blocks plus b's 4th full block.
    c = _req("c", prefix + [7, 8, 9, 10, 5])
    assert _admit(kv, c).num_tokens == 16
    kv.pool.check_invariants()


def test_hit_never_covers_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    kv.free(a)
    same = _req("same", list(range(8)))
    hit = kv.get_computed_blocks(same)
    assert hit.num_tokens == 4  # not 8: the last token must run to give the next token's logits
    one_more = _req("longer", list(range(9)))
    assert kv.get_computed_blocks(one_more).num_tokens == 8


def test_blocks_cached_only_once_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None  # scheduled, not yet computed
    b = _req("b", list(range(13)))
    assert kv.get_computed_blocks(b) is NO_HIT
    a.num_computed_tokens = 6  # one step computed a chunk of 6
    _compute(kv, a, 0)
    assert kv.get_computed_blocks(b).num_tokens == 4


def test_allocate_none_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = _req("a", list(range(8)))
    _admit(kv, a)
    kv.free(a)  # 2 cached free blocks
    b = _req("b", list(range(8)) + list(range(50, 60)))  # 18 tokens: needs 5 blocks, 2 of them hits
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8
    free_before = [x.block_id for x in kv.pool.free_queue]
    assert kv.allocate_slots(b, 10, hit) is None
    assert [x.block_id for x in kv.pool.free_queue] == free_before and b.block_ids == []
    # 2 hits (free, so they count against the free blocks) + 2 new blocks fit.
    assert kv.allocate_slots(b, 7, hit) is not None
    assert len(b.block_ids) == 4 and kv.num_free_blocks == 0
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots(b, 1, hit)


def test_no_prefix_caching():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(_req("b", list(range(9)))) is NO_HIT
    assert kv.pool.cached == {}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("caching", [True, False])
def test_random_operations_leak_nothing(seed, caching):
    """Requests with shared prefixes are admitted, grown in chunks, finished or aborted in a random
    order; after each operation the pool is consistent, and at the end every block is free."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=40, block_size=BS, enable_prefix_caching=caching)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        op = rng.random()
        if op < 0.35:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            r = _req(f"r{step}", tokens)
            computed = kv.get_computed_blocks(r)
            n = rng.randrange(1, r.num_tokens - computed.num_tokens + 1)
            if kv.allocate_slots(r, n, computed) is not None:
                r.num_computed_tokens = computed.num_tokens + n
                live.append(r)
        elif op < 0.75 and live:
            r = rng.choice(live)
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(rng.randrange(50))
            n = rng.randrange(1, r.num_tokens - r.num_computed_tokens + 1)
            if kv.allocate_slots(r, n) is not None:
                r.num_computed_tokens += n
            assert len(r.block_ids) * BS >= r.num_computed_tokens
        elif live:
            r = live.pop(rng.randrange(len(live)))
            kv.free(r)
        kv.pool.check_invariants()
        held = sum(len(r.block_ids) for r in live)
        refs = sum(b.ref_cnt for b in kv.pool.blocks[1:])
        assert held == refs
    for r in live:
        kv.free(r)
    kv.pool.check_invariants()
    assert kv.num_free_blocks == 39 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
