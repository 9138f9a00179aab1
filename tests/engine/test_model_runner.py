"""ModelRunner: the flattened step it builds (ids, positions, cu_seqlens, context lengths, slot mapping,
padded block tables), KV cache sizing, and a scheduler-driven run (chunked prefill next to decodes over
a NaN-filled cache) whose sampled tokens are the argmax of a cache-free forward's logits."""

import contextlib

import pytest
import torch

import fuseformer
from fuseformer.engine.model_runner import CacheConfig, ModelRunner
from fuseformer.engine.request import Request
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig
from fuseformer.models.attention_metadata import AttentionMetadata
from fuseformer.testing import tiny_llama

_model = tiny_llama


def _runner_and_scheduler(model, config, num_blocks=32, block_size=4, budget=6):
    runner = ModelRunner(model, config, CacheConfig(block_size=block_size, num_kv_blocks=num_blocks))
    sched = Scheduler(
        SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget, max_model_len=64)
    )
    return runner, sched


def test_prepare_flattens_the_step():
    model, config = _model()
    runner, sched = _runner_and_scheduler(model, config, budget=9)
    sched.add_request(Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0)))
    sched.add_request(Request("b", [7, 8, 9, 10, 11], SamplingParams(temperature=0)))
    out = sched.schedule()  # a: all 6 prompt tokens; b: the first 3 of 5 (budget 9)
    ids, positions, meta, rows = runner.prepare(out)
    a, b = out.scheduled
    assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert meta.cu_seqlens_q.tolist() == [0, 6, 9] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.max_seqlen_q == 6
    assert meta.context_lens.tolist() == [6, 3]
    assert meta.block_tables.tolist() == [list(a.block_ids), [b.block_ids[0], 0]]
    assert meta.block_tables.dtype == torch.int32
    slots = [a.block_ids[p // 4] * 4 + p % 4 for p in range(6)] + [b.block_ids[0] * 4 + p for p in range(3)]
    assert meta.slot_mapping.tolist() == slots and meta.slot_mapping.dtype == torch.int64
    assert rows == [5]  # only a reaches its last token
    assert meta.kv_caches is runner.kv_caches

    sched.update_from_output(out, {"a": [12]})
    out = sched.schedule()  # a decodes its sampled token; b finishes its prompt
    ids, positions, meta, rows = runner.prepare(out)
    assert ids.tolist() == [12, 10, 11] and positions.tolist() == [6, 3, 4]
    assert meta.context_lens.tolist() == [7, 5] and rows == [0, 2]
    assert meta.slot_mapping.tolist() == [a.block_ids[1] * 4 + 2, out.scheduled[1].block_ids[0] * 4 + 3] + [
        out.scheduled[1].block_ids[1] * 4
    ]


def test_kv_cache_sizing():
    model, config = _model()
    block_bytes = config.kv_cache_block_bytes(16, torch.float32)
    runner = ModelRunner(model, config, CacheConfig(block_size=16, cpu_kv_cache_gib=0.01))
    assert runner.num_blocks == int(0.01 * 2**30) // block_bytes
    assert len(runner.kv_caches) == config.num_hidden_layers
    for k, v in runner.kv_caches:
        assert k.shape == v.shape == (runner.num_blocks, 16, 2, 12) and k.dtype == torch.float32
    assert ModelRunner(model, config, CacheConfig(num_kv_blocks=5, cpu_kv_cache_gib=0.01)).num_blocks == 5
    for bad in (dict(num_kv_blocks=1), dict(block_size=0), dict(gpu_memory_utilization=0), dict(cpu_kv_cache_gib=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CacheConfig(**bad)


def _reference_next_tokens(model, seqs):
    """Greedy next token of each full sequence from a cache-free varlen forward."""
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionMetadata.varlen([len(s) for s in seqs]))
        last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
        return model.compute_logits(hidden, last).argmax(-1).tolist()


@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: the interpreted kernels where they apply
def test_execute_samples_the_cache_free_argmax(backend):
    """Chunked prefills (budget 6) next to decodes over a NaN-filled cache: a slot read before it is
    written poisons the logits; every sampled token is the argmax of a forward without a cache."""
    model, config = _model()
    runner, sched = _runner_and_scheduler(model, config)
    for k, v in runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2], "b": [6, 5], "c": [3, 5, 8, 9, 7, 9, 3, 2, 3]}
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    done, steps_with_chunks = {}, 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        with fuseformer.use_backend(backend) if backend != "auto" else contextlib.nullcontext():
            result = runner.execute(out)
        sampled_reqs = [s.request for s in out.scheduled if s.sample]
        assert sorted(result.sampled_token_ids) == sorted(r.request_id for r in sampled_reqs)
        if sampled_reqs:
            with fuseformer.use_backend("reference"):
                expected = _reference_next_tokens(model, [r.all_token_ids for r in sampled_reqs])
            assert [result.sampled_token_ids[r.request_id][0] for r in sampled_reqs] == expected
        steps_with_chunks += any(not s.sample for s in out.scheduled) and any(s.sample for s in out.scheduled)
        for u in sched.update_from_output(out, result.sampled_token_ids):
            if u.finished:
                done[u.request_id] = u
    assert sorted(done) == ["a", "b", "c"]
    assert steps_with_chunks > 0  # some step mixed a prefill chunk with sampling requests
    assert sched.kv.pool.num_free_blocks == 31


def test_a_seeded_requests_tokens_depend_on_its_seed_not_its_batch():
    """The runner keys a seeded row's draw by its seed and its sampled token's position: the same tokens
    alone and beside another request (other rows, another step order), other tokens for another seed."""
    model, config = _model()

    def tokens(requests):
        runner, sched = _runner_and_scheduler(model, config, budget=64)
        for r in requests:
            sched.add_request(r)
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sched.update_from_output(out, runner.execute(out).sampled_token_ids)
        return requests[-1].output_token_ids

    def seeded(seed):
        return Request("s", [1, 2, 3], SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True))

    crowd = Request("u", [4, 5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True))
    alone = tokens([seeded(3)])
    assert tokens([crowd, seeded(3)]) == alone
    assert tokens([seeded(4)]) != alone


