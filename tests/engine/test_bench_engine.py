"""``fuseformer bench engine`` at a tiny shape on the CPU: every workload runs through ours and its
peers, the workloads have the sizes they say, and ours holds HF's weights exactly (same logits)."""

import pytest
import torch

import fuseformer
from fuseformer.bench.engine import WORKLOADS, build_models, decode_bytes, format_table, run_workload, workload
from fuseformer.models.attention_metadata import AttentionMetadata

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)  # fmt: skip


def test_workloads_have_their_sizes():
    prompts, outs = workload("mix", 1000)
    assert len(prompts) == len(outs) == 512
    assert all(32 <= len(p) <= 1024 for p in prompts) and all(16 <= o <= 512 for o in outs)
    assert len({len(p) for p in prompts}) > 100  # lengths vary
    prompts, outs = workload("prefix", 1000)
    assert len(prompts) == 256 and all(len(p) == 2048 + 32 and p[:2048] == prompts[0][:2048] for p in prompts)
    assert len({tuple(p[2048:]) for p in prompts}) == 256 and outs == [128] * 256
    prompts, outs = workload("batch1", 1000)
    assert [len(p) for p in prompts] == [128] and outs == [256]
    prompts, outs = workload("fixed", 1000, scale=0.25)
    assert len(prompts) == 64 and {len(p) for p in prompts} == {64} and outs == [64] * 64
    with pytest.raises(ValueError, match="workload must be one of"):
        workload("sharegpt", 1000)


def test_bench_engine_code_paths_on_cpu():
    with fuseformer.use_backend("reference"):
        hf, ours = build_models(SHAPE, "cpu", torch.float32)
        ids = torch.randint(0, 128, (9,))
        with torch.no_grad():
            expected = hf(ids[None]).logits[0]
            got = ours.compute_logits(ours(ids, torch.arange(9), AttentionMetadata.varlen([9])))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        records = []
        for name in WORKLOADS:
            records += run_workload(
                name, hf, ours, device="cpu", scale=1 / 32, num_kv_blocks=256, block_size=4, max_num_batched_tokens=80
            )
    by = {(r["workload"], r["impl"]): r for r in records}
    assert set(by) == {
        ("batch1", "fuseformer LLM"), ("batch1", "HF generate bs 1"), ("fixed", "fuseformer LLM"),
        ("fixed", "HF generate_batch"), ("fixed", "HF generate bs 64"), ("mix", "fuseformer LLM"),
        ("prefix", "fuseformer LLM"),
    }  # fmt: skip
    for name, outs in ((w, workload(w, 128, 1 / 32)[1]) for w in WORKLOADS):
        r = by[(name, "fuseformer LLM")]
        assert "error" not in r and r["output_tokens"] == sum(outs), r
        assert r["mean_ttft_ms"] > 0 and r["output_tok_s"] > 0
    assert by[("prefix", "fuseformer LLM")]["prefix_hit_rate"] > 0.5
    assert by[("batch1", "fuseformer LLM")]["decode_tb_s"] > 0
    assert by[("batch1", "fuseformer LLM")]["first_ttft_ratio"] > 0  # first request after start / a later one
    assert all(len(by[(w, "fuseformer LLM")]["slowest_launches"]) > 0 for w in WORKLOADS)
    for key in (("fixed", "HF generate_batch"), ("fixed", "HF generate bs 64"), ("batch1", "HF generate bs 1")):
        assert "error" in by[key] or by[key]["output_tokens"] == by[(key[0], "fuseformer LLM")]["output_tokens"]
    assert "fuseformer LLM" in format_table(records)
    # The decode reads every weight but the input embedding (untied here).
    embed = ours.model.embed_tokens.weight
    assert decode_bytes(ours) == sum(p.numel() * 4 for p in ours.parameters()) - embed.numel() * 4


def test_run_workload_variants_change_the_engine_before_the_timed_run():
    """A variant (impl name -> ``_run_ours`` keywords) runs beside the defaults; its ``after_build`` gets the
    LLM before the timed run (benchmarks/engine_workloads.py's A/B without graph pieces)."""
    seen = []
    with fuseformer.use_backend("reference"):
        _, ours = build_models(SHAPE, "cpu", torch.float32)
        records = run_workload(
            "batch1", None, ours, device="cpu", scale=1 / 32, peers=False, num_kv_blocks=64, block_size=4,
            variants={"ours, changed": dict(after_build=seen.append, num_kv_blocks=64, block_size=4)},
        )  # fmt: skip
    assert [r["impl"] for r in records] == ["fuseformer LLM", "ours, changed"]
    assert len(seen) == 1 and seen[0].__class__.__name__ == "LLM" and "error" not in records[1]


def test_triton_compiles_records_through_the_hook_and_restores_it():
    """``TritonCompiles`` installs Triton's post-compile hook for its block only; a compile that the
    hook reports is recorded by its specialization (the interpreter compiles nothing, so the hook is
    called as Triton calls it)."""
    knobs = pytest.importorskip("triton").knobs
    from fuseformer.bench.engine import TritonCompiles

    before = knobs.runtime.jit_post_compile_hook
    with TritonCompiles() as compiles:
        hook = knobs.runtime.jit_post_compile_hook
        assert hook is not before
        hook(key=None, repr="_kernel[num_warps=4](X: *bf16, n: i32)", fn=None, compile=None,
             is_manual_warmup=False, already_compiled=False)  # fmt: skip
        hook(repr="_kernel[num_warps=4](X: ())", signature={"X": "*fp32"}, configs=[{(0,): [["tt.divisibility", 16]]}])
    assert knobs.runtime.jit_post_compile_hook is before
    assert compiles.available and compiles.names == [
        "_kernel[num_warps=4](X: *bf16, n: i32)",
        "_kernel[num_warps=4](X: ()) {'X': '*fp32'} {(0,): [['tt.divisibility', 16]]}",  # 3.6: the signature apart
    ]


def test_gc_pauses_counts_collections_by_generation():
    import gc

    from fuseformer.bench.engine import GcPauses

    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    assert pauses.counts[0] >= 1 and pauses.counts[2] >= 1 and all(s >= 0 for s in pauses.seconds)
    assert pauses._callback not in gc.callbacks
    assert pauses.record()["counts"] == pauses.counts
    full = pauses.record()["full"]
    assert len(full) == pauses.counts[2] and full[-1]["thread"] == "MainThread" and full[-1]["frozen"] == 0
