"""The engine's CUDA graphs (engine/cuda_graphs.py): decode steps (``DecodeGraphs``) and steps with prefill
chunks as graph pieces around attention (``PiecewiseGraphs``); padded static buffers, fallback to eager.

On the CPU the padded static-buffer path runs without graphs (``make_decode_graphs(capture=False)``):
every step of a scheduler-driven run (chunked prefills next to decodes, batch sizes that pad, batches
past the largest size) gives the hidden states of the eager path by DESIGN.md §3 (against an fp64
run, the eager one as baseline), writes the KV cache only at the step's own slots (the rest bitwise
unchanged, the null block included), and runs eagerly exactly when a step is not decode-only or is
too large. The graph pieces likewise (``make_piecewise_graphs(capture=False)``: the same static buffers
and the same split of the forward at each attention layer, attention run inside it): every step with
a prefill chunk up to the largest size runs through them, larger ones eagerly. Through ``LLM``
(preemption, prefix caching) the greedy tokens are the eager ones. On a
GPU the same with captured graphs, and end to end from a checkpoint: ``LLM(cuda_graphs=True)``
gives the greedy tokens of ``cuda_graphs=False``, except at near-ties of the eager run's logprobs.
"""

import contextlib
import copy
import math

import pytest
import torch

import fuseformer
from fuseformer.engine.core import EngineCore
from fuseformer.engine.cuda_graphs import graph_batch_sizes, piecewise_sizes
from fuseformer.engine.llm import LLM
from fuseformer.engine.model_runner import CacheConfig, ModelRunner
from fuseformer.engine.request import Request
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig
from fuseformer.testing import TINY_LLAMA, assert_close, shared_prefix_prompts, tiny_llama

_model = tiny_llama


def _backend(name):
    return fuseformer.use_backend(name) if name != "auto" else contextlib.nullcontext()


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert graph_batch_sizes(300)[-4:] == [256, 272, 288, 300]


