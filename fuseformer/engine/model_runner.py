"""ModelRunner: runs one scheduled step of the model over the paged KV cache and samples.

It owns the per-layer K/V caches, allocated once (``[num_blocks, block_size, Hkv, D]`` each).
``execute`` flattens the step's scheduled tokens into one varlen batch (input ids, positions,
``cu_seqlens_q``, context lengths, slot mapping, block tables), runs the model, computes logits only
for the rows that sample (each request's last scheduled token when it reaches the end of its
sequence), and samples on the device.

CUDA graphs (``cuda_graphs=True``, vLLM's default, its ``enforce_eager=False``), captured at engine
start (engine/cuda_graphs.py): a decode-only step (every scheduled request computes exactly one token)
replays a graph of the model forward for a padded batch size, instead of launching ~14 kernels per
layer from Python (``DecodeGraphs``); a step with prefill chunks of up to 512 tokens replays graph
pieces for a padded token count with each layer's attention launched between them
(``PiecewiseGraphs``). Larger steps run eagerly. Logits and sampling always run eagerly, on the
forward's output rows.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

from fuseformer.engine.cuda_graphs import (
    MAX_GRAPH_BATCH,
    DecodeGraphs,
    PiecewiseGraphs,
    graph_batch_sizes,
    piecewise_sizes,
)
from fuseformer.engine.outputs import PositionLogprobs
from fuseformer.engine.request import RequestStatus
from fuseformer.engine.sampler import (
    SamplingMetadata,
    position_logprobs,
    prompt_logprobs,
    sample,
    to_device,
)
from fuseformer.engine.scheduler import SchedulerOutput
from fuseformer.models.attention_metadata import AttentionMetadata
from fuseformer.models.config import ModelConfig

# CacheConfig.kv_cache_dtype -> the caches' dtype (None: the model's). vLLM's names; e5m2 is refused.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(kw_only=True, slots=True)
class CacheConfig:
    """How many KV blocks to allocate, and in which dtype.

    Args:
        block_size: tokens per block.
        num_kv_blocks: blocks to allocate (the null block 0 included); overrides the two below.
        gpu_memory_utilization: on CUDA, the fraction of the GPU's total memory this engine may use
            (weights, the activations of a full step, and the KV cache).
        cpu_kv_cache_gib: on the CPU, the KV cache size in GiB.
        kv_cache_dtype: "auto" (the model's dtype), or "fp8" / "fp8_e4m3" (vLLM's names): e4m3 K/V
            scaled by each attention's ``k_scale`` / ``v_scale`` (1.0 unless the checkpoint has them),
            1 byte an element: twice a bf16 cache's blocks in the same memory. CUDA: sm_89+ only.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            e5m2 = " (fp8_e5m2 is not supported)" if self.kv_cache_dtype == "fp8_e5m2" else ""
            raise ValueError(
                f"CacheConfig: kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3'{e5m2}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"CacheConfig: block_size must be a positive int, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"CacheConfig: num_kv_blocks must be an int >= 2 or None, got {self.num_kv_blocks!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"CacheConfig: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"CacheConfig: cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")


@dataclass(slots=True)
class ModelRunnerOutput:
    """``sampled_token_ids``: request id -> [token] for the requests that sampled this step;
    ``logprobs``: request id -> [{token id: Logprob}] for those that asked for logprobs."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[PositionLogprobs]] | None = None


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is enqueued (``ModelRunner.launch``): the requests that sample, their
    parameters, the sampler's device output (None when nothing samples), a CUDA event recorded after
    it (None off CUDA: the work is done already), and whether the forward replayed a decode graph
    (``graphed``) or graph pieces (``pieces``)."""

    requests: list
    params: list
    output: object | None
    done: torch.cuda.Event | None
    graphed: bool
    pieces: bool = False
    # On CUDA: the output's sampled ids, logprob ids, logprobs and sampled ranks (None where absent),
    # copied to pinned host memory before ``done``.
    host: tuple | None = None
    prompt: _PromptLogprobs | None = None  # the prompt logprobs it computes (before ``done``)
    # A step whose sampling is deferred (``SchedulerOutput.deferred_sampling``): its logits on the
    # device, waiting for ``ModelRunner.launch_sampling``; None once sampled (and for other steps).
    logits: torch.Tensor | None = None
    # (MaskFill, rows): its grammar rows' bitmask filling (``start_sampling``); ``launch_sampling`` waits.
    mask_fill: tuple | None = None
    # Its grammar rows' bitmask (None when no row has a grammar): ms the grammar library took to fill it,
    # and ms the host waited for it (all of the fill when not started ahead by ``start_sampling``).
    mask_ms: float | None = None
    mask_wait_ms: float | None = None
    positions: list[int] | None = None  # each sampling request's sampled token's position

    def ready(self) -> bool:
        """The device work has finished (always, off CUDA)."""
        return self.done is None or self.done.query()


