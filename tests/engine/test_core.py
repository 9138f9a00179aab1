"""EngineCore: the step over scheduler, KV cache and runner, driven without the offline API. Its steps
give LLM.generate's tokens; the requests its output processor says a stop string ended are finished
in the scheduler (also with a step scheduled ahead); a launched step's two halves (``launch_step``,
``finish_step``) and an admit-only step launched while another is in flight; ``step_with_arrivals``;
abort; ``max_model_len`` sizing. And LLM as the offline API over it: its core, its read-only views of
the core's state, and models taken through the registry only."""

import pytest
import torch
from torch import nn

import fuseformer
from fuseformer.engine.core import EngineCore, StepHandle
from fuseformer.engine.llm import LLM
from fuseformer.engine.model_runner import CacheConfig
from fuseformer.engine.output_processor import OutputProcessor
from fuseformer.engine.outputs import RequestOutput
from fuseformer.engine.request import RequestStatus
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.testing import TINY_LLAMA, tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
_LIMITS = dict(max_model_len=64, max_num_batched_tokens=24, max_num_seqs=12)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _core(model, num_kv_blocks=40, **kwargs):
    m, config = model
    return EngineCore(m, config, CacheConfig(block_size=4, num_kv_blocks=num_kv_blocks), **(_LIMITS | kwargs))


def _processor(core, config):
    return OutputProcessor(None, [], config.vocab_size, core.max_model_len)


