"""The engine's CUDA graphs: whole decode steps (``DecodeGraphs``) and steps with prefill chunks as graph
pieces around attention (``PiecewiseGraphs``), each over static input buffers, captured at engine start.

A step launched from Python costs ~14 kernel launches a layer and the Python around them (~8-10 ms a
step for the 8B shape on a fast host); a replayed graph costs one launch. Decode-only steps (every
request computes one token) replay a whole-forward graph per padded batch size. A step that carries a
prefill chunk has a varlen attention whose grid and metadata change with the step's sequences, so it
replays vLLM v1's way: everything but attention captured per padded token count, in pieces, and each
layer's attention (the KV cache write and the paged attention) launched eagerly between them on the
step's own metadata. Steps above the largest captured size run eagerly.
"""

from __future__ import annotations

import bisect
import time

import torch

from fuseformer.engine.sampler import staged
from fuseformer.engine.scheduler import ScheduledRequest
from fuseformer.models.attention_metadata import AttentionMetadata

MAX_GRAPH_BATCH = 512  # the largest decode step captured as a CUDA graph


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes captured as CUDA graphs, vLLM's pattern: 1, 2, 4, every multiple of 8
    up to 256, then every multiple of 16, and ``max_batch`` itself. A step of n decodes replays the
    smallest size >= n, so padding wastes at most 7 rows (15 above 256)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += [b for b in range(8, min(max_batch, 256) + 1, 8)] + [b for b in range(272, max_batch + 1, 16)]
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """The model forward of decode-only steps over static input buffers, one CUDA graph per padded
    batch size.

    Static buffers, sized for the largest batch ``Bmax`` (each graph reads the first B rows):
    input_ids, positions, slot_mapping (Bmax,) int64; context_lens (Bmax,) int32; cu_seqlens_q
    (Bmax+1,) int32 = 0, 1, ..., Bmax (one query per row, padding included: constant);
    block_tables (Bmax, max_blocks) int32. A step of n decodes takes the smallest size B >= n, copies
    its rows into rows [0, n) and pads rows [n, B) so they are harmless: input id 0, position 0,
    slot -1 (``reshape_and_cache`` skips it: nothing is written), context length 1 and block-table
    column 0 = the null block 0 (never handed to a request), so a padded row attends to slot 0 of the
    null block and its output row is finite garbage that nothing reads. Only columns [0, width) of
    the block table are rewritten each step (width: the step's longest table): the attention kernel
    reads a row's columns below ceil(context_len / block_size) only, and those are rewritten.

    ``capture=True`` (CUDA): ``capture()`` warms each size up (Triton JIT, cuBLAS heuristics, the
    ops' launch-config caches: nothing may compile or sync inside capture) and captures it, largest
    first, all graphs in one memory pool (a smaller graph reuses the larger ones' intermediates;
    graphs replay one at a time). ``capture=False`` (the CPU tests): ``run`` calls the forward on the
    same padded static buffers, so the padding is tested without CUDA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: list[int],
        *,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.block_size, self.max_blocks, self.device, self.use_graphs = block_size, max_blocks_per_seq, device, capture
        b = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        # rows: input_ids, positions, slot_mapping: one host-to-device copy per step for the three.
        self._ids_pos_slots = torch.tensor([[0] * b, [0] * b, [-1] * b], **i64)
        self.input_ids, self.positions, self.slot_mapping = self._ids_pos_slots.unbind(0)
        self.context_lens = torch.ones(b, **i32)
        self.cu_seqlens_q = torch.arange(b + 1, **i32)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> (B, H) hidden states the graph writes
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # steps run per size
        self.padded_rows = 0  # padding rows computed, over all steps (the cost of fixed sizes)
        self.pool_bytes = 0  # GPU memory the graphs' pool holds (measured after capture)
        self.capture_seconds = 0.0

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            max_seqlen_q=1,
            kv_caches=self.kv_caches,
            context_lens=self.context_lens[:b],
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
        )
        return self.model(self.input_ids[:b], self.positions[:b], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size (no-op without ``capture``). The static buffers hold
        padding meanwhile (slots -1), so neither the warm-ups nor the graphs write the KV cache."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: the smaller ones fit in its freed memory
            self._forward(b)  # warm-up, outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        self.capture_seconds = time.perf_counter() - start

    def padded_size(self, scheduled: list[ScheduledRequest]) -> int | None:
        """The captured size for this step, or None when it must run eagerly: a request computes more
        than one token (a prefill chunk), more requests than the largest size, or a longer block table
        than the static one."""
        n = len(scheduled)
        if n > self.sizes[-1]:
            return None
        for s in scheduled:
            if len(s.token_ids) != 1 or len(s.block_ids) > self.max_blocks:
                return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, scheduled: list[ScheduledRequest], b: int, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Load the step into rows [0, n) of the static buffers, pad [n, B), replay the size-``b``
        graph (or run the forward, without graphs). ``input_ids`` (n,) on the device: the rows'
        input tokens instead of their ``token_ids`` (a step scheduled ahead). Returns hidden states
        (B, H); rows [0, n) are the step's, in scheduled order; the tensor is overwritten by the next
        run. The copies come from pinned memory: they never wait for a step still on the device."""
        bs, pad = self.block_size, b - len(scheduled)
        ids, pos, slots, ctx, tables = [], [], [], [], []
        for s in scheduled:
            p = s.start_position
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables.append(s.block_ids)
        width = max(len(t) for t in tables)
        rows = [t + (0,) * (width - len(t)) for t in tables] + [(0,) * width] * pad
        # Host-to-device copies, stream-ordered before the replay that reads them.
        dev = self.device
        ids_pos_slots = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad], dtype=torch.int64)
        self._ids_pos_slots[:, :b].copy_(staged(ids_pos_slots, dev), non_blocking=True)
        if input_ids is not None:
            self._ids_pos_slots[0, : len(scheduled)].copy_(input_ids)
        self.context_lens[:b].copy_(staged(torch.tensor(ctx + [1] * pad, dtype=torch.int32), dev), non_blocking=True)
        self.block_tables[:b, :width].copy_(staged(torch.tensor(rows, dtype=torch.int32), dev), non_blocking=True)
        self.replays[b] += 1
        self.padded_rows += pad
        if not self.use_graphs:
            return self._forward(b)
        self.graphs[b].replay()
        return self.outputs[b]