def test_logprobs_per_request():
    model, config = _model()
    runner, sched = _runner_and_scheduler(model, config, budget=64)
    sched.add_request(Request("two", [1, 2, 3], SamplingParams(temperature=0, logprobs=2)))
    sched.add_request(Request("none", [1, 2, 3], SamplingParams(temperature=0)))
    sched.add_request(Request("zero", [4, 2], SamplingParams(temperature=0, logprobs=0)))
    result = runner.execute(sched.schedule())
    assert set(result.logprobs) == {"two", "zero"}
    (lp,) = result.logprobs["two"]
    token = result.sampled_token_ids["two"][0]
    assert list(lp)[0] == token and len(lp) == 2  # greedy: the sampled token is also the top one
    with torch.no_grad():
        hidden = model(torch.tensor([1, 2, 3]), torch.arange(3), AttentionMetadata.varlen([3]))
        ref = model.compute_logits(hidden[-1:]).double().log_softmax(-1)[0]
    top2 = ref.topk(2).indices.tolist()
    assert list(lp) == top2
    for rank, (t, v) in enumerate(lp.items(), 1):
        assert abs(v.logprob - ref[t].item()) < 1e-4 and v.rank == rank
    assert list(result.logprobs["zero"][0]) == result.sampled_token_ids["zero"]


def test_empty_step():
    model, config = _model()
    runner, sched = _runner_and_scheduler(model, config)
    result = runner.execute(sched.schedule())
    assert result.sampled_token_ids == {} and result.logprobs is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_cache_sized_from_free_gpu_memory(dtype):
    """On CUDA the pool takes what gpu_memory_utilization leaves after weights and a full step's
    activations; a step at the full token budget then runs without running out of memory."""
    model, config = _model(
        "cuda", dtype, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, vocab_size=32000
    )
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    util = (total - free) / total + 0.2  # 20% of the GPU beyond what is in use now
    runner = ModelRunner(
        model, config, CacheConfig(block_size=16, gpu_memory_utilization=util), max_num_batched_tokens=8192
    )
    block_bytes = config.kv_cache_block_bytes(16, dtype)
    assert runner.num_blocks * block_bytes <= 0.2 * total
    assert runner.num_blocks * block_bytes >= 0.1 * total  # activations of this small model are < 10%
    sched = Scheduler(SchedulerConfig(num_blocks=runner.num_blocks, block_size=16, max_num_batched_tokens=8192))
    for i in range(8):
        sched.add_request(Request(str(i), list(range(1, 1025)), SamplingParams(temperature=0, max_tokens=2)))
    out = sched.schedule()
    assert out.num_batched_tokens == 8192
    result = runner.execute(out)
    assert len(result.sampled_token_ids) == 8
    assert torch.cuda.memory_allocated() <= util * total
