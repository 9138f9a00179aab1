"""StepLog (where an engine's steps spend their time): records by kind, totals, the records since a
count, and what LLM.generate logs for its steps (one record per step, tokens as scheduled)."""

import pytest

import fuseformer
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.step_log import StepLog, StepRecord, summarize, totals_since
from fuseformer.testing import tiny_llama


def test_totals_since_and_summarize():
    log = StepLog(maxlen=3)
    log.add(StepRecord("prefill", 10, 2, 1.0, 2.0, 0.5, 3.0))
    before = log.totals()
    for i in range(4):
        log.add(StepRecord("graph", 2, 2, 0.5, 1.0 + i, 0.25))
    assert log.count == 5 and len(log.records) == 3  # the oldest dropped, the totals kept
    assert log.totals()["prefill"] == dict(steps=1, tokens=10, launch_s=0.001, wait_s=0.002, post_s=0.0005,
                                           gpu_s=0.003, wall_s=0.0035, mask_s=0.0, mask_wait_s=0.0)  # fmt: skip
    diff = totals_since(log.totals(), before)
    assert list(diff) == ["graph"] and diff["graph"]["steps"] == 4 and diff["graph"]["tokens"] == 8
    assert diff["graph"]["wait_s"] == pytest.approx((1 + 2 + 3 + 4) / 1e3)
    assert [r.wait_ms for r in log.since(3)] == [3.0, 4.0]
    assert [r.wait_ms for r in log.since(0)] == [2.0, 3.0, 4.0]  # only what is kept
    assert log.since(5) == []
    s = summarize(log.since(3))
    assert s["wait_ms"] == dict(p50=3.5, max=4.0) and "gpu_ms" not in s  # no GPU times on these
    with pytest.raises(ValueError, match="maxlen"):
        StepLog(maxlen=0)


def test_llm_logs_each_step_by_kind():
    model, _ = tiny_llama()
    llm = LLM(model, num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=16)
    prompts = [list(range(1, 12)), list(range(3, 9))]  # 11 + 6 tokens: more than one 16-token step
    with fuseformer.use_backend("reference"):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    totals = llm.core.step_log.totals()
    assert set(totals) <= {"prefill", "mixed", "decode"} and "decode" in totals
    # Every scheduled token is in one record: the prompts once, each output token but the last.
    assert sum(t["tokens"] for t in totals.values()) == 11 + 6 + 2 * 4
    assert sum(t["steps"] for t in totals.values()) == llm.core.step_log.count == len(llm.core.step_log.records)
    assert all(r.gpu_ms is None and r.launch_ms > 0 and r.wall_ms >= r.launch_ms for r in llm.core.step_log.records)
    first = llm.core.step_log.records[0]
    assert first.kind == "prefill" and first.tokens == 16 and first.seqs == 2