# Token counts of the steps with prefill chunks captured as graph pieces: vLLM's piecewise capture
# limit (512) with coarser steps than its 67 sizes (capture time and graphs: 33 pieces a size for 32
# layers); up to 512 tokens a step reads the weights once (~3.7 ms for the 8B shape on an H200), so
# a padded token costs little next to the host time a graph saves.
PIECEWISE_TOKENS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The token counts captured as graph pieces for steps of up to ``max_tokens`` tokens: those of
    ``PIECEWISE_TOKENS`` below it and ``min(max_tokens, 512)`` itself."""
    top = min(max_tokens, PIECEWISE_TOKENS[-1])
    return [t for t in PIECEWISE_TOKENS if t < top] + [top]


class PiecewiseGraphs:
    """The model forward of a step with prefill chunks (mixed or prefill-only) of up to ``sizes[-1]``
    tokens, replayed as CUDA graph pieces with each layer's attention launched eagerly between them.

    Each attention layer, handed ``AttentionMetadata.split``, calls ``split(layer, q, k, v)`` instead of
    its cache attention: the piece being captured copies q, k, v (T, H, D) into static buffers and
    ends; the next piece begins by reading the static attention output ``o`` (the layer's o_proj). A
    size of T tokens is thus L + 1 graphs for L layers. ``run`` copies the step's n input ids and
    positions into rows [0, n) of the static buffers, then replays piece 0, runs layer 0's
    ``attend_cache`` on rows [0, n) of q, k, v with the step's own metadata (from
    ``ModelRunner.prepare``: its sequences, context lengths, slots and block tables) into rows [0, n)
    of ``o``, replays piece 1, and so on. Rows [n, T) are padding: they hold the ids and positions of
    an earlier step (valid, so every row stays finite), nothing writes the KV cache for them, their
    attention output rows are stale, and nothing reads their hidden states.

    All sizes share one memory pool (they replay one at a time), not the decode graphs' pool: a step
    launched on a side stream behind a decode graph in flight (``EngineCore.step_with_arrivals``) may
    replay pieces while that graph runs. The tensors that cross pieces within a size are held by the
    capture until its last piece ends. The q, k, v and o buffers are outside the pool: (T, Hq + 2 Hkv
    + Hq, D), 10 MB for the 8B shape at 512 tokens; the copies into and out of them cost ~4 us a layer
    at 512 tokens.

    Models whose rotary frequencies read the metadata (``rope_scaling`` "dynamic") are not captured
    (the runner leaves such steps eager). ``capture=False`` (the CPU tests): ``run`` calls the forward
    on the same static buffers with the same split, attention run inside it, so the buffers, the
    padding and the split are tested without CUDA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: list[int],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"PiecewiseGraphs: CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches, self.sizes = model, kv_caches, sorted(sizes)
        self.device, self.use_graphs = device, capture
        t = self.sizes[-1]
        self._ids_pos = torch.zeros(2, t, dtype=torch.int64, device=device)
        self.input_ids, self.positions = self._ids_pos.unbind(0)
        kw = dict(dtype=dtype, device=device)
        self.q, self.o = torch.zeros(t, num_heads, head_dim, **kw), torch.zeros(t, num_heads, head_dim, **kw)
        self.k, self.v = torch.zeros(t, num_kv_heads, head_dim, **kw), torch.zeros(t, num_kv_heads, head_dim, **kw)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # size -> its L + 1 pieces
        self.layers: list[torch.nn.Module] = []  # the attention layers in call order (between the pieces)
        self.outputs: dict[int, torch.Tensor] = {}  # size -> (T, H) hidden states the last piece writes
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # steps run per size
        self.padded_rows = 0  # padding rows computed, over all steps
        self.pool_bytes = 0  # GPU memory the pieces added to the pool (measured after capture)
        self.capture_seconds = 0.0
        self._step: tuple[int, AttentionMetadata] | None = None  # the step being run: its tokens, metadata
        self._capturing: list[torch.cuda.CUDAGraph] | None = None  # the pieces of the size being captured
        self._pool = None

    def _split(self, layer: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``AttentionMetadata.split``: q (T, Hq, D), k, v (T, Hkv, D) -> the attention output rows o[:T]."""
        t = q.shape[0]
        self.q[:t].copy_(q)
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)
        if self._capturing is not None:  # this piece ends here; the next starts with the layer's o_proj
            self._capturing[-1].capture_end()
            if len(self.layers) < len(self._capturing):
                self.layers.append(layer)
            elif self.layers[len(self._capturing) - 1] is not layer:
                raise RuntimeError("PiecewiseGraphs: the model called its attention layers in another order")
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._pool)
            self._capturing.append(graph)
        elif self._step is not None:  # without graphs, attention runs here (the warm-up skips it)
            self._attend(layer)
        return self.o[:t]

    def _attend(self, layer: torch.nn.Module) -> None:
        n, meta = self._step
        self.o[:n].copy_(layer.attend_cache(self.q[:n], self.k[:n], self.v[:n], meta))

    def _forward(self, t: int) -> torch.Tensor:
        # The model reads kv_caches (not None: the cache branch) and split; attention itself gets the
        # step's metadata in _attend. cu_seqlens_q is unused (no dynamic rope here).
        meta = AttentionMetadata(
            cu_seqlens_q=self._ids_pos[0, :0].int(), max_seqlen_q=t, kv_caches=self.kv_caches, split=self._split
        )
        return self.model(self.input_ids[:t], self.positions[:t], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first, in one memory pool (a no-op without
        ``capture``). The warm-ups skip attention (nothing to compile there: it runs eagerly at each
        step) and write no KV cache."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # capture needs a stream other than the default
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for t in reversed(self.sizes):
                self._forward(t)  # warm-up: Triton JIT, cuBLAS heuristics, the ops' config caches
                stream.synchronize()
                first = torch.cuda.CUDAGraph()
                self._capturing = [first]
                first.capture_begin(pool=self._pool)
                try:
                    self.outputs[t] = self._forward(t)
                finally:
                    pieces, self._capturing = self._capturing, None
                    pieces[-1].capture_end()
                self.graphs[t] = pieces
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        self.capture_seconds = time.perf_counter() - start

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured size for a step of ``num_tokens`` tokens, or None (more than the largest)."""
        if num_tokens > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, t: int) -> torch.Tensor:
        """The step's forward at size ``t``: ``input_ids``, ``positions`` (n,) on the device and its
        metadata (``ModelRunner.prepare``). Returns hidden states (T, H); rows [0, n) are the step's,
        in order; the tensor is overwritten by the next run."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.replays[t] += 1
        self.padded_rows += t - n
        self._step = (n, meta)
        try:
            if not self.use_graphs:
                return self._forward(t)
            pieces = self.graphs[t]
            for piece, layer in zip(pieces, self.layers):
                piece.replay()
                self._attend(layer)
            pieces[-1].replay()
            return self.outputs[t]
        finally:
            self._step = None