def test_piecewise_sizes():
    assert piecewise_sizes(8) == [8]
    assert piecewise_sizes(16) == [16]
    assert piecewise_sizes(100) == [16, 32, 64, 96, 100]
    assert piecewise_sizes(512) == [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    assert piecewise_sizes(8192) == piecewise_sizes(512)  # larger steps run eagerly


def test_cuda_graphs_need_a_cuda_device():
    model, config = _model()
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        ModelRunner(model, config, CacheConfig(block_size=4, num_kv_blocks=8), cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        ModelRunner(model, config, CacheConfig(block_size=4, num_kv_blocks=8), cuda_graphs=1)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LLM(model, device="cpu", num_kv_blocks=8, block_size=4, max_model_len=16, cuda_graphs=True)


def test_llm_fast_by_default_on_cuda_only(monkeypatch):
    """CUDA graphs and async scheduling are the default where the model runs on CUDA, unless
    enforce_eager; on the CPU nothing changes."""
    from fuseformer.engine import llm as llm_module

    model, _ = _model()
    kw = dict(num_kv_blocks=8, block_size=4, max_model_len=16)
    llm = LLM(model, **kw)
    assert not llm.runner.cuda_graphs and not llm.async_scheduling
    assert LLM(model, async_scheduling=True, **kw).async_scheduling
    with pytest.raises(ValueError, match="enforce_eager=True and cuda_graphs=True contradict"):
        LLM(model, enforce_eager=True, cuda_graphs=True, **kw)
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        LLM(model, enforce_eager="yes", **kw)
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None"):
        LLM(model, async_scheduling=1, **kw)

    # What EngineCore is asked for when the model is on CUDA (the core itself replaced: no GPU here).
    asked = {}

    class Core:
        def __init__(self, *args, cuda_graphs, async_scheduling, **kwargs):
            asked.update(cuda_graphs=cuda_graphs, async_scheduling=async_scheduling)
            self.max_model_len = 16

    monkeypatch.setattr(llm_module, "EngineCore", Core)
    monkeypatch.setattr(llm_module, "batch_limits", lambda device: (256, 8192))  # (reads the GPU's properties)
    for kwargs, expected in [
        ({}, (True, True)),
        ({"enforce_eager": True}, (False, False)),
        ({"enforce_eager": True, "async_scheduling": True}, (False, True)),
        ({"cuda_graphs": False}, (False, True)),
    ]:
        LLM(model, device="cuda", **kwargs, **kw)
        assert (asked["cuda_graphs"], asked["async_scheduling"]) == expected, kwargs


def _drive(device, dtype, backend, sizes, capture, piece_sizes=None):
    """One scheduler drives three runners over the same model: eager, padded (decode ``sizes`` and, with
    ``piece_sizes``, graph pieces; CUDA graphs when ``capture``) and an fp64 eager reference. Every step
    is checked; returns step counts."""
    model, config = _model(device, dtype)
    ref_model = copy.deepcopy(model).double()
    cache = CacheConfig(block_size=4, num_kv_blocks=40)
    eager, padded, ref = (ModelRunner(m, config, cache) for m in (model, model, ref_model))
    padded.decode_graphs = graphs = padded.make_decode_graphs(sizes, capture=capture)
    pieces = padded.piecewise_graphs = (
        padded.make_piecewise_graphs(piece_sizes, capture=capture) if piece_sizes else None
    )
    gen = torch.Generator().manual_seed(1)
    for k, v in padded.kv_caches:  # random, not zeros: a write anywhere but the step's slots shows
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    graphs.capture()
    if pieces is not None:
        pieces.capture()
    sched = Scheduler(
        SchedulerConfig(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64)
    )
    prompts = [(7, 9), (2, 4), (11, 6), (5, 12), (1, 3), (9, 7)]  # (prompt length, max_tokens)
    for i, (n, max_tokens) in enumerate(prompts):
        ids = torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        sched.add_request(Request(str(i), ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    counts = dict(graph=0, mixed=0, too_large=0, pieces=0)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        before = [(k.clone(), v.clone()) for k, v in padded.kv_caches]
        replays = sum(graphs.replays.values())
        piece_replays = sum(pieces.replays.values()) if pieces is not None else 0
        with _backend(backend):
            h_eager, rows = eager.forward(out)
            h_padded, rows_padded = padded.forward(out)
        with fuseformer.use_backend("reference"):
            h_ref, _ = ref.forward(out)
        t, n = out.num_batched_tokens, len(out.scheduled)
        decode_only = t == n
        used_graph = sum(graphs.replays.values()) == replays + 1
        assert used_graph == (decode_only and n <= max(sizes)), (n, t, used_graph)
        counts["graph"] += used_graph
        counts["mixed"] += not decode_only
        counts["too_large"] += decode_only and not used_graph
        used_pieces = pieces is not None and sum(pieces.replays.values()) == piece_replays + 1
        assert used_pieces == (pieces is not None and not used_graph and t <= max(piece_sizes)), (n, t)
        counts["pieces"] += used_pieces
        assert rows_padded == rows
        if used_graph:
            assert h_padded.shape[0] == min(b for b in sizes if b >= n)
        if used_pieces:
            assert h_padded.shape[0] == min(p for p in piece_sizes if p >= t)
        assert_close("hidden", h_padded[:t], h_ref, h_eager)

        slots = eager.prepare(out)[2].slot_mapping.cpu()
        written = torch.zeros(padded.num_blocks * 4, dtype=torch.bool)
        written[slots] = True
        for layer, caches in enumerate(zip(padded.kv_caches, before, eager.kv_caches, ref.kv_caches)):
            for i, name in enumerate(("k", "v")):
                after, old, e, r = (c[i].flatten(0, 1).cpu() for c in caches)  # (slots, Hkv, D)
                assert torch.equal(after[~written], old[~written]), f"layer {layer} {name}: a padded row wrote"
                assert_close(f"layer {layer} {name} cache", after[written], r[written], e[written])

        if rows:
            idx = torch.tensor(rows, device=device)
            logits_eager = model.compute_logits(h_eager, idx)
            logits_padded = model.compute_logits(h_padded, idx)
            if dtype == torch.float32:  # half precision may break a near-tie either way
                assert logits_padded.argmax(-1).tolist() == logits_eager.argmax(-1).tolist()
            tokens = ref_model.compute_logits(h_ref, idx).argmax(-1).tolist()
            sampled = [s.request_id for s in out.scheduled if s.sample]
            sched.update_from_output(out, {rid: [tok] for rid, tok in zip(sampled, tokens)})
        else:
            sched.update_from_output(out, {})
    assert sched.kv.pool.num_free_blocks == 39
    return counts, graphs


@pytest.mark.parametrize(
    "backend, dtype",
    [("reference", torch.float32), ("auto", torch.float32), ("auto", torch.float16)],
    ids=["reference-fp32", "kernels-fp32", "kernels-fp16"],  # kernels: interpreted on the CPU
)
def test_padded_decode_matches_eager_and_writes_only_its_slots(backend, dtype):
    counts, graphs = _drive("cpu", dtype, backend, sizes=[2, 4], capture=False)
    assert counts["graph"] > 0 and counts["mixed"] > 0 and counts["too_large"] > 0, counts
    assert graphs.replays[2] > 0 and graphs.replays[4] > 0 and graphs.padded_rows > 0


@pytest.mark.parametrize(
    "backend, dtype",
    [("reference", torch.float32), ("auto", torch.float16)],
    ids=["reference-fp32", "kernels-fp16"],  # kernels: interpreted on the CPU
)
def test_pieces_match_eager_and_write_only_their_slots(backend, dtype):
    """Steps with prefill chunks of up to 12 tokens through the graph pieces' static buffers (padded to 8
    or 12), the 13-16-token ones eagerly, decode steps through the decode graphs."""
    counts, graphs = _drive("cpu", dtype, backend, sizes=[2, 4], capture=False, piece_sizes=[8, 12])
    assert counts["pieces"] > 0 and counts["graph"] > 0 and counts["mixed"] > counts["pieces"], counts


def _near_tie_or_equal(eager, graphs, tol):
    """Each request's tokens are equal, or first differ where the eager run's top-2 logprobs
    (``logprobs=2``) are within ``tol``; after the split the continuations are not comparable."""
    identical = 0
    for e, g in zip(eager, graphs):
        e, g = e.outputs[0], g.outputs[0]
        if e.token_ids == g.token_ids:
            identical += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(e.token_ids, g.token_ids)) if a != b)
        lp = e.logprobs[j]
        assert g.token_ids[j] in lp, f"step {j}: graphs' token {g.token_ids[j]} is not in eager's top 2 {lp}"
        gap = lp[e.token_ids[j]].logprob - lp[g.token_ids[j]].logprob
        assert gap <= tol, f"step {j}: logprob gap {gap:.3g} is no near-tie: {e.token_ids} != {g.token_ids}"
    return identical


def _workload(vocab, num, seed=0):
    """``num`` prompts of 1..40 tokens, every other one behind a shared 12-token prefix, with
    max_tokens 3..19: a batch that shrinks through many padded sizes."""
    prompts = shared_prefix_prompts(vocab, num, 40, torch.Generator().manual_seed(seed))
    params = [
        SamplingParams(temperature=0, max_tokens=3 + (7 * i) % 17, ignore_eos=True, logprobs=2) for i in range(num)
    ]
    return prompts, params


def test_padded_decode_through_llm_changes_no_token():
    """Preemption (a small cache), prefix caching and padded sizes 1..8 through LLM on the CPU."""
    model, _ = _model()
    prompts, params = _workload(TINY_LLAMA["vocab_size"], 12)
    kw = dict(num_kv_blocks=40, block_size=4, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=12)
    with fuseformer.use_backend("reference"):
        eager = LLM(model, **kw)
        expected = eager.generate(prompts, params, use_tqdm=False)
        llm = LLM(model, **kw)
        llm.core.runner.decode_graphs = graphs = llm.core.runner.make_decode_graphs([1, 2, 4, 8], capture=False)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert _near_tie_or_equal(expected, got, tol=1e-4) == len(prompts)
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.scheduler.kv.pool.prefix_stats.hits > 0
    assert sum(c > 0 for c in graphs.replays.values()) >= 3 and graphs.padded_rows > 0
    assert llm.core.scheduler.kv.pool.num_free_blocks == 39


def test_pieces_through_llm_change_no_token():
    """The same run with the steps that carry prefill chunks through graph pieces of 8, 16 and 24 tokens
    (without graphs: the static buffers and the split), decode steps through the decode buffers."""
    model, _ = _model()
    prompts, params = _workload(TINY_LLAMA["vocab_size"], 12)
    kw = dict(num_kv_blocks=40, block_size=4, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=12)
    with fuseformer.use_backend("reference"):
        expected = LLM(model, **kw).generate(prompts, params, use_tqdm=False)
        llm = LLM(model, **kw)
        runner = llm.core.runner
        runner.decode_graphs = runner.make_decode_graphs([1, 2, 4, 8], capture=False)
        runner.piecewise_graphs = pieces = runner.make_piecewise_graphs([8, 16, 24], capture=False)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert _near_tie_or_equal(expected, got, tol=1e-4) == len(prompts)
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.scheduler.kv.pool.prefix_stats.hits > 0
    assert sum(c > 0 for c in pieces.replays.values()) >= 2 and pieces.padded_rows > 0, pieces.replays
    assert llm.core.scheduler.kv.pool.num_free_blocks == 39


_TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=128)  # fmt: skip
# What makes each tiny config exercise its architecture's attention (windows, bias, q/k norms, soft-caps).
_EXTRA = {
    "MistralForCausalLM": dict(sliding_window=3),
    "Qwen2ForCausalLM": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "Qwen3ForCausalLM": dict(head_dim=16),
    "GemmaForCausalLM": dict(head_dim=8, num_key_value_heads=1),
    "Gemma2ForCausalLM": dict(head_dim=8, sliding_window=3, attn_logit_softcapping=2.0),
}


def _tiny(architecture, **extra):
    transformers = pytest.importorskip("transformers")
    from fuseformer.models import registry
    from fuseformer.models.config import ModelConfig

    hf = transformers.AutoConfig.for_model(
        registry.ARCHITECTURES[architecture].model_type, **(_TINY | _EXTRA.get(architecture, {}) | extra)
    )
    hf.architectures = [architecture]
    torch.manual_seed(0)
    return registry.build_model(ModelConfig.from_hf(hf.to_dict())).eval()


def _architectures():
    from fuseformer.models import registry

    return registry.supported_architectures()


@pytest.mark.parametrize("architecture", _architectures())
def test_pieces_serve_every_architecture(architecture):
    """Each registered architecture (sliding windows, q/k/v bias, q/k norms, Gemma2's soft-cap and
    post-norms) gives the eager engine's greedy tokens with its steps' attention split off into the
    graph pieces (without graphs on the CPU), chunked prefills beside decodes."""
    model = _tiny(architecture)
    prompts, params = _workload(_TINY["vocab_size"], 8)
    kw = dict(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=8)
    with fuseformer.use_backend("reference"):
        expected = LLM(model, **kw).generate(prompts, params, use_tqdm=False)
        llm = LLM(model, **kw)
        llm.core.runner.piecewise_graphs = pieces = llm.core.runner.make_piecewise_graphs([8, 16], capture=False)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert _near_tie_or_equal(expected, got, tol=1e-4) == len(prompts)
    assert pieces.replays[8] > 0 and pieces.replays[16] > 0


def test_check_pieces_passes_them_and_catches_a_wrong_one(monkeypatch):
    """``check_pieces`` (run at start after capture) compares a prefill through the pieces with the
    eager forward at the smallest and largest size: None for the real pieces; a reason when a piece
    hands attention the wrong rows (here: k taken from q's buffer); the cache zero again afterwards."""
    from fuseformer.engine import cuda_graphs

    model, config = _model()
    runner = ModelRunner(model, config, CacheConfig(block_size=4, num_kv_blocks=40))
    runner.piecewise_graphs = pieces = runner.make_piecewise_graphs([8, 24], capture=False)
    with fuseformer.use_backend("reference"):
        assert runner.check_pieces() is None
        assert pieces.replays == {8: 0, 24: 0}  # a check is not a step
        real = cuda_graphs.PiecewiseGraphs._attend

        def wrong(self, layer):
            n, meta = self._step
            self.o[:n].copy_(layer.attend_cache(self.q[:n], self.q[:n, : self.k.shape[1]], self.v[:n], meta))

        monkeypatch.setattr(cuda_graphs.PiecewiseGraphs, "_attend", wrong)
        why = runner.check_pieces()
        monkeypatch.setattr(cuda_graphs.PiecewiseGraphs, "_attend", real)
    assert why is not None and "prefill through the pieces" in why, why
    assert all(k.count_nonzero() == 0 and v.count_nonzero() == 0 for k, v in runner.kv_caches)


def test_no_pieces_for_dynamic_rope():
    """Dynamic NTK rope reads the step's sequence lengths inside the first piece: such a model gets no
    graph pieces (its steps with prefill chunks run eagerly under cuda_graphs) and asking says why."""
    model = _tiny("LlamaForCausalLM", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    runner = ModelRunner(model, model.config, CacheConfig(block_size=4, num_kv_blocks=8))
    assert runner._pieces_unsupported() is not None
    with pytest.raises(ValueError, match="no graph pieces for this model: .*dynamic"):
        runner.make_piecewise_graphs([8], capture=False)


# ---- on a GPU: captured graphs ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_graph_decode_matches_eager_and_writes_only_its_slots_gpu(dtype):
    """The CPU test's run with captured graphs (sizes 1, 2, 4): every step's hidden states and cache
    writes by §3 against fp64, eager as baseline; mixed and too-large steps run eagerly."""
    counts, graphs = _drive("cuda", dtype, "auto", sizes=[1, 2, 4], capture=True)
    assert counts["graph"] > 0 and counts["mixed"] > 0 and counts["too_large"] > 0, counts
    assert set(graphs.graphs) == {1, 2, 4} and graphs.padded_rows > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_pieces_match_eager_and_write_only_their_slots_gpu(dtype):
    """The CPU pieces test with captured graphs: steps with prefill chunks of up to 12 tokens replay
    graph pieces (3 for the 2-layer model), attention launched between them; every step's hidden states
    and cache writes by §3 against fp64, eager as baseline."""
    counts, graphs = _drive("cuda", dtype, "auto", sizes=[2, 4], capture=True, piece_sizes=[8, 12])
    assert counts["pieces"] > 0 and counts["graph"] > 0 and counts["mixed"] > counts["pieces"], counts


def _llama_checkpoint(path, dtype="float32", **overrides):
    transformers = pytest.importorskip("transformers")
    cfg = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
    ) | overrides  # fmt: skip
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * r if name.endswith("norm.weight") else r / math.sqrt(p.shape[1]) if p.dim() > 1 else r)
    hf.to(getattr(torch, dtype)).save_pretrained(path)
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-3), ("bfloat16", 0.25)])
def test_cuda_graphs_greedy_equals_eager_gpu(dtype, tol, tmp_path, monkeypatch):
    """48 requests of 1..40 tokens at once (half share a 12-token prefix), max_tokens 3..19, chunked
    in 32-token steps over a cache too small for all (preemption): ``cuda_graphs=True`` gives the
    greedy tokens of ``cuda_graphs=False``, except at near-ties of the eager logprobs (bf16: a padded
    GEMM may round differently from an unpadded one). Graphs of sizes up to 32 replay, with padding;
    capture writes nothing to the cache (checked before the engine's warm-up, which does write it)."""
    overrides = dict(head_dim=128, hidden_size=256, num_attention_heads=4) if dtype == "bfloat16" else {}
    cfg = _llama_checkpoint(tmp_path, dtype, **overrides)
    prompts, params = _workload(cfg["vocab_size"], 48)
    kw = dict(
        device="cuda", num_kv_blocks=60, block_size=4, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=48
    )
    eager = LLM(tmp_path, **kw)
    expected = eager.generate(prompts, params, use_tqdm=False)
    real_warm_up = EngineCore.warm_up
    monkeypatch.setattr(EngineCore, "warm_up", lambda self: 0.0)
    llm = LLM(tmp_path, cuda_graphs=True, **kw)
    graphs, pieces = llm.core.runner.decode_graphs, llm.core.runner.piecewise_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16, 24, 32]  # min(max_num_seqs, max_num_batched_tokens)
    assert sorted(pieces.graphs) == [16, 32] and all(len(p) == 3 for p in pieces.graphs.values())
    assert all(k.count_nonzero() == 0 and v.count_nonzero() == 0 for k, v in llm.core.runner.kv_caches)
    real_warm_up(llm.core)
    got = llm.generate(prompts, params, use_tqdm=False)
    identical = _near_tie_or_equal(expected, got, tol)
    assert identical >= (0.9 if dtype == "float32" else 0.75) * len(prompts), identical
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(got, params))
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.scheduler.kv.pool.prefix_stats.hits > 0
    assert sum(c > 0 for c in graphs.replays.values()) >= 4 and graphs.padded_rows > 0, graphs.replays
    assert sum(pieces.replays.values()) > 0, pieces.replays  # the chunked prefills beside decodes
    assert llm.core.scheduler.kv.pool.num_free_blocks == 59


