"""FP8 KV cache (``CacheConfig(kv_cache_dtype="fp8")``): the ModelRunner allocates e4m3 caches, 1 byte an
element (twice a bf16 cache's blocks, four times an fp32 one's, in the same memory); a scheduler-driven
greedy generation over them (chunked prefills next to decodes, the padded decode-graph path too) mostly
agrees with the model-dtype cache's; the attention modules' fp32 ``k_scale``/``v_scale`` buffers; bad
``kv_cache_dtype`` values are refused naming the field."""

import contextlib
import importlib
import os

import pytest
import torch

import fuseformer
from fuseformer.engine.model_runner import CacheConfig, ModelRunner
from fuseformer.engine.request import Request
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig
from fuseformer.models.registry import build_model
from fuseformer.testing import tiny_llama

PROMPTS = {"a": [3, 1, 4, 1, 5, 9, 2], "b": [6, 5], "c": [3, 5, 8, 9, 7, 9, 3, 2, 3], "d": [2, 7, 1, 8, 2, 8]}
NEW_TOKENS = 12


@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_fp8_cache_is_e4m3_and_holds_more_blocks_in_the_same_memory(dtype, ratio):
    model, config = tiny_llama(dtype=dtype)
    runners = {
        kv: ModelRunner(model, config, CacheConfig(block_size=16, cpu_kv_cache_gib=0.01, kv_cache_dtype=kv))
        for kv in ("auto", "fp8", "fp8_e4m3")
    }
    auto, fp8 = runners["auto"], runners["fp8"]
    assert fp8.num_blocks == int(0.01 * 2**30) // config.kv_cache_block_bytes(16, torch.float8_e4m3fn)
    assert ratio * auto.num_blocks <= fp8.num_blocks < ratio * (auto.num_blocks + 1)
    assert runners["fp8_e4m3"].num_blocks == fp8.num_blocks
    assert config.kv_cache_block_bytes(16, torch.float8_e4m3fn) * ratio == config.kv_cache_block_bytes(16, dtype)
    for k, v in fp8.kv_caches:
        assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape == (fp8.num_blocks, 16, 2, 12)
    for k, v in auto.kv_caches:
        assert k.dtype == v.dtype == dtype
    assert sum(k.nbytes + v.nbytes for k, v in fp8.kv_caches) <= 0.01 * 2**30


def _generate(model, config, kv_cache_dtype, backend, graphs=False):
    """Greedy tokens of PROMPTS through a Scheduler and a ModelRunner (budget 6: chunked prefills next
    to decodes) over a NaN-filled cache; with ``graphs``, decode steps take the padded static-buffer
    path of the decode graphs (without capture)."""
    runner = ModelRunner(model, config, CacheConfig(block_size=4, num_kv_blocks=40, kv_cache_dtype=kv_cache_dtype))
    for k, v in runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    if graphs:
        runner.decode_graphs = runner.make_decode_graphs([1, 2, 4], capture=False)
    sched = Scheduler(SchedulerConfig(num_blocks=40, block_size=4, max_num_batched_tokens=6, max_model_len=64))
    for rid, prompt in PROMPTS.items():
        sched.add_request(Request(rid, prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)))
    tokens = {rid: [] for rid in PROMPTS}
    with fuseformer.use_backend(backend) if backend != "auto" else contextlib.nullcontext():
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sampled = runner.execute(out).sampled_token_ids
            for rid, new in sampled.items():
                tokens[rid] += new
            sched.update_from_output(out, sampled)
    return tokens, runner


def _agreement(a, b):
    """Positions where two runs' tokens agree, of all, and the requests identical throughout."""
    same = sum(x == y for rid in a for x, y in zip(a[rid], b[rid]))
    return same / sum(len(t) for t in a.values()), sum(a[rid] == b[rid] for rid in a)


