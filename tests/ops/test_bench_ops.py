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
