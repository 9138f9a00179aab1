"""KVCacheManager: which KV blocks each request holds; the scheduler's only door to the BlockPool.

Two calls carry the protocol, as in vLLM v1's ``kv_cache_manager.py``:

- ``get_computed_blocks(request)`` when a waiting request is about to be scheduled: the blocks of
  its longest cached prefix (a ``ComputedBlocks``, not yet referenced);
- ``allocate_slots(request, num_new_tokens, computed)``: reference those blocks and add enough
  new ones for ``num_new_tokens`` more tokens, or return None (and change nothing) when the pool
  cannot; the scheduler then preempts or waits.

Blocks are made findable by the prefix cache only once their K/V has been written, i.e. up to
``request.num_computed_tokens`` (which the scheduler advances after each step): at the next
``allocate_slots`` and at ``free``. So a hit never points at a block being written in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuseformer.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from fuseformer.engine.request import Request


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix-cache hit: ``blocks`` hold the K/V of the request's first ``num_tokens`` tokens."""

    blocks: tuple[KVCacheBlock, ...] = ()
    num_tokens: int = 0


NO_HIT = ComputedBlocks()


class KVCacheManager:
    """Per-request block tables over one ``BlockPool``.

    Args:
        num_blocks: blocks in the pool, the null block 0 included.
        block_size: tokens per block.
        enable_prefix_caching: share the blocks of equal prompt prefixes between requests.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of the request already in the hash map

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.prefix_stats.hit_rate

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest chain of cached full blocks that prefixes ``request``'s tokens.

        Never the whole sequence: the last token is always left to compute, since the model must
        run on it to give the logits of the next token. The lookup is counted in the hit rate
        when the request is admitted (its first ``allocate_slots``), not at every try.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        blocks = self.pool.get_cached_blocks(request.block_hashes[:max_hit_blocks])
        return ComputedBlocks(tuple(blocks), len(blocks) * self.block_size) if blocks else NO_HIT

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = NO_HIT
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` tokens after the request's computed ones.

        ``computed`` (from ``get_computed_blocks``, only for a request holding no blocks) is
        referenced and put at the head of its block table. Returns the ids of the newly allocated
        blocks (possibly none), or None, changing nothing, when the pool has too few free blocks.
        """
        rid = request.request_id
        held = self._blocks.get(rid)
        num_computed = request.num_computed_tokens + computed.num_tokens
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(computed.blocks)
        if held is not None:
            if computed.blocks:
                raise ValueError(f"allocate_slots: request {rid!r} already has blocks; a prefix hit is for a new one")
            num_needed -= len(held)
            if num_needed <= 0:  # the common decode step: room left in the last block
                self._cache_computed_blocks(request)
                return []
        num_needed = max(num_needed, 0)
        # Hit blocks with no other user sit in the free queue; referencing them takes them out of it.
        num_hits_free = sum(1 for b in computed.blocks if b.ref_cnt == 0) if computed.blocks else 0
        if num_needed + num_hits_free > self.pool.num_free_blocks:
            return None

        if self.enable_prefix_caching and held is None and request.num_computed_tokens == 0:
            self.pool.prefix_stats.record(request.num_tokens, computed.num_tokens)  # admission
        self.pool.touch(computed.blocks)
        new_blocks = self.pool.allocate(num_needed)
        if held is None:
            held = self._blocks[rid] = []
            self._num_cached_blocks[rid] = len(computed.blocks)
        held.extend(computed.blocks)
        held.extend(new_blocks)
        request.block_ids.extend(b.block_id for b in computed.blocks)
        new_ids = [b.block_id for b in new_blocks]
        request.block_ids.extend(new_ids)
        self._cache_computed_blocks(request)
        return new_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks (its computed full blocks stay findable until evicted)."""
        rid = request.request_id
        self._cache_computed_blocks(request)
        blocks = self._blocks.pop(rid, [])
        self._num_cached_blocks.pop(rid, None)
        self.pool.free(blocks)
        request.block_ids.clear()

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self._blocks.get(request.request_id, [])]

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def _cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's full blocks whose K/V is written into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        if request.num_computed_tokens // self.block_size <= start:
            return
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        self._update_block_hashes(request, num_full)
        self.pool.cache_full_blocks(blocks[start:num_full], request.block_hashes[start:num_full])
        self._num_cached_blocks[rid] = num_full

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend ``request.block_hashes`` to its first ``num_blocks`` full blocks."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(len(hashes), min(num_blocks, len(tokens) // bs)):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
