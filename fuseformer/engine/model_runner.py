"""ModelRunner: runs one scheduled step of the model over the paged KV cache and samples.

It owns the per-layer K/V caches, allocated once (``[num_blocks, block_size, Hkv, D]`` each), and
the seeded requests' ``torch.Generator``s. ``execute`` flattens the step's scheduled tokens into one
varlen batch (input ids, positions, ``cu_seqlens_q``, context lengths, slot mapping, block tables),
runs the model, computes logits only for the rows that sample (each request's last scheduled token
when it reaches the end of its sequence), and samples on the device. Plain eager execution: CUDA
graphs and overlapped host work are a later issue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuseformer.engine.sampler import SamplingMetadata, make_generator, sample
from fuseformer.engine.scheduler import SchedulerOutput
from fuseformer.models.config import ModelConfig
from fuseformer.models.llama import AttentionMetadata


@dataclass(kw_only=True, slots=True)
class CacheConfig:
    """How many KV blocks to allocate.

    Args:
        block_size: tokens per block.
        num_kv_blocks: blocks to allocate (the null block 0 included); overrides the two below.
        gpu_memory_utilization: on CUDA, the fraction of the GPU's total memory this engine may use
            (weights, the activations of a full step, and the KV cache).
        cpu_kv_cache_gib: on the CPU, the KV cache size in GiB.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0

    def __post_init__(self) -> None:
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
    ``logprobs``: request id -> [{token id: logprob}] for those that asked for logprobs."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]] | None = None


class ModelRunner:
    """Executes scheduled steps of ``model`` (a ``LlamaForCausalLM``) over its own paged KV cache.

    Args:
        model: the model, in eval mode, on its device and in its dtype.
        config: the model's ModelConfig.
        cache_config: KV cache sizing.
        max_num_batched_tokens, max_num_seqs: the scheduler's limits (size the memory profile of a step).
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
    ) -> None:
        self.model = model
        self.config = config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_blocks = cache_config.num_kv_blocks or self._blocks_from_memory()
        shape = config.kv_cache_shape(self.num_blocks, self.block_size)
        kw = dict(dtype=self.dtype, device=self.device)
        self.kv_caches = [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in range(config.num_hidden_layers)]
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' RNGs, by request id

    # ---- KV cache sizing -------------------------------------------------------------------

    def _blocks_from_memory(self) -> int:
        block_bytes = self.config.kv_cache_block_bytes(self.block_size, self.dtype)
        if self.device.type != "cuda":
            return max(2, int(self.cache_config.cpu_kv_cache_gib * 2**30) // block_bytes)
        activation_peak = self._profile_step()
        free, total = torch.cuda.mem_get_info(self.device)
        # What others (and this process: weights, the profile's cached blocks) already use is taken
        # from the share we may have; the profile's peak is kept free for the steps to come.
        budget = total * self.cache_config.gpu_memory_utilization - (total - free) - activation_peak
        num_blocks = int(budget // block_bytes)
        if num_blocks < 2:
            raise ValueError(
                f"ModelRunner: no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f}, gpu_memory_utilization {self.cache_config.gpu_memory_utilization}, "
                f"a step's activations take "
                f"{activation_peak / 2**30:.2f} GiB); raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks

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
        rows (indices into T) whose logits sample, in scheduled order."""
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
            return x.to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            cu_seqlens_q=dev(torch.tensor(cu, dtype=torch.int32)),
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
            kv_caches=self.kv_caches,
            context_lens=dev(torch.tensor(context_lens, dtype=torch.int32)),
            slot_mapping=dev(slots),
            block_tables=dev(block_tables.to(torch.int32)),
        )
        return dev(torch.tensor(input_ids, dtype=torch.int64)), dev(pos), meta, sample_rows

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; sample a token for each request whose ``sample`` is set."""
        for rid in scheduler_output.finished_request_ids:
            self.generators.pop(rid, None)
        if scheduler_output.is_empty:
            return ModelRunnerOutput({})
        input_ids, positions, meta, sample_rows = self.prepare(scheduler_output)
        hidden = self.model(input_ids, positions, meta)
        sampling = [s.request for s in scheduler_output.scheduled if s.sample]
        if not sampling:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden, torch.tensor(sample_rows, device=self.device))
        params = [r.sampling_params for r in sampling]
        generators = [
            self._generator(r.request_id, p.seed) if p.seed is not None else None for r, p in zip(sampling, params)
        ]
        md = SamplingMetadata.build(
            params,
            vocab_size=logits.shape[-1],
            device=self.device,
            prompt_token_ids=[r.prompt_token_ids for r in sampling],
            output_token_ids=[r.output_token_ids for r in sampling],
            generators=generators,
        )
        out = sample(logits, md)
        ids = out.sampled_token_ids.tolist()
        sampled = {r.request_id: [t] for r, t in zip(sampling, ids)}
        if out.logprobs is None:
            return ModelRunnerOutput(sampled)
        lp_ids, lps = out.logprob_token_ids.tolist(), out.logprobs.tolist()
        logprobs = {}
        for i, (r, p) in enumerate(zip(sampling, params)):
            if p.logprobs is not None:
                k = 1 + p.logprobs
                logprobs[r.request_id] = [dict(zip(lp_ids[i][:k], lps[i][:k]))]
        return ModelRunnerOutput(sampled, logprobs)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = make_generator(seed, self.device)
        return gen