# Measured (tiny_llama seed 0, fp32; torch 2.13, Triton 3.6 interpreter; the same on both backends): the
# fp8 cache's greedy tokens equal the fp32 cache's at 40 of 48 positions with the default scales (1.0),
# 43 of 48 with the scales below; 3 of the 4 requests identical throughout in both. What differs is
# e4m3's rounding (~3% an element: the logits move by up to ~0.36 of ~5 on a 9-token prefill), against
# the near-ties of a random 2-layer model (top-2 margins of 0.03-0.2 are common); after its first
# difference a request's continuation is another sequence. (Seeds 1 and 2: 37 and 6 of 48 at 1.0,
# 45 and 30 of 48 with the scales below.)
@pytest.mark.parametrize("backend", ["auto", "reference"])  # auto: the interpreted attention kernels
@pytest.mark.parametrize("scales", [None, (0.02, 0.015)])
def test_fp8_cache_generation_agrees_with_the_model_dtype_cache(backend, scales, monkeypatch):
    PA = importlib.import_module("fuseformer.ops.paged_attention")
    kernel_calls = []
    fwd = PA.paged_attention_fwd
    monkeypatch.setattr(PA, "paged_attention_fwd", lambda *a, **kw: kernel_calls.append(1) or fwd(*a, **kw))
    model, config = tiny_llama()
    if scales is not None:  # as the loader sets a checkpoint's: |k| / 0.02, |v| / 0.015 reach ~300-400 of 448
        for layer in model.model.layers:
            layer.self_attn.k_scale.fill_(scales[0])
            layer.self_attn.v_scale.fill_(scales[1])
    expected, _ = _generate(model, config, "auto", backend)
    kernel_calls.clear()
    got, runner = _generate(model, config, "fp8", backend, graphs=backend == "auto")
    assert all(len(t) == NEW_TOKENS for t in got.values())
    assert bool(kernel_calls) == (backend == "auto" and os.environ.get("TRITON_INTERPRET") == "1")
    rate, identical = _agreement(expected, got)
    assert rate >= 0.75 and identical >= len(PROMPTS) - 1, (rate, identical, expected, got)
    k_cache = runner.kv_caches[0][0]
    assert k_cache.dtype == torch.float8_e4m3fn
    written = k_cache.float()[1:].isfinite()  # block 0 is the null block
    assert written.any() and (k_cache.float()[1:][written] != 0).any()
    if backend == "auto":
        assert runner.decode_graphs.replays[4] > 0  # decode steps took the padded static buffers


def test_attention_scales_are_fp32_buffers_that_default_to_one():
    """Attention's ``k_scale``/``v_scale``: fp32 scalars through ``.to(dtype)``, 1.0 after the loader's
    meta build + ``to_empty``, values kept across a move, not in the state dict (the loader sets them)."""
    model, _ = tiny_llama(dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert attn.k_scale.dtype == attn.v_scale.dtype == torch.float32 and attn.k_scale.shape == ()
    assert attn.k_scale.item() == attn.v_scale.item() == 1.0
    assert not any("scale" in name for name in model.state_dict())
    attn.k_scale.fill_(0.0123)
    model.to(torch.float16)
    assert attn.k_scale.dtype == torch.float32 and attn.k_scale.item() == pytest.approx(0.0123, rel=1e-7)
    with torch.device("meta"):
        meta = build_model(model.config).to(torch.bfloat16)
    meta.to_empty(device="cpu")
    for layer in meta.model.layers:
        assert layer.self_attn.k_scale.dtype == torch.float32
        assert layer.self_attn.k_scale.item() == layer.self_attn.v_scale.item() == 1.0


@pytest.mark.parametrize("bad", ["fp8_e5m2", "int8", "bfloat16", "FP8", "", None, torch.float8_e4m3fn])
def test_bad_kv_cache_dtype_is_refused(bad):
    match = "fp8_e5m2 is not supported" if bad == "fp8_e5m2" else "kv_cache_dtype must be one of 'auto', 'fp8'"
    with pytest.raises(ValueError, match=match):
        CacheConfig(kv_cache_dtype=bad)
    assert CacheConfig().kv_cache_dtype == "auto"


@pytest.mark.gpu
def test_fp8_cache_generation_gpu(monkeypatch):
    """On the GPU: bf16 model, e4m3 caches written and read by the kernels (decode graphs' static path)."""
    PA = importlib.import_module("fuseformer.ops.paged_attention")
    kernel_calls = []
    fwd = PA.paged_attention_fwd
    monkeypatch.setattr(PA, "paged_attention_fwd", lambda *a, **kw: kernel_calls.append(1) or fwd(*a, **kw))
    model, config = tiny_llama(device="cuda", dtype=torch.bfloat16)
    expected, _ = _generate(model, config, "auto", "auto")
    got, runner = _generate(model, config, "fp8", "auto", graphs=True)
    assert kernel_calls and runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    rate, identical = _agreement(expected, got)
    print(f"fp8 vs bf16 cache: {rate:.2f} of positions agree, {identical} of {len(PROMPTS)} requests identical")
    assert rate >= 0.5, (rate, expected, got)  # unmeasured on a GPU yet: a loose bound
