"""Scheduler: token budget, running first, chunked prefill, preemption (newest first, recomputed to
the same tokens), abort, stop conditions, and every request finishing exactly once.

A fake model stands in for the runner: it writes each scheduled token into a simulated KV cache at
the slot its block table gives, then "attends" by reading every position of the sequence back
through the block table, and returns next = f(tokens read). A wrong block table, a prefix hit on the
wrong blocks, or a block reused while still in use all change the tokens read, hence the output,
which is compared with a plain generation loop that needs no cache.
"""

import random

import pytest

from fuseformer.engine.outputs import Logprob
from fuseformer.engine.request import Request, RequestStatus
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.engine.scheduler import Scheduler, SchedulerConfig

VOCAB = 101


def next_token(tokens):
    h = 17
    for t in tokens:
        h = (h * 1000003 + t) % (1 << 61)
    return h % VOCAB


def reference(prompt, params, eos=None, max_model_len=10**9):
    """The output tokens generated without any engine (same stop rules as the scheduler)."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in params.stop_token_ids or (t == eos and not params.ignore_eos):
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class FakeModel:
    def __init__(self, config):
        self.bs = config.block_size
        self.kv = [None] * (config.num_blocks * config.block_size)

    def _slot(self, block_ids, pos):
        return block_ids[pos // self.bs] * self.bs + pos % self.bs

    def step(self, out):
        for s in out.scheduled:  # write this step's K/V first (as each layer does), then attend
            assert 0 not in s.block_ids, "the null block was handed out"
            assert len(s.block_ids) * self.bs >= s.start_position + s.num_new_tokens
            assert list(s.positions) == list(range(s.start_position, s.start_position + len(s.token_ids)))
            for pos, tok in zip(s.positions, s.token_ids):
                self.kv[self._slot(s.block_ids, pos)] = tok
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                end = s.start_position + s.num_new_tokens
                seen = [self.kv[self._slot(s.block_ids, p)] for p in range(end)]
                sampled[s.request_id] = [next_token(seen)]
        return sampled


def _config(**kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return SchedulerConfig(**kw)


def _run(sched, model, max_steps=10_000, on_step=None):
    """Step until done; returns {request_id: (output ids, finish reason)} and the number of steps."""
    finished = {}
    for step in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished, step
        out = sched.schedule()
        if on_step is not None:
            on_step(step, out)
        for u in sched.update_from_output(out, model.step(out)):
            if u.finished:
                assert u.request_id not in finished, "finished twice"
                finished[u.request_id] = u.finish_reason
    raise AssertionError("did not finish")


def _check_step(sched, out, was_running):
    cfg = sched.config
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    ids = [s.request_id for s in out.scheduled]
    assert len(set(ids)) == len(ids)
    assert all(s.num_new_tokens > 0 for s in out.scheduled)
    # Running requests first: no previously running one after a newly admitted one.
    kinds = [s.request_id in was_running for s in out.scheduled]
    assert kinds == sorted(kinds, reverse=True)
    sched.kv.pool.check_invariants()


def test_chunked_prefill_across_steps():
    sched = Scheduler(_config(max_num_batched_tokens=10))
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = [random.randrange(VOCAB) for _ in range(25)]
    sched.add_request(Request("a", prompt, p))
    model = FakeModel(sched.config)
    plan = []
    for _ in range(5):
        out = sched.schedule()
        (s,) = out.scheduled
        plan.append((s.start_position, s.num_new_tokens, s.sample))
        assert s.token_ids == sched.requests["a"].all_token_ids[s.start_position : s.start_position + s.num_new_tokens]
        # A sampled token for a chunk that does not reach the end is ignored.
        sampled = model.step(out) or {"a": [0]}
        sched.update_from_output(out, sampled)
    assert plan == [(0, 10, False), (10, 10, False), (20, 5, True), (25, 1, True), (26, 1, True)]
    assert not sched.has_unfinished_requests()


def test_no_chunked_prefill_waits_for_room():
    sched = Scheduler(_config(max_num_batched_tokens=128, enable_chunked_prefill=False))
    sched.add_request(Request("a", list(range(100)), SamplingParams(max_tokens=2, ignore_eos=True)))
    sched.add_request(Request("b", list(range(200, 250)), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 100)]  # b does not fit whole
    sched.update_from_output(out, {"a": [1]})
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 50)]


def test_running_first_then_waiting_with_budget_left():
    sched = Scheduler(_config(max_num_batched_tokens=8))
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    sched.add_request(Request("a", list(range(5)), p))
    sched.add_request(Request("b", list(range(50, 70)), p))
    model = FakeModel(sched.config)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [("a", 5, True), ("b", 3, False)]
    sched.update_from_output(out, model.step(out))
    sched.add_request(Request("c", list(range(80, 90)), p))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]  # c waits
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_max_num_seqs():
    sched = Scheduler(_config(max_num_seqs=2))
    for i in range(4):
        sched.add_request(Request(str(i), [i + 1] * 3, SamplingParams(max_tokens=2, ignore_eos=True)))
    plan = []
    finished, _ = _run(
        sched, FakeModel(sched.config), on_step=lambda i, o: plan.append([s.request_id for s in o.scheduled])
    )
    assert plan == [["0", "1"], ["0", "1"], ["2", "3"], ["2", "3"]] and len(finished) == 4


def test_preempts_newest_and_recomputes_same_tokens():
    # 6 usable blocks of 4; three 7-token prompts take 2 blocks each; the 9th token needs a third.
    cfg = _config(num_blocks=7, block_size=4, max_model_len=24, max_num_batched_tokens=32)
    sched = Scheduler(cfg)
    model = FakeModel(cfg)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = {rid: [random.randrange(VOCAB) for _ in range(7)] for rid in "abc"}
    for rid, prompt in prompts.items():
        sched.add_request(Request(rid, prompt, params))
    reqs = dict(sched.requests)
    for _ in range(2):
        out = sched.schedule()
        assert [s.request_id for s in out.scheduled] == ["a", "b", "c"] and not out.preempted_request_ids
        sched.update_from_output(out, model.step(out))
    out = sched.schedule()
    assert out.preempted_request_ids == ["c"] and [s.request_id for s in out.scheduled] == ["a", "b"]
    c = reqs["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_ids == []
    assert sched.waiting[0] is c and c.num_output_tokens == 2  # its tokens are kept, only recomputed
    sched.update_from_output(out, model.step(out))

    finished, _ = _run(sched, model)
    assert set(finished) == {"a", "b", "c"} and sched.num_preemptions >= 1
    for rid, prompt in prompts.items():
        assert reqs[rid].output_token_ids == reference(prompt, params)[0], rid
    assert sched.kv.num_free_blocks == 6


def test_several_preempted_in_one_step_keep_their_order():
    # 8 usable blocks; four 7-token prompts take 2 each; at the 9th token each needs a third: a gets
    # d's, b gets one of them, c finds none and, being the newest left, preempts itself.
    cfg = _config(num_blocks=9, block_size=4, max_model_len=32, max_num_batched_tokens=64)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = {rid: [random.randrange(VOCAB) for _ in range(7)] for rid in "abcd"}
    for rid, prompt in prompts.items():
        sched.add_request(Request(rid, prompt, params))
    reqs = dict(sched.requests)
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, model.step(out))
    out = sched.schedule()
    assert out.preempted_request_ids == ["d", "c"] and [s.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # the older one readmitted first
    sched.update_from_output(out, model.step(out))
    finished, _ = _run(sched, model)
    assert set(finished) == set("abcd")
    for rid, prompt in prompts.items():
        assert reqs[rid].output_token_ids == reference(prompt, params)[0], rid


def test_abort_frees_at_once():
    sched = Scheduler(_config())
    p = SamplingParams(max_tokens=50, ignore_eos=True)
    for rid in "abc":
        sched.add_request(Request(rid, list(range(10)) + [ord(rid)], p))
    sched.add_request(Request("w", list(range(300, 310)), p))
    model = FakeModel(sched.config)
    out = sched.schedule()
    sched.update_from_output(out, model.step(out))
    free_before = sched.kv.num_free_blocks
    held_b = len(sched.requests["b"].block_ids)
    (b,) = sched.abort("b")
    assert b.status is RequestStatus.FINISHED_ABORTED and b.finish_reason == "abort" and b.block_ids == []
    assert sched.kv.num_free_blocks == free_before + held_b
    assert sched.abort(["b", "nope"]) == []  # already finished / unknown: ignored
    out = sched.schedule()
    assert out.finished_request_ids == ["b"] and "b" not in [s.request_id for s in out.scheduled]
    # Aborting between schedule and update: the stale entry is skipped.
    sched.abort(["a", "w"])
    updates = sched.update_from_output(out, model.step(out))
    assert {u.request_id for u in updates} == {"c"}
    sched.abort("c")
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 63
    sched.kv.pool.check_invariants()


@pytest.mark.parametrize(
    "case,expect_reason",
    [
        ("max_tokens", "length"),
        ("eos", "stop"),
        ("ignore_eos", "length"),
        ("stop_token", "stop"),
        ("model_len", "length"),
    ],
)
def test_stop_conditions(case, expect_reason):
    prompt = [5, 6, 7, 8, 9]
    free_run, _ = reference(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    eos = free_run[0] if case in ("eos", "ignore_eos") else None
    params = {
        "max_tokens": SamplingParams(max_tokens=4, ignore_eos=True),
        "eos": SamplingParams(max_tokens=200),
        "ignore_eos": SamplingParams(max_tokens=6, ignore_eos=True),
        "stop_token": SamplingParams(max_tokens=200, stop_token_ids=[free_run[2]]),
        "model_len": SamplingParams(max_tokens=200, ignore_eos=True),
    }[case]
    sched = Scheduler(_config(max_model_len=20))
    req = Request("r", prompt, params, eos_token_id=eos)
    sched.add_request(req)
    finished, _ = _run(sched, FakeModel(sched.config))
    want, reason = reference(prompt, params, eos, max_model_len=20)
    assert reason == expect_reason and finished == {"r": reason}
    assert req.output_token_ids == want and req.finish_reason == reason
    expect_len = {"max_tokens": 4, "ignore_eos": 6, "model_len": 15}.get(case)
    if expect_len is not None:
        assert req.num_output_tokens == expect_len
    if case == "stop_token":
        assert req.stop_reason == free_run[2] and req.output_token_ids[-1] == free_run[2]
    if case == "eos":
        assert req.output_token_ids == [eos]


def test_prefix_cache_hit_gives_same_tokens():
    sched = Scheduler(_config())
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    shared = [random.randrange(VOCAB) for _ in range(13)]
    model = FakeModel(sched.config)
    sched.add_request(Request("a", shared + [1], p))
    _run(sched, model)
    b = Request("b", shared + [2, 3], p)
    sched.add_request(b)
    _run(sched, model)
    assert b.num_cached_tokens == 12
    assert b.output_token_ids == reference(shared + [2, 3], p)[0]
    assert sched.get_stats().prefix_cache_hit_rate == pytest.approx(12 / (14 + 15))


def test_finish_requests_with_stop_string_status():
    sched = Scheduler(_config())
    sched.add_request(Request("a", [1, 2, 3]))
    (a,) = sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a.finish_reason == "stop" and not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_update_without_sample_raises():
    sched = Scheduler(_config())
    sched.add_request(Request("a", [1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, {})


def test_logprobs_accumulate():
    sched = Scheduler(_config())
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1))
    sched.add_request(req)
    for lp in (-0.5, -1.25):
        out = sched.schedule()
        sched.update_from_output(out, {"a": [7]}, logprobs={"a": [{7: Logprob(lp, 2), 9: Logprob(-0.1, 1)}]})
    assert req.cumulative_logprob == pytest.approx(-1.75)
    assert req.logprobs == [{7: Logprob(-0.5, 2), 9: Logprob(-0.1, 1)}, {7: Logprob(-1.25, 2), 9: Logprob(-0.1, 1)}]
    assert req.is_finished


def test_bad_requests_and_config():
    sched = Scheduler(_config(max_model_len=16))
    sched.add_request(Request("a", [1] * 16))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(Request("a", [1]))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("b", [1] * 17))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("c", [])
    for kw, field in [
        ({"num_blocks": 1}, "num_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 4, "max_model_len": 100}, "max_model_len"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64}, "max_num_batched_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            _config(**kw)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload(seed):
    """Arrivals over time, shared prefixes, random aborts, a small cache (so preemption happens):
    every step respects the limits, every request finishes exactly once with the reference tokens,
    and no block is left referenced."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    cfg = SchedulerConfig(
        num_blocks=max(rng.choice([12, 16, 40]), 40 // block_size + 2),  # small: preemption happens
        block_size=block_size,
        max_model_len=40,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 16]),
        enable_prefix_caching=seed != 5,
    )
    sched = Scheduler(cfg)
    model = FakeModel(cfg)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    eos = 0
    pending = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 15))]
        params = SamplingParams(max_tokens=rng.randrange(1, 16), ignore_eos=rng.random() < 0.5)
        pending.append(Request(f"r{i}", prompt, params, eos_token_id=eos))
    requests = {r.request_id: r for r in pending}
    finished, aborted = {}, set()
    step = 0
    while pending or sched.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                sched.add_request(pending.pop(0))
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            assert [r.request_id for r in sched.abort(rid)] == [rid]
            aborted.add(rid)
        was_running = {r.request_id for r in sched.running}
        out = sched.schedule()
        _check_step(sched, out, was_running)
        if sched.requests:
            assert out.scheduled, "work left but nothing scheduled"
        for u in sched.update_from_output(out, model.step(out)):
            if u.finished:
                assert u.request_id not in finished and u.request_id not in aborted
                finished[u.request_id] = u.finish_reason
        step += 1
        assert step < 5000
    assert set(finished) | aborted == set(requests) and not set(finished) & aborted
    for rid, reason in finished.items():
        r = requests[rid]
        assert (r.output_token_ids, reason) == reference(r.prompt_token_ids, r.sampling_params, eos, 40), rid
    assert sched.kv.num_free_blocks == cfg.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    sched.kv.pool.check_invariants()
    stats = sched.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_grammars_advanced_once_whether_early_or_in_the_update():
    """``advance_grammars`` gives each sampling request's grammar its tokens before the update, which then
    leaves them; a request that does not sample this step, or finished since, is passed over both ways."""

    class Grammar:
        ready, error = True, None

        def __init__(self):
            self.taken = []

        def accept_tokens(self, tokens):
            self.taken += tokens
            return True

    for early in (False, True):
        sched = Scheduler(_config(max_num_batched_tokens=6))
        reqs = [
            Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=3, ignore_eos=True))
            for rid, n in (("a", 2), ("b", 3), ("c", 9))
        ]
        for r in reqs:
            r.grammar = Grammar()
            sched.add_request(r)
        for step in range(3):
            out = sched.schedule()
            sampled = {s.request_id: [10 * step + i] for i, s in enumerate(out.scheduled) if s.sample}
            if step == 1:
                sched.abort("b")  # finished while its step is in flight
            if early:
                sched.advance_grammars(out, sampled)
            sched.update_from_output(out, sampled, grammars_advanced=early)
        # c's prompt (9 tokens) is chunked: its first step samples nothing.
        assert [r.grammar.taken for r in reqs] == [r.output_token_ids for r in reqs], early
        assert reqs[0].grammar.taken and not reqs[1].grammar.taken[1:] and len(reqs[2].grammar.taken) == 1
