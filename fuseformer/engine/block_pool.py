"""BlockPool: the fixed set of KV-cache block ids, their reference counts and the prefix cache.

A block holds the K/V of ``block_size`` consecutive tokens of one sequence (the tensors live in the
model runner: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer; this file only hands
out ids). Block 0 is reserved as the null block: the runner may point padding entries of a block
table at it, and it is never allocated.

Prefix caching: a full block is named by a chain hash, ``H(parent block's hash, its token ids,
extra key)``, so equal hashes mean equal token prefixes up to and including that block. A map
hash -> block lets a new request reuse the blocks of any earlier request with the same prefix. A
freed block keeps its hash and stays findable while it sits in the free queue; it loses the hash
only when it is evicted (handed out again). The free queue is in LRU order (evict from the front,
free to the back) and is a doubly-linked list through the blocks, so a cached free block that gets
a hit is taken out of the middle in O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes
NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: object = None) -> BlockHash:
    """The chain hash of one full block: sha256 of (parent hash, token ids, repr(extra key)).

    sha256 rather than Python's 64-bit ``hash``: a collision would silently give a request another
    prompt's K/V, and 32 bytes per block make that impossible in practice (~1 us per 16 tokens).
    ``extra_key`` separates blocks whose tokens match but whose K/V differ (LoRA, multimodal inputs).
    """
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return h.digest()


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, extra_key: object = None, *, parent_hashes: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Chain hashes of every full block of ``token_ids``; the first ``len(parent_hashes)`` are taken as given."""
    hashes = list(parent_hashes)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra_key))
    return hashes


class KVCacheBlock:
    """One block id with its reference count, its hash (set while it holds a cached full block) and
    its links in the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Free blocks in eviction order (least recently freed first): a doubly-linked list through the
    blocks' own ``prev_free``/``next_free`` with two sentinels, so popleft, append and removal from
    the middle are all O(1) without allocation."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def popleft(self) -> KVCacheBlock:
        if self.num_free == 0:
            raise RuntimeError("FreeBlockQueue: no free block")
        block = self._head.next_free
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"FreeBlockQueue: {block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free

    def __len__(self) -> int:
        return self.num_free


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens: ``queries`` tokens asked for, ``hits`` found cached."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """``num_blocks`` KV block ids (block 0 reserved as the null block), with prefix caching.

    Args:
        num_blocks: blocks in the cache, the null block included; at least 2.
        block_size: tokens per block.
        enable_prefix_caching: keep hashes of full blocks so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockPool: block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}  # hash -> the block holding it (in use or free)
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free ones, cached or not)."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks referenced by some request (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The blocks of the longest cached prefix of the chain ``block_hashes`` (see ``hash_token_blocks``).

        Takes hashes rather than token ids so that a request's hashes are computed once and reused
        (after preemption, at every block it fills). The blocks are not referenced: call ``touch``.
        """
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in block_hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Reference prefix-hit blocks: a free one leaves the free queue (so it cannot be evicted)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` fresh blocks (reference count 1) from the front of the free queue, evicting
        any cached hash they held. Raises if fewer are free: callers check ``num_free_blocks``."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"BlockPool: {num_blocks} blocks asked for, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block. Blocks reaching 0 go to the back of the free queue,
        the sequence's last block first, so that tails (shared by fewer requests) are evicted before
        the prefixes that lead to them."""
        for b in reversed(blocks):
            if b.ref_cnt <= 0:
                raise RuntimeError(f"BlockPool: {b} freed more often than referenced")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Make full blocks findable: ``blocks[i]`` holds the tokens hashed as ``block_hashes[i]``.

        Only call this once the blocks' K/V has been written. If another block already holds a
        hash (two requests computed the same prefix at once), that one stays cached and this
        block is left uncached; it is freed like any other.
        """
        if not self.enable_prefix_caching:
            return
        for b, h in zip(blocks, block_hashes, strict=True):
            if b.block_hash is not None:
                continue  # a prefix hit, or cached earlier
            if h not in self.cached:
                b.block_hash = h
                self.cached[h] = b

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after new weights are loaded); blocks in use stay in use,
        only unfindable. Returns how many hashes were dropped."""
        n = len(self.cached)
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        return n

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent (for tests and debugging; O(num_blocks))."""
        free = list(self.free_queue)
        if len(free) != self.free_queue.num_free or len({b.block_id for b in free}) != len(free):
            raise AssertionError("free queue length or uniqueness broken")
        if any(b.ref_cnt != 0 for b in free) or self.null_block in free:
            raise AssertionError("a referenced block or the null block is in the free queue")
        free_ids = {b.block_id for b in free}
        for b in self.blocks[1:]:
            if b.block_id not in free_ids and b.ref_cnt <= 0:
                raise AssertionError(f"{b} is neither free nor referenced (leaked)")
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise AssertionError(f"hash map points at {b} with another hash")
