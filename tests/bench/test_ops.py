"""bench ops' bookkeeping that runs without a GPU: the rounds of host-bound cases."""

import fuseformer.bench.ops as B


def test_median_of_rounds_takes_each_cases_median_and_keeps_the_rounds(monkeypatch):
    monkeypatch.setattr(B, "copy_ceiling_tb_s", lambda: 4.0)
    nbytes = 8_000_000

    def rec(impl, ms, graph=None):
        r = dict(op="rms_norm", impl=impl, pass_="bwd", bytes=nbytes, ms=ms)
        if graph is not None:
            r["graph_ms"] = graph
        return r

    runs = [
        [rec("ours", 0.040, 0.010), dict(op="rms_norm", impl="peer", pass_="bwd", error="boom")],
        [rec("ours", 0.075, 0.012), rec("peer", 0.056)],
        [rec("ours", 0.041, 0.011), rec("peer", 0.062)],
    ]
    ours, peer = B._median_of_rounds(runs)
    assert ours["ms"] == 0.041 and ours["rounds_ms"] == [0.040, 0.075, 0.041] and ours["graph_ms"] == 0.011
    assert abs(ours["tb_s"] - nbytes / 0.041e-3 / 1e12) < 1e-9 and abs(ours["pct_copy"] - 25 * ours["tb_s"]) < 1e-9
    assert peer["ms"] == (0.056 + 0.062) / 2 and "error" not in peer and peer["rounds_ms"] == [0.056, 0.062]
    assert B._median_of_rounds([runs[0]]) is runs[0]


def test_gpu_time_of_host_bound_calls_is_taken_after_every_wall_time(monkeypatch):
    """A host-bound case's call is kept (``_gpu_fn``) and profiled only once every suite has run: a
    profiler session slowed the later launches' wall times on the H200 (run 79). The kept call leaves
    no trace in the records."""
    order = []

    def suite(quick):
        order.append("suite")
        return [dict(op="rms_norm", impl="ours", _gpu_fn=lambda: order.append("call")), dict(op="swiglu", impl="x")]

    def later_suite(quick):
        order.append("later suite")
        return []

    def fake_kernels(fn, reps):
        order.append("profile")
        fn()
        return [dict(ms_per_call=0.010), dict(ms_per_call=0.005)]

    monkeypatch.setattr(B, "SUITE", [suite, later_suite])
    monkeypatch.setattr(B, "gpu_kernels", fake_kernels)
    monkeypatch.setattr(B.torch.cuda, "empty_cache", lambda: None)
    records = B.bench_ops(quick=True)
    assert order == ["suite", "later suite", "profile", "call"]
    assert abs(records[0]["gpu_us"] - 15.0) < 1e-9 and "_gpu_fn" not in records[0]
    assert "gpu_us" not in records[1]