@pytest.mark.gpu
def test_cache_sizing_leaves_room_for_the_graph_pool_gpu():
    """With graphs on, the KV cache is sized after setting aside the pool's estimate; the pool the
    capture takes stays within it, and steps at the full budget (eager) and decode steps (graphs)
    stay within gpu_memory_utilization."""
    model, config = _model(
        "cuda", torch.bfloat16, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, vocab_size=32000
    )
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    util = (total - free) / total + 0.2
    runner = ModelRunner(
        model,
        config,
        CacheConfig(block_size=16, gpu_memory_utilization=util),
        max_num_batched_tokens=4096,
        max_num_seqs=128,
        cuda_graphs=True,
    )
    graphs, pieces = runner.decode_graphs, runner.piecewise_graphs
    taken, estimate = graphs.pool_bytes + pieces.pool_bytes, runner._graph_pool_estimate()
    assert 0 < taken <= estimate, (graphs.pool_bytes, pieces.pool_bytes, estimate)
    sched = Scheduler(
        SchedulerConfig(num_blocks=runner.num_blocks, block_size=16, max_num_batched_tokens=4096, max_num_seqs=128)
    )
    for i in range(128):
        sched.add_request(Request(str(i), list(range(1, 33)), SamplingParams(temperature=0, max_tokens=3)))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out).sampled_token_ids)
    assert graphs.replays[128] == 2  # the two decode steps of the 128 requests
    assert torch.cuda.memory_reserved() <= util * total


