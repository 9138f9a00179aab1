"""bench_train's code paths on CPU at a toy shape (the figures come from the H200 run)."""

import pytest

import fuseformer
from fuseformer.train.bench import LLAMA_1B, _model_flops_per_token, bench_train, format_table


def test_flops_formula():
    # Llama 3.2 1B: 1.236B parameters with the tied embedding; every one is a matmul weight here
    # (the LM head), except the norms. 6N + causal attention 6 * L * H * S.
    flops = _model_flops_per_token(LLAMA_1B, 4096)
    assert flops == pytest.approx(6 * 1.2354e9 + 6 * 16 * 2048 * 4096, rel=1e-3)


def test_bench_train_smoke_cpu():
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, batch=2, seq=16)  # fmt: skip
    with fuseformer.use_backend("reference"):
        records = bench_train(True, device="cpu", shape=shape)
    by_impl = {r["impl"]: r for r in records}
    ours = {"fuseformer", "fuseformer trainer", "fuseformer fp8", "fuseformer trainer fp8"}
    assert set(by_impl) == {"hf eager", "hf+liger"} | ours
    for impl in ("hf eager", "fuseformer", "fuseformer trainer", "fuseformer fp8", "fuseformer trainer fp8"):
        assert "error" not in by_impl[impl], by_impl[impl]
        assert by_impl[impl]["tokens_per_s"] > 0 and by_impl[impl]["batch"] * by_impl[impl]["seq"] == 32
    assert "fuseformer trainer" in format_table(records)