def _add(core, processor, request_id, prompt, params=GREEDY):
    core.add_requests(processor.add(processor.make_request(request_id, prompt, params)))


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY_LLAMA["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def _tokens(outputs: list[RequestOutput]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for out in outputs:
        for c in out.outputs:
            got.setdefault(out.request_id, []).extend(c.token_ids)
    return got


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_core_steps_give_what_generate_returns(model, async_scheduling):
    """Prompts added to the core and stepped to the end: LLM.generate's tokens; every block back; with
    async scheduling, steps launched ahead, and none left in flight at the end."""
    prompts = _prompts((5, 13, 1, 9))
    with fuseformer.use_backend("reference"):
        expected = LLM(model[0], num_kv_blocks=40, block_size=4, **_LIMITS).generate(prompts, GREEDY, use_tqdm=False)
        core = _core(model, async_scheduling=async_scheduling)
        processor = _processor(core, model[1])
        for i, p in enumerate(prompts):
            _add(core, processor, f"r{i}", p)
        assert core.has_unfinished_requests() and core.has_waiting_requests()
        outputs, in_flight_seen = [], False
        while processor.has_unfinished_requests():
            outputs += core.step(processor)
            in_flight_seen |= core.step_in_flight is not None
    assert _tokens(outputs) == {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(expected)}
    finished = [o.request_id for o in outputs if o.finished]
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]  # each finished exactly once
    assert core.async_scheduling == async_scheduling
    assert (core.num_steps_ahead > 0) == async_scheduling == in_flight_seen
    assert core.step_in_flight is None and not core.has_unfinished_requests()
    assert core.scheduler.kv.pool.num_free_blocks == 39
    assert core.get_stats().num_running == 0 and core.step_log.count > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_runs_every_kind_of_step_and_leaves_nothing(model, async_scheduling, monkeypatch):
    """warm_up (on by default on CUDA) runs prefills of each token bucket and one less, decode, mixed
    and prefix-hit steps and a seeded sampled request; afterwards no request, no cached prefix, every
    block free, zeroed counters, torch's RNG untouched, and the engine gives what a fresh one gives."""
    prompts = _prompts((5, 13, 1, 9))
    with fuseformer.use_backend("reference"):
        fresh = _core(model, async_scheduling=async_scheduling)
        processor = _processor(fresh, model[1])
        for i, p in enumerate(prompts):
            _add(fresh, processor, f"r{i}", p)
        expected = []
        while processor.has_unfinished_requests():
            expected += fresh.step(processor)

        core = _core(model, async_scheduling=async_scheduling)
        token_counts, kinds, hits = [], set(), set()
        log_step = EngineCore._log_step

        def spy(self, handle, wait_ms, post_ms):
            token_counts.append(handle.scheduler_output.num_batched_tokens)
            hits.update((s.start_position, len(s.token_ids)) for s in handle.scheduler_output.scheduled if s.sample)
            kinds.update(
                "hit"
                if s.start_position > 0 and len(s.token_ids) > 1
                else "mixed"
                if len(handle.scheduler_output.scheduled) > 1
                and any(len(x.token_ids) > 1 for x in handle.scheduler_output.scheduled)
                else "step"
                for s in handle.scheduler_output.scheduled
            )
            log_step(self, handle, wait_ms, post_ms)

        monkeypatch.setattr(EngineCore, "_log_step", spy)
        rng = torch.get_rng_state()
        assert core.warm_up() > 0 and core.warm_up_seconds > 0
        monkeypatch.undo()
        assert torch.equal(torch.get_rng_state(), rng)
        # limit min(24 tokens a step, 64 - 2): 1, 15, 16, 24 tokens prefilled in one step each, and 8
        # (paged attention's buckets at GQA group 2: 1, 8, 16, 32, 64 queries, those up to 24 run).
        assert {1, 8, 15, 16, 24} <= set(token_counts) and {"hit", "mixed"} <= kinds
        # The same after a prefix hit on the 24-token prompt's full blocks of 4: 20 + 1, 16 + 8, 8 + 16.
        assert {(20, 1), (16, 8), (8, 16)} <= hits
        kv = core.scheduler.kv
        assert not core.has_unfinished_requests() and core.step_in_flight is None
        assert kv.pool.num_free_blocks == 39 and not kv.pool.cached
        assert kv.prefix_cache_hit_rate == 0 and core.step_log.count == 0
        processor = _processor(core, model[1])
        for i, p in enumerate(prompts):
            _add(core, processor, f"r{i}", p)
        outputs = []
        while processor.has_unfinished_requests():
            outputs += core.step(processor)
    assert _tokens(outputs) == _tokens(expected)
    with pytest.raises(RuntimeError, match="warm up before adding any"):
        _add(core, processor, "late", prompts[0])
        core.warm_up()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    "max_model_len, prefills",
    [(12, {(15, 3), (16, 2), (24, 3)}), (64, {(15, 1), (16, 1), (24, 1)})],  # 5+5+5, 8+8, 8+8+8 at 12
)
def test_warm_up_reaches_the_step_budget_over_several_sequences(model, async_scheduling, max_model_len, prefills,
                                                                monkeypatch):  # fmt: skip
    """warm_up prefills each bucket up to the step's budget (max_num_batched_tokens 24), over as many
    sequences as hold it where one sequence may hold fewer (max_model_len 12; the one less than a bucket
    over one more), and runs a mixed step at the full budget over several sequences either way: decodes
    beside a prefill chunk. Afterwards nothing is left."""
    steps = []
    log_step = EngineCore._log_step

    def spy(self, handle, wait_ms, post_ms):
        out = handle.scheduler_output
        steps.append((out.num_batched_tokens, len(out.scheduled), sum(len(s.token_ids) == 1 for s in out.scheduled)))
        log_step(self, handle, wait_ms, post_ms)

    with fuseformer.use_backend("reference"):
        core = _core(model, max_model_len=max_model_len, warm_up=False, async_scheduling=async_scheduling)
        monkeypatch.setattr(EngineCore, "_log_step", spy)
        core.warm_up()
        monkeypatch.undo()
    seen = {(tokens, seqs) for tokens, seqs, decodes in steps if decodes == 0}
    assert prefills <= seen, sorted(seen)
    assert all(seqs == 1 for tokens, seqs in seen if tokens <= 10)
    # The full-budget mixed step: decodes beside the arriving prompts' first chunks.
    assert any(tokens > 20 and 2 <= decodes < seqs for tokens, seqs, decodes in steps), str(steps)
    assert max(tokens for tokens, _, _ in steps) == 24
    assert not core.has_unfinished_requests() and core.scheduler.kv.pool.num_free_blocks == 39