@pytest.mark.gpu
def test_pieces_on_a_side_stream_behind_a_decode_graph_gpu(tmp_path, monkeypatch):
    """A request that arrives while a decode graph runs gets its prefill launched at once on a side stream
    (``step_with_arrivals``, ``prefill_stream``) through graph pieces, which have a memory pool of their
    own; every request's greedy tokens are those of the eager engine running it alone."""
    cfg = _llama_checkpoint(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist() for n in (20, 24, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    kw = dict(device="cuda", num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=32)
    eager = LLM(tmp_path, enforce_eager=True, **kw)
    expected = [eager.generate([p], params, use_tqdm=False)[0] for p in prompts]
    llm = LLM(tmp_path, cuda_graphs=True, async_scheduling=False, prefill_stream=True, **kw)
    pieces = llm.runner.piecewise_graphs
    llm.add_request("0", {"prompt_token_ids": prompts[0]}, params)
    outputs = {o.request_id: list(o.outputs[0].token_ids) for o in llm.step()}  # its prefill (pieces)
    arriving = list(enumerate(prompts))[1:]
    # A tiny model's decode step may finish before the first poll: while requests are still to arrive the
    # step in flight reads as not ready, so each arrival's prefill is launched on the side stream.
    from fuseformer.engine.core import StepHandle

    real_ready = StepHandle.ready
    monkeypatch.setattr(StepHandle, "ready", property(lambda self: not arriving and real_ready.fget(self)))

    def arrivals(timeout):
        if not arriving:
            return False
        i, p = arriving.pop(0)
        llm.add_request(str(i), {"prompt_token_ids": p}, params)
        return True

    early, before = 0, sum(pieces.replays.values())
    while llm.has_unfinished_requests():
        outs, launched = llm.step_with_arrivals(arrivals, poll_s=0.05)
        early += launched
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    assert early >= 1 and sum(pieces.replays.values()) > before
    got = [outputs[str(i)] for i in range(len(prompts))]
    for e, g in zip(expected, got):
        assert len(g) == 12
        if e.outputs[0].token_ids != g:  # only at a near-tie of the eager run's top two
            j = next(i for i, (a, b) in enumerate(zip(e.outputs[0].token_ids, g)) if a != b)
            lp = e.outputs[0].logprobs[j]
            assert g[j] in lp and lp[e.outputs[0].token_ids[j]].logprob - lp[g[j]].logprob <= 1e-3