def _grammars(sampling: list) -> tuple[list[int], list]:
    """The sampling rows whose request is running with a grammar, and those grammars."""
    rows = [i for i, r in enumerate(sampling) if r.grammar is not None and r.status is RequestStatus.RUNNING]
    return rows, [sampling[i].grammar for i in rows]


@dataclass(slots=True)
class _PromptLogprobs:
    """A step's prompt logprobs (``SamplingParams.prompt_logprobs``): ``entries`` (request, positions,
    top count) in row order; ``tensors`` ids, logprobs (R, 1 + max top count) and ranks (R,), in
    pinned host memory on CUDA."""

    entries: list[tuple]
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def append_to_requests(self) -> None:
        """Append each request's positions to its ``Request.prompt_logprobs`` (the step has finished)."""
        ids, lps, ranks = (t.tolist() for t in self.tensors)
        row = 0
        for req, count, k in self.entries:
            req.prompt_logprobs.extend(
                position_logprobs(ids[r][: 1 + k], lps[r][: 1 + k], ranks[r]) for r in range(row, row + count)
            )
            row += count


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor ``t`` in pinned host memory, enqueued on the current stream."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ModelRunner:
    """Executes scheduled steps of ``model`` (one the registry builds: ``fuseformer.models.registry``) over
    its own paged KV cache.

    Args:
        model: the model, in eval mode, on its device and in its dtype.
        config: the model's ModelConfig.
        cache_config: KV cache sizing.
        max_num_batched_tokens, max_num_seqs: the scheduler's limits (size the memory profile of a step).
        max_model_len: prompt + output tokens of one request at most (the width of the graphs' block table).
        cuda_graphs: capture decode-only steps as CUDA graphs, and steps with prefill chunks of up to 512
            tokens as graph pieces, at start (engine/cuda_graphs.py), after the KV cache is allocated (the
            cache is a graph input); the cache sizing leaves room for the graphs' memory pool. Needs a
            CUDA device: True elsewhere raises ValueError (the graphs are what was asked for; silently
            running eager would hide it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        cache_config: CacheConfig,
        *,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        cuda_graphs: bool = False,
    ) -> None:
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"ModelRunner: cuda_graphs must be a bool, got {cuda_graphs!r}")
        self.model = model
        self.config = config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(
                f"ModelRunner: cuda_graphs=True needs a CUDA device, the model is on {self.device}; "
                "pass cuda_graphs=False (eager steps)"
            )
        self.cuda_graphs = cuda_graphs
        # A decode step of n requests computes n tokens: both scheduler limits bound the graph sizes.
        # Decode steps of up to 512 requests replay graphs (vLLM's capture limit); larger ones run eagerly.
        graphed = min(max_num_seqs, max_num_batched_tokens, MAX_GRAPH_BATCH)
        self.graph_sizes = graph_batch_sizes(graphed) if cuda_graphs else []
        # Steps with prefill chunks, as graph pieces up to 512 tokens (where the model allows it).
        pieces = cuda_graphs and self._pieces_unsupported() is None
        self.piecewise_sizes = piecewise_sizes(max_num_batched_tokens) if pieces else []
        self.kv_cache_dtype = KV_CACHE_DTYPES[cache_config.kv_cache_dtype] or self.dtype  # e4m3: 2x the blocks
        if self.kv_cache_dtype.itemsize == 1 and self.device.type == "cuda":
            if torch.cuda.get_device_capability(self.device) < (8, 9):  # Triton has no e4m3 before sm_89
                raise ValueError(f"ModelRunner: kv_cache_dtype {cache_config.kv_cache_dtype!r} needs sm_89+")
        self.num_blocks = cache_config.num_kv_blocks or self._blocks_from_memory()
        shape = config.kv_cache_shape(self.num_blocks, self.block_size)
        kw = dict(dtype=self.kv_cache_dtype, device=self.device)
        self.kv_caches = [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in range(config.num_hidden_layers)]
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.num_steps = 0  # non-empty steps run (graph replays: decode_graphs.replays, piecewise_graphs.replays)
        if cuda_graphs:
            g = self.decode_graphs = self.make_decode_graphs(self.graph_sizes, capture=True)
            g.capture()
            pieces = ""
            if self.piecewise_sizes:
                # A pool of their own: a prefill launched on a side stream behind a decode graph in flight
                # (EngineCore.step_with_arrivals) replays pieces while that graph runs.
                p = self.piecewise_graphs = self.make_piecewise_graphs(self.piecewise_sizes, capture=True)
                try:
                    p.capture()
                    why = self.check_pieces()
                except Exception as exc:
                    why = f"{type(exc).__name__}: {exc}"
                if why is not None:  # said, not hidden: those steps then run eagerly, as before the pieces
                    self.piecewise_graphs = None
                    print(f"fuseformer: the graph pieces are not used ({why}); steps with prefill chunks run "
                          "eagerly", file=sys.stderr, flush=True)  # fmt: skip
                else:
                    pieces = (
                        f" and {sum(map(len, p.graphs.values()))} graph pieces (steps with prefill chunks of "
                        f"{p.sizes[0]}-{p.sizes[-1]} tokens) in {p.capture_seconds:.1f} s, "
                        f"{p.pool_bytes / 2**30:.2f} GiB"
                    )
            print(
                f"fuseformer: captured {len(g.graphs)} CUDA graphs (decode steps of {g.sizes[0]}-{g.sizes[-1]} "
                f"requests) in {g.capture_seconds:.1f} s, {g.pool_bytes / 2**30:.2f} GiB{pieces}; "
                "enforce_eager=True runs without them",
                file=sys.stderr,
                flush=True,
            )

    def make_decode_graphs(self, sizes: list[int], *, capture: bool) -> DecodeGraphs:
        """Static buffers (and, with ``capture``, CUDA graphs) over this runner's model and cache for
        decode steps of ``sizes``; block tables ceil(max_model_len / block_size) wide (at most the
        blocks there are). ``capture=False`` runs the padded static-buffer path without graphs (tests
        on the CPU set it as ``decode_graphs``)."""
        max_blocks = min(math.ceil(self.max_model_len / self.block_size), self.num_blocks - 1)
        return DecodeGraphs(
            self.model,
            self.kv_caches,
            sizes,
            max_blocks_per_seq=max_blocks,
            block_size=self.block_size,
            device=self.device,
            capture=capture,
        )

    def make_piecewise_graphs(self, sizes: list[int], *, capture: bool) -> PiecewiseGraphs:
        """Static buffers (and, with ``capture``, graph pieces) over this runner's model and cache for
        steps with prefill chunks of up to ``sizes[-1]`` tokens; ``capture=False`` runs the same buffers
        and split without graphs (tests on the CPU set it as ``piecewise_graphs``)."""
        why = self._pieces_unsupported()
        if why is not None:
            raise ValueError(f"ModelRunner: no graph pieces for this model: {why}")
        c = self.config
        return PiecewiseGraphs(
            self.model,
            self.kv_caches,
            sizes,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            dtype=self.dtype,
            device=self.device,
            capture=capture,
        )

    @torch.inference_mode()
    def check_pieces(self) -> str | None:
        """Run the smallest and the largest size of ``piecewise_graphs`` as the prefill of one sequence
        (random tokens, written into the cache's first blocks, which no request holds yet; the cache is
        zeroed again afterwards) and the same prefill eagerly: None when the hidden states agree (within
        1% of their largest magnitude: split-K sums may add in another order), else what differs. At
        start, after capture: a captured piece that read or wrote the wrong memory shows here, not in a
        user's tokens."""
        pieces, bs = self.piecewise_graphs, self.block_size
        gen = torch.Generator().manual_seed(0)
        try:
            return self._check_pieces(pieces, bs, gen)
        finally:
            for k, v in self.kv_caches:
                k.zero_()
                v.zero_()

    def _check_pieces(self, pieces: PiecewiseGraphs, bs: int, gen: torch.Generator) -> str | None:
        for t in sorted({pieces.sizes[0], pieces.sizes[-1]}):
            blocks = math.ceil(t / bs)
            if blocks >= self.num_blocks:  # block 0 is the null block
                continue
            positions = torch.arange(t)
            table = torch.arange(1, blocks + 1)
            meta = AttentionMetadata(
                cu_seqlens_q=to_device(torch.tensor([0, t], dtype=torch.int32), self.device),
                max_seqlen_q=t,
                kv_caches=self.kv_caches,
                context_lens=to_device(torch.tensor([t], dtype=torch.int32), self.device),
                slot_mapping=to_device(table[positions // bs] * bs + positions % bs, self.device),
                block_tables=to_device(table[None].to(torch.int32), self.device),
            )
            ids = to_device(torch.randint(0, self.config.vocab_size, (t,), generator=gen), self.device)
            positions = to_device(positions, self.device)
            eager = self.model(ids, positions, meta).float()
            replayed = pieces.run(ids, positions, meta, t)[:t].float()
            pieces.replays[t] -= 1  # not a step
            err = float((replayed - eager).abs().max() / eager.abs().max().clamp_min(1e-30))
            if not err <= 1e-2:
                return f"a {t}-token prefill through the pieces is {err:.3g} off the eager forward (relative, max)"
        return None

    def _pieces_unsupported(self) -> str | None:
        """Why this model's steps cannot replay graph pieces, or None."""
        rs = self.config.rope_scaling
        if rs is not None and rs.get("rope_type") == "dynamic":
            return "its rotary frequencies (rope_scaling 'dynamic') read the step's metadata in the first piece"
        return None

    # ---- KV cache sizing -------------------------------------------------------------------

    def _blocks_from_memory(self) -> int:
        block_bytes = self.config.kv_cache_block_bytes(self.block_size, self.kv_cache_dtype)
        if self.device.type != "cuda":
            return max(2, int(self.cache_config.cpu_kv_cache_gib * 2**30) // block_bytes)
        activation_peak = self._profile_step()
        graph_bytes = self._graph_pool_estimate() if self.cuda_graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        # What others (and this process: weights, the profile's cached blocks) already use is taken
        # from the share we may have; the profile's peak is kept free for the steps to come, and the
        # graphs' pool (captured after the cache is allocated: the cache is a graph input) is set aside.
        budget = total * self.cache_config.gpu_memory_utilization - (total - free) - activation_peak - graph_bytes
        num_blocks = int(budget // block_bytes)
        if num_blocks < 2:
            raise ValueError(
                f"ModelRunner: no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f}, gpu_memory_utilization {self.cache_config.gpu_memory_utilization}, "
                f"a step's activations take {activation_peak / 2**30:.2f} GiB, the CUDA graphs "
                f"{graph_bytes / 2**30:.2f} GiB); raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks

    @torch.inference_mode()
    def _graph_pool_estimate(self) -> int:
        """Bytes the CUDA graphs will take: the activation peak of a forward of the largest graph size
        (decode batch or piecewise token count; measured here, as that many 1-token sequences without
        the cache: the activation shapes of a decode, and of the pieces, attention aside), once per pool
        (decode graphs, pieces) with 128 MiB for its capture stream's cuBLAS and cuBLASLt workspaces
        (allocated in the pool during capture, up to 32 MiB each on Hopper) and the allocator's rounding
        (20 MiB segments for 1-10 MB tensors), plus each graph's output rows (kept) and the pieces'
        static q, k, v, o buffers.
        For the 8B shape at 256 rows: ~30 MB + 35 MB + 128 MiB, 0.1% of an H200; the pool actually
        taken is ``decode_graphs.pool_bytes`` + ``piecewise_graphs.pool_bytes``."""
        b = max(self.graph_sizes[-1], *self.piecewise_sizes)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(b, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, ids, AttentionMetadata.varlen([1] * b, device=self.device))
        del hidden, ids
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        c = self.config
        outputs = (sum(self.graph_sizes) + sum(self.piecewise_sizes)) * c.hidden_size * self.dtype.itemsize
        qkvo = max(self.piecewise_sizes, default=0) * 2 * (c.num_attention_heads + c.num_key_value_heads) * c.head_dim
        pools = 2 if self.piecewise_sizes else 1
        return pools * (peak + 128 * 2**20) + outputs + qkvo * self.dtype.itemsize

    @torch.inference_mode()
    def _profile_step(self) -> int:
        """Peak bytes a full step takes beyond what is allocated now: a forward of
        ``max_num_batched_tokens`` tokens (no cache) and the logits and sampling of ``max_num_seqs`` rows."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        t = self.max_num_batched_tokens
        lens = [min(self.max_model_len, t - i) for i in range(0, t, self.max_model_len)]
        ids = torch.zeros(t, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, AttentionMetadata.varlen(lens, device=self.device))
        rows = torch.arange(min(self.max_num_seqs, t), device=self.device)
        logits = self.model.compute_logits(hidden, rows)
        # The sampler's (N, V) fp32 work tensors: a sort, softmaxes, the exponential draws.
        work = torch.empty((4, *logits.shape), dtype=torch.float32, device=self.device)
        del hidden, logits, work
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return peak

    # ---- one step --------------------------------------------------------------------------

    def prepare(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step as device tensors: input_ids (T,), positions (T,), attention metadata, and the
        rows (indices into T) whose logits sample, in scheduled order. The copies never wait for a
        step still on the device (``to_device``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        tables: list[tuple[int, ...]] = []
        for s in scheduler_output.scheduled:
            n, start = len(s.token_ids), s.start_position
            input_ids += s.token_ids
            positions += range(start, start + n)
            cu.append(cu[-1] + n)
            context_lens.append(start + n)
            tables.append(s.block_ids)
            if s.sample:
                sample_rows.append(cu[-1] - 1)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + (0,) * (width - len(t)) for t in tables], dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
        # Slot of each new token: its block (from its sequence's table) * block_size + offset.
        slots = block_tables[seq_of_token, pos // bs] * bs + pos % bs

        def dev(x: torch.Tensor) -> torch.Tensor:
            return to_device(x, self.device)

        meta = AttentionMetadata(
            cu_seqlens_q=dev(torch.tensor(cu, dtype=torch.int32)),
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
            kv_caches=self.kv_caches,
            context_lens=dev(torch.tensor(context_lens, dtype=torch.int32)),
            slot_mapping=dev(slots),
            block_tables=dev(block_tables.to(torch.int32)),
        )
        return dev(torch.tensor(input_ids, dtype=torch.int64)), dev(pos), meta, sample_rows

    def forward(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """The model forward of a non-empty step: hidden states (T', H) and the rows whose logits
        sample. A decode-only step that fits a captured size replays its graph (T' = the padded size,
        rows [0, n) the step's); any other step runs eagerly (T' = the step's token count)."""
        hidden, sample_rows, _ = self._forward(scheduler_output, None)
        return hidden, sample_rows

    @torch.inference_mode()
    def _forward(
        self, scheduler_output: SchedulerOutput, prev_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int], str]:
        """``forward``, and how it ran: "graph" (a decode graph replayed), "pieces" (graph pieces replayed)
        or "eager". ``prev_tokens``: the previous step's sampled tokens on the device, for a step
        scheduled ahead (its input ids are rows of them)."""
        self.num_steps += 1
        graphs = self.decode_graphs
        scheduled = scheduler_output.scheduled
        input_ids = None
        if scheduler_output.ahead_rows is not None:
            if prev_tokens is None:
                raise ValueError("ModelRunner: a step scheduled ahead needs the previous step's sampled tokens")
            rows = scheduler_output.ahead_rows
            if rows == list(range(len(rows))):
                input_ids = prev_tokens[: len(rows)]
            else:
                input_ids = prev_tokens.index_select(0, to_device(torch.tensor(rows), self.device))
        b = graphs.padded_size(scheduled) if graphs is not None else None
        if b is not None:
            hidden = graphs.run(scheduled, b, input_ids)
            return hidden, [i for i, s in enumerate(scheduled) if s.sample], "graph" if graphs.use_graphs else "eager"
        ids, positions, meta, sample_rows = self.prepare(scheduler_output)
        ids = ids if input_ids is None else input_ids
        pieces = self.piecewise_graphs
        t = pieces.padded_size(ids.shape[0]) if pieces is not None else None
        if t is not None:
            return pieces.run(ids, positions, meta, t), sample_rows, "pieces" if pieces.use_graphs else "eager"
        return self.model(ids, positions, meta), sample_rows, "eager"

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; sample a token for each request whose ``sample`` is set."""
        return self.collect(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, prev_tokens: torch.Tensor | None = None) -> LaunchedStep:
        """Enqueue the step's forward and sampling on the device and return without waiting for them
        (``collect`` waits and reads the sampled tokens; no copy in between waits for the device).
        Between the two, the host is free: the engine can launch a new request's prefill behind a
        decode step in flight (``AsyncEngine``), or the next decode step, scheduled ahead, whose input
        tokens are rows of ``prev_tokens`` (the step in flight's ``LaunchedStep.output.sampled_token_ids``).
        A step with ``deferred_sampling`` enqueues its forward and logits only: ``launch_sampling``
        enqueues its sampler once the requests' outputs hold the previous step's tokens."""
        if scheduler_output.is_empty:
            return LaunchedStep([], [], None, None, False)
        hidden, sample_rows, how = self._forward(scheduler_output, prev_tokens)
        graphed, pieces = how == "graph", how == "pieces"
        prompt = self._prompt_logprobs(scheduler_output, hidden)
        sampling = [s.request for s in scheduler_output.scheduled if s.sample]
        # Each sampled token's position: the key of a seeded request's draw (sampler.py).
        positions = [s.start_position + len(s.token_ids) for s in scheduler_output.scheduled if s.sample]
        if not sampling:
            done = None
            if prompt is not None and self.device.type == "cuda":
                done = torch.cuda.Event(enable_timing=True)
                done.record()
            return LaunchedStep([], [], None, done, graphed, pieces, prompt=prompt)
        if graphed and sample_rows == list(range(len(sample_rows))):
            logits = self.model.compute_logits(hidden[: len(sample_rows)])  # a decode graph's first rows
        else:
            logits = self.model.compute_logits(hidden, to_device(torch.tensor(sample_rows), self.device))
        params = [r.sampling_params for r in sampling]
        step = LaunchedStep(
            sampling, params, None, None, graphed, pieces, prompt=prompt, logits=logits, positions=positions
        )
        if not scheduler_output.deferred_sampling:
            self.launch_sampling(step)
        return step

    def start_sampling(self, step: LaunchedStep) -> None:
        """Start filling a deferred step's grammar bitmask on the compiler's thread (GIL released), beside the
        caller's work (the outputs hold the previous tokens; the grammars untouched until launch_sampling)."""
        rows, matchers = _grammars(step.requests) if step.logits is not None and step.mask_fill is None else ([], [])
        if rows:
            step.mask_fill = (matchers[0].compiler.fill_bitmask_async(matchers), rows)

    @torch.inference_mode()
    def launch_sampling(self, step: LaunchedStep) -> None:
        """Enqueue the sampler of a launched step whose sampling was deferred (``LaunchedStep.logits``),
        reading the requests' outputs as they are now; ``launch`` calls it at once for other steps. A
        request no longer running (it finished in the previous step: its row is ignored) is sampled
        without its grammar."""
        logits, step.logits = step.logits, None
        if logits is None:
            raise RuntimeError("launch_sampling: the step has no logits waiting (sampled already?)")
        sampling, params = step.requests, step.params
        md = SamplingMetadata.build(
            params,
            vocab_size=logits.shape[-1],
            device=self.device,
            prompt_token_ids=[r.prompt_token_ids for r in sampling],
            output_token_ids=[r.output_token_ids for r in sampling],
            positions=step.positions,
            eos_token_ids=[r.eos_token_ids for r in sampling],
            bad_words_token_ids=[r.bad_words_token_ids for r in sampling],
        )
        md.bitmask, md.bitmask_rows = self._grammar_bitmask(sampling, step)
        step.mask_fill = None
        step.output = out = sample(logits, md)
        if self.device.type == "cuda":
            # The results come to pinned host memory in the stream, before the event: reading them
            # later waits for this step only (a .tolist() of a device tensor would wait for the whole
            # stream, a step launched ahead included).
            step.host = tuple(
                None if t is None else _to_host(t)
                for t in (out.sampled_token_ids, out.logprob_token_ids, out.logprobs, out.sampled_ranks)
            )
            step.done = torch.cuda.Event(enable_timing=True)  # EngineCore.step_log times the step with it
            step.done.record()

    @staticmethod
    def collect(step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step and read its sampled tokens (and logprobs)."""
        if step.logits is not None:
            raise RuntimeError("collect: the step's sampling is deferred and not launched yet (launch_sampling)")
        out = step.output
        if step.done is not None:
            step.done.synchronize()  # the wait, with the GIL released
        if step.prompt is not None:
            step.prompt.append_to_requests()
        if out is None:
            return ModelRunnerOutput({})
        sampled_ids, lp_ids, lps, ranks = step.host or (
            out.sampled_token_ids,
            out.logprob_token_ids,
            out.logprobs,
            out.sampled_ranks,
        )
        sampling, params = step.requests, step.params
        ids = sampled_ids.tolist()
        sampled = {r.request_id: [t] for r, t in zip(sampling, ids)}
        if lps is None:
            return ModelRunnerOutput(sampled)
        lp_ids, lps, ranks = lp_ids.tolist(), lps.tolist(), ranks.tolist()
        logprobs = {}
        for i, (r, p) in enumerate(zip(sampling, params)):
            if p.logprobs is not None:
                k = 1 + p.logprobs
                logprobs[r.request_id] = [position_logprobs(lp_ids[i][:k], lps[i][:k], ranks[i])]
        return ModelRunnerOutput(sampled, logprobs)

    def _prompt_logprobs(self, scheduler_output: SchedulerOutput, hidden: torch.Tensor) -> _PromptLogprobs | None:
        """The prompt logprobs of this step, enqueued (``SamplingParams.prompt_logprobs``): for each
        request that asks, the prompt tokens that the positions it computes predict, except those
        already in ``Request.prompt_logprobs`` (recomputed after a preemption). ``hidden``: the
        forward's rows (eager or graphed: one row per scheduled token, in order). The LM head takes
        ``max_num_seqs`` rows at a time, the (rows, V) logits a step's sampling was profiled for."""
        scheduled = scheduler_output.scheduled
        if all(s.request.prompt_logprobs is None for s in scheduled):  # 6 us at 256 requests
            return None
        rows: list[int] = []
        targets: list[int] = []
        entries = []
        offset = 0
        for s in scheduled:
            req, start = s.request, s.start_position
            if req.prompt_logprobs is not None:
                first = max(start, len(req.prompt_logprobs))
                end = min(start + len(s.token_ids), req.num_prompt_tokens - 1)  # the last predicts the output
                if end > first:
                    rows += range(offset + first - start, offset + end - start)
                    targets += req.prompt_token_ids[first + 1 : end + 1]
                    entries.append((req, end - first, req.sampling_params.prompt_logprobs))
            offset += len(s.token_ids)
        if not rows:
            return None
        k = max(e[2] for e in entries)
        rows_t = to_device(torch.tensor(rows), self.device)
        targets_t = to_device(torch.tensor(targets), self.device)
        chunk = self.max_num_seqs
        parts = [
            prompt_logprobs(self.model.compute_logits(hidden, rows_t[i : i + chunk]), targets_t[i : i + chunk], k)
            for i in range(0, len(rows), chunk)
        ]
        tensors = tuple(torch.cat(t) for t in zip(*parts))
        if self.device.type == "cuda":
            tensors = tuple(_to_host(t) for t in tensors)
        return _PromptLogprobs(entries, tensors)

    def _grammar_bitmask(self, sampling: list, step: LaunchedStep) -> tuple[torch.Tensor | None, ...]:
        """The bitmask of the sampling rows with a grammar ((R, W) int32) and their rows ((R,) int64, None
        when every row has one), on the device; (None, None) when none has. Uses ``step.mask_fill`` when
        ``start_sampling`` started it (a row finished since keeps its mask; its token is dropped), and
        records the fill's time and the wait for it in ``step``. Free rows are not touched."""
        start = time.perf_counter()
        if step.mask_fill is not None:
            fill, rows = step.mask_fill
            bitmask = fill.result()
            fill_ms = 1e3 * fill.seconds
        else:
            rows, matchers = _grammars(sampling)
            if not rows:
                return None, None
            bitmask = matchers[0].compiler.fill_bitmask(matchers)
            fill_ms = None  # filled here: all of it waited for
        step.mask_wait_ms = 1e3 * (time.perf_counter() - start)
        step.mask_ms = step.mask_wait_ms if fill_ms is None else fill_ms
        bitmask = to_device(bitmask, self.device)
        if len(rows) == len(sampling):
            return bitmask, None
        return bitmask, to_device(torch.tensor(rows, dtype=torch.int64), self.device)