class _StopAfter:
    """An output processor stand-in: says a stop string ended ``request_id`` once it has ``num`` tokens;
    records every update it gets."""

    def __init__(self, request_id: str, num: int) -> None:
        self.request_id, self.num = request_id, num
        self.tokens: dict[str, list[int]] = {}
        self.stopped_at: int | None = None

    def process(self, updates):
        stopped = []
        for u in updates:
            self.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.request_id == self.request_id and len(self.tokens[u.request_id]) == self.num:
                stopped.append(u.request_id)
                self.stopped_at = self.num
        return [], stopped


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_the_processor_finds_is_finished_in_the_scheduler(model, async_scheduling):
    """The processor's stopped ids are finished (FINISHED_STOPPED) before the next step: no more tokens
    for that request (with async scheduling its row in the step in flight is dropped), its blocks free
    at once, the other request runs to its end."""
    core = _core(model, async_scheduling=async_scheduling)
    stub = _StopAfter("a", 2)
    requests = {}
    for rid, prompt in zip("ab", _prompts((6, 7), seed=1)):
        group = OutputProcessor(None, [], model[1].vocab_size, core.max_model_len).make_request(rid, prompt, GREEDY)
        requests[rid] = group.requests[0]
        core.add_requests(group.requests)
    with fuseformer.use_backend("reference"):
        while core.has_unfinished_requests():
            core.step(stub)
            if stub.stopped_at is not None and "a" in core.scheduler.requests:
                pytest.fail("a stopped request is still scheduled after the step that stopped it")
    assert len(stub.tokens["a"]) == 2 and len(stub.tokens["b"]) == GREEDY.max_tokens
    assert requests["a"].status is RequestStatus.FINISHED_STOPPED and requests["a"].num_output_tokens == 2
    assert requests["b"].status is RequestStatus.FINISHED_LENGTH
    assert (core.num_steps_ahead > 0) == async_scheduling
    assert core.step_in_flight is None and core.scheduler.kv.pool.num_free_blocks == 39


def test_launch_step_admit_only_leaves_the_step_in_flight_alone(model):
    """launch_step / finish_step: a prefill-only step launched while a decode step is in flight
    schedules only the new request, and finishing the two in order gives every request the tokens it
    gets alone (greedy, fp32 reference)."""
    prompts = _prompts((5, 3), seed=2)
    with fuseformer.use_backend("reference"):
        alone = [LLM(model[0], num_kv_blocks=40, block_size=4, **_LIMITS).generate(p, GREEDY, use_tqdm=False)[0]
                 for p in prompts]  # fmt: skip
        core = _core(model)
        processor = _processor(core, model[1])
        _add(core, processor, "a", prompts[0])
        outs = core.step(processor)  # a's prefill: a decodes from here on
        in_flight = core.launch_step()
        assert isinstance(in_flight, StepHandle) and not in_flight.overlappable  # no graphs on the CPU
        assert [s.request_id for s in in_flight.scheduler_output.scheduled] == ["a"]
        _add(core, processor, "b", prompts[1])
        assert core.has_waiting_requests()
        admitted = core.launch_step(admit_only=True)
        assert [s.request_id for s in admitted.scheduler_output.scheduled] == ["b"]
        first = core.finish_step(in_flight, processor)
        second = core.finish_step(admitted, processor)
        assert [o.request_id for o in first] == ["a"] and [o.request_id for o in second] == ["b"]
        outs += first + second
        while processor.has_unfinished_requests():
            outs += core.step(processor)
    assert _tokens(outs) == {"a": alone[0].outputs[0].token_ids, "b": alone[1].outputs[0].token_ids}
    assert core.scheduler.kv.pool.num_free_blocks == 39


