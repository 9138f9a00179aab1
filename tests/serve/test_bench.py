"""bench_serve's code paths on the CPU at a tiny shape: offline, the server at unlimited rate, lone
requests and requests at a fixed rate all run (the client in a process of its own) and report sane
numbers; a request the server refuses fails the phase with the server's answer."""

import pytest
import torch

import fuseformer

SHAPE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, tie_word_embeddings=False,
)  # fmt: skip


def test_bench_serve_code_paths_on_cpu():
    from fuseformer.bench.serve import format_table, run_serve_case

    with fuseformer.use_backend("reference"):
        records = run_serve_case(
            SHAPE, 6, 8, 5, num_lone=2, num_rated=3, rate=10.0, device="cpu", dtype=torch.float32,
            num_kv_blocks=64, block_size=4, async_scheduling=True, overlap_prefill=True,
        )  # fmt: skip
    impls = [r["impl"] for r in records]
    assert impls == [
        "offline LLM.generate", "offline LLM.generate, async_scheduling",
        "server, unlimited rate", "server, unlimited rate", "server, lone request",
        "server, 10 req/s, overlap_prefill", "server, 10 req/s",
    ]  # fmt: skip
    sync_offline, offline, unlimited, unlimited2, lone, overlapped, rated = records
    # Both offline runs, the server's settings (async_scheduling) last: the ratios are to that one.
    assert not sync_offline["async_scheduling"] and sync_offline["steps_ahead"] == 0
    assert offline["async_scheduling"] and offline["steps_ahead"] > 0 and unlimited["async_scheduling"]
    assert overlapped["requests"] == 3 and overlapped["overlapped"] == 0  # no CUDA graphs: nothing to overlap
    # As served (overlap_prefill on; no prefill stream off CUDA), the other setting timed beside it.
    assert unlimited["overlap_prefill"] and not unlimited["prefill_stream"]
    assert [r["as_served"] for r in (lone, overlapped, rated)] == [True, True, False]
    assert overlapped["overlap_prefill"] and not rated["overlap_prefill"] and not rated["prefill_stream"]
    assert [unlimited["attempt"], unlimited2["attempt"]] == [0, 1]
    assert offline["output_tok_s"] > 0 and unlimited["output_tok_s"] > 0
    assert unlimited["ratio_to_offline"] == unlimited["output_tok_s"] / offline["output_tok_s"]
    # The engine counters cover the phase: 6 requests x 5 tokens take at least 5 steps, all with outputs.
    counters = unlimited["engine"]
    assert counters["steps"] >= 5 and counters["step_s"] > 0 and 1 <= counters["handoffs"] <= counters["steps"]
    assert lone["requests"] == 2 and rated["requests"] == 3
    assert 0 < lone["p50_ttft_ms"] < 10_000 and 0 < rated["p50_ttft_ms"] < 10_000
    # The engine side of the TTFT: its parts are consistent and within the client's time.
    for r in (lone, rated):
        parts = r["engine_ms"]
        assert set(parts) == {"wait_for_step", "first_step", "to_handoff", "to_stream", "engine_total"}
        assert all(v["p50"] >= 0 for v in parts.values())
        assert parts["first_step"]["p50"] <= parts["engine_total"]["p50"] <= r["p50_ttft_ms"]
    assert "server, unlimited rate" in format_table(records)


def test_bench_client_reports_a_refusal_and_goes_on():
    from fuseformer.bench.engine import build_models
    from fuseformer.bench.serve import _ClientProcess, _start_server
    from fuseformer.engine.llm import LLM

    with fuseformer.use_backend("reference"):
        _, model = build_models(SHAPE, "cpu", torch.float32)
        llm = LLM(model, device="cpu", max_model_len=32, num_kv_blocks=64, block_size=4)
        url, stop, _ = _start_server(llm, "bench")
        client = None
        try:
            client = _ClientProcess(url, "bench")
            (ttft,) = client.run("lone", [[1, 2, 3]], 7)
            assert 0 < ttft < 10
            with pytest.raises(RuntimeError, match="HTTP/1.1 400"):
                client.run("lone", [[1, 2, 3]], 100)  # does not fit max_model_len: 400
            (ttft,) = client.run("lone", [[1, 2, 3]], 7)  # the client goes on after a failed phase
        finally:
            if client is not None:
                client.close()
            stop()
