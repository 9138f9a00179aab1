"""SamplingParams: defaults, normalisation, and every bad value raising with the field's name."""

import pytest

from fuseformer.engine.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 16, 1.0, -1, 1.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.is_greedy
    assert not p.needs_penalties
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(frequency_penalty=0.5).needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties
    # Edges that are valid.
    SamplingParams(top_p=1.0, min_p=1.0, top_k=0, presence_penalty=-2, frequency_penalty=2, logprobs=0, seed=0)


def test_keyword_only_and_slots():
    with pytest.raises(TypeError):
        SamplingParams(1)  # positional
    with pytest.raises(AttributeError):
        SamplingParams().not_a_field = 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("logprobs", -1),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [1, -5]),
    ],
)
def test_bad_value_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field,value", [("n", 1.5), ("max_tokens", "16"), ("top_k", True), ("temperature", "hot"), ("seed", 1.0)]
)
def test_bad_type_names_field(field, value):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_outside_generator_range_is_rejected(seed):
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 1e-40),  # subnormal in fp32: logits / T overflowed to inf, NaN probabilities
        ("temperature", 1e-50),  # 0 in fp32: sampled as if the temperature were 1
        ("temperature", 9.9e-7),
        ("top_p", 1e-50),  # 0 in fp32: every token dropped
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),  # inf in fp32: a logit of 0 times inf is NaN
    ],
)
def test_values_that_fp32_cannot_hold_are_rejected(field, value):
    with pytest.raises(ValueError, match=f"{field} .*fp32"):
        SamplingParams(**{field: value})


def test_fp32_bounds_are_inclusive():
    from fuseformer.engine.sampling_params import MAX_REPETITION_PENALTY, MIN_SAMPLING_VALUE

    SamplingParams(temperature=MIN_SAMPLING_VALUE, top_p=MIN_SAMPLING_VALUE, repetition_penalty=MIN_SAMPLING_VALUE)
    SamplingParams(repetition_penalty=MAX_REPETITION_PENALTY)


def test_token_controls_normalised():
    p = SamplingParams(logit_bias={"5": -100, 7: 2.5}, bad_words="fox", allowed_token_ids=(1, 2), min_tokens=3)
    assert p.logit_bias == {5: -100.0, 7: 2.5} and p.bad_words == ["fox"] and p.allowed_token_ids == [1, 2]
    assert p.masks_tokens and not SamplingParams().masks_tokens
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams(bad_words=[]).bad_words is None
    SamplingParams(min_tokens=16, max_tokens=16, prompt_logprobs=0, truncate_prompt_tokens=-1)


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_tokens", -1),
        ("min_tokens", 17),  # above max_tokens (16)
        ("min_tokens", 1.5),
        ("logit_bias", {5: 101}),
        ("logit_bias", {5: -100.5}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {-3: 1}),
        ("logit_bias", {5: "big"}),
        ("logit_bias", [5, 1]),
        ("bad_words", ["ok", " "]),
        ("bad_words", [3]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -2]),
        ("prompt_logprobs", -1),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
    ],
)
def test_bad_token_control_names_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams: {field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("name", ["best_of", "use_beam_search", "logits_processors", "spaces_between_special_tokens"])
def test_vllm_fields_not_here_raise_naming_them(name):
    with pytest.raises(TypeError, match=name):
        SamplingParams(**{name: 2})