def test_launch_step_refuses_while_a_step_scheduled_ahead_is_in_flight(model):
    core = _core(model, async_scheduling=True)
    processor = _processor(core, model[1])
    for rid, p in zip("ab", _prompts((4, 4), seed=3)):
        _add(core, processor, rid, p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with fuseformer.use_backend("reference"):
        for _ in range(4):  # the prefill, then decode steps of both: the first is launched ahead
            if core.step_in_flight is not None:
                break
            core.step(processor)
        assert core.step_in_flight is not None
        with pytest.raises(RuntimeError, match="scheduled ahead"):
            core.launch_step()
        admitted = core.launch_step(admit_only=True)  # nothing waits: an empty step, allowed
        assert not admitted.scheduler_output.scheduled
        core.finish_step(admitted, processor)
        while processor.has_unfinished_requests():
            core.step(processor)
    assert core.step_in_flight is None and core.scheduler.kv.pool.num_free_blocks == 39


def test_step_with_arrivals_launches_the_new_prefill_behind_the_step_in_flight(model, monkeypatch):
    """While an overlappable step is in flight, ``arrivals`` is polled; the request it adds has its
    prefill launched at once and its output follows the in-flight step's, in the same call. A step that
    is not overlappable (no CUDA graph) never polls."""
    prompts = _prompts((5, 3), seed=4)
    with fuseformer.use_backend("reference"):
        core = _core(model)
        processor = _processor(core, model[1])
        _add(core, processor, "a", prompts[0])
        core.step(processor)  # a's prefill

        polls = []

        def arrivals(timeout):
            polls.append(timeout)
            if len(polls) == 1:
                _add(core, processor, "b", prompts[1])
                return True
            return False

        outs, early = core.step_with_arrivals(arrivals, processor, poll_s=1e-3)
        assert not early and polls == []  # eager steps are not overlappable

        monkeypatch.setattr(StepHandle, "overlappable", property(lambda self: bool(self.scheduler_output.scheduled)))
        monkeypatch.setattr(StepHandle, "ready", property(lambda self: False))  # "still on the device"
        outs, early = core.step_with_arrivals(arrivals, processor, poll_s=1e-3)
        assert early and polls == [1e-3]
        assert [o.request_id for o in outs] == ["a", "b"]  # the decode step's delta, then b's first token
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1]


def test_abort_frees_the_blocks_at_once(model):
    core = _core(model)
    processor = _processor(core, model[1])
    _add(core, processor, "a", _prompts((9,), seed=5)[0])
    with fuseformer.use_backend("reference"):
        core.step(processor)
    assert core.get_stats().num_running == 1 and core.scheduler.kv.pool.num_free_blocks < 39
    core.abort(processor.abort("a"))
    stats = core.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0) and not core.has_unfinished_requests()
    assert core.scheduler.kv.pool.num_free_blocks == 39
    core.abort(["a", "unknown"])  # finished or unknown: ignored


def test_max_model_len_adapts_to_the_cache_unless_given(model):
    assert _core(model, num_kv_blocks=4, max_model_len=None).max_model_len == 12  # 3 usable blocks of 4
    with pytest.raises(ValueError, match="max_model_len"):
        _core(model, num_kv_blocks=4, max_model_len=64)


# ---- LLM over the core --------------------------------------------------------------------------


def test_llm_is_the_offline_api_over_its_core(model):
    """LLM's engine state is its core's: the same objects, read-only from the LLM."""
    llm = LLM(model[0], num_kv_blocks=40, block_size=4, async_scheduling=True, async_scheduling_min_seqs=3, **_LIMITS)
    core = llm.core
    assert isinstance(core, EngineCore) and isinstance(llm.output_processor, OutputProcessor)
    assert llm.scheduler is core.scheduler and llm.runner is core.runner and llm.step_log is core.step_log
    assert llm.max_model_len == core.max_model_len == llm.output_processor.max_model_len == 64
    assert llm.async_scheduling and llm.async_scheduling_min_seqs == core.scheduler.min_seqs == 3
    assert not llm.prefill_stream and llm.num_steps_ahead == 0
    for name in ("scheduler", "runner", "step_log", "num_steps_ahead", "async_scheduling", "prefill_stream"):
        with pytest.raises(AttributeError):
            setattr(llm, name, None)
    with fuseformer.use_backend("reference"):
        llm.generate(_prompts((4, 4, 4), seed=6), GREEDY, use_tqdm=False)
    assert llm.num_steps_ahead == core.num_steps_ahead > 0
    sync = LLM(model[0], num_kv_blocks=40, block_size=4, **_LIMITS)
    assert not sync.async_scheduling and sync.async_scheduling_min_seqs is None


def test_llm_takes_models_of_the_registry_only(model):
    """A built model must be the registry's class for its config's architecture."""
    from fuseformer.models.registry import build_model

    _, config = model
    with torch.device("cpu"):
        built = build_model(config)
    assert LLM(built, num_kv_blocks=8, block_size=4).model is built

    class NotRegistered(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.proj = nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"architecture 'Qwen2ForCausalLM' must be a LlamaForCausalLM"):
        LLM(NotRegistered(), num_kv_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="model must be a model directory or a model built by"):
        LLM(nn.Linear(2, 2), num_kv_blocks=8, block_size=4)
